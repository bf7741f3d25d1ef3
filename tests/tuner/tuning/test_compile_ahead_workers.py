"""How many compile-ahead processes a sweep starts: what was asked for, else none without a
GPU, else 12 per trial worker within the cores the workers leave."""

from __future__ import annotations

import pytest

from tuner.tuning import sweep
from tuner.tuning.sweep import COMPILE_AHEAD_PER_WORKER, SweepOptions, _compile_ahead_workers


@pytest.mark.parametrize(("cpus", "workers", "expected"), [
    (16, 1, COMPILE_AHEAD_PER_WORKER),  # the H200 host: 12 of the 14 cores left
    (16, 2, 13),  # 24 wanted, 16 - 2 - 1 left
    (128, 8, 8 * COMPILE_AHEAD_PER_WORKER),
    (2, 1, 1),  # a small host keeps one
])
def test_default_is_per_worker_within_the_cores_left(monkeypatch: pytest.MonkeyPatch, cpus: int,
                                                     workers: int, expected: int) -> None:
    monkeypatch.setattr(sweep.os, "cpu_count", lambda: cpus)
    assert _compile_ahead_workers(SweepOptions(workers=workers), ["0"]) == expected


def test_asked_for_or_no_gpu() -> None:
    assert _compile_ahead_workers(SweepOptions(compile_ahead=3), ["0"]) == 3
    assert _compile_ahead_workers(SweepOptions(compile_ahead=-1), ["0"]) == 0
    assert _compile_ahead_workers(SweepOptions(), []) == 0
