"""``tuner winners``: per problem, which implementation ``tuner.attention`` runs on a device:
the winner, the runner-up and every measured implementation's TFLOP/s beside them.

It reads the stored bests of the forward templates of ``tuner.dispatch``'s implementations
(torch_sdpa, flash_fwd, gluon_fwd, flash_decode), at the kernel versions of this install (a
best tuned for other kernel source is not what would run), and ranks them by TFLOP/s, the
dispatcher's rule for inference calls (docs/DISPATCH.md). A problem without a ``torch_sdpa``
best runs torch SDPA whatever else is stored: the table says so.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Annotated, Any

import typer
from rich.table import Table

from tuner.cli.common import (
    DbOption,
    JsonOption,
    console,
    database_url,
    fmt_tflops,
    print_json,
    problem_label,
)

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
    from db import crud
    from db.session import session_scope
    from templates import current_device
    from templates.registry import get_template
    from tuner import implementations  # noqa: F401  (registers the implementations)
    from tuner.dispatch import BASELINE, get_implementation
    from tuner.dispatch import implementations as all_implementations

    url = database_url(db)
    device_filter = device or current_device().key
    impl_of = {impl.forward: impl.name for impl in all_implementations()}
    current = {name: get_template(name).version() for name in impl_of}
    baseline = get_implementation(BASELINE).forward
    by_problem: dict[str, dict[str, Any]] = defaultdict(dict)
    stale = 0  # bests tuned for other kernel source than this install's
    with session_scope(url, write=False) as s:
        for row in crud.list_best(s, device=device_filter, dtype=dtype, limit=100_000):
            name = row.template.name
            if name not in impl_of:
                continue
            if row.template.version != current[name]:
                stale += 1
                continue
            entry = by_problem[row.problem_key]
            entry.setdefault("problem", dict(row.problem))
            entry.setdefault("tflops", {})[impl_of[name]] = float(row.tflops)
    items = []
    for key, entry in by_problem.items():
        ranked = sorted(entry["tflops"].items(), key=lambda kv: -kv[1])
        measured_baseline = get_implementation(BASELINE).name in entry["tflops"]
        winner = ranked[0][0] if measured_baseline else BASELINE
        runner_up = next((name for name, _ in ranked if name != winner), None)
        tflops = entry["tflops"]
        items.append({
            "problem_key": key, "problem": entry["problem"], "tflops": tflops,
            "winner": winner, "runner_up": runner_up,
            "margin": (tflops[winner] / tflops[runner_up]
                       if measured_baseline and runner_up else None),
            "why": ("fastest measured" if measured_baseline else
                    f"{baseline} not measured: torch SDPA runs as the user's call would")})
    items.sort(key=lambda it: it["problem_key"])
    if json_out:
        print_json(items)
        return
    if not items:
        older = f"; {stale} stored for older kernel versions" if stale else ""
        console.print(f"no bests of {', '.join(impl_of)} stored for device {device_filter!r} "
                      f"in {url} at this install's kernel versions{older} (tune them with "
                      "`tuner sweep quick`)")
        return
    names = [impl.name for impl in all_implementations()
             if any(impl.name in it["tflops"] for it in items)]
    table = Table(title=f"winners on {device_filter.split('|')[0]} ({len(items)} problems)")
    for column in ("problem", "winner", "margin", *names):
        table.add_column(column, justify="left" if column in ("problem", "winner") else "right",
                         overflow="fold")
    for it in items:
        margin = f"{it['margin']:.2f}x {it['runner_up']}" if it["margin"] else it["why"]
        table.add_row(problem_label(it["problem"]), it["winner"], margin,
                      *(fmt_tflops(it["tflops"].get(n)) for n in names))
    console.print(table)
    console.print("TFLOP/s of each implementation's stored best; margin: the winner over the "
                  "runner-up (docs/DISPATCH.md)")
