"""Several processes writing one database at once, as sweep workers do (both backends)."""

from __future__ import annotations

import random
import threading

import pytest
from sqlalchemy.orm import Session

from db import crud
from db.models import TrialStatus
from db.session import session_scope
from tests.db import _data, _workers

WORKERS = 4
TRIALS_PER_WORKER = 25


@pytest.mark.slow
def test_concurrent_workers_lose_nothing_and_agree(db_url: str) -> None:
    reports = _workers.race(_workers.write_trials,
                            [(db_url, w, TRIALS_PER_WORKER) for w in range(WORKERS)])

    # One device and one template, whoever created them.
    assert len({(r["device_id"], r["template_id"]) for r in reports.values()}) == 1
    # The shared config: one row, and every worker was handed that row.
    assert len({r["shared_id"] for r in reports.values()}) == 1
    some = reports[0]
    with session_scope(db_url, write=False) as s:
        assert len(crud.list_devices(s)) == 1 and len(crud.list_templates(s)) == 1
        counts = crud.trial_counts(s)
        assert counts[TrialStatus.OK.value] == WORKERS * TRIALS_PER_WORKER + 1  # no lost rows
        assert sum(counts.values()) == counts[TrialStatus.OK.value]
        # Every problem's best is the fastest trial any worker wrote, despite the racing refreshes.
        fastest: dict[str, float] = {}
        for report in reports.values():
            for key, tflops in report["written"]:
                fastest[key] = max(fastest.get(key, 0.0), tflops)
        for key, tflops in fastest.items():
            trials = crud.trials_for(s, device_id=some["device_id"],
                                     template_id=some["template_id"], problem_key=key)
            assert max(t.tflops or 0.0 for t in trials) == tflops
            best = [b for b in crud.list_best(s) if b.problem_key == key]
            assert len(best) == 1 and best[0].tflops == tflops


def test_a_refresh_waits_for_an_uncommitted_refresh_of_the_same_problem(db_url: str) -> None:
    """Worker B's refresh must see worker A's trial, even though A committed after B began.

    Without serializing refreshes, B (on PostgreSQL) would compute its best from what was
    committed before A, then overwrite A's best row with a slower config once A commits.
    """
    rng = random.Random(30)
    info = _data.device_info(rng)
    problem = _data.problem(rng)
    key = _data.problem_key(problem)
    with session_scope(db_url) as s:
        device_id = crud.get_or_create_device(s, info=info).id
        template_id = crud.get_or_create_template(s, name="flash_fwd", version="v1", space={}).id

    def record_and_refresh(s: Session, config_key: str, tflops: float) -> None:
        crud.record_trial(s, device_id=device_id, template_id=template_id, problem_key=key,
                          problem=problem, config_key=config_key, config={}, median_ms=1.0,
                          tflops=tflops, status=TrialStatus.OK)
        crud.refresh_best(s, device_id=device_id, template_id=template_id, problem_key=key)

    b_done = threading.Event()

    def worker_b() -> None:
        with session_scope(db_url) as s:
            record_and_refresh(s, "slower", 200.0)
        b_done.set()

    with session_scope(db_url) as a:
        record_and_refresh(a, "faster", 300.0)
        thread = threading.Thread(target=worker_b)
        thread.start()
        assert not b_done.wait(0.3), "B's refresh did not wait for A's transaction"
    thread.join(timeout=30)
    assert b_done.is_set()
    with session_scope(db_url, write=False) as s:
        best = crud.best_for(s, device_key=str(info["key"]), template_name="flash_fwd",
                             template_version="v1", problem_key=key)
        assert best is not None and best.tflops == 300.0
