"""Optuna studies in the project database: one per (device, template@version, problem key).

The studies live in the same database as the project's tables (Optuna's RDB storage on the
same URL), so every worker of every host that shares the URL joins the same studies, and
``optuna-dashboard <url>`` shows them. Workers keep heartbeats on the trials they hold: a
worker killed mid-trial leaves a trial whose heartbeat goes stale; the next worker to look
fails it and enqueues a retry of its config (RetryFailedTrialCallback).
"""

from __future__ import annotations

import copy
import hashlib
import inspect
import logging
import threading
import time
import warnings
from collections.abc import Callable, Mapping
from datetime import datetime, timedelta
from typing import Any, TypeVar

import optuna
from optuna.samplers import BaseSampler
from optuna.storages import RDBStorage, RetryFailedTrialCallback
from optuna.storages._rdb import models
from optuna.trial import TrialState
from sqlalchemy import event, select
from sqlalchemy.engine import Connection, Engine, make_url
from sqlalchemy.exc import IntegrityError, OperationalError, ProgrammingError
from sqlalchemy.orm import Session

from db.session import with_installed_driver

__all__ = [
    "GRACE_PERIOD_S",
    "HEARTBEAT_INTERVAL_S",
    "HeartbeatKeeper",
    "fail_stale_trials",
    "make_storage",
    "open_study",
    "retry_locked",
    "study_name",
]

log = logging.getLogger(__name__)
T = TypeVar("T")

HEARTBEAT_INTERVAL_S = 10
# A trial whose heartbeat is older than this is taken to be held by a dead worker.
GRACE_PERIOD_S = 30
# Optuna's study_name column holds 512 characters.
_MAX_STUDY_NAME = 500
SQLITE_TIMEOUT_S = 30.0


def study_name(device_key: str, template_name: str, template_version: str,
               problem_key: str, space_tag: str = "") -> str:
    """``space_tag`` (``SearchSpace.tag``) names a restricted space; empty for the whole one."""
    suffix = f"|{space_tag}" if space_tag else ""
    name = f"{template_name}@{template_version}|{problem_key}|{device_key}{suffix}"
    if len(name) <= _MAX_STUDY_NAME:
        return name
    digest = hashlib.sha256(device_key.encode()).hexdigest()[:16]
    return f"{template_name}@{template_version}|{problem_key}|device-{digest}{suffix}"


def optuna_url(url: str) -> str:
    """The URL Optuna's storage should open: psycopg 3 for a plain postgresql:// URL, as the
    project's own engine does (psycopg2 is not installed)."""
    return with_installed_driver(url).render_as_string(hide_password=False)


# PostgreSQL's codes for "already exists" (duplicate_table, duplicate_object): what a process
# gets when another creates the same table first (Optuna creates its tables, and its own
# alembic_version, without a lock), which SQLAlchemy raises as a ProgrammingError.
_CREATION_RACE_SQLSTATES = frozenset({"42P07", "42710"})


def retry_locked(fn: Callable[[], T], *, attempts: int = 6, backoff_s: float = 0.2) -> T:
    """Run ``fn`` again when the database was busy (SQLite lock, a table-creation race)."""
    for attempt in range(attempts):
        try:
            return fn()
        except (OperationalError, IntegrityError, ProgrammingError) as exc:
            raced = getattr(exc.orig, "sqlstate", None) in _CREATION_RACE_SQLSTATES
            if attempt == attempts - 1 or (isinstance(exc, ProgrammingError) and not raced):
                raise
            log.debug("database busy (%s); retrying", exc)
            time.sleep(backoff_s * 2**attempt)
    raise AssertionError("unreachable")


def make_storage(url: str, *, heartbeat_interval_s: int = HEARTBEAT_INTERVAL_S,
                 grace_period_s: int = GRACE_PERIOD_S, max_retry: int = 1) -> RDBStorage:
    """Optuna's RDB storage on the project database, with heartbeats and retry of trials
    that a dead worker held. Creating the tables is retried: several processes may start on
    a fresh database at once."""
    target = optuna_url(url)
    engine_kwargs: dict[str, Any] = {"pool_pre_ping": True}
    if make_url(target).get_backend_name() == "sqlite":
        # Wait for the write lock instead of failing at once when another worker writes.
        engine_kwargs["connect_args"] = {"timeout": SQLITE_TIMEOUT_S}
    kwargs: dict[str, Any] = {"heartbeat_interval": heartbeat_interval_s,
                              "grace_period": grace_period_s}
    # Optuna 4.9 renamed the callback and its argument; the GPU host may run an older one.
    params = inspect.signature(RDBStorage.__init__).parameters
    retry_cls = getattr(optuna.storages, "RetryHeartbeatStaleTrialCallback",
                        RetryFailedTrialCallback)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        warnings.simplefilter("ignore", FutureWarning)
        kwargs["heartbeat_stale_trial_callback" if "heartbeat_stale_trial_callback" in params
               else "failed_trial_callback"] = retry_cls(max_retry=max_retry)
        storage = retry_locked(lambda: RDBStorage(target, engine_kwargs=engine_kwargs,
                                                  **kwargs))
    if make_url(target).get_backend_name() == "sqlite":
        _serialize_sqlite_transactions(storage.engine)
    return storage


