"""A time budget for a whole sweep (``tuner sweep --budget 5m``), spent on the problems in
proportion to how much of the job's time they take.

Each (template, problem) task weighs ``count x cost``: the recording's count of its bucket
(``tuner.record``; 1 without one) times an estimate of the problem's time, the larger of its
FLOPs and its bytes moved at the ridge point of a Hopper GPU (a decode step is priced by its
bytes, a prefill by its FLOPs). When a task's search starts it is allotted its weight's share
of the time left (less what the head-to-heads at the end will need), so time a task does not
use (a small space, an early end) goes to the ones after it. The budget is checked before each
measurement: one started in time runs to its end and is stored; none is cut off half-done.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Sequence

from templates.base import Problem, Template
from tuner.errors import TunerError

__all__ = ["RIDGE_FLOP_PER_BYTE", "SweepBudget", "job_cost", "parse_duration"]

# FLOPs per byte where a Hopper GPU turns from memory- to compute-bound (H100 SXM: ~990 dense
# bf16 TFLOP/s over 3.35 TB/s; H200: over 4.8 TB/s, ~205): a problem's time is about the larger
# of its FLOPs and this many times its bytes. Only the ratio between problems matters here.
RIDGE_FLOP_PER_BYTE = 250.0

_DURATION = re.compile(r"(\d+(?:\.\d+)?)\s*(h|m|min|s|sec)?", re.IGNORECASE)
_UNIT_S = {"h": 3600.0, "m": 60.0, "min": 60.0, "s": 1.0, "sec": 1.0, None: 1.0}


def parse_duration(text: str) -> float:
    """``"5m"``, ``"90s"``, ``"1h30m"``, ``"300"`` (seconds) -> seconds (> 0)."""
    cleaned = text.strip().replace(" ", "")
    pos, total = 0, 0.0
    for match in _DURATION.finditer(cleaned):
        if match.start() != pos or not match.group(0):
            break
        total += float(match.group(1)) * _UNIT_S[(match.group(2) or "").lower() or None]
        pos = match.end()
    if not cleaned or pos != len(cleaned) or total <= 0:
        raise TunerError(f"--budget {text!r} is not a positive duration",
                         "write it like 5m, 90s, 1h30m or 300 (seconds)")
    return total


def job_cost(template: Template, problem: Problem) -> float:
    """The problem's time by ``template``, up to a constant: max(FLOPs, ridge x bytes)."""
    return max(float(template.flops(problem)),
               RIDGE_FLOP_PER_BYTE * float(template.bytes_moved(problem)), 1.0)


class SweepBudget:
    """The wall time of one sweep, shared by its worker threads (module docstring)."""

    def __init__(self, total_s: float, weights: Sequence[float], *,
                 started: float | None = None) -> None:
        if total_s <= 0:
            raise ValueError(f"total_s must be > 0, but got {total_s}")
        self.total_s = total_s
        self.started = time.monotonic() if started is None else started
        self.deadline = self.started + total_s
        self.weights = [max(float(w), 0.0) for w in weights]
        self._allotted: dict[int, float] = {}  # task index -> its search's deadline
        self._lock = threading.Lock()
        self._measured = 0  # measurements seen and the seconds they took, for the reserve
        self._measure_s = 0.0
        self.reserve_readings = 0  # head-to-head readings still to come at the end

    def left(self, now: float | None = None) -> float:
        return self.deadline - (time.monotonic() if now is None else now)

    def spent(self, now: float | None = None) -> bool:
        return self.left(now) <= 0

    def observe(self, seconds: float) -> None:
        """One measurement took ``seconds`` of wall time (the reserve is priced by these)."""
        with self._lock:
            self._measured += 1
            self._measure_s += max(seconds, 0.0)

    @property
    def seconds_per_measurement(self) -> float | None:
        with self._lock:
            return self._measure_s / self._measured if self._measured else None

    def reserve_s(self) -> float:
        """What the head-to-heads at the end will take, at this sweep's pace so far."""
        pace = self.seconds_per_measurement
        return self.reserve_readings * pace if pace else 0.0

    def skip(self, index: int) -> None:
        """Task ``index`` takes no share (its search was dropped): the others divide it."""
        with self._lock:
            self._allotted.setdefault(index, self.started)

    def allot(self, index: int, now: float | None = None) -> float:
        """The deadline of task ``index``'s search: its weight's share of the time left among
        the tasks not yet allotted (itself included), in whatever order they come (a resumed
        sweep takes its unmeasured problems first); the same for every worker that asks."""
        now = time.monotonic() if now is None else now
        with self._lock:
            if index in self._allotted:
                return self._allotted[index]
            waiting = sum(w for i, w in enumerate(self.weights) if i not in self._allotted)
            share = self.weights[index] / waiting if waiting > 0 else 1.0
        left = max(self.left(now) - self.reserve_s(), 0.0)
        with self._lock:
            return self._allotted.setdefault(index, now + left * share)
