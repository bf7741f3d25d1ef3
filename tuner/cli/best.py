"""``tuner best``: the stored best configs (of this device unless told otherwise)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.table import Table

from tuner.cli.common import (
    DbOption,
    JsonOption,
    checked_dtype,
    checked_template,
    checked_variant,
    config_text,
    console,
    database_url,
    fmt_tflops,
    print_json,
    print_table,
    problem_label,
)
from tuner.cli.comparison_table import compared_table
from tuner.errors import TunerError
from tuner.settings import get_settings
from tuner.wire import readings_text

if TYPE_CHECKING:
    from db.finalists import Readings
    from templates.base import Problem, Template
    from tuner.wire import ImplementationsCompared

__all__ = ["best"]


def best(
    device: Annotated[str | None, typer.Option(
        "--device", help="device name or key (default: this machine's device)",
        show_default=False)] = None,
    all_devices: Annotated[bool, typer.Option("--all", help="every device")] = False,
    template: Annotated[str | None, typer.Option("--template", help="template name")] = None,
    dtype: Annotated[str | None, typer.Option("--dtype", help="float16, bfloat16, float32")] = None,
    variant: Annotated[str | None, typer.Option(
        "--variant", help="dense, causal-top_left, ... (as stored)")] = None,
    shape: Annotated[str | None, typer.Option(
        "--shape", help="only the best for this shape's bucket, e.g. B=8,H=16,N=2048,D=128 "
                        "(with --template, default flash_fwd; --dtype, default every dtype; "
                        "--causal)", show_default=False)] = None,
    causal: Annotated[str, typer.Option("--causal", help="with --shape")] = "none",
    limit: Annotated[int, typer.Option("--limit", help="most rows to show")] = 1000,
    db: DbOption = None,
    json_out: JsonOption = False,
) -> None:
    """Print the stored best configs: with no filter, every one of this device."""
    if limit < 1:
        raise TunerError(f"--limit must be >= 1, but got {limit}", "e.g. --limit 100")
    # After the check of the flags alone (its error comes in 0.7 s): these import torch and the
    # kernels, 3-4 s (python -X importtime; issue 41, item 1).
    from db import crud
    from db.session import session_scope
    from templates import all_templates, current_device
    from templates.base import DTYPES

    dtype, variant = checked_dtype(dtype), checked_variant(variant)
    url = database_url(db)
    if template is not None:
        with session_scope(url, write=False) as s:
            checked_template(template, (t.name for t in crud.list_templates(s)))
    device_filter = None if all_devices else (device or current_device().key)
    problem_keys = None
    asked: dict[str, Problem] = {}  # with --shape: the problem asked, by bucket
    if shape is not None:
        template = template or "flash_fwd"
        # The bucket of the shape in the dtype asked for, else in each dtype.
        tpl = _template(template)
        asked = {tpl.problem_key(p): p for p in (_problem_of(template, shape, d, causal)
                                                 for d in ([dtype] if dtype else DTYPES))}
        problem_keys = set(asked)
    current = {t.name: t.version() for t in all_templates()}
    with session_scope(url, write=False) as s:
        rows = crud.list_best(s, device=device_filter, template=template, dtype=dtype,
                              variant=variant, limit=limit if problem_keys is None else 100_000)
        if problem_keys is not None:
            rows = [r for r in rows if r.problem_key in problem_keys][:limit]
        readings = crud.best_readings(s, rows)
        ranked = _ranked(s, rows, current)
        items = [_item(r, readings[r.id], current) | {"runs": _runs(r, ranked, current)}
                 for r in rows]
        compared = _compared(s, rows, asked, current)
        for r, it in zip(rows, items, strict=True):
            if asked:
                found = compared.get((r.device.key, r.problem_key))
                it["implementations"] = found.model_dump(mode="json") if found else None
        hint = ""
        if not items and device_filter is not None:
            hint = _why_empty(s, device_filter, problem_keys, template=template, dtype=dtype,
                              variant=variant)
    if json_out:
        print_json(items)
        return
    if not items:
        what = "best configs" if problem_keys is None else "best config for the --shape bucket"
        where = f"device {device_filter!r}" if device_filter else "any device"
        console.print(f"no {what} stored for {where} in {url} ({hint or 'run `tuner sweep` first'})")
        return
    names_of = {it["device"]: it["device_name"] for it in items}
    devices = {it["device_name"] for it in items}
    names = {it["template"] for it in items}
    columns = [c for c in ("device", "template") if len(devices if c == "device" else names) > 1]
    title = f"best configs ({len(items)})"
    if len(devices) == 1:
        title += f" on {next(iter(devices))}"
    if len(names) == 1:
        title += f", template {next(iter(names))}"
    table = Table(title=title)
    numbers = ("TFLOP/s", "readings (spread)", "default", "speedup")
    shared = any(it["runs"] for it in items)  # a problem measured for several implementations
    for column in (*columns, "problem", *numbers, *(["runs"] if shared else []), "config"):
        # Names stay whole on a narrow terminal; the problem and config columns fold instead.
        table.add_column(column, justify="right" if column in numbers else "left",
                         overflow="fold", no_wrap=column in columns)
    for it in items:
        name = it["template"] + ("" if it["current_version"] else " (old kernel)")
        lead = [{"device": it["device_name"], "template": name}[c] for c in columns]
        table.add_row(*lead, problem_label(it["problem"]), fmt_tflops(it["tflops"]),
                      readings_text(it["readings"], it["spread"]),
                      fmt_tflops(it["default_tflops"]),
                      f"{it['speedup']:.2f}x" if it["speedup"] else "-",
                      *([_runs_text(it["runs"])] if shared else []),
                      config_text(it["config"]))
    print_table(table)
    for (device_key, key), found in compared.items():
        print_table(compared_table(found, problem_label(asked[key].to_dict()),
                                   names_of.get(device_key, device_key)))
    if shared:
        console.print("runs: whether tuner.attention runs this config, where the problem is "
                      "measured for several implementations (`tuner winners` ranks them all)")
    if any(it["device_name"] == "cpu-interpreter" for it in items):
        console.print("[yellow]cpu-interpreter rows: Triton interpreter timings, NOT GPU "
                      "timings[/]")


def _why_empty(s: Any, device_filter: str, problem_keys: set[str] | None, *,
               template: str | None, dtype: str | None, variant: str | None) -> str:
    """What the database holds near an empty answer: the same rows on other devices, or this
    device's rows for other shapes ("" when neither)."""
    # lazy: sqlalchemy +0.25 s (2-core CPU); keeps `tuner --help` < 1 s
    from db import crud

    def matches(row: Any) -> bool:
        return problem_keys is None or row.problem_key in problem_keys

    elsewhere = [r for r in crud.list_best(s, template=template, dtype=dtype, variant=variant,
                                           limit=100_000)
                 if device_filter not in (r.device.key, r.device.name) and matches(r)]
    if elsewhere:
        names = sorted({r.device.name for r in elsewhere})
        return f"{len(elsewhere)} on other devices ({', '.join(names)}): add --all"
    if problem_keys is not None:
        here = crud.count_best(s, device=device_filter, template=template, dtype=dtype,
                               variant=variant)
        if here:
            return (f"{here} stored on this device for other shapes: drop --shape to list "
                    "them")
    return ""