def _serialize_sqlite_transactions(engine: Engine) -> None:
    """Give Optuna's SQLite transactions real isolation: each one takes the write lock first.

    Optuna claims a queued trial by reading its state and then writing RUNNING, relying on
    SELECT ... FOR UPDATE, which SQLite ignores; and the sqlite3 driver runs that SELECT
    outside any transaction. Two workers could then both claim one enqueued trial and both
    measure its config (seen with three processes on one file). ``BEGIN IMMEDIATE`` makes the
    read and the write one atomic step; PostgreSQL needs nothing (its row locks do it).
    """

    def on_connect(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None  # SQLAlchemy's "begin" event emits BEGIN
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute(f"PRAGMA busy_timeout = {int(SQLITE_TIMEOUT_S * 1000)}")
            # In WAL mode (the project's engine sets it, db.session) NORMAL syncs at
            # checkpoints, not at every commit: a killed sweep loses nothing, a power cut at
            # most the last commits, as for the project's own tables. Optuna commits several
            # times a trial: 120 -> 72 ms of bookkeeping a trial on the 2-core CPU machine
            # (ask, two attributes, tell). Outside WAL, NORMAL could corrupt: left as it is.
            if cursor.execute("PRAGMA journal_mode").fetchone()[0].lower() == "wal":
                cursor.execute("PRAGMA synchronous = NORMAL")
        finally:
            cursor.close()

    def on_begin(connection: Connection) -> None:
        connection.exec_driver_sql("BEGIN IMMEDIATE")

    event.listen(engine, "connect", on_connect)
    event.listen(engine, "begin", on_begin)
    engine.dispose()  # connections made before the hooks (table creation) are not reused


def open_study(storage: RDBStorage, name: str, sampler: BaseSampler,
               attrs: Mapping[str, Any]) -> optuna.Study:
    """Create or join the study ``name`` (maximizing TFLOP/s)."""
    study = retry_locked(lambda: optuna.create_study(
        study_name=name, storage=storage, sampler=sampler, direction="maximize",
        load_if_exists=True))
    if not study.user_attrs:
        for key, value in attrs.items():
            study.set_user_attr(key, value)
    return study


def fail_stale_trials(study: optuna.Study) -> None:
    """Fail trials whose worker stopped beating (their retry is enqueued by the callback),
    and trials whose worker died before its first beat."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        retry_locked(lambda: optuna.storages.fail_stale_trials(study))
        retry_locked(lambda: _fail_orphans(study))


def _fail_orphans(study: optuna.Study) -> None:
    """Fail RUNNING trials that never had a heartbeat and started a grace period ago.

    ``ask`` creates the trial, then samples its params, and only then can a worker beat for
    it: a worker killed in between leaves a trial that Optuna's stale check never sees (it
    skips trials without a heartbeat). Such a trial would hold its config forever, and the
    workers that wait for held configs would wait forever.
    """
    cached = study._storage
    backend = getattr(cached, "_backend", cached)
    if not isinstance(backend, RDBStorage) or backend.heartbeat_interval is None:
        return
    grace = backend.grace_period or 2 * backend.heartbeat_interval
    # datetime_start is the creating host's local time, as Optuna writes it.
    cutoff = datetime.now() - timedelta(seconds=grace)
    trial = models.TrialModel.__table__
    beat = models.TrialHeartbeatModel.__table__
    query = (select(trial.c.trial_id)
             .select_from(trial.outerjoin(beat, beat.c.trial_id == trial.c.trial_id))
             .where(trial.c.study_id == study._study_id,
                    trial.c.state == TrialState.RUNNING.name,
                    beat.c.trial_heartbeat_id.is_(None), trial.c.datetime_start < cutoff))
    with Session(backend.engine) as session:
        orphans = session.scalars(query).all()
    callback = backend.get_heartbeat_stale_trial_callback()
    for trial_id in orphans:
        try:
            if not cached.set_trial_state_values(trial_id, state=TrialState.FAIL):
                continue
        except optuna.exceptions.UpdateFinishedTrialError:
            continue  # another worker got there first
        log.info("failed trial id %d: its worker died before its first heartbeat", trial_id)
        if callback is not None:
            callback(study, copy.deepcopy(cached.get_trial(trial_id)))


class HeartbeatKeeper:
    """Records a heartbeat every interval for each trial this process holds.

    ``study.optimize`` does this itself; the ask/tell loop of a sweep must do it, or every
    trial it holds would look stale to other workers.
    """

    def __init__(self, storage: RDBStorage, interval_s: float | None = None) -> None:
        self._storage = storage
        self._interval = float(interval_s or storage.get_heartbeat_interval() or 10)
        self._trials: set[int] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="optuna-heartbeat", daemon=True)
        self._thread.start()

    @property
    def interval_s(self) -> float:
        """Seconds between two beats; a holder silent for 3x as long is taken for dead."""
        return self._interval

    def hold(self, trial_id: int) -> None:
        with self._lock:
            self._trials.add(trial_id)
        self._beat(trial_id)

    def release(self, trial_id: int) -> None:
        with self._lock:
            self._trials.discard(trial_id)

    def _beat(self, trial_id: int) -> None:
        try:
            self._storage.record_heartbeat(trial_id)
        except Exception as exc:  # a missed beat is retried next interval
            log.debug("heartbeat for trial %d failed: %s", trial_id, exc)

    def _loop(self) -> None:
        while not self._stop.wait(self._interval):
            with self._lock:
                held = list(self._trials)
            for trial_id in held:
                self._beat(trial_id)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
