"""The rule of db.finalists: which configs are finalists, and which one is the best."""

from __future__ import annotations

import pytest

from db.finalists import Measured, choose_best, pick_finalists


def config(ref: str, first_ms: float, *again: float, default: bool = False,
           failed: str | None = None, order: int = 0) -> Measured:
    """A config of a problem of 100 GFLOP: TFLOP/s = 100 / ms."""
    return Measured(ref=ref, order=order, first_ms=first_ms, first_tflops=100.0 / first_ms,
                    is_default=default, remeasured_ms=again, failed=failed)


def test_without_remeasurements_the_fastest_single_reading_wins() -> None:
    configs = [config("a", 1.0, default=True), config("b", 0.8, order=1),
               config("c", 0.8, order=2)]
    choice = choose_best(configs)
    assert choice is not None and choice.best.ref == "b"  # the tie goes to the earlier
    assert choice.best.tflops == 125.0 and choice.best.runs == 1
    assert choice.default is not None and choice.speedup == pytest.approx(1.25)
    assert choose_best([]) is None


def test_a_lucky_first_reading_loses_to_a_consistently_fast_config() -> None:
    lucky = config("lucky", 0.5, 1.5, 1.4)
    steady = config("steady", 0.8, 0.81, 0.79, order=1)
    default = config("default", 1.2, 1.0, 1.1, default=True, order=2)
    choice = choose_best([lucky, steady, default])
    assert choice is not None and choice.best.ref == "steady"
    assert choice.best.median_ms == 0.8 and choice.best.runs == 3
    assert lucky.median_ms == 1.4 and lucky.tflops == pytest.approx(100 / 1.4)
    # The default at its median (1.1 ms), like the best: median against median.
    assert choice.speedup == pytest.approx(1.1 / 0.8)


def test_a_single_reading_competes_with_the_finalists_first_readings() -> None:
    finalists = [config("a", 0.5, 1.0, 1.0), config("b", 0.6, 0.9, 0.9, order=1)]
    # Slower than every finalist's first reading, faster than their medians: still out.
    between = config("between", 0.7, order=2)
    choice = choose_best([*finalists, between])
    assert choice is not None and choice.best.ref == "b"
    # Faster than every first reading (found after the finalists, e.g. by a longer sweep):
    # it stands until it is re-measured in turn.
    newer = config("newer", 0.45, order=3)
    choice = choose_best([*finalists, between, newer])
    assert choice is not None and choice.best.ref == "newer"


def test_a_failed_remeasurement_disqualifies_and_the_next_config_moves_up() -> None:
    configs = [config("a", 0.5, failed="wrong_result: error 0.3"),
               config("b", 0.6, order=1), config("c", 0.7, order=2),
               config("d", 0.9, default=True, order=3), config("e", 0.95, order=4)]
    assert [c.ref for c in pick_finalists(configs, 2)] == ["b", "c", "d"]  # and the default
    assert [c.ref for c in pick_finalists(configs, 3)] == ["b", "c", "d"]
    assert pick_finalists(configs, 0) == []
    choice = choose_best(configs)
    assert choice is not None and choice.best.ref == "b"
    assert choose_best([configs[0]]) is None  # nothing left to serve


def test_a_disqualified_default_gives_no_speedup() -> None:
    choice = choose_best([config("a", 0.5, 0.5), config("d", 0.9, default=True,
                                                        failed="timeout: 300 s", order=1)])
    assert choice is not None and choice.default is None and choice.speedup is None
