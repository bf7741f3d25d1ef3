"""``tuner winners``: per problem, which implementation ``tuner.attention`` runs on a device:
the winner, the runner-up and every measured implementation's TFLOP/s beside them, and each
SDPA backend's time.

The ranking is ``tuner.dispatch.winners`` (shared with ``tuner best``, ``GET /v1/winners`` and the
dashboard), at the kernel versions of this install: a best tuned for other kernel source is
not what would run here.
"""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from tuner.cli.common import (
    DbOption,
    JsonOption,
    checked_dtype,
    console,
    database_url,
    fmt_tflops,
    print_json,
    print_table,
    problem_label,
)
from tuner.errors import TunerError
from tuner.wire import backends_text

__all__ = ["winners"]


def winners(
    device: Annotated[str | None, typer.Option(
        "--device", help="device name or key (default: this machine's device)",
        show_default=False)] = None,
    dtype: Annotated[str | None, typer.Option("--dtype", help="float16, bfloat16, float32")] = None,
    db: DbOption = None,
    json_out: JsonOption = False,
) -> None:
    """Which implementation wins each stored problem, and by how much."""
    # lazy: sqlalchemy, torch+triton +2.8 s (2-core CPU); keeps `tuner --help` < 1 s
    from db.session import session_scope
    from templates import current_device
    from templates.registry import get_template
    from tuner.dispatch.rule import implementations
    from tuner.dispatch.winners import forward_templates, stored_winners

    dtype = checked_dtype(dtype)
    url = database_url(db)
    device_filter = device or current_device().key
    with session_scope(url, write=False) as s:
        try:
            found = stored_winners(s, device=device_filter, dtype=dtype,
                                   version_of=lambda name: get_template(name).version())
        except ValueError as exc:
            raise TunerError(str(exc), "see `tuner list devices`") from None
    if json_out:
        print_json([it.model_dump(mode="json") for it in found.items])
        return
    if not found.items:
        older = f"; {found.stale} stored for older kernel versions" if found.stale else ""
        console.print(f"no bests of {', '.join(forward_templates())} stored for device "
                      f"{device_filter!r} in {url} at this install's kernel versions{older} "
                      "(tune them with `tuner sweep quick`)")
        return
    names = [impl.name for impl in implementations()
             if any(impl.name in it.tflops for it in found.items)]
    backends = any(it.sdpa_backends for it in found.items)
    table = Table(title=f"winners on {found.device_name} ({len(found.items)} problems)")
    for column in ("problem", "winner", "margin", *names):
        table.add_column(column, justify="left" if column in ("problem", "winner") else "right",
                         overflow="fold")
    if backends:
        table.add_column("sdpa backends", overflow="fold")
    for it in found.items:
        margin = f"{it.margin:.2f}x {it.runner_up}" if it.margin else it.why
        if it.margin and it.decided is False:
            margin += " (noise)"
        table.add_row(problem_label(it.problem), it.winner, margin,
                      *(fmt_tflops(it.tflops.get(n)) + (" (h2h)" if n in it.head_to_head
                                                         else "") for n in names),
                      *([backends_text(it.sdpa_backends)] if backends else []))
    print_table(table)
    console.print("TFLOP/s of each implementation's stored best; margin: the winner over the "
                  "runner-up (docs/DISPATCH.md), (noise) where their head-to-head's "
                  "readings do not tell them apart; (h2h): the median of the problem's "
                  "head-to-head, its implementations measured side by side"
                  + ("; sdpa backends: each SDPA backend's best time, fastest first (a failed "
                     "one is not listed)" if backends else ""))
