"""Paired rounds: is B faster than A, or is the gap within what A timed against itself shows?

Used by e2e_hf.py, e2e_softcap.py, e2e_packed.py, hf_mask_cost.py and dispatch_bench.py. Two implementations timed one after the other read a
few percent apart from drift (clocks, temperature, what ran before) alone, so a verdict rests
on rounds that time every implementation once, close together, in orders that balance
position and predecessor (:func:`round_orders`); on the ratio B/A *within* each round (drift
slower than a round cancels); and on the same comparison of A with itself ("A again", timed
as a third implementation in the same rounds), the A/A noise floor. Pure Python: the CPU tests
check it with synthetic timings.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

LEVEL = 0.95  # confidence of the median's interval
MIN_COVERAGE = 0.9  # below it (fewer than 5 rounds) no verdict: min..max is no interval yet
VERDICTS = ("faster", "same within noise", "slower", "too few rounds")


def synced_ms(fn: Callable[[], Any], sync: Callable[[], None]) -> float:
    """Wall-clock milliseconds of one ``fn()`` from a synchronized start to a synchronized
    end (``sync``: ``torch.cuda.synchronize`` on a GPU, a no-op on the CPU): a model step's
    time includes its host work and waits, which kernel timers leave out."""
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return (time.perf_counter() - start) * 1e3

def round_orders(names: Sequence[str], rounds: int) -> list[list[str]]:
    """The order of each round: rotated by one every second round, and every odd round the
    mirror of the one before (A B C, C B A, B C A, A C B, ...). Rotation alone keeps each
    name's predecessor (a kernel that runs the GPU hot slows the next one); the mirror gives
    every name both neighbours in turn, and a linear drift over a pair of rounds falls on
    every name alike (ABBA). For three names, six rounds run all six orders."""
    out = []
    n = len(names)
    for r in range(rounds):
        shift = (r // 2) % n if n else 0
        order = list(names[shift:]) + list(names[:shift])
        out.append(order[::-1] if r % 2 else order)
    return out


def interleave(measures: dict[str, Callable[[], float]], rounds: int) -> dict[str, list[float]]:
    """Each measure (a call that returns its own milliseconds) once per round, in
    :func:`round_orders`; the readings per name, in round order (index r: round r)."""
    times: dict[str, list[float]] = {name: [] for name in measures}
    for order in round_orders(list(measures), rounds):
        for name in order:
            times[name].append(float(measures[name]()))
    return times


def median_interval(values: Sequence[float], level: float = LEVEL) -> tuple[float, float, float]:
    """(low, high, coverage): the distribution-free interval of the median from order
    statistics, x(k)..x(n+1-k) with the largest k whose coverage 1 - 2 P(Binom(n, 1/2) < k)
    is at least ``level`` (k = 1, min..max, where none is: then coverage says how much less).
    No resampling, so the same rounds always give the same interval."""
    xs = sorted(values)
    n = len(xs)
    if n == 0:
        raise ValueError("no values")

    def coverage(k: int) -> float:
        return 1 - 2 * sum(math.comb(n, i) for i in range(k)) / 2 ** n

    k = 1
    while k + 1 <= (n + 1) // 2 and coverage(k + 1) >= level:
        k += 1
    return xs[k - 1], xs[n - k], coverage(k)


def summary(ratios: Sequence[float]) -> dict[str, float]:
    """Median, quartiles (the spread of single rounds) and the median's interval (how well
    the rounds pin the median down) of per-round ratios."""
    xs = list(ratios)
    low, high, cover = median_interval(xs)
    q1, _, q3 = (statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1
                 else (xs[0],) * 3)
    return {"median": statistics.median(xs), "q1": q1, "q3": q3, "ci_low": low,
            "ci_high": high, "ci_coverage": cover, "rounds": len(xs)}


def compare(times: dict[str, list[float]], base: str, other: str, again: str
            ) -> dict[str, Any]:
    """``other`` against ``base`` over paired rounds, with ``again`` (``base`` timed a second
    time in the same rounds) as the noise floor. Ratios are times, other / base (< 1: other
    is faster). ``floor``: how far from 1.00 the A/A median's interval reaches, that is what
    two timings of one implementation may read apart here (order bias included, which the
    A/B interval alone cannot see). Verdict: "faster" where the A/B interval lies wholly below
    1 - floor, "slower" wholly above 1 + floor, else "same within noise"."""
    pairs = list(zip(times[base], times[other], strict=True))
    ratio = summary([o / b for b, o in pairs])
    noise = summary([a / b for b, a in zip(times[base], times[again], strict=True)])
    floor = max(abs(noise["ci_low"] - 1), abs(noise["ci_high"] - 1))
    if min(ratio["ci_coverage"], noise["ci_coverage"]) < MIN_COVERAGE:
        verdict = "too few rounds"
    elif ratio["ci_high"] < 1 - floor:
        verdict = "faster"
    elif ratio["ci_low"] > 1 + floor:
        verdict = "slower"
    else:
        verdict = "same within noise"
    return {"ratio": ratio, "noise": noise, "floor": floor, "verdict": verdict}


def describe(c: dict[str, Any]) -> str:
    """A comparison in one line: median [interval] +-floor verdict."""
    r = c["ratio"]
    return (f"{r['median']:.3f}x [{r['ci_low']:.3f}, {r['ci_high']:.3f}] "
            f"noise +-{100 * c['floor']:.1f}% {c['verdict']}")
