"""A sweep: every (template, problem) of a spec, tuned by one or more workers into the
project database.

Each worker is a thread of this process that owns one trial-worker process (its GPU, round
robin over the visible GPUs) and walks the problems in order; all workers join the same
Optuna study per problem, so a problem's trials spread over them. More hosts join by
running the same sweep against the same PostgreSQL URL. Everything measured is stored as it
finishes; running a sweep again resumes it (stored configs are not run again), and a larger
``--trials`` extends it. At the end of each problem's search its finalists are measured
again and the best is chosen by their medians (``tuner.tuning.search.loop``, ``db.finalists``).
When every problem is searched, the bests of the implementations of each problem are measured
side by side, and priced by those readings from then on (``tuner.tuning.head_to_head``). Each search
measures the default config first, then the transfer prior (``tuner.tuning.search.prior``).

With a time budget (``SweepOptions.budget_s``, ``--budget 5m``) the problems go heaviest first
(a recording's count x the problem's size) and share the time by that weight
(``tuner.tuning.search.budget``); each implementation of a problem first measures its first configs
(a probe), one measured clearly slower than another stops there
(``tuner.tuning.search.contenders``), and the rest are searched within their shares. The budget is
checked before each measurement; the sweep stops with the best found so far, every
measurement stored, and its report says so (``budget_spent``).

The caller gets events (``on_event``, always called on the calling thread) to draw
progress, and a :class:`SweepReport` at the end.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import queue
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from db import crud
from db.finalists import pick_finalists
from db.models import SweepStatus, TrialStatus
from db.session import init_db, run_in_transaction
from templates.base import Problem, Template
from templates.device import DeviceInfo
from templates.registry import get_template
from tuner.errors import TunerError
from tuner.lookup.resolver import get_resolver
from tuner.lookup.stored_bests import StoredBest
from tuner.tuning.gpus import visible_gpus
from tuner.tuning.head_to_head import (
    DEFAULT_HEAD_TO_HEAD_ROUNDS,
    DEFAULT_MAX_ROUNDS_FACTOR,
    HeadToHeadResult,
    HeadToHeadStore,
    candidates_for,
    run_head_to_head,
)
from tuner.tuning.runner.compile_ahead import CompileAhead
from tuner.tuning.runner.isolated import IsolatedRunner
from tuner.tuning.runner.measure import describe_exception
from tuner.tuning.runner.outcome import PhaseTotals, WorkerRunner
from tuner.tuning.search.budget import SweepBudget, job_cost
from tuner.tuning.search.contenders import beaten_templates
from tuner.tuning.search.loop import (
    DEFAULT_FINAL_REPEATS,
    DEFAULT_FINALISTS,
    ProblemSearch,
    SearchSettings,
    SearchStats,
    TrialEvent,
    ValidConfigs,
)
from tuner.tuning.search.prior import shipped_bests, stored_bests, transfer_prior
from tuner.tuning.search.samplers import SAMPLERS, make_sampler
from tuner.tuning.search.space import SpaceRestriction, check_restriction, problem_space
from tuner.tuning.search.store import DbStore, StoredRemeasurement, StoredResult, measured_configs
from tuner.tuning.search.study import (
    HEARTBEAT_INTERVAL_S,
    HeartbeatKeeper,
    make_storage,
    open_study,
    study_name,
)
from tuner.tuning.suites import SweepSpec

__all__ = [
    "HeadToHeadFinished",
    "HeadToHeadStarted",
    "ProblemFailed",
    "ProblemFinished",
    "ProblemPruned",
    "ProblemReport",
    "ProblemStarted",
    "SweepOptions",
    "SweepReport",
    "SweepStarted",
    "Task",
    "TrialDone",
    "device_from_dict",
    "expand_tasks",
    "run_sweep",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SweepOptions:
    trials: int = 20  # configs with results per problem (invalid ones not counted)
    timeout_s: float = 300.0  # per trial, compile included
    sampler: str = "tpe"
    workers: int = 1
    seed: int | None = None
    # Compile-ahead processes; None: COMPILE_AHEAD_PER_WORKER per worker on a GPU host (within
    # the cores the workers leave), none under the interpreter (nothing to compile ahead).
    compile_ahead: int | None = None
    # Seconds between the heartbeats of a worker's trials; a trial silent for 3x as long is
    # taken to be a dead worker's: failed and retried.
    heartbeat_s: int = HEARTBEAT_INTERVAL_S
    # Per problem, after its search: configs measured again, and how many times each; the
    # best is chosen by their medians (0 finalists: off).
    finalists: int = DEFAULT_FINALISTS
    final_repeats: int = DEFAULT_FINAL_REPEATS
    # At the end, per problem of two implementations or more: rounds of their bests measured
    # side by side, whose medians price them (0: off); a close call between the two fastest
    # takes more, up to head_to_head_max_rounds (None: DEFAULT_MAX_ROUNDS_FACTOR x as many).
    head_to_head_rounds: int = DEFAULT_HEAD_TO_HEAD_ROUNDS
    head_to_head_max_rounds: int | None = None
    # A time budget for the whole sweep, in seconds (None: none; tuner.tuning.search.budget): spent
    # on the problems by their counts x sizes, heaviest problem first. With it, each
    # problem's implementations first measure their first configs (the default, the
    # transfer prior), and one measured clearly slower than another stops being searched
    # (tuner.tuning.search.contenders), unless prune is False.
    budget_s: float | None = None
    prune: bool = True

    def __post_init__(self) -> None:
        if self.budget_s is not None and self.budget_s <= 0:
            raise TunerError(f"--budget must be a positive duration, but got {self.budget_s:g} "
                             "s", "e.g. --budget 5m")
        if self.heartbeat_s < 1:
            raise TunerError(f"--heartbeat must be >= 1 s, but got {self.heartbeat_s}",
                             f"e.g. --heartbeat {HEARTBEAT_INTERVAL_S}")
        if self.trials < 1:
            raise TunerError(f"--trials must be >= 1, but got {self.trials}", "e.g. --trials 20")
        if self.timeout_s <= 0:
            raise TunerError(f"--timeout must be > 0 seconds, but got {self.timeout_s:g}",
                             "e.g. --timeout 300")
        if self.workers < 1:
            raise TunerError(f"--workers must be >= 1, but got {self.workers}",
                             "e.g. --workers 2")
        if self.sampler not in SAMPLERS:
            raise TunerError(f"unknown sampler {self.sampler!r}",
                             f"use one of {', '.join(SAMPLERS)}")
        if self.finalists < 0:
            raise TunerError(f"--finalists must be >= 0, but got {self.finalists}",
                             f"e.g. --finalists {DEFAULT_FINALISTS}, or 0 to choose the best "
                             "by its single reading")
        if self.final_repeats < 1:
            raise TunerError(f"--final-repeats must be >= 1, but got {self.final_repeats}",
                             f"e.g. --final-repeats {DEFAULT_FINAL_REPEATS}; --finalists 0 "
                             "turns the re-measurements off")
        if self.head_to_head_rounds < 0:
            raise TunerError(f"--head-to-head-rounds must be >= 0, but got "
                             f"{self.head_to_head_rounds}",
                             f"e.g. --head-to-head-rounds {DEFAULT_HEAD_TO_HEAD_ROUNDS}; "
                             "--head-to-head-rounds 0 prices each implementation by its own "
                             "search's readings")
        if (self.head_to_head_max_rounds is not None
                and self.head_to_head_max_rounds < self.head_to_head_rounds):
            raise TunerError(f"--head-to-head-max-rounds ({self.head_to_head_max_rounds}) must "
                             f"be >= --head-to-head-rounds ({self.head_to_head_rounds})",
                             f"e.g. --head-to-head-max-rounds "
                             f"{DEFAULT_MAX_ROUNDS_FACTOR * self.head_to_head_rounds}; as "
                             "many as --head-to-head-rounds gives close calls no more rounds")


@dataclass(frozen=True)
class Task:
    """One problem of one template; ``label`` is what people read. ``space`` narrows the
    template's space (a spec's [space] table; empty: the whole space)."""

    template: Template
    problem: Problem
    problem_key: str
    space: SpaceRestriction = field(default_factory=dict)
    count: int = 1  # how often the job ran problems of this bucket (a recording's counts)

    @property
    def label(self) -> str:
        return f"{self.template.name} {self.problem.label}"


# ----------------------------------------------------------------------------- events
@dataclass(frozen=True)
class SweepStarted:
    sweep_id: int
    device: dict[str, Any]
    tasks: list[Task]
    skipped: list[tuple[str, str]]  # (label, why the template cannot run it)


@dataclass(frozen=True)
class ProblemStarted:
    worker: int
    index: int
    budget: int  # the problem's budget, capped by its number of valid configs
    results: int  # configs with results already (earlier sweeps, other workers)


@dataclass(frozen=True)
class TrialDone:
    worker: int
    index: int
    event: TrialEvent


@dataclass(frozen=True)
class ProblemFinished:
    worker: int
    index: int
    stats: SearchStats


@dataclass(frozen=True)
class ProblemPruned:
    """The implementation was measured clearly slower than another on this problem and is
    searched no further (``tuner.tuning.search.contenders``); ``stats``: what its probe did."""

    worker: int
    index: int
    reason: str
    stats: SearchStats


@dataclass(frozen=True)
class ProblemFailed:
    """The template's code failed for this problem before any trial; the sweep goes on."""

    worker: int
    index: int
    reason: str


