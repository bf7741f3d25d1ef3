"""benchmarks/paired.py on synthetic timings: the round orders balance position and
predecessor, the median's interval is the order-statistics one, and the verdict follows the
paired ratio (drift cancels), not the separate medians, and respects the A/A floor."""

from __future__ import annotations

import itertools
import random
import time
from collections import Counter
from collections.abc import Callable

import pytest

from benchmarks.paired import (
    compare,
    interleave,
    median_interval,
    round_orders,
    summary,
    synced_ms,
)


def test_round_orders_balance_position_and_neighbours() -> None:
    orders = round_orders(["a", "b", "c"], 6)
    assert orders[:2] == [["a", "b", "c"], ["c", "b", "a"]]  # ABBA: the mirror follows
    assert sorted(map(tuple, orders)) == sorted(itertools.permutations("abc"))
    names = ["a", "b", "c", "d"]
    orders = round_orders(names, 2 * len(names))
    for pos in range(len(names)):
        assert Counter(o[pos] for o in orders) == {n: 2 for n in names}
    before = Counter((o[i - 1], o[i]) for o in orders for i in range(1, len(o)))
    assert before[("a", "b")] and before[("b", "a")]  # each neighbour comes first in turn


def test_median_interval_from_order_statistics() -> None:
    xs = [float(x) for x in range(10, 0, -1)]
    low, high, cover = median_interval(xs)
    assert (low, high) == (2.0, 9.0)  # x(2)..x(9) for n = 10
    assert cover == pytest.approx(1 - 2 * 11 / 1024)
    assert median_interval([3.0, 1.0, 2.0, 5.0, 4.0]) == (1.0, 5.0, pytest.approx(1 - 2 / 32))
    assert median_interval([1.0])[2] == 0.0
    s = summary([1.0, 2.0, 3.0, 4.0, 100.0])
    assert (s["median"], s["q1"], s["q3"], s["rounds"]) == (3.0, 2.0, 4.0, 5)


def drifting(costs: dict[str, float], drift: float, jitter: float, seed: int = 0
             ) -> dict[str, Callable[[], float]]:
    """Measures whose time grows by ``drift`` per call made (clocks slowing down during the
    run), times ``jitter`` of noise: timed one after the other, the later one reads slow."""
    rng = random.Random(seed)
    calls = itertools.count()

    def measure(cost: float) -> float:
        return cost * (1 + drift * next(calls)) * (1 + rng.uniform(-jitter, jitter))

    return {name: (lambda c: lambda: measure(c))(cost) for name, cost in costs.items()}


def test_paired_ratio_cancels_drift_that_separate_timings_do_not() -> None:
    # tuner 3% faster while the clock slows 0.5% per call (45% over the run): within a round
    # the drift is small, so the paired median reads the 3%.
    measures = drifting({"sdpa": 10.0, "tuner": 9.7, "sdpa again": 10.0}, 0.005, 0.002)
    times = interleave(measures, 30)
    c = compare(times, "sdpa", "tuner", "sdpa again")
    assert c["ratio"]["median"] == pytest.approx(0.97, abs=0.004)
    assert c["floor"] < 0.01
    assert c["verdict"] == "faster"
    # one implementation after the other (the old way): tuner, timed second, reads slower
    after = drifting({"sdpa": 10.0, "tuner": 9.7}, 0.005, 0.002)
    first = [after["sdpa"]() for _ in range(30)]
    second = [after["tuner"]() for _ in range(30)]
    assert min(second) / min(first) > 1.0


def test_pairing_within_rounds_removes_a_wandering_clock() -> None:
    # the clock wanders +-10% from round to round, far more than the 3% to find: the ratio
    # within a round is still exact to the jitter, which separate readings cannot be.
    rng = random.Random(2)
    calls = itertools.count()
    factors = [rng.uniform(0.9, 1.1) for _ in range(20)]

    def measure(cost: float) -> float:
        return cost * factors[next(calls) // 3] * (1 + rng.uniform(-0.002, 0.002))

    times = interleave({n: (lambda c: lambda: measure(c))(cost)
                        for n, cost in {"sdpa": 10.0, "tuner": 9.7, "sdpa again": 10.0}.items()},
                       20)
    c = compare(times, "sdpa", "tuner", "sdpa again")
    assert c["ratio"]["q3"] - c["ratio"]["q1"] < 0.005
    assert c["ratio"]["ci_high"] < 0.975 and c["verdict"] == "faster"
    assert max(times["sdpa"]) / min(times["sdpa"]) > 1.1  # the readings themselves wander


@pytest.mark.parametrize(("cost", "verdict"), [(10.0, "same within noise"), (10.3, "slower"),
                                               (9.7, "faster")])
def test_verdict_follows_the_paired_interval(cost: float, verdict: str) -> None:
    times = interleave(drifting({"sdpa": 10.0, "tuner": cost, "sdpa again": 10.0}, 0.001,
                                0.005, seed=1), 20)
    assert compare(times, "sdpa", "tuner", "sdpa again")["verdict"] == verdict


def test_a_biased_noise_floor_keeps_a_small_gap_same_within_noise() -> None:
    # sdpa read 2% slower each time it was timed again (an order effect the A/B interval
    # alone cannot see): a 1.5% gap of tuner is within that floor, a 4% one is not.
    rounds = 12
    base = [10.0 + 0.01 * (r % 3) for r in range(rounds)]
    times = {"sdpa": base, "sdpa again": [t * 1.02 for t in base],
             "tuner": [t * 1.015 for t in base]}
    c = compare(times, "sdpa", "tuner", "sdpa again")
    assert c["floor"] == pytest.approx(0.02)
    assert c["verdict"] == "same within noise"
    times["tuner"] = [t * 1.04 for t in base]
    assert compare(times, "sdpa", "tuner", "sdpa again")["verdict"] == "slower"


def test_too_few_rounds_give_no_verdict() -> None:
    times = {"sdpa": [1.0] * 4, "tuner": [2.0] * 4, "sdpa again": [1.0] * 4}
    assert compare(times, "sdpa", "tuner", "sdpa again")["verdict"] == "too few rounds"
    times = {k: v + v[:1] for k, v in times.items()}
    assert compare(times, "sdpa", "tuner", "sdpa again")["verdict"] == "slower"


def test_synced_ms_times_from_a_synchronized_start_to_a_synchronized_end() -> None:
    events: list[str] = []
    ms = synced_ms(lambda: events.append("run") or time.sleep(0.02),
                   lambda: events.append("sync"))
    assert events == ["sync", "run", "sync"]
    assert 20 <= ms < 2000