def _template(name: str) -> Template:
    # lazy: torch+triton +1.5 s (2-core CPU); keeps `tuner --help` < 1 s
    from templates.registry import get_template

    try:
        return get_template(name)
    except ValueError as exc:
        raise TunerError(str(exc), "see `tuner list templates`") from None


def _problem_of(template_name: str, shape: str, dtype: str, causal: str) -> Problem:
    # lazy: optuna, sqlalchemy, torch+triton +1.8 s (2-core CPU); keeps `tuner --help` < 1 s
    from tuner.tuning.suites import parse_shape, spec_from_mapping

    spec = spec_from_mapping({"templates": [template_name], "shapes": [parse_shape(shape)],
                              "dtypes": [dtype], "causal": [causal]}, source="--shape")
    problem: Problem = spec.problems[0]
    return problem


def _compared(s: Any, rows: list[Any], asked: dict[str, Problem], current: dict[str, str]
              ) -> dict[tuple[str, str], ImplementationsCompared]:
    """With --shape: the implementations compared for the asked problem
    (``tuner.dispatch.comparison``) on each device and bucket the listed rows are of, at this
    install's kernel versions."""
    # lazy: sqlalchemy, torch+triton +3.2 s (2-core CPU); keeps `tuner --help` < 1 s
    from tuner.dispatch.comparison import compare_in_database
    from tuner.lookup.devices import device_info_from_row

    margin = get_settings().neighbour_margin
    out = {}
    for r in rows:
        at = (r.device.key, r.problem_key)
        if r.problem_key in asked and at not in out:
            out[at] = compare_in_database(s, asked[r.problem_key], device_info_from_row(r.device),
                                          version_of=current.__getitem__, margin=margin)
    return out


