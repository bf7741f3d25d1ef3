"""Stored bests with and without re-measurements, shared by the readings tests of the service
and of the CLI."""

from __future__ import annotations

from dataclasses import dataclass

from db import crud
from db.models import TrialStatus
from db.session import session_scope
from templates.base import Problem
from tests.api.serving_data import FWD, H100, bundle, item, problem
from tuner.lookup.bundle import store_bundle, validate_bundle

# The re-measured best's readings, as multiples of its first time: the median stays the first,
# so its stored time and TFLOP/s are the bundle's, and the spread is (1.10 - 0.95) / 1.
AGAIN = (1.10, 0.95)
SPREAD = 0.15


@dataclass(frozen=True)
class SeededBests:
    once: Problem  # its best measured once
    again: Problem  # its best measured 3 times (and once more, failing)


def seed_bests(url: str) -> SeededBests:
    """Two stored bests of flash_fwd on the H100: one measured once; one re-measured twice
    (OK) and once more with a failure, recorded after its best row was refreshed (as while
    another worker's finalist round is in flight): a failed reading, even one that carries
    a time, is no reading."""
    once, again = problem(1024), problem(2048)
    with session_scope(url) as s:
        store_bundle(s, validate_bundle(bundle(item(once, default_tflops=None),
                                               item(again, default_tflops=None))))
        row = crud.best_for(s, device_key=H100.key, template_name=FWD.name,
                            template_version=FWD.version(), problem_key=FWD.problem_key(again))
        assert row is not None and row.trial_id is not None
        first_ms, first_tflops = row.median_ms, row.tflops
        for factor in AGAIN:
            crud.record_remeasurement(s, trial_id=row.trial_id, status=TrialStatus.OK,
                                      median_ms=first_ms * factor,
                                      tflops=first_tflops / factor)
        refreshed = crud.refresh_best(s, device_id=row.device_id, template_id=row.template_id,
                                      problem_key=row.problem_key)
        assert refreshed is not None and refreshed.median_ms == first_ms
        crud.record_remeasurement(s, trial_id=row.trial_id, status=TrialStatus.WRONG_RESULT,
                                  median_ms=first_ms / 2, reason="relative error 0.4")
    return SeededBests(once=once, again=again)