@dataclass(frozen=True)
class HeadToHeadStarted:
    """The bests of a problem's implementations are being measured side by side."""

    label: str  # the problem's
    templates: tuple[str, ...]
    rounds: int


@dataclass(frozen=True)
class HeadToHeadFinished:
    result: HeadToHeadResult


@dataclass(frozen=True)
class _WorkerReady:
    worker: int
    device: dict[str, Any]  # DeviceInfo fields plus "key", as the trial worker reports


@dataclass(frozen=True)
class _WorkerExit:
    worker: int
    error: BaseException | None


Event = (SweepStarted | ProblemStarted | TrialDone | ProblemFinished | ProblemPruned
         | ProblemFailed | HeadToHeadStarted | HeadToHeadFinished)


# ----------------------------------------------------------------------------- the report
@dataclass
class ProblemReport:
    label: str
    template: str
    template_version: str
    problem: dict[str, Any]
    problem_key: str
    budget: int = 0
    counts: dict[str, int] = field(default_factory=dict)  # stored results of the problem
    measured: int = 0  # configs run by this sweep
    reused: int = 0
    deferred: int = 0
    # The stored best: with finalists, at the median of its readings (best_runs of them)
    best_tflops: float | None = None
    best_config: dict[str, Any] | None = None
    best_median_ms: float | None = None
    best_runs: int = 0
    default_tflops: float | None = None  # at its median when it was re-measured
    speedup: float | None = None
    wall_s: float = 0.0  # worker seconds spent on the problem's search by this sweep
    bench_s: float = 0.0  # of which timing the kernel
    remeasured: int = 0  # configs of the problem measured again (finalists, any sweep)
    disqualified: int = 0  # of which failed a re-measurement
    remeasurements: int = 0  # re-measurements run by this sweep
    final_s: float = 0.0  # worker seconds they took (not in wall_s)
    # Where the worker time of the measured configs (of wall_s), and of the re-measurements
    # (of final_s), went: each phase of a trial (tuner.tuning.runner.outcome.PHASES)
    phases: PhaseTotals = field(default_factory=PhaseTotals)
    final_phases: PhaseTotals = field(default_factory=PhaseTotals)
    # The current finalists: config, readings (the first, then the re-measurements), median
    finalists: list[dict[str, Any]] = field(default_factory=list)
    skipped: str | None = None
    count: int = 1  # how often the job ran the problem's bucket (a recording's counts)
    pruned: str | None = None  # why the search stopped after the probe (clearly slower)
    budget_spent: bool = False  # its search ended at its share of the --budget
    reached: bool = True  # False: the --budget was spent before its search started

    @property
    def ok(self) -> int:
        return self.counts.get(TrialStatus.OK.value, 0)

    @property
    def failed(self) -> dict[str, int]:
        return {k: v for k, v in self.counts.items() if k != TrialStatus.OK.value and v}

    @property
    def seconds_per_trial(self) -> float | None:
        return self.wall_s / self.measured if self.measured else None

    @property
    def bench_seconds_per_trial(self) -> float | None:
        return self.bench_s / self.measured if self.measured else None

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data.update(ok=self.ok, failed=self.failed, seconds_per_trial=self.seconds_per_trial,
                    bench_seconds_per_trial=self.bench_seconds_per_trial)
        return data