def _ranked(s: Any, rows: list[Any], current: dict[str, str]) -> dict[str, dict[str, Any]]:
    """``tuner.dispatch.winners``' ranking of each device among ``rows`` that has bests of an
    implementation's forward template: device key -> problem key -> ``ProblemWinner``."""
    # lazy: sqlalchemy, torch+triton +3.0 s (2-core CPU); keeps `tuner --help` < 1 s
    from tuner.dispatch.winners import forward_templates, stored_winners

    forward = forward_templates()
    keys = sorted({r.device.key for r in rows if r.template.name in forward})
    return {key: {it.problem_key: it for it in stored_winners(
        s, device=key, version_of=current.__getitem__).items} for key in keys}


def _runs(row: Any, ranked: dict[str, dict[str, Any]], current: dict[str, str]
          ) -> dict[str, Any] | None:
    """For a best of an implementation's forward template whose problem is measured for
    several implementations: the implementation, the winner, the runner-up and the margin
    (None otherwise, and for bests of other kernel versions: they are not what runs)."""
    # lazy: sqlalchemy, torch+triton +3.1 s (2-core CPU); keeps `tuner --help` < 1 s
    from tuner.dispatch.winners import forward_templates

    implementation = forward_templates().get(row.template.name)
    found = ranked.get(row.device.key, {}).get(row.problem_key)
    if (implementation is None or found is None or len(found.tflops) < 2
            or current.get(row.template.name) != row.template.version):
        return None
    return {"implementation": implementation, "winner": found.winner,
            "runner_up": found.runner_up, "margin": found.margin, "why": found.why,
            "tflops": found.tflops, "median_ms": found.median_ms,
            "sdpa_backends": {name: t.model_dump(mode="json")
                              for name, t in found.sdpa_backends.items()}}


def _runs_text(runs: dict[str, Any] | None) -> str:
    if runs is None:
        return "-"
    me, winner, tflops = runs["implementation"], runs["winner"], runs["tflops"]
    if me == winner:
        return f"yes, {runs['margin']:.2f}x {runs['runner_up']}"
    if winner not in tflops:  # torch SDPA unmeasured: it runs by rule
        return f"no, {winner} ({runs['why']})"
    return f"no, {winner} {tflops[winner] / tflops[me]:.2f}x faster"


def _item(row: Any, readings: Readings, current: dict[str, str]) -> dict[str, Any]:
    return {"device": row.device.key, "device_name": row.device.name,
            "template": row.template.name, "template_version": row.template.version,
            "current_version": current.get(row.template.name) == row.template.version,
            "problem_key": row.problem_key, "problem": dict(row.problem),
            "dtype": row.dtype, "variant": row.variant, "config": dict(row.config),
            "tflops": row.tflops, "median_ms": row.median_ms,
            "readings": readings.count, "spread": readings.spread,
            "default_tflops": row.default_tflops, "speedup": row.speedup,
            "sweep_id": row.sweep_id, "updated_at": row.updated_at}
