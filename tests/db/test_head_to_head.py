"""Which head-to-head readings price a stored best (db.head_to_head, db.finalists): the latest
finished session's, never an unfinished one's; a failed reading disqualifies its config."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from db import crud, head_to_head
from db.models import TrialStatus
from db.session import init_db, session_scope

GFLOP = 100.0  # the problem's work: TFLOP/s = 100 / ms


@dataclass(frozen=True)
class Stored:
    url: str
    device_id: int
    template_id: int
    fast: int  # the template's best by its sweep readings (1.0 ms)
    slow: int  # the runner-up (1.1 ms)


@pytest.fixture
def stored(db_url: str) -> Stored:
    init_db(db_url)
    with session_scope(db_url) as s:
        device = crud.get_or_create_device(s, info={
            "key": "gpu|1", "name": "gpu", "compute_capability": "9.0", "sm_count": 1,
            "total_memory": 1, "driver_version": "1", "triton_version": "1",
            "torch_version": "1", "cuda_version": "1"})
        template = crud.get_or_create_template(s, name="t", version="v", space={})
        trials = [crud.record_trial(s, device_id=device.id, template_id=template.id,
                                    problem_key="p", problem={"dtype": "float16"},
                                    config_key=key, config={"k": key}, status=TrialStatus.OK,
                                    median_ms=ms, tflops=GFLOP / ms).id
                  for key, ms in (("fast", 1.0), ("slow", 1.1))]
        crud.refresh_best(s, device_id=device.id, template_id=template.id, problem_key="p")
        return Stored(db_url, device.id, template.id, *trials)


def _session(stored: Stored, readings: dict[int, list[float | None]], *,
             finish: bool = True) -> int:
    """A head-to-head with these readings per trial (None: a wrong result), rounds in order."""
    with session_scope(stored.url) as s:
        session = head_to_head.start_head_to_head(s, device_id=stored.device_id, problem={},
                                                  rounds=max(map(len, readings.values())))
        for position, (trial_id, times) in enumerate(readings.items()):
            for n, ms in enumerate(times):
                ok = ms is not None
                head_to_head.record_head_to_head_reading(
                    s, head_to_head_id=session, trial_id=trial_id, round=n, position=position,
                    status=TrialStatus.OK if ok else TrialStatus.WRONG_RESULT,
                    reason="" if ok else "relative error 0.5", median_ms=ms,
                    tflops=GFLOP / ms if ms is not None else None)
        if finish:
            head_to_head.finish_head_to_head(s, head_to_head_id=session)
        return session


def _best(stored: Stored) -> tuple[int, float, float, tuple[float, ...]]:
    """Refresh, then (trial, median_ms, tflops, readings) of the stored best."""
    with session_scope(stored.url) as s:
        best = crud.refresh_best(s, device_id=stored.device_id, template_id=stored.template_id,
                                 problem_key="p")
        assert best is not None
        readings = crud.best_readings(s, [best])[best.id]
        assert best.median_ms == pytest.approx(readings.median_ms)
        assert best.trial_id is not None
        return best.trial_id, best.median_ms, best.tflops, readings.times_ms


def test_the_latest_finished_session_prices_the_best(stored: Stored) -> None:
    assert _best(stored) == (stored.fast, 1.0, GFLOP / 1.0, (1.0,))
    _session(stored, {stored.fast: [1.3, 1.2, 1.25]})
    trial, ms, tflops, readings = _best(stored)
    assert (trial, ms, readings) == (stored.fast, 1.25, (1.3, 1.2, 1.25))
    assert tflops == pytest.approx(GFLOP / 1.25)
    _session(stored, {stored.fast: [1.05, 1.07]})  # a later session replaces it
    trial, ms, _, readings = _best(stored)
    assert (trial, readings) == (stored.fast, (1.05, 1.07)) and ms == pytest.approx(1.06)


def test_an_unfinished_session_prices_nothing(stored: Stored) -> None:
    _session(stored, {stored.fast: [1.3, 1.2, 1.25]})
    _session(stored, {stored.fast: [0.5]}, finish=False)  # killed after one round
    trial, ms, _, readings = _best(stored)
    assert (trial, ms, readings) == (stored.fast, 1.25, (1.3, 1.2, 1.25))
    with session_scope(stored.url, write=False) as s:
        found = head_to_head.side_by_side(s, trial_ids=[stored.fast, stored.slow])
    assert set(found) == {stored.fast} and found[stored.fast].failed is None


def test_side_by_side_readings_do_not_choose_among_a_templates_configs(stored: Stored) -> None:
    # Slower side by side than the runner-up's sweep reading, but the runner-up was never
    # measured in that session: the template's best stays, at its side-by-side time.
    _session(stored, {stored.fast: [1.5, 1.5, 1.5]})
    trial, ms, _, _ = _best(stored)
    assert (trial, ms) == (stored.fast, 1.5)


def test_a_failed_reading_disqualifies_its_config(stored: Stored) -> None:
    _session(stored, {stored.fast: [1.0, None, 1.0]})
    trial, ms, _, readings = _best(stored)
    assert (trial, ms, readings) == (stored.slow, 1.1, (1.1,))  # the runner-up moves up
    with session_scope(stored.url, write=False) as s:
        (found,) = head_to_head.side_by_side(s, trial_ids=[stored.fast]).values()
    assert found.failed is not None and "wrong_result: relative error 0.5" in found.failed
    # Even in a session that was never finished: a wrong result is one.
    _session(stored, {stored.slow: [None]}, finish=False)
    with session_scope(stored.url) as s:
        assert crud.refresh_best(s, device_id=stored.device_id, template_id=stored.template_id,
                                 problem_key="p") is None