@dataclass
class SweepReport:
    sweep_id: int
    name: str
    status: str
    device: dict[str, Any]
    sampler: str
    workers: int
    problems: list[ProblemReport]
    wall_s: float
    compile_ahead: int
    head_to_heads: list[HeadToHeadResult] = field(default_factory=list)
    budget_s: float | None = None
    # True: the --budget ended the sweep (some searches stopped early or never started);
    # the best configs found so far are stored, with every measurement.
    budget_spent: bool = False

    @property
    def interpreter(self) -> bool:
        return self.device.get("name") == "cpu-interpreter"

    def to_dict(self) -> dict[str, Any]:
        return {"sweep_id": self.sweep_id, "name": self.name, "status": self.status,
                "device": self.device, "interpreter": self.interpreter,
                "timings_are_gpu_timings": not self.interpreter, "sampler": self.sampler,
                "workers": self.workers, "compile_ahead": self.compile_ahead,
                "wall_s": self.wall_s, "budget_s": self.budget_s,
                "budget_spent": self.budget_spent,
                "problems": [p.to_dict() for p in self.problems],
                "head_to_heads": [h.to_dict() for h in self.head_to_heads]}


# ----------------------------------------------------------------------------- helpers
def device_from_dict(data: dict[str, Any]) -> DeviceInfo:
    names = {f.name for f in dataclasses.fields(DeviceInfo)}
    return DeviceInfo(**{k: v for k, v in data.items() if k in names})


def expand_tasks(spec: SweepSpec) -> tuple[list[Task], list[tuple[str, str]]]:
    """The spec's (template, problem) pairs, one per shape bucket, and the skipped ones.

    Problem-major: every template of the first problem, then of the second, and so on. A sweep
    stopped by its time limit (or killed) thus leaves whole problems decided, each with all its
    implementations measured, rather than every problem measured by the first templates only
    (where the dispatcher can only pick among what was measured)."""
    spec.import_template_modules()
    templates: list[Template] = []
    skipped: list[tuple[str, str]] = []
    for name in spec.templates:
        try:
            template = get_template(name)
        except ValueError as exc:
            if spec.recorded is not None:  # recorded by another release: its problems still
                skipped.append((name, f"not a template of this release ({exc})"))  # tune
                continue
            raise TunerError(f"spec {spec.name!r}: {exc}",
                             "use a registered template name (`tuner list templates`)") from None
        try:
            check_restriction(template.config_cls, spec.space, name)
        except ValueError as exc:
            raise TunerError(f"spec {spec.name!r}: {exc}",
                             "name only knobs and choices of every template of the spec "
                             "(`tuner list templates --json` lists them), or split the "
                             "spec per template") from None
        templates.append(template)
    tasks: list[Task] = []
    index: dict[tuple[str, str], int] = {}
    for problem in spec.problems:
        count = spec.counts.get(problem, 1)
        own = spec.problem_templates.get(problem)
        for template in templates:
            if own is not None and template.name not in own:
                continue  # the job's calls of this problem never run it (tuner.record)
            task = Task(template, problem, template.problem_key(problem), spec.space, count)
            why = template.unsupported(problem)
            if why:
                skipped.append((task.label, why))
                continue
            at = index.get((template.name, task.problem_key))
            if at is None:  # one study per shape bucket, counting all of its problems
                index[(template.name, task.problem_key)] = len(tasks)
                tasks.append(task)
            else:
                tasks[at] = dataclasses.replace(tasks[at], count=tasks[at].count + count)
    if not tasks:
        raise TunerError(f"spec {spec.name!r}: no problem that its templates can run "
                         f"({'; '.join(f'{label}: {why}' for label, why in skipped)})",
                         "change the shapes, dtypes or variants of the spec")
    return tasks, skipped


