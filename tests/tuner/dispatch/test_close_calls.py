"""When a head-to-head's readings settle which candidate is faster (tuner.dispatch.close_calls)."""

from __future__ import annotations

import pytest

from tuner.dispatch.close_calls import decided, sign_test_p


def test_the_sign_test_is_two_sided_and_exact() -> None:
    assert sign_test_p(5, 5) == pytest.approx(2 / 32)  # 5 rounds alone never reach 0.05
    assert sign_test_p(6, 6) == pytest.approx(2 / 64) == sign_test_p(0, 6)
    assert sign_test_p(7, 8) == pytest.approx(2 * 9 / 256)
    assert sign_test_p(3, 6) == 1.0 and sign_test_p(0, 0) == 1.0
    with pytest.raises(ValueError, match="wins must be within 0..rounds"):
        sign_test_p(7, 6)


def rounds(*ms: float) -> dict[int, float]:
    return dict(enumerate(ms))


def test_ranges_apart_decide_at_once() -> None:
    assert decided(rounds(1.00, 1.01, 1.02), rounds(1.03, 1.05, 1.04))
    # One reading of the leader above one of the runner-up's: the ranges overlap.
    assert not decided(rounds(1.00, 1.01, 1.04), rounds(1.03, 1.05, 1.04))


def test_a_leader_faster_in_every_round_decides_after_six() -> None:
    # The clock drifts over the session: the ranges overlap, every round still says the same.
    drift = [1.00, 1.04, 1.01, 1.05, 1.02, 1.06]
    leader = [ms - 0.005 for ms in drift]
    assert not decided(rounds(*leader[:5]), rounds(*drift[:5]))  # p = 1/16
    assert decided(rounds(*leader), rounds(*drift))  # p = 1/32


def test_a_split_or_a_tie_never_decides() -> None:
    assert not decided(rounds(1.0, 1.1, 1.0, 1.1, 1.0, 1.1),
                       rounds(1.1, 1.0, 1.1, 1.0, 1.1, 1.0))
    assert not decided(rounds(*[1.0] * 10), rounds(*[1.0] * 10))  # ties count against


def test_only_rounds_both_ran_are_paired() -> None:
    # The leader's round 9 has no partner: 6 paired wins decide, the extra one adds nothing.
    leader = {**rounds(1.00, 1.04, 1.01, 1.05, 1.02, 1.06), 9: 0.5}
    other = {**rounds(1.01, 1.05, 1.02, 1.06, 1.03, 1.07), 8: 0.99}
    assert decided(leader, other)
    del leader[5]
    assert not decided(leader, other)  # 5 paired wins


def test_nothing_to_decide_without_readings() -> None:
    assert decided({}, rounds(1.0)) and decided(rounds(1.0), {})
