"""``tuner verify``: re-measure the stored best configs in a fresh worker, compare the times."""

from __future__ import annotations

from contextlib import nullcontext
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.table import Table

from tuner.cli.common import (
    INTERPRETER_WARNING,
    DbOption,
    GpuLockDirOption,
    JsonOption,
    console,
    database_url,
    fmt_tflops,
    gpu_lock_dir,
    print_json,
    print_table,
    problem_label,
)
from tuner.errors import TunerError
from tuner.tuning.runner.timing import REP_MS
from tuner.tuning.verify_options import AUTO, DEFAULT_TOLERANCE, VerifyOptions, parse_tolerance
from tuner.wire import readings_text

if TYPE_CHECKING:
    from tuner.tuning.verify import Verified

__all__ = ["verify"]

# Exit status when a stored best is off by more than the tolerance or fails to run again
# (user errors exit 2, through the app's error path).
EXIT_NOT_VERIFIED = 1


def verify(
    spec: Annotated[str | None, typer.Argument(
        help="verify every problem of a suite (quick, standard, cpu) or a .toml/.yaml spec "
             "file; or give --shape; or neither: every stored best of this device",
        show_default=False)] = None,
    tolerance: Annotated[str, typer.Option(
        "--tolerance", help="largest allowed |re-measured / stored time - 1| (0.03: 3%), or "
                            "'auto': per stored best, the larger of 3% and the spread of its own "
                            "stored readings")] = str(DEFAULT_TOLERANCE),
    repeats: Annotated[int, typer.Option(
        "--repeats", "-r", help="re-measurements per config; their median time counts")] = 1,
    rep_ms: Annotated[float, typer.Option(
        "--rep-ms", help="milliseconds of timed runs per re-measurement on the GPU (do_bench's "
                         "rep; sweeps time 100); longer lowers the noise")] = REP_MS,
    timeout: Annotated[float, typer.Option(
        "--timeout", help="seconds per re-measurement, compile included")] = 300.0,
    seed: Annotated[int | None, typer.Option(
        "--seed", help="seeds the inputs (default: fresh random inputs)",
        show_default=False)] = None,
    template: Annotated[list[str] | None, typer.Option(
        "--template", help="only this template (repeatable); with --shape: the template(s) "
                           "of the shapes (default flash_fwd)", show_default=False)] = None,
    shape: Annotated[list[str] | None, typer.Option(
        "--shape", help="a problem shape, e.g. B=8,H=16,N=2048,D=128 (repeatable)",
        show_default=False)] = None,
    dtype: Annotated[list[str] | None, typer.Option(
        "--dtype", help="only this dtype (repeatable); with --shape: default bfloat16 (float16 "
                        "under the CPU interpreter)",
        show_default=False)] = None,
    causal: Annotated[list[str] | None, typer.Option(
        "--causal", help="with --shape: none, top_left, bottom_right (repeatable)",
        show_default=False)] = None,
    variant: Annotated[str | None, typer.Option(
        "--variant", help="without SPEC or --shape: only this variant (dense, "
                          "causal-top_left, ... as stored)", show_default=False)] = None,
    lock_dir: GpuLockDirOption = None,
    db: DbOption = None,
    json_out: JsonOption = False,
) -> None:
    """Re-measure the stored best config of each problem in a fresh worker process.

    Each re-measurement is a trial as in a sweep (fresh inputs, the reference check,
    do_bench); a config whose median time is off by more than --tolerance from its stored
    time, or that fails, makes the command exit 1. Each row also gives the stored best's own
    readings and their spread: a deviation within it is within the config's measured noise.
    """
    options = VerifyOptions(repeats=repeats, timeout_s=timeout,
                            tolerance=parse_tolerance(tolerance), seed=seed, rep_ms=rep_ms)
    if spec is not None and shape:
        raise TunerError("give either a suite/spec file or --shape flags, not both",
                         "drop the SPEC argument or the --shape options")
    if causal and not shape:
        raise TunerError("--causal goes with --shape", "pick stored rows by --variant "
                         "(e.g. causal-top_left), or give --shape")
    if variant is not None and (spec is not None or shape):
        raise TunerError("--variant filters the stored rows when no SPEC or --shape is given",
                         "give the variant in the spec or with --causal instead")
    # After the checks of the flags alone, so that their errors come in 0.7 s, not 4 s: these
    # import torch and the kernels (python -X importtime; issue 41, item 1).
    from templates import current_device
    from templates.device import interpreter_active
    from tuner.tuning.gpus import gpus_for_sweep
    from tuner.tuning.runner.isolated import IsolatedRunner
    from tuner.tuning.suites import resolve_spec, spec_from_flags
    from tuner.tuning.sweep import expand_tasks
    from tuner.tuning.verify import stored_for_tasks, stored_matching
    from tuner.tuning.verify import verify as remeasure
    url = database_url(db)
    # The device the stored rows are looked up for: this machine's, as `tuner best` does.
    device_key = current_device().key
    note = None
    if spec is not None or shape:
        if spec is not None:
            resolved, note = resolve_spec(spec, interpreter=interpreter_active())
        else:
            resolved = spec_from_flags(templates=template or [], shapes=shape or [],
                                       dtypes=dtype or [], causal=causal or [],
                                       interpreter=interpreter_active())
        tasks, _ = expand_tasks(resolved)
        stored = stored_for_tasks(url, device_key, tasks)
    else:
        stored, left_out = stored_matching(url, device_key, templates=template or [],
                                           dtypes=dtype or [], variant=variant)
        if left_out:
            note = (f"{left_out} stored best config(s) of older kernel versions or "
                    "unregistered templates left out")
        if not stored:
            raise TunerError(f"no stored best config of the current kernels on "
                             f"{device_key.split('|', 1)[0]} in {url} matches"
                             + (f" ({note})" if note else ""),
                             "run `tuner sweep` on this device first (the same --db), or "
                             "loosen --template/--dtype/--variant")
    if note and not json_out:
        console.print(f"[yellow]{note}[/]")
    with gpus_for_sweep(gpu_lock_dir(lock_dir), 1):
        runner = IsolatedRunner(name="verify-worker")
        try:
            device = runner.device()
            if device["key"] != device_key:
                raise TunerError(f"the worker process measures on {device['key']!r}, but the "
                                 f"stored rows were looked up for {device_key!r}",
                                 "make this process and its worker see the same GPU "
                                 "(CUDA_VISIBLE_DEVICES, --gpu-lock-dir)")
            with console.status("re-measuring") if not json_out else nullcontext():
                results = remeasure(stored, runner, options)
        finally:
            runner.close()
    failed = [r for r in results if not r.within_tolerance]
    interpreter = device.get("name") == "cpu-interpreter"
    if json_out:
        data: dict[str, Any] = {
            "device": device, "tolerance": options.tolerance, "repeats": repeats,
            "rep_ms": rep_ms,
            "verified": len(results) - len(failed), "failed": len(failed),
            "ok": not failed, "problems": [r.to_dict() for r in results]}
        if note:
            data["note"] = note
        if interpreter:
            data["warning"] = INTERPRETER_WARNING
        print_json(data)
    else:
        _print_table(results, device, options)
        if interpreter:
            console.print(f"[yellow]{INTERPRETER_WARNING}[/]")
    if failed:
        raise typer.Exit(EXIT_NOT_VERIFIED)


