"""The search on the project database, on SQLite and PostgreSQL: Optuna's RDB storage and
the trials table shared by concurrent workers, who then re-measure the finalists together."""

from __future__ import annotations

import sqlite3
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import optuna
import pytest
from optuna.trial import TrialState
from sqlalchemy import select

from db.finalists import pick_finalists
from db.models import BestConfig, Remeasurement, Trial, TrialStatus
from db.session import dispose_engine, init_db, session_scope
from templates import Problem, current_device, get_template
from tuner.tuning.replay import RecordedProblem, ReplayRunner
from tuner.tuning.runner.outcome import TrialOutcome, TrialRequest
from tuner.tuning.search.loop import ProblemSearch, SearchSettings
from tuner.tuning.search.samplers import make_sampler
from tuner.tuning.search.space import params_of
from tuner.tuning.search.store import DbStore, measured_configs
from tuner.tuning.search.study import HeartbeatKeeper, make_storage, open_study, study_name


class FirstTrialsTogether(ReplayRunner):
    """A replay runner whose first measurement in each thread waits until every worker's has
    begun, so the concurrent workers all get a share of the budget whatever the scheduler."""

    def __init__(self, *args: object, workers: int, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._all_started = threading.Barrier(workers, timeout=60)
        self._seen = threading.local()

    def measure(self, request: TrialRequest, timeout_s: float) -> TrialOutcome:
        if not getattr(self._seen, "first", False):
            self._seen.first = True
            self._all_started.wait()
        return super().measure(request, timeout_s)


def one_problem(db_url: str, landscape: RecordedProblem) -> tuple[Any, Any, Problem, str, Any]:
    """The toy template's recorded problem on a migrated ``db_url``: template, device,
    problem, its key, and Optuna's storage there."""
    template = get_template("toy_tiles")
    device = current_device()
    problem = Problem.from_dict(landscape.problem)
    init_db(db_url)
    return template, device, problem, template.problem_key(problem), make_storage(db_url)


def store_of(url: str, template: Any, device: Any, worker: str = "") -> DbStore:
    return DbStore(url, device=device.to_dict() | {"key": device.key},
                   template_name=template.name, template_version=template.version(),
                   space=template.config_cls.json_schema(), worker=worker)

def test_workers_share_one_study_and_one_trials_table(db_url: str,
                                                      landscape: RecordedProblem) -> None:
    template, device, problem, key, storage = one_problem(db_url, landscape)
    heartbeats = HeartbeatKeeper(storage)
    name = study_name(device.key, template.name, template.version(), key)
    seeds = (0, 1, 2)
    # Every worker must get trials, but a thread that starts after the others have taken the
    # whole budget has nothing to do (seen twice on the loaded 2-core CI machine, even with a
    # 50 ms trial): no first trial finishes before each worker is measuring one.
    runner = FirstTrialsTogether(template, landscape.trials, workers=len(seeds), delay_s=0.01)
    budget = 16

    def worker(seed: int) -> None:
        store = store_of(db_url, template, device, f"w{seed}")
        study = open_study(storage, name, make_sampler("tpe", template.config_cls,
                                                       budget=budget, seed=seed), {"k": key})
        ProblemSearch(template=template, problem=problem, device=device, study=study,
                      store=store, runner=runner, heartbeats=heartbeats,
                      settings=SearchSettings(budget=budget, seed=seed, finalists=3,
                                              final_repeats=2)).run()

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in seeds]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    heartbeats.close()
    with session_scope(db_url, write=False) as s:
        rows = list(s.scalars(select(Trial)))
        again = Counter(r.trial.config_key for r in s.scalars(select(Remeasurement)))
        measured = [r for r in rows if r.status != TrialStatus.INVALID]
        assert budget <= len(measured) <= budget + 2
        assert {r.worker for r in rows} == {"w0", "w1", "w2"}
    # Each config measured once by one worker, plus its stored re-measurements if a finalist.
    assert runner.calls == {r.config_key: 1 + again[r.config_key] for r in measured}
    # Workers that end together may re-measure one finalist at once: a few more readings.
    assert again and max(again.values()) <= 2 + len(seeds) - 1
    store = store_of(db_url, template, device)
    final = pick_finalists(measured_configs(store.known(key), store.remeasurements(key)), 3)
    assert len(final) in (3, 4) and all(again[str(f.ref)] >= 2 for f in final)
    with session_scope(db_url, write=False) as s:
        (best,) = s.scalars(select(BestConfig))
        top = max(r.tflops or 0 for r in measured if r.status == TrialStatus.OK)
        assert best.tflops == top and best.default_tflops is not None
        default = template.default_config(problem, device)
        assert [r.config_key for r in rows if r.is_default] == [default.key()]


