"""Timing one kernel launch: CUDA events on the GPU, wall clock under the interpreter."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

__all__ = ["INTERPRETER_RUNS", "REP_MS", "time_gpu", "time_interpreter"]

# PROTOCOL.md: do_bench with 25 ms of warm-up and 100 ms of timed runs, median, L2 flushed
# between runs by do_bench itself.
WARMUP_MS = 25
REP_MS = 100
# Under the interpreter one launch takes seconds; a few runs are enough to prove the path.
INTERPRETER_RUNS = 3


def time_gpu(fn: Callable[[], Any], rep_ms: float = REP_MS) -> float:
    """Median milliseconds of ``fn`` on the GPU (triton.testing.do_bench), over about
    ``rep_ms`` ms of timed runs: the protocol's 100 ms in sweeps; longer lowers the noise of a
    re-measurement (``tuner verify --rep-ms``)."""
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=WARMUP_MS, rep=rep_ms, return_mode="median"))


def time_interpreter(fn: Callable[[], Any], runs: int = INTERPRETER_RUNS) -> float:
    """Median wall-clock milliseconds of ``fn`` over ``runs`` calls: NOT a GPU timing."""
    samples = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return float(statistics.median(samples))