# Compile processes a GPU worker keeps busy: a candidate compiles in ~1-2 s on one core while
# the GPU times one in ~0.2 s. Measured in the H200 ship sweep (16 cores, one worker): 12
# processes spent 0.09 s a trial compiling inside the worker and measured 588 configs in 387 s,
# where the old default of 4 spent 0.14 s and measured 441 in 429 s.
COMPILE_AHEAD_PER_WORKER = 12


def _compile_ahead_workers(options: SweepOptions, gpus: list[str]) -> int:
    if options.compile_ahead is not None:
        return max(0, options.compile_ahead)
    if not gpus:
        return 0
    cpus = os.cpu_count() or 2
    return max(1, min(COMPILE_AHEAD_PER_WORKER * options.workers, cpus - options.workers - 1))


def _host() -> str:
    return socket.gethostname()


# ----------------------------------------------------------------------------- the sweep
@dataclass
class _Shared:
    """What every worker thread of one sweep uses."""

    db_url: str
    sweep_id: int
    tasks: list[Task]
    versions: dict[str, str]
    options: SweepOptions
    gpus: list[str]
    storage: Any  # optuna RDBStorage
    heartbeats: HeartbeatKeeper
    compile_ahead: CompileAhead
    lookahead: int
    stale_check_s: float
    events: queue.Queue[Any]
    stop: threading.Event
    make_runner: Callable[..., WorkerRunner]
    budget: SweepBudget | None = None
    prior_rows: dict[str, list[StoredBest]] = field(default_factory=dict)  # by template
    # Each task's valid configs (ProblemSearch.valid), from its first search (the probe) on.
    valid: dict[int, ValidConfigs] = field(default_factory=dict)


