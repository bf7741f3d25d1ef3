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

__all__ = ["Runner", "TrialOutcome", "TrialRequest", "WorkerRunner"]


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
    runner_s: float = 0.0  # seconds the runner spent on the trial in all
    gpu_timing: bool = False  # False: interpreter wall-clock runs, not GPU timings
    fatal: bool = False  # the runner process cannot go on (CUDA context lost, crash)

    @property
    def ok(self) -> bool:
        return self.status == TrialStatus.OK

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


class Runner(Protocol):
    """Measures one config: an isolated GPU worker, or a replay of recorded results."""

    def measure(self, request: TrialRequest, timeout_s: float) -> TrialOutcome: ...


class WorkerRunner(Runner, Protocol):
    """A runner that owns a trial worker: it reports the worker's device (DeviceInfo fields
    plus ``key``) and is closed when done (``IsolatedRunner``; fakes in tests)."""

    def device(self) -> dict[str, Any]: ...

    def close(self) -> None: ...
