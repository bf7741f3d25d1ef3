"""api.rate_limit.TokenBuckets: rate and burst per key, on a clock the test moves."""

from __future__ import annotations

import pytest

from api.rate_limit import TokenBuckets


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_burst_then_the_rate_per_key() -> None:
    clock = Clock()
    buckets = TokenBuckets(rate=2.0, burst=3, clock=clock)
    assert [buckets.take("a") for _ in range(3)] == [0.0, 0.0, 0.0]
    assert buckets.take("a") == pytest.approx(0.5)  # one token comes every 1/2 s
    assert buckets.take("b") == 0.0  # another address has its own bucket
    clock.now += 0.5
    assert buckets.take("a") == 0.0
    assert buckets.take("a") == pytest.approx(0.5)
    clock.now += 60  # refills to the burst, no further
    assert [buckets.take("a") for _ in range(4)][-1] > 0


def test_memory_is_bounded_by_forgetting_the_least_recently_seen() -> None:
    clock = Clock()
    buckets = TokenBuckets(rate=1.0, burst=1, max_keys=2, clock=clock)
    assert buckets.take("a") == 0.0 and buckets.take("b") == 0.0
    assert buckets.take("a") > 0  # a is now the most recently seen
    assert buckets.take("c") == 0.0  # forgets b
    assert len(buckets) == 2
    assert buckets.take("a") > 0  # a is still remembered (and still empty)
    assert buckets.take("b") == 0.0  # b was forgotten: a full bucket again


def test_bad_limits_are_refused() -> None:
    with pytest.raises(ValueError, match="rate must be > 0"):
        TokenBuckets(rate=0, burst=1)


def test_queue_lines_callers_up_at_the_rate_and_caps_the_wait() -> None:
    clock = Clock()
    buckets = TokenBuckets(rate=4.0, burst=2, clock=clock)
    waits = [buckets.queue("a", max_wait=1.0) for _ in range(8)]
    # Two at once, then one every 1/4 s for those who came together, up to the cap.
    assert waits == pytest.approx([0.0, 0.0, 0.25, 0.5, 0.75, 1.0, 1.0, 1.0])
    assert buckets.queue("b", max_wait=1.0) == 0.0  # another address has its own line
    clock.now += 1.25  # the debt never exceeds the cap: the cap plus 1/rate later, a token
    assert buckets.queue("a", max_wait=1.0) == pytest.approx(0.0)
    clock.now += 60
    assert [buckets.queue("a", max_wait=1.0) for _ in range(3)] == pytest.approx([0, 0, 0.25])