def run_sweep(spec: SweepSpec, options: SweepOptions, *, db_url: str,
              on_event: Callable[[Event], None] | None = None,
              stop: threading.Event | None = None,
              make_runner: Callable[..., WorkerRunner] = IsolatedRunner) -> SweepReport:
    """Tune every problem of ``spec`` into ``db_url``; see the module docstring.
    ``make_runner(name=..., env=...)`` makes each trial worker's runner (tests give fakes)."""
    started = time.monotonic()
    emit = on_event or (lambda event: None)
    tasks, skipped = expand_tasks(spec)
    budget = None
    if options.budget_s is not None:
        tasks = heaviest_first(tasks)
        budget = SweepBudget(options.budget_s, [t.count * job_cost(t.template, t.problem)
                                                for t in tasks], started=started)
        budget.reserve_readings = options.head_to_head_rounds * sum(
            len(templates) for _, templates in _templates_by_problem(tasks))
    gpus = visible_gpus()
    if gpus and options.workers > len(gpus):
        raise TunerError(f"--workers {options.workers} but {len(gpus)} GPU(s) visible: two "
                         "workers timing kernels on one GPU disturb each other's timings",
                         f"use --workers {len(gpus)} or fewer here, and more hosts on one "
                         "PostgreSQL database for more")
    init_db(db_url)
    grace_s = 3 * options.heartbeat_s
    # Creates Optuna's tables once, before the workers race.
    storage = make_storage(db_url, heartbeat_interval_s=options.heartbeat_s,
                           grace_period_s=grace_s)
    sweep_id = run_in_transaction(db_url, lambda s: crud.create_sweep(
        s, name=spec.name, spec={**spec.to_dict(), "options": dataclasses.asdict(options)},
        host=_host()).id)
    compile_ahead = CompileAhead(_compile_ahead_workers(options, gpus),
                                 env={"CUDA_VISIBLE_DEVICES": gpus[0]} if gpus else {})
    shared = _Shared(
        db_url=db_url, sweep_id=sweep_id, tasks=tasks,
        versions={t.template.name: t.template.version() for t in tasks}, options=options,
        gpus=gpus, storage=storage, heartbeats=HeartbeatKeeper(storage),
        compile_ahead=compile_ahead,
        lookahead=max(1, compile_ahead.workers // options.workers) if compile_ahead.workers
        else 0, stale_check_s=grace_s / 2, events=queue.Queue(),
        stop=stop or threading.Event(), make_runner=make_runner, budget=budget,
        prior_rows={name: stored_bests(db_url, name)
                    for name in dict.fromkeys(t.template.name for t in tasks)})
    devices: dict[int, dict[str, Any]] = {}
    stats: dict[int, list[SearchStats]] = {i: [] for i in range(len(tasks))}
    failures: dict[int, str] = {}
    pruned: dict[int, str] = {}
    errors: list[BaseException] = []
    head_to_heads: list[HeadToHeadResult] = []
    status = SweepStatus.FAILED
    starved = False  # the --budget was spent before anything was measured
    threads = [threading.Thread(target=_work, args=(shared, w), name=f"sweep-worker-{w}",
                                daemon=True) for w in range(options.workers)]
    try:
        for thread in threads:
            thread.start()
        running = len(threads)
        while running:  # events from the worker threads, handed on from this thread
            try:
                item = shared.events.get(timeout=0.5)
            except queue.Empty:
                continue
            if isinstance(item, _WorkerReady):
                if not devices:
                    emit(SweepStarted(sweep_id, item.device, tasks, skipped))
                devices[item.worker] = item.device
            elif isinstance(item, _WorkerExit):
                running -= 1
                if item.error is not None:
                    errors.append(item.error)
                    shared.stop.set()  # one worker's bug stops the sweep; what is stored stays
            else:
                if isinstance(item, ProblemFinished | ProblemPruned):
                    stats[item.index].append(item.stats)
                if isinstance(item, ProblemPruned):
                    pruned[item.index] = item.reason
                elif isinstance(item, ProblemFailed):
                    failures[item.index] = item.reason
                emit(item)
        status = SweepStatus.FAILED if errors else (
            SweepStatus.INTERRUPTED if shared.stop.is_set() else SweepStatus.DONE)
        starved = budget is not None and budget.spent() and not any(
            st.measured or st.remeasured for runs in stats.values() for st in runs)
        if starved and status == SweepStatus.DONE:
            status = SweepStatus.INTERRUPTED  # nothing measured: no head-to-heads either
        if status == SweepStatus.DONE and options.head_to_head_rounds and devices:
            device = devices.get(0) or next(iter(devices.values()))
            head_to_heads = _head_to_heads(shared, device, emit, set(pruned))
            if shared.stop.is_set():
                status = SweepStatus.INTERRUPTED
    except KeyboardInterrupt:
        status = SweepStatus.INTERRUPTED
        raise
    finally:
        shared.stop.set()
        for thread in threads:
            thread.join(timeout=options.timeout_s + 30)
        compile_ahead.close()
        shared.heartbeats.close()
        with contextlib.suppress(Exception):
            run_in_transaction(db_url, lambda s: crud.finish_sweep(s, sweep_id=sweep_id,
                                                                   status=status))
    if not errors and budget is not None and starved:
        raise TunerError(f"--budget {options.budget_s:g} s was too small for any measurement: "
                         f"it was spent after {time.monotonic() - started:.1f} s, before the "
                         "first (the trial worker starts, imports torch and compiles); nothing "
                         "was measured or stored",
                         "give a budget of a minute or more (e.g. --budget 5m)")
    if errors:
        error = errors[0]
        if isinstance(error, TunerError):
            raise error
        raise TunerError(f"sweep {spec.name!r} stopped: {type(error).__name__}: {error}",
                         "the results measured so far are stored; fix the cause and run the "
                         "same command again to resume") from error
    device = devices.get(0) or next(iter(devices.values()), {})
    problems = _problem_reports(db_url, device, tasks, shared.versions, stats, skipped,
                                options.finalists)
    for index, reason in failures.items():
        problems[index].skipped = reason
    for index, reason in pruned.items():
        problems[index].pruned = reason
    for index, task in enumerate(tasks):
        problems[index].count = task.count
        problems[index].budget_spent = any(st.budget_spent for st in stats[index])
        problems[index].reached = bool(stats[index]) or index in failures
    spent = budget is not None and (budget.spent() or any(
        p.budget_spent or not p.reached for p in problems[:len(tasks)]))
    return SweepReport(sweep_id=sweep_id, name=spec.name, status=status.value, device=device,
                       sampler=options.sampler, workers=options.workers, problems=problems,
                       wall_s=time.monotonic() - started, compile_ahead=compile_ahead.workers,
                       head_to_heads=head_to_heads, budget_s=options.budget_s,
                       budget_spent=spent)


def _work(shared: _Shared, worker: int) -> None:
    """One worker thread: its own trial-worker process, every problem in order."""
    gpus = shared.gpus
    env = {"CUDA_VISIBLE_DEVICES": gpus[worker % len(gpus)]} if len(gpus) > 1 else {}
    # Created (and closed) on this thread: the worker process dies with its thread.
    runner = shared.make_runner(name=f"trial-worker-{worker}", env=env)
    error: BaseException | None = None
    try:
        device = runner.device()
        shared.events.put(_WorkerReady(worker, device))
        stores: dict[str, DbStore] = {}

        def store_of(task: Task) -> DbStore:
            name = task.template.name
            if name not in stores:
                stores[name] = DbStore(
                    shared.db_url, device=device, template_name=name,
                    template_version=shared.versions[name],
                    space=task.template.config_cls.json_schema(), sweep_id=shared.sweep_id,
                    worker=f"{_host()}:{os.getpid()}:{worker}")
            return stores[name]

        if shared.budget is not None:
            _work_budgeted(shared, worker, device, runner, store_of)
            return
        for index, task in enumerate(shared.tasks):
            if shared.stop.is_set():
                break
            _tune(shared, worker, index, task, device, store_of(task), runner)
    except BaseException as exc:  # reported on the main thread
        error = exc
    finally:
        runner.close()
        shared.events.put(_WorkerExit(worker, error))


def _work_budgeted(shared: _Shared, worker: int, device: dict[str, Any],
                   runner: WorkerRunner, store_of: Callable[[Task], DbStore]) -> None:
    """The tasks under a --budget, problem by problem (unmeasured first, then heaviest
    first: ``unmeasured_first``): each implementation measures its first configs (a probe,
    its best re-measured once), those clearly slower than another stop
    (``tuner.tuning.search.contenders``), and the contenders are searched within their share
    of the time left (``SweepBudget.allot``)."""
    assert shared.budget is not None
    budget, info = shared.budget, device_from_dict(device)
    for indices in unmeasured_first(_by_problem(shared.tasks), shared.tasks, store_of):
        if shared.stop.is_set() or budget.spent():
            return
        probes: dict[int, SearchStats] = {}
        for index in indices:
            task = shared.tasks[index]
            stats = _tune(shared, worker, index, task, device, store_of(task), runner,
                          probe=True)
            if stats is not None:
                probes[index] = stats
        beaten = (beaten_templates(shared.tasks[indices[0]].problem,
                                   {shared.tasks[i].template.name: _best_readings(
                                       shared.tasks[i], store_of(shared.tasks[i]))
                                    for i in probes}, info)
                  if shared.options.prune and len(probes) > 1 else {})
        for index in indices:
            if index not in probes or shared.tasks[index].template.name in beaten:
                budget.skip(index)  # its share goes to the contenders
        for index, probe in probes.items():
            task = shared.tasks[index]
            if task.template.name in beaten:
                shared.events.put(ProblemPruned(worker, index, beaten[task.template.name],
                                                probe))
                continue
            stats = _tune(shared, worker, index, task, device, store_of(task), runner,
                          emit_finished=False)
            shared.events.put(ProblemFinished(worker, index,
                                              _merged(probe, stats) if stats else probe))


def heaviest_first(tasks: list[Task]) -> list[Task]:
    """``tasks`` with the problems in order of their share of the job's time (count x cost,
    summed over the problem's templates), heaviest first; problem-major as before."""
    weight: dict[Problem, float] = {}
    for task in tasks:
        weight[task.problem] = weight.get(task.problem, 0.0) + task.count * job_cost(
            task.template, task.problem)
    order = {p: i for i, p in enumerate(sorted(weight, key=lambda p: -weight[p]))}
    return sorted(tasks, key=lambda t: order[t.problem])  # stable: templates keep their order


def unmeasured_first(groups: list[list[int]], tasks: list[Task],
                     store_of: Callable[[Task], DbStore]) -> list[list[int]]:
    """A budgeted sweep's problems (``groups`` of task indices), those with the most
    templates that have nothing stored first, in their order otherwise. A sweep run again
    after its budget ran out then measures first what the last run did not reach: going
    through the problems it finished (each one's study, probe and share, with nothing new
    to measure) had taken a second run's budget before it got there (H200, 2026-11-30: 210 s,
    3 configs measured, the same 3 problems left)."""
    def unmeasured(indices: list[int]) -> int:
        return sum(store_of(tasks[i]).best(tasks[i].problem_key) is None for i in indices)

    return sorted(groups, key=lambda indices: -unmeasured(indices))  # stable


def _by_problem(tasks: list[Task]) -> list[list[int]]:
    """Indices of ``tasks`` grouped by problem, in order (tasks are problem-major)."""
    groups: dict[Problem, list[int]] = {}
    for index, task in enumerate(tasks):
        groups.setdefault(task.problem, []).append(index)
    return list(groups.values())


def _best_readings(task: Task, store: DbStore) -> list[float]:
    """The readings (ms) of ``task``'s best config so far: its first and its re-measurements."""
    best = store.best(task.problem_key)
    if best is None:
        return []
    key = task.template.config(best.config).key()
    first = store.find(task.problem_key, key)
    again = store.remeasurements(task.problem_key).get(key, [])
    readings = [first.median_ms] if first is not None and first.median_ms else []
    return readings + [r.median_ms for r in again if r.ok and r.median_ms]


def _merged(a: SearchStats, b: SearchStats) -> SearchStats:
    """Two passes of one worker over one problem as one."""
    out = dataclasses.replace(b, statuses=a.statuses + b.statuses,
                              phases=a.phases.merged(b.phases),
                              final_phases=a.final_phases.merged(b.final_phases))
    for name in ("measured", "reused", "invalid", "deferred", "asks", "wall_s", "bench_s",
                 "runner_s", "remeasured", "disqualified", "final_s", "measure_s"):
        setattr(out, name, getattr(a, name) + getattr(b, name))
    out.budget = max(a.budget, b.budget)
    out.budget_spent = a.budget_spent or b.budget_spent
    return out


def _tune(shared: _Shared, worker: int, index: int, task: Task, device: dict[str, Any],
          store: DbStore, runner: WorkerRunner, *, probe: bool = False,
          emit_finished: bool = True) -> SearchStats | None:
    """One problem on one worker: join its study, search until its budget is met (a probe:
    only its first configs, its best re-measured once; under a --budget: within its share).
    Returns what it did (None: set-up failed, reported)."""
    options, template = shared.options, task.template
    version = shared.versions[template.name]
    seed = None if options.seed is None else options.seed * 1000 + index
    info = device_from_dict(device)
    try:  # the template's own code runs here: its default config, its constraints
        space = problem_space(template, task.problem, info, task.space)
    except Exception as exc:
        _setup_failed(shared, worker, index, template, exc)
        return None
    study = open_study(
        shared.storage, study_name(device["key"], template.name, version, task.problem_key,
                                   space.tag()),
        make_sampler(options.sampler, space, budget=options.trials, seed=seed),
        {"template": template.name, "template_version": version, "device": device["key"],
         "problem_key": task.problem_key, "problem": task.problem.to_dict(),
         **({} if space.is_full else {"space": space.to_dict()})})
    timing = shared.budget
    try:
        # The shipped table of this GPU model counts as this device's stored bests: a fresh
        # database after a kernel change measures the table's configs first (prior.py).
        shipped = shipped_bests(get_resolver().shipped_table(info), template, device["key"])
        prior = transfer_prior(template, version, task.problem, info, device["key"],
                               [*shared.prior_rows.get(template.name, []), *shipped])
        settings = SearchSettings(
            budget=options.trials, timeout_s=options.timeout_s, lookahead=shared.lookahead,
            seed=seed, stale_check_s=shared.stale_check_s, finalists=options.finalists,
            final_repeats=options.final_repeats,
            hard_deadline=timing.deadline if timing else None,
            deadline=timing.allot(index) if timing and not probe else None)
        search = ProblemSearch(
            template=template, problem=task.problem, device=info, study=study, store=store,
            runner=runner, space=space, settings=settings,
            compile_ahead=shared.compile_ahead, heartbeats=shared.heartbeats,
            on_trial=functools.partial(_forward_trial, shared.events, worker, index),
            stop=shared.stop, prior=prior, on_measure=timing.observe if timing else None,
            valid=shared.valid.get(index))
        if probe:  # the first configs only; the best of them and the default read twice
            search.settings = dataclasses.replace(
                settings, budget=min(options.trials, search.firsts()),
                finalists=min(options.finalists, 1), final_repeats=1)
        budget = search.effective_budget()
        shared.valid[index] = search.valid()
    except Exception as exc:
        _setup_failed(shared, worker, index, template, exc)
        return None
    shared.events.put(ProblemStarted(worker, index, budget, search.results()))
    stats = search.run()
    if emit_finished:
        shared.events.put(ProblemFinished(worker, index, stats))
    return stats


def _head_to_heads(shared: _Shared, device: dict[str, Any], emit: Callable[[Event], None],
                   left_out: set[int] | None = None) -> list[HeadToHeadResult]:
    """After every search: each problem's implementations side by side
    (``tuner.tuning.head_to_head``), on this thread, in a trial worker of its own on the first GPU.
    A head-to-head that fails (not a candidate: the step itself) is reported and the next one runs;
    the bests the sweep stored stay as they are."""
    # Implementations dropped after their probe (``left_out``, task indices) were measured
    # clearly slower: the side-by-side rounds go to the contenders.
    groups = _templates_by_problem([task for i, task in enumerate(shared.tasks)
                                    if i not in (left_out or set())])
    if not groups:
        return []  # no trial worker started for nothing (a spec of one template)
    options, info = shared.options, device_from_dict(device)
    store = HeadToHeadStore(shared.db_url, device=device, sweep_id=shared.sweep_id,
                            worker=f"{_host()}:{os.getpid()}:head-to-head")
    env = {"CUDA_VISIBLE_DEVICES": shared.gpus[0]} if len(shared.gpus) > 1 else {}
    runner = shared.make_runner(name="head-to-head", env=env)
    results: list[HeadToHeadResult] = []
    max_rounds = options.head_to_head_max_rounds
    if shared.budget is not None:  # no rounds beyond the asked ones for close calls
        max_rounds = options.head_to_head_rounds
    try:
        for index, (problem, templates) in enumerate(groups):
            if shared.stop.is_set():
                break
            label, rounds = problem.label, options.head_to_head_rounds
            if shared.budget is not None and not _time_for(shared.budget, rounds,
                                                           len(templates)):
                log.info("head-to-head of %s left out: the --budget is spent", label)
                continue
            try:
                candidates = candidates_for(store, problem, templates, shared.versions, info)
                if not candidates:
                    continue
                emit(HeadToHeadStarted(label, tuple(c.template.name for c in candidates),
                                       rounds))
                result = run_head_to_head(
                    store, runner, candidates, label=label, problem=problem, device=info,
                    rounds=rounds, max_rounds=max_rounds, timeout_s=options.timeout_s,
                    stop=shared.stop,
                    seed=None if options.seed is None else options.seed * 1000 + index)
            except Exception as exc:
                log.warning("the head-to-head of %s failed; its bests stay as the sweep stored "
                            "them", label, exc_info=True)
                result = HeadToHeadResult(label=label, problem=problem.to_dict(), rounds=rounds,
                                          failed=describe_exception(exc))
            results.append(result)
            emit(HeadToHeadFinished(result))
    finally:
        runner.close()
    return results


def _time_for(budget: SweepBudget, rounds: int, candidates: int) -> bool:
    """Whether a head-to-head of ``rounds`` x ``candidates`` readings fits in what is left
    of the budget at the sweep's pace (a head-to-head cut short prices nothing)."""
    pace = budget.seconds_per_measurement or 0.0
    return budget.left() >= rounds * candidates * pace


def _templates_by_problem(tasks: list[Task]) -> list[tuple[Problem, list[Template]]]:
    """The problems of ``tasks`` swept by two templates or more, in order, with them."""
    found: dict[Problem, list[Template]] = {}
    for task in tasks:
        found.setdefault(task.problem, []).append(task.template)
    return [(problem, templates) for problem, templates in found.items() if len(templates) > 1]


def _setup_failed(shared: _Shared, worker: int, index: int, template: Template,
                  exc: Exception) -> None:
    """The template's code failed for this problem before any trial; the sweep goes on."""
    shared.events.put(ProblemFailed(worker, index, f"{template.name} could not set up the "
                                    f"search: {describe_exception(exc)}"))


def _forward_trial(events: queue.Queue[Any], worker: int, index: int, event: TrialEvent) -> None:
    events.put(TrialDone(worker, index, event))


def _report_finalists(report: ProblemReport, known: dict[str, StoredResult],
                      remeasured: dict[str, list[StoredRemeasurement]], k: int) -> None:
    """What the problem's re-measurements say: how many configs were re-measured, and the
    finalists of ``k`` (this sweep's --finalists) with their readings."""
    report.remeasured = len(remeasured)
    report.disqualified = sum(any(not r.ok for r in runs) for runs in remeasured.values())
    # The finalists as they stand (a disqualified one has given its place to the next), and
    # every config re-measured by a sweep with more finalists than this one.
    measured = measured_configs(known, remeasured)
    picked = pick_finalists(measured, k)
    shown = [m for m in measured if m in picked or m.ref in remeasured]
    for m in sorted(shown, key=lambda m: (m.failed is not None, -m.tflops)):
        key = str(m.ref)
        report.finalists.append({
            "config": known[key].config, "is_default": m.is_default,
            "runs_ms": [m.first_ms, *(r.median_ms for r in remeasured.get(key, []))],
            "median_ms": m.median_ms, "tflops": m.tflops,
            "status": "disqualified" if m.failed else "ok", "reason": m.failed or ""})


def _problem_reports(db_url: str, device: dict[str, Any], tasks: list[Task],
                     versions: dict[str, str], stats: dict[int, list[SearchStats]],
                     skipped: list[tuple[str, str]], finalists: int) -> list[ProblemReport]:
    reports: list[ProblemReport] = []
    stores: dict[str, DbStore] = {}
    for index, task in enumerate(tasks):
        name = task.template.name
        report = ProblemReport(label=task.label, template=name, template_version=versions[name],
                               problem=task.problem.to_dict(), problem_key=task.problem_key)
        for s in stats.get(index, []):
            report.budget = max(report.budget, s.budget)
            report.measured += s.measured
            report.reused += s.reused
            report.deferred += s.deferred
            report.wall_s += s.wall_s
            report.bench_s += s.bench_s
            report.remeasurements += s.remeasured
            report.final_s += s.final_s
            report.phases = report.phases.merged(s.phases)
            report.final_phases = report.final_phases.merged(s.final_phases)
        if device:
            store = stores.get(name)
            if store is None:
                store = stores[name] = DbStore(db_url, device=device, template_name=name,
                                               template_version=versions[name],
                                               space=task.template.config_cls.json_schema())
            known = store.known(task.problem_key)
            report.counts = dict(Counter(r.status.value for r in known.values()))
            _report_finalists(report, known, store.remeasurements(task.problem_key),
                              finalists)
            best = store.best(task.problem_key)
            if best is not None:
                report.best_tflops, report.best_config = best.tflops, best.config
                report.best_median_ms, report.best_runs = best.median_ms, best.runs
                report.default_tflops, report.speedup = best.default_tflops, best.speedup
            else:
                report.default_tflops = next((r.tflops for r in known.values()
                                              if r.is_default and r.tflops), None)
        reports.append(report)
    for label, why in skipped:
        reports.append(ProblemReport(label=label, template=label.split()[0], template_version="",
                                     problem={}, problem_key="", skipped=why))
    return reports