class _Raced(Exception):
    """A driver error as psycopg raises it, with its SQLSTATE."""

    def __init__(self, sqlstate: str) -> None:
        super().__init__(sqlstate)
        self.sqlstate = sqlstate


def test_a_table_creation_race_is_retried_and_nothing_else_is() -> None:
    """PostgreSQL says "already exists" (42P07) to the second of two processes creating
    Optuna's tables at once (a fleet's workers on a fresh database): tried again; another
    ProgrammingError (a real mistake) is not."""
    from sqlalchemy.exc import ProgrammingError

    from tuner.tuning.search.study import retry_locked

    calls: list[int] = []

    def created_by_another_first() -> str:
        calls.append(1)
        if len(calls) == 1:
            raise ProgrammingError("CREATE TABLE alembic_version", None, _Raced("42P07"))
        return "storage"

    assert retry_locked(created_by_another_first, backoff_s=0.0) == "storage"
    assert len(calls) == 2

    def wrong_sql() -> str:
        calls.append(1)
        raise ProgrammingError("SELEC 1", None, _Raced("42601"))  # syntax_error

    calls.clear()
    with pytest.raises(ProgrammingError):
        retry_locked(wrong_sql, backoff_s=0.0)
    assert len(calls) == 1


def test_optunas_sqlite_connections_sync_at_checkpoints_in_wal_mode(tmp_path: Path) -> None:
    # Optuna commits several times a trial; in WAL mode NORMAL is as safe as the project's
    # own tables (db.session), and only there.
    wal = f"sqlite:///{tmp_path / 'wal.db'}"
    init_db(wal)  # WAL, as a sweep's database is
    plain = tmp_path / "plain.db"
    sqlite3.connect(plain).close()  # a rollback-journal file
    for url, expected in ((wal, 1), (f"sqlite:///{plain}", 2)):  # NORMAL, FULL
        storage = make_storage(url)
        with storage.engine.connect() as connection:
            assert connection.exec_driver_sql("PRAGMA synchronous").scalar() == expected, url
        storage.engine.dispose()
    dispose_engine(wal)


def test_of_two_running_trials_of_one_config_the_one_that_started_first_runs_it(
        db_url: str, landscape: RecordedProblem) -> None:
    # An enqueued trial keeps its enqueuing's (lower) number and starts when popped: here after
    # another worker's fresh trial of the same config started. The lower number alone let
    # both measure it (CI's fleet test, 2026-12-01).
    template, device, problem, key, storage = one_problem(db_url, landscape)
    name = study_name(device.key, template.name, template.version(), key)

    def search(seed: int) -> ProblemSearch:
        study = open_study(storage, name, make_sampler("tpe", template.config_cls, budget=4,
                                                       seed=seed), {"k": key})
        return ProblemSearch(template=template, problem=problem, device=device, study=study,
                             store=store_of(db_url, template, device, f"w{seed}"),
                             runner=None,  # type: ignore[arg-type]
                             settings=SearchSettings(budget=4, seed=seed))

    first, second = search(0), search(1)
    config = template.default_config(problem, device)
    params = params_of(config)
    first.study.enqueue_trial(params)  # number 0, waiting
    fresh = optuna.trial.create_trial(
        state=TrialState.RUNNING, params=params,
        distributions={k: first._dists[k] for k in params})  # noqa: SLF001
    fresh_id = first.study._storage.create_new_trial(  # noqa: SLF001
        first.study._study_id, template_trial=fresh)  # noqa: SLF001
    started = first.study._storage.get_trial(fresh_id)  # noqa: SLF001
    assert started.number == 1 and started.datetime_start is not None
    first._mine.add(started.number)  # noqa: SLF001
    time.sleep(0.01)
    popped = second.study.ask(second._dists)  # noqa: SLF001  (pops number 0, starts now)
    second._mine.add(popped.number)  # noqa: SLF001
    assert popped.number == 0
    assert second._held_elsewhere(popped, config.key()) == 1  # noqa: SLF001
    assert first._held_elsewhere(optuna.Trial(first.study, fresh_id),  # noqa: SLF001
                                 config.key()) is None
