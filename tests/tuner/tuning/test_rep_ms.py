"""How long a trial times on the GPU (``TrialRequest.rep_ms``, do_bench's ``rep``) travels from
the request through the worker to the timing; bad values are refused with what is allowed.
Without a GPU the last step is checked with a stand-in ``do_bench``."""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

import pytest

from db.models import TrialStatus
from templates import current_device
from tests.tuner.conftest import TOY_PROBLEM
from tuner.tuning.runner import timing
from tuner.tuning.runner.outcome import TrialOutcome, TrialRequest
from tuner.tuning.runner.timing import REP_MS, WARMUP_MS, time_gpu
from tuner.tuning.runner.trial_process import _answer


def request(**extra: Any) -> TrialRequest:
    return TrialRequest(template="toy_add", template_module="tests.tuner.toy_templates",
                        problem=TOY_PROBLEM.to_dict(), config={"BLOCK": 64, "num_warps": 2},
                        seed=3, **extra)


def test_requests_keep_the_protocols_100_ms_unless_told() -> None:
    assert request().rep_ms == REP_MS == 100
    assert request(rep_ms=500).rep_ms == 500


@pytest.mark.parametrize("bad", [0, -5.0, float("nan"), float("inf"), True, "100"])
def test_a_bad_timing_length_is_refused(bad: object) -> None:
    with pytest.raises(ValueError, match=r"rep_ms must be a finite number of milliseconds > 0"):
        request(rep_ms=bad)


def test_the_worker_passes_the_timing_length_to_the_measurement(
        monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, Any] = {}

    def fake_measure(*args: Any, **kwargs: Any) -> TrialOutcome:
        seen.update(kwargs)
        return TrialOutcome(TrialStatus.OK, median_ms=1.0, tflops=1.0)

    # The module (tuner.tuning.runner's attribute of that name is the function it exports).
    module = importlib.import_module("tuner.tuning.runner.measure")
    monkeypatch.setattr(module, "measure", fake_measure)
    device = current_device()
    # As the parent sends it (IsolatedRunner: dataclasses.asdict of the request).
    answer = _answer(dataclasses.asdict(request(rep_ms=400.0)), device)
    assert answer["status"] == "ok" and seen["rep_ms"] == 400.0 and seen["seed"] == 3
    # A request of older code, without rep_ms, times as the protocol does.
    older = {k: v for k, v in dataclasses.asdict(request()).items() if k != "rep_ms"}
    _answer(older, device)
    assert seen["rep_ms"] == REP_MS
    bad = _answer({**older, "rep_ms": 0}, device)
    assert bad["status"] == "runtime_error" and "rep_ms must be" in bad["reason"]


def test_time_gpu_hands_the_length_to_do_bench(monkeypatch: pytest.MonkeyPatch) -> None:
    import triton.testing

    calls: list[dict[str, Any]] = []

    def fake_do_bench(fn: Any, **kwargs: Any) -> float:
        calls.append(kwargs)
        return 1.5

    monkeypatch.setattr(triton.testing, "do_bench", fake_do_bench)
    monkeypatch.setattr(timing, "paced_ms", lambda fn, estimate: estimate / 2)
    assert time_gpu(lambda: None) == 1.5 and time_gpu(lambda: None, 750.0) == 1.5
    assert calls == [{"warmup": WARMUP_MS, "rep": REP_MS, "return_mode": "median"},
                     {"warmup": WARMUP_MS, "rep": 750.0, "return_mode": "median"}]


def test_time_gpu_is_the_back_to_back_pace_where_that_is_slower(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # A launch slower than its kernel hides behind do_bench's L2 flush, not in a loop.
    import triton.testing

    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kwargs: 0.05)
    paced: list[float] = []

    def pace(fn: Any, estimate: float) -> float:
        paced.append(estimate)
        return 0.08

    monkeypatch.setattr(timing, "paced_ms", pace)
    assert time_gpu(lambda: None) == 0.08 and paced == [0.05]
