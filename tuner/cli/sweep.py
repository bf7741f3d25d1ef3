"""``tuner sweep``: tune a suite or a spec into the database, with progress and a summary."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from tuner.cli.common import (
    INTERPRETER_WARNING,
    DbOption,
    GpuLockDirOption,
    JsonOption,
    console,
    database_url,
    err_console,
    fmt_tflops,
    gpu_lock_dir,
    print_json,
    print_table,
)
from tuner.errors import TunerError

if TYPE_CHECKING:
    from tuner.tuning.runner.outcome import PhaseTotals

__all__ = ["sweep"]

DEFAULT_TRIALS = 20
# --sampler grid without --trials: the whole space (the budget is capped by the number of
# configs the constraints let through).
WHOLE_SPACE = 10**9


def sweep(
    spec: Annotated[str | None, typer.Argument(
        help="a built-in suite (quick, standard, cpu) or a .toml/.yaml spec file; "
             "or leave out and give --shape", show_default=False)] = None,
    trials: Annotated[int | None, typer.Option(
        "--trials", "-n", help="configs to measure per problem (default: the spec's, else 20; "
                               "grid: the whole space)", show_default=False)] = None,
    timeout: Annotated[float | None, typer.Option(
        "--timeout", help="seconds per trial, compile included (default 300)",
        show_default=False)] = None,
    sampler: Annotated[str | None, typer.Option(
        "--sampler", help="tpe (default), gp, random, or grid (exhaustive)",
        show_default=False)] = None,
    workers: Annotated[int, typer.Option(
        "--workers", "-w", help="trial workers on this host (GPUs round robin)")] = 1,
    seed: Annotated[int | None, typer.Option("--seed", help="sampler and input seed")] = None,
    compile_ahead: Annotated[int | None, typer.Option(
        "--compile-ahead", help="processes compiling upcoming configs (default: a few on a "
                                "GPU, none under the interpreter)", show_default=False)] = None,
    heartbeat: Annotated[int, typer.Option(
        "--heartbeat", help="seconds between trial heartbeats; a trial silent 3x as long is "
                            "a dead worker's and is retried")] = 10,
    finalists: Annotated[int | None, typer.Option(
        "--finalists", help="per problem, the configs with the fastest first readings (and "
                            "the default) measured again at the end; the best is chosen by "
                            "their medians; 0: off (default: the spec's, else 3)",
        show_default=False)] = None,
    final_repeats: Annotated[int | None, typer.Option(
        "--final-repeats", help="re-measurements of each finalist, on fresh inputs "
                                "(default: the spec's, else 2)", show_default=False)] = None,
    head_to_head_rounds: Annotated[int | None, typer.Option(
        "--head-to-head-rounds", help="at the end, per problem of two implementations or more "
                                      "(e.g. torch_sdpa and flash_fwd): rounds of their best "
                                      "configs measured side by side, rotated; their medians "
                                      "price them for the dispatcher; 0: off (default: the "
                                      "spec's, else 5)", show_default=False)] = None,
    head_to_head_max_rounds: Annotated[int | None, typer.Option(
        "--head-to-head-max-rounds", help="rounds a close call between the two fastest may "
                                          "take (more rounds of those two, until their "
                                          "readings decide; default: twice "
                                          "--head-to-head-rounds)", show_default=False)] = None,
    budget: Annotated[str | None, typer.Option(
        "--budget", help="a time budget for the whole sweep (e.g. 5m, 90s, 1h): spent on the "
                         "problems by their share of the job's time (a recording's counts x "
                         "each problem's size), heaviest first; implementations measured "
                         "clearly slower than another stop being searched; stops with the "
                         "best found so far, every measurement stored", show_default=False)
    ] = None,
    template: Annotated[list[str] | None, typer.Option(
        "--template", help="with --shape: template(s) to tune (default flash_fwd)")] = None,
    shape: Annotated[list[str] | None, typer.Option(
        "--shape", help="a problem shape, e.g. B=8,H=16,N=2048,D=128 (repeatable)")] = None,
    dtype: Annotated[list[str] | None, typer.Option(
        "--dtype", help="with --shape: float16, bfloat16, float32 (repeatable; default bfloat16, "
                        "float16 under the CPU interpreter)")] = None,
    causal: Annotated[list[str] | None, typer.Option(
        "--causal", help="with --shape: none, top_left, bottom_right (repeatable)")] = None,
    lock_dir: GpuLockDirOption = None,
    db: DbOption = None,
    json_out: JsonOption = False,
) -> None:
    """Tune every problem of a suite or spec into the database.

    Results are stored as they finish; running the same command again resumes (stored
    configs are not measured again), and a larger --trials tunes further.
    """
    if spec is not None and shape:
        raise TunerError("give either a suite/spec file or --shape flags, not both",
                         "drop the SPEC argument or the --shape options")
    if spec is None and not shape:
        raise TunerError("nothing to tune", "give a suite (`tuner sweep quick`), a spec file "
                         "(`tuner sweep my.toml`) or shapes (`--shape B=8,H=16,N=2048,D=128`)")
    # After the checks of the flags alone (their errors come in 0.7 s): these import torch,
    # the kernels and Optuna, 4-5 s (python -X importtime; issue 41, item 1).
    import optuna

    from templates.device import interpreter_active
    from tuner.tuning.gpus import gpus_for_sweep
    from tuner.tuning.head_to_head import DEFAULT_HEAD_TO_HEAD_ROUNDS
    from tuner.tuning.search.budget import parse_duration
    from tuner.tuning.search.loop import DEFAULT_FINAL_REPEATS, DEFAULT_FINALISTS
    from tuner.tuning.suites import resolve_spec, spec_from_flags
    from tuner.tuning.sweep import SweepOptions, run_sweep

    budget_s = parse_duration(budget) if budget is not None else None
    url = database_url(db)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    interpreter = interpreter_active()
    note = None
    if spec is not None:
        resolved, note = resolve_spec(spec, interpreter=interpreter)
    else:
        resolved = spec_from_flags(templates=template or [], shapes=shape or [],
                                   dtypes=dtype or [], causal=causal or [],
                                   interpreter=interpreter)
    chosen_sampler = sampler or resolved.sampler or "tpe"
    if trials is not None:
        pass
    elif chosen_sampler == "grid" or budget_s is not None:
        trials = WHOLE_SPACE  # the time budget, not a count, ends the search
    else:
        trials = resolved.trials or DEFAULT_TRIALS
    options = SweepOptions(trials=trials, budget_s=budget_s, timeout_s=timeout or resolved.timeout_s or 300.0,
                           sampler=chosen_sampler, workers=workers, seed=seed,
                           compile_ahead=compile_ahead, heartbeat_s=heartbeat,
                           finalists=_first_given(finalists, resolved.finalists,
                                                  DEFAULT_FINALISTS),
                           final_repeats=_first_given(final_repeats, resolved.final_repeats,
                                                      DEFAULT_FINAL_REPEATS),
                           head_to_head_rounds=_first_given(
                               head_to_head_rounds, resolved.head_to_head_rounds,
                               DEFAULT_HEAD_TO_HEAD_ROUNDS),
                           head_to_head_max_rounds=head_to_head_max_rounds)
    if note and not json_out:
        console.print(f"[yellow]{note}[/]")
    stop = threading.Event()
    display = None if json_out else SweepDisplay()
    claimed: list[str] = []
    try:
        with gpus_for_sweep(gpu_lock_dir(lock_dir), workers) as claimed:
            if claimed and not json_out:
                console.print(f"claimed GPU(s) {', '.join(claimed)}")
            report = run_sweep(resolved, options, db_url=url,
                               on_event=display.handle if display else None, stop=stop)
    except KeyboardInterrupt:
        if display:
            display.close()
        err_console.print("[yellow]interrupted: everything measured so far is stored; run the "
                          "same command again to resume[/]")
        raise typer.Exit(130) from None
    finally:
        if display:
            display.close()
    if json_out:
        data = report.to_dict()
        if note:
            data["note"] = note
        if report.interpreter:
            data["warning"] = INTERPRETER_WARNING
        if claimed:
            data["claimed_gpus"] = claimed
        print_json(data)
    else:
        print_summary(report)
    if report.status == "interrupted":
        raise typer.Exit(130)


def _first_given(flag: int | None, spec: int | None, default: int) -> int:
    """The flag's value, else the spec's, else the default (0 is a value: the flag is off)."""
    return flag if flag is not None else spec if spec is not None else default


class SweepDisplay:
    """Progress bars: all problems (configs measured of the total, ETA), one bar per problem
    being tuned (best so far), and a line per finished problem."""

    def __init__(self) -> None:
        self.progress = Progress(
            TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
            TextColumn("best {task.fields[best]}"), TimeElapsedColumn(), TextColumn("ETA"),
            TimeRemainingColumn(), console=console, transient=False)
        self._overall: TaskID | None = None
        self._tasks: dict[int, TaskID] = {}
        self._labels: list[str] = []
        self._budgets: dict[int, int] = {}
        self._results: dict[int, int] = {}
        self._started = False

    def handle(self, event: Any) -> None:
        # lazy: optuna, sqlalchemy, torch+triton +3.0 s (2-core CPU); keeps `tuner --help` < 1 s
        from tuner.tuning.sweep import (
            HeadToHeadFinished,
            HeadToHeadStarted,
            ProblemFailed,
            ProblemFinished,
            ProblemPruned,
            ProblemStarted,
            SweepStarted,
            TrialDone,
        )

        if isinstance(event, SweepStarted):
            self._start(event)
        elif isinstance(event, ProblemStarted):
            self._budgets[event.index] = event.budget
            self._results[event.index] = max(self._results.get(event.index, 0),
                                              min(event.results, event.budget))
            if event.index not in self._tasks:
                self._tasks[event.index] = self.progress.add_task(
                    f"  {self._labels[event.index]}", total=event.budget,
                    completed=self._results[event.index], best="-")
            self._refresh_overall()
        elif isinstance(event, TrialDone):
            ev = event.event
            self._results[event.index] = max(self._results.get(event.index, 0),
                                             min(ev.results, ev.budget))
            task = self._tasks.get(event.index)
            if task is not None:
                fields: dict[str, Any] = {}
                if ev.best_tflops is not None:
                    fields["best"] = f"{fmt_tflops(ev.best_tflops)} TFLOP/s"
                if ev.source == "final":
                    fields["description"] = (f"  {self._labels[event.index]}: re-measuring "
                                             "finalists")
                self.progress.update(task, completed=self._results[event.index], **fields)
            self._refresh_overall()
        elif isinstance(event, ProblemFinished):
            self._finish_problem(event)
        elif isinstance(event, ProblemPruned):
            task = self._tasks.get(event.index)
            if task is not None:
                self.progress.update(task, visible=False)
            self.progress.console.print(f"  [yellow]stopped[/] {self._labels[event.index]}: "
                                        f"{event.reason}")
        elif isinstance(event, ProblemFailed):
            self.progress.console.print(f"  [red]skipped[/] {self._labels[event.index]}: "
                                        f"{event.reason}")
        elif isinstance(event, HeadToHeadStarted):
            self.progress.console.print(f"  head-to-head {event.label}: "
                                        f"{', '.join(event.templates)}, {event.rounds} rounds "
                                        "side by side")
        elif isinstance(event, HeadToHeadFinished):
            self.progress.console.print(f"  {head_to_head_line(event.result)}")

    def _start(self, event: Any) -> None:
        device = event.device
        console.print(f"[bold]sweep {event.sweep_id}[/] on {device.get('name')} "
                      f"(triton {device.get('triton_version')}, torch "
                      f"{device.get('torch_version')}): {len(event.tasks)} problem(s)")
        if device.get("name") == "cpu-interpreter":
            console.print(f"[yellow]{INTERPRETER_WARNING}[/]")
        for label, why in event.skipped:
            console.print(f"[dim]skipped {label}: {why}[/]")
        self._labels = [t.label for t in event.tasks]
        self.progress.start()
        self._started = True
        self._overall = self.progress.add_task("all problems", total=None, best="")

    def _refresh_overall(self) -> None:
        if self._overall is None:
            return
        # Problems not started yet count with the budget of the ones that have.
        known = list(self._budgets.values())
        guess = max(known) if known else 0
        total = sum(self._budgets.get(i, guess) for i in range(len(self._labels)))
        self.progress.update(self._overall, total=total, completed=sum(self._results.values()))

    def _finish_problem(self, event: Any) -> None:
        task = self._tasks.get(event.index)
        stats = event.stats
        if task is not None:
            self.progress.update(task, visible=False)
        best = stats.best
        if best is None:
            line = "no config ran correctly"
        else:
            line = f"best {fmt_tflops(best.tflops)} TFLOP/s"
            notes = [f"median of {best.runs}"] if best.runs > 1 else []
            if best.default_tflops:
                notes.append(f"default {fmt_tflops(best.default_tflops)}, "
                             f"{best.tflops / best.default_tflops:.2f}x")
            if notes:
                line += f" ({'; '.join(notes)})"
        self.progress.console.print(f"  [green]done[/] {self._labels[event.index]}: {line}")

    def close(self) -> None:
        if self._started:
            self.progress.stop()
            self._started = False


def head_to_head_line(result: Any) -> str:
    """One head-to-head: each candidate's median side by side, fastest first (ms, since all
    ran one problem), or why it has none."""
    if result.failed:
        return f"[red]failed[/] head-to-head {result.label}: {result.failed}"
    if not result.finished:
        return f"[yellow]interrupted[/] head-to-head {result.label}: prices nothing"
    ranked = sorted(result.candidates, key=lambda c: (c.median_ms is None, c.median_ms or 0))
    parts = [f"{c.template} {c.median_ms:.4g} ms" if c.median_ms is not None
             else f"{c.template} out ({c.failed})" for c in ranked]
    counts = sorted({len(c.runs_ms) for c in ranked if c.median_ms is not None})
    rounds = (f"{counts[0]} rounds" if len(counts) == 1
              else f"{counts[0]} rounds, {counts[-1]} for the close call")
    return (f"[green]done[/] head-to-head {result.label}: {', '.join(parts)} "
            f"(medians of {rounds})")


def _remeasured(p: Any) -> str:
    """Configs re-measured, and how many of them were disqualified."""
    if not p.remeasured:
        return "-"
    return f"{p.remeasured}, {p.disqualified} out" if p.disqualified else str(p.remeasured)


def _where_it_went(phases: PhaseTotals, wall_s: float, count: int, per: str) -> str:
    """The phases of ``count`` trials, per trial (``PhaseTotals.breakdown``); nothing where
    their runner told none (a replay)."""
    if not phases.trials or not phases.runner_s:
        return ""
    return f"; {per}: {phases.breakdown(wall_s, count)}"


def print_summary(report: Any) -> None:
    from tuner.tuning.runner.outcome import PhaseTotals  # lazy: db.models, sqlalchemy

    templates = {p.template for p in report.problems if not p.skipped}
    table = Table(title=f"sweep {report.sweep_id} ({report.name}): {report.status}, "
                        f"sampler {report.sampler}, {report.workers} worker(s); TFLOP/s")
    for column in ("problem", "best", "default", "speedup", "finals", "ok", "failed",
                   "s/trial", "bench s"):
        table.add_column(column, justify="left" if column in ("problem", "failed")
                         else "right", overflow="fold")
    measured = remeasurements = 0
    wall = bench = final = 0.0
    phases, final_phases = PhaseTotals(), PhaseTotals()
    for p in report.problems:
        label = p.label if len(templates) > 1 else p.label.split(" ", 1)[-1]
        if p.skipped:
            table.add_row(label, "-", "-", "-", "-", "-", f"skipped: {p.skipped}", "-", "-")
            continue
        measured += p.measured
        remeasurements += p.remeasurements
        wall += p.wall_s
        bench += p.bench_s
        final += p.final_s
        phases = phases.merged(p.phases)
        final_phases = final_phases.merged(p.final_phases)
        failed = ", ".join(f"{n} {kind}" for kind, n in sorted(p.failed.items())) or "-"
        table.add_row(label, fmt_tflops(p.best_tflops), fmt_tflops(p.default_tflops),
                      f"{p.speedup:.2f}x" if p.speedup else "-", _remeasured(p), str(p.ok),
                      failed, f"{p.seconds_per_trial:.2f}" if p.seconds_per_trial else "-",
                      f"{p.bench_seconds_per_trial:.2f}" if p.bench_seconds_per_trial else "-")
    print_table(table)
    if len(templates) == 1:
        console.print(f"template: {templates.pop()}; s/trial: worker seconds per measured "
                      "config; bench s: of which timing the kernel")
    if any(p.remeasured for p in report.problems):
        console.print("finals: configs measured again at the end (the finalists and the "
                      "default; out: disqualified by a failed re-measurement); best, default: "
                      "TFLOP/s at the median of their readings where re-measured")
    if measured:
        console.print(f"{measured} config(s) measured by this sweep in {report.wall_s:.0f} s: "
                      f"{wall / measured:.2f} s per trial of worker time, of which "
                      f"{bench / measured:.2f} s timing the kernel "
                      f"(compile-ahead processes: {report.compile_ahead})"
                      + _where_it_went(phases, wall, measured, "per trial"))
    if remeasurements:
        console.print(f"{remeasurements} finalist re-measurement(s) by this sweep: "
                      f"{final:.0f} s of worker time"
                      + _where_it_went(final_phases, final, remeasurements, "each"))
    if report.head_to_heads:
        console.print("head-to-heads: each implementation's best measured side by side at "
                      "the end; these medians price them for the dispatcher")
        for result in report.head_to_heads:
            console.print(f"  {head_to_head_line(result)}")
    if report.budget_s is not None:
        pruned = [p for p in report.problems if p.pruned]
        unreached = [p for p in report.problems if not p.reached and not p.skipped]
        if report.budget_spent:
            console.print(f"[yellow]the --budget of {report.budget_s:g} s is spent[/]: the best "
                          f"configs found so far are stored, with every measurement; "
                          f"{sum(p.budget_spent for p in report.problems)} search(es) stopped "
                          f"at their share, {len(unreached)} not started (run again with a "
                          "larger budget to go on)")
        else:
            console.print(f"within the --budget of {report.budget_s:g} s "
                          f"({report.wall_s:.0f} s used)")
        for p in pruned:
            console.print(f"  stopped searching {p.label}: {p.pruned}")
        for p in unreached:
            console.print(f"  not reached: {p.label}")
    if not measured and not remeasurements:
        console.print("nothing new to measure: every problem already has its budget of "
                      "results (raise --trials to tune further)")
    if report.interpreter:
        console.print(f"[yellow]{INTERPRETER_WARNING}[/]")
