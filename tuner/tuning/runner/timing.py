"""Timing one kernel launch: CUDA events on the GPU, wall clock under the interpreter."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

__all__ = ["INTERPRETER_RUNS", "REP_MS", "back_to_back_ms", "paced_ms", "time_gpu",
           "time_interpreter"]

# PROTOCOL.md: do_bench with 25 ms of warm-up and 100 ms of timed runs, median, L2 flushed
# between runs by do_bench itself.
WARMUP_MS = 25
REP_MS = 100
# Under the interpreter one launch takes seconds; a few runs are enough to prove the path.
INTERPRETER_RUNS = 3


def time_gpu(fn: Callable[[], Any], rep_ms: float = REP_MS) -> float:
    """Milliseconds per call of ``fn`` on the GPU: the median of triton.testing.do_bench over
    about ``rep_ms`` ms of timed runs (the protocol's 100 ms in sweeps; longer lowers the
    noise of a re-measurement, ``tuner verify --rep-ms``), or the pace of calls queued back
    to back (``paced_ms``) where that is slower.

    do_bench flushes L2 before each run, and the GPU works on the flush while the host
    launches the run: a call whose launch takes longer than its kernel partly hides it there.
    In a loop of calls (a decode step per layer) nothing hides it. The dispatcher compares
    implementations by these times, so the slower reading is the one a caller gets: a Triton
    kernel 5% faster on the GPU but launched in 80 us of host time must not beat cuDNN's
    55 us call (the H100's decode row, 2026-11-24).
    """
    # lazy: torch+triton +1.3 s (2-core CPU); keeps `tuner --help` < 1 s
    from triton.testing import do_bench

    flushed = float(do_bench(fn, warmup=WARMUP_MS, rep=rep_ms, return_mode="median"))
    return max(flushed, paced_ms(fn, flushed))


# Back-to-back pace: about PACE_MS of calls per reading, between PACE_CALLS[0] and [1] calls
# (a CUDA launch queue holds about 1000 launches; a call may take a few), median of
# PACE_READINGS readings.
PACE_MS = 10.0
PACE_CALLS = (5, 200)
PACE_READINGS = 3


def paced_ms(fn: Callable[[], Any], estimate_ms: float) -> float:
    """Median milliseconds per call of ``fn`` called back to back (``back_to_back_ms``) over
    PACE_READINGS readings of about PACE_MS each."""
    calls = int(min(PACE_CALLS[1], max(PACE_CALLS[0], PACE_MS / max(estimate_ms, 1e-3))))
    return float(statistics.median(back_to_back_ms(fn, calls) for _ in range(PACE_READINGS)))


def back_to_back_ms(fn: Callable[[], Any], calls: int) -> float:
    """Milliseconds per call of ``calls`` calls of ``fn`` queued back to back, no flush between
    them, timed by CUDA events around the whole run (host launch time included where it sets
    the pace)."""
    # lazy: torch +1.2 s (2-core CPU); keeps `tuner --help` < 1 s
    import torch

    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls


def time_interpreter(fn: Callable[[], Any], runs: int = INTERPRETER_RUNS) -> float:
    """Median wall-clock milliseconds of ``fn`` over ``runs`` calls: NOT a GPU timing."""
    samples = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return float(statistics.median(samples))
