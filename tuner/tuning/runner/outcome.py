"""What a runner answers for one config: a measurement or a failure of some kind.

A failed config is a result, not an exception: each kind (invalid, compile error, runtime
error, wrong result, timeout) is recorded with its reason so the sweep never retries it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Protocol

from db.models import TrialStatus
from tuner.tuning.runner.timing import REP_MS

__all__ = ["PHASES", "PhaseTotals", "Runner", "TrialOutcome", "TrialRequest", "WorkerRunner"]

# The phases of a trial in the worker, in order (``tuner.tuning.runner.measure``): making the
# inputs, the first launch (compile or cache load, and one run), the reference, the check of
# the output against it, the timed runs. What the worker spent beside them (the request,
# poisoning freed memory, ...) is ``runner_s`` less their sum.
PHASES = ("inputs_s", "compile_s", "reference_s", "check_s", "bench_s")


@dataclass(frozen=True)
class TrialRequest:
    """One config of one problem to measure; plain data, so it crosses process boundaries.

    ``template_module`` is imported by the worker before it looks the template up, so
    templates that register themselves outside the ``templates`` package work too.
    ``rep_ms``: milliseconds of timed runs on the GPU (``do_bench``'s ``rep``); sweeps keep the
    protocol's 100, ``tuner verify --rep-ms`` may time longer. The interpreter ignores it.
    """

    template: str
    template_module: str
    problem: dict[str, Any]
    config: dict[str, Any]
    seed: int = 0
    rep_ms: float = REP_MS

    def __post_init__(self) -> None:
        if isinstance(self.rep_ms, bool) or not (
                isinstance(self.rep_ms, int | float) and math.isfinite(self.rep_ms)
                and self.rep_ms > 0):
            raise ValueError(f"rep_ms must be a finite number of milliseconds > 0, but got "
                             f"{self.rep_ms!r} (the protocol's is {REP_MS})")


@dataclass(frozen=True)
class TrialOutcome:
    status: TrialStatus
    reason: str = ""
    median_ms: float | None = None
    tflops: float | None = None
    compile_s: float | None = None  # the first launch: compile (or cache load) and one run
    error: float | None = None  # relative error against the reference
    bench_s: float = 0.0  # seconds spent timing (do_bench, or the interpreter's runs)
    runner_s: float = 0.0  # seconds the worker spent on the trial in all
    gpu_timing: bool = False  # False: interpreter wall-clock runs, not GPU timings
    fatal: bool = False  # the runner process cannot go on (CUDA context lost, crash)
    # The other phases (PHASES), None where the trial did not get that far
    inputs_s: float | None = None  # make_inputs
    reference_s: float | None = None  # the reference: computed, or the kept one checked
    check_s: float | None = None  # template.error of the output against it
    reference_kept: bool = False  # the reference was the worker's kept one (not computed)
    start_s: float = 0.0  # seconds spent starting a fresh worker for this trial (the parent)

    @property
    def ok(self) -> bool:
        return self.status == TrialStatus.OK

    def phases(self) -> dict[str, float]:
        """Seconds of each phase the trial went through (PHASES; a phase it did not reach
        is left out; ``bench_s`` only where it timed)."""
        found = {name: getattr(self, name) for name in PHASES}
        return {name: float(seconds) for name, seconds in found.items()
                if seconds is not None and (name != "bench_s" or seconds > 0)}

    def phase_record(self) -> dict[str, Any] | None:
        """What a stored row keeps of where the trial's time went (its ``phases`` column):
        the phases, ``runner_s``, ``start_s`` where a worker was started for it, and
        ``reference_kept``; None for a config that never reached a worker (rejected by a
        constraint in the search)."""
        if not self.runner_s and not self.start_s and not self.phases():
            return None
        record: dict[str, Any] = {**self.phases(), "runner_s": self.runner_s}
        if self.start_s:
            record["start_s"] = self.start_s
        if self.reference_kept:
            record["reference_kept"] = True
        return record

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["status"] = self.status.value
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrialOutcome:
        return cls(**{**data, "status": TrialStatus(data["status"])})

    @classmethod
    def failed(cls, status: TrialStatus, reason: str, **extra: Any) -> TrialOutcome:
        return cls(status=status, reason=reason, **extra)


@dataclass
class PhaseTotals:
    """Where the worker time of some trials went: each phase (PHASES) summed over them, the
    worker's whole time on them (``runner_s``), and the seconds spent starting workers."""

    trials: int = 0
    inputs_s: float = 0.0
    compile_s: float = 0.0
    reference_s: float = 0.0
    check_s: float = 0.0
    bench_s: float = 0.0
    runner_s: float = 0.0
    start_s: float = 0.0
    references_kept: int = 0  # trials whose reference was the worker's kept one

    def add(self, outcome: TrialOutcome) -> None:
        self.trials += 1
        for name, seconds in outcome.phases().items():
            setattr(self, name, getattr(self, name) + seconds)
        self.runner_s += outcome.runner_s
        self.start_s += outcome.start_s
        self.references_kept += outcome.reference_kept

    def merged(self, other: PhaseTotals) -> PhaseTotals:
        return PhaseTotals(**{f.name: getattr(self, f.name) + getattr(other, f.name)
                              for f in dataclasses.fields(self)})

    @property
    def rest_s(self) -> float:
        """The worker's time beside the phases: reading the request, poisoning freed memory,
        a failure's clean-up."""
        return max(0.0, self.runner_s - sum(getattr(self, name) for name in PHASES))

    def breakdown(self, wall_s: float, count: int) -> str:
        """Per one of ``count`` trials that took ``wall_s`` seconds in all: each phase, the
        rest of the worker's time, and what was spent outside the worker (starting workers,
        and the search's own work: the sampler, the database, waiting on compile-ahead)."""
        if count <= 0:
            return ""
        outside = max(0.0, wall_s - self.runner_s - self.start_s)
        parts = [("inputs", self.inputs_s), ("compile", self.compile_s),
                 ("reference", self.reference_s), ("check", self.check_s),
                 ("timing", self.bench_s), ("rest of the worker", self.rest_s)]
        if self.start_s:
            parts.append(("starting workers", self.start_s))
        parts.append(("outside the worker", outside))
        text = ", ".join(f"{name} {seconds / count:.2f} s" for name, seconds in parts)
        if self.references_kept:
            text += (f"; {self.references_kept} of {self.trials} reference(s) kept from an "
                     "earlier trial")
        return text


class Runner(Protocol):
    """Measures one config: an isolated GPU worker, or a replay of recorded results."""

    def measure(self, request: TrialRequest, timeout_s: float) -> TrialOutcome: ...


class WorkerRunner(Runner, Protocol):
    """A runner that owns a trial worker: it reports the worker's device (DeviceInfo fields
    plus ``key``) and is closed when done (``IsolatedRunner``; fakes in tests)."""

    def device(self) -> dict[str, Any]: ...

    def close(self) -> None: ...