def _print_table(results: list[Verified], device: dict[str, Any],
                 options: VerifyOptions) -> None:
    templates = {r.stored.template for r in results}
    several = len(templates) > 1
    auto = options.tolerance == AUTO
    bar = _pct(options.tolerance) if isinstance(options.tolerance, float | int) else "the bar"
    table = Table(title=f"stored best configs re-measured on {device.get('name')}"
                        + ("" if several else f", template {next(iter(templates))}")
                        + (f" (median of {options.repeats})" if options.repeats > 1 else "")
                        + (f", {options.rep_ms:g} ms timed" if options.rep_ms != REP_MS else ""))
    # The stored readings sit next to the verdict: a deviation within their spread is within
    # the config's own measured noise.
    columns = (*(("template",) if several else ()), "problem", "stored ms", "TFLOP/s",
               "re-measured ms", "TFLOP/s", "ratio", "stored readings (spread)",
               *(("bar",) if auto else ()), f"within {bar}")
    for column in columns:
        table.add_column(column, overflow="fold",
                         justify="left" if column in ("template", "problem") else "right")
    for r in results:
        failure = r.failure
        verdict = ("[green]yes[/]" if r.within_tolerance else
                   f"[red]failed: {failure.status.value}[/]" if failure else "[red]NO[/]")
        ratio = r.ratio
        table.add_row(*((r.stored.template,) if several else ()),
                      problem_label(r.stored.problem), _ms(r.stored.median_ms),
                      fmt_tflops(r.stored.tflops), _ms(r.measured_ms),
                      fmt_tflops(r.measured_tflops),
                      f"{ratio:.3f}" if ratio is not None else "-",
                      readings_text(r.stored.readings, r.stored.spread),
                      *((_pct(r.tolerance, 1),) if auto else ()), verdict)
    print_table(table)
    off = [r for r in results if not r.within_tolerance]
    what = (f"within their bar, max({_pct(DEFAULT_TOLERANCE)}, the spread of their stored "
            "readings),") if auto else f"within {bar}"
    console.print(f"{len(results) - len(off)} of {len(results)} {what} of the stored time "
                  "(ratio: re-measured / stored time)")
    for r in off:
        label = f"{r.stored.template} {problem_label(r.stored.problem)}"
        failure = r.failure
        why = (f"re-measurement failed ({failure.status.value}): {failure.reason}" if failure
               else f"re-measured {_ms(r.measured_ms)} ms vs stored {_ms(r.stored.median_ms)} ms"
               + _noise(r))
        console.print(f"[red]off:[/] {label}: {why}", highlight=False)


def _noise(result: Verified) -> str:
    """Whether an off result's deviation lies within its stored readings' spread."""
    spread = result.stored.spread
    if spread is None:
        return " (stored from one reading: its noise is unknown)"
    inside = "within" if result.within_stored_spread else "beyond"
    return (f", {inside} the {_pct(spread, 1)} spread of its {result.stored.readings} stored "
            "readings")


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def _pct(fraction: float, decimals: int | None = None) -> str:
    return f"{fraction * 100:.{decimals}f}%" if decimals is not None else f"{fraction * 100:g}%"
