"""Engines, sessions and the retry of transactions that lost a lock."""

from __future__ import annotations

import random
import sqlite3
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError, OperationalError
from sqlalchemy.orm import Session

from db import crud
from db.models import Device, Template
from db.session import (
    SQLITE_BUSY_TIMEOUT_S,
    DatabaseUnavailableError,
    _switch_to_wal,
    dispose_engine,
    get_sessionmaker,
    init_db,
    is_retryable_error,
    make_engine,
    run_in_transaction,
    session_scope,
    with_installed_driver,
)
from tests.db import _data


def test_sqlite_connections_use_wal_busy_timeout_and_foreign_keys(tmp_path: Path) -> None:
    (tmp_path / "nested" / "folder").mkdir(parents=True)
    url = f"sqlite:///{tmp_path / 'nested' / 'folder' / 'tuner.db'}"
    try:
        engine = make_engine(url)
        assert make_engine(url) is engine  # one engine per URL
        with engine.connect() as connection:
            pragma = connection.exec_driver_sql
            assert pragma("PRAGMA journal_mode").scalar() == "wal"
            assert pragma("PRAGMA foreign_keys").scalar() == 1
            assert pragma("PRAGMA busy_timeout").scalar() == int(SQLITE_BUSY_TIMEOUT_S * 1000)
        assert (tmp_path / "nested" / "folder" / "tuner.db").exists()
    finally:
        dispose_engine(url)


class _BusyCursor:
    """A cursor whose WAL switch is refused as locked ``refusals`` times, then done."""

    def __init__(self, refusals: int, message: str = "database is locked") -> None:
        self.refusals, self.message, self.mode = refusals, message, "delete"

    def execute(self, sql: str) -> _BusyCursor:
        if sql == "PRAGMA journal_mode = WAL":
            if self.refusals:
                self.refusals -= 1
                raise sqlite3.OperationalError(self.message)
            self.mode = "wal"
        return self

    def fetchone(self) -> tuple[str]:
        return (self.mode,)


def test_a_wal_switch_refused_as_locked_is_retried_not_raised() -> None:
    # SQLite refuses a lock upgrade that could deadlock (new connections switching an empty
    # file at once) without waiting in its busy handler; CI saw it in the concurrency test.
    cursor = _BusyCursor(refusals=3)
    _switch_to_wal(cursor)
    assert cursor.mode == "wal" and cursor.refusals == 0
    other = _BusyCursor(refusals=1, message="disk I/O error")  # not a lock: raised at once
    with pytest.raises(sqlite3.OperationalError, match="disk I/O"):
        _switch_to_wal(other)


def test_a_sqlite_file_in_a_missing_folder_is_refused_not_created(tmp_path: Path) -> None:
    # A mistyped path must not silently start an empty database somewhere new (issue 20).
    url = f"sqlite:///{tmp_path / 'nested' / 'tuner.db'}"
    with pytest.raises(DatabaseUnavailableError) as err:
        make_engine(url)
    assert err.value.message == (f"the SQLite database {tmp_path / 'nested' / 'tuner.db'} is in "
                                 f"a folder that does not exist ({tmp_path / 'nested'})")
    assert f"mkdir -p {tmp_path / 'nested'}" in err.value.fix
    assert not (tmp_path / "nested").exists()


def test_a_server_that_does_not_answer_is_named_without_its_password() -> None:
    url = "postgresql+psycopg://tuner:s3cret-pass@127.0.0.1:1/tuner"  # port 1: refused
    try:
        with pytest.raises(DatabaseUnavailableError) as err:
            init_db(url)
        assert err.value.message.startswith(
            "cannot open the database postgresql+psycopg://tuner:***@127.0.0.1:1/tuner: ")
        assert "s3cret-pass" not in str(err.value)
        assert err.value.fix.startswith("start the PostgreSQL server")
        assert isinstance(err.value.__cause__, OperationalError)
    finally:
        dispose_engine(url)


def test_urls_pick_the_installed_drivers() -> None:
    url = "postgresql://nobody@127.0.0.1:1/none"  # no connection is made
    try:
        assert make_engine(url).dialect.driver == "psycopg"
    finally:
        dispose_engine(url)
    with pytest.raises(ValueError, match="must be sqlite or postgresql, but got 'mysql'"):
        make_engine("mysql://u@h/db")
    # One rule for every opener (the engine, Optuna's storage, the dispatcher's lookup).
    assert with_installed_driver(url).drivername == "postgresql+psycopg"
    assert with_installed_driver("postgresql+psycopg://h/db").drivername == "postgresql+psycopg"
    assert with_installed_driver("sqlite:///x.db").drivername == "sqlite"


def test_session_scope_commits_or_rolls_back(db_url: str) -> None:
    with session_scope(db_url) as s:
        s.add(Template(name="kept", version="v1"))
    with pytest.raises(RuntimeError, match="boom"), session_scope(db_url) as s:
        s.add(Template(name="lost", version="v1"))
        s.flush()
        raise RuntimeError("boom")
    with session_scope(db_url, write=False) as s:
        assert s.scalars(sa.select(Template.name)).all() == ["kept"]


def _stale_snapshot_error(url: str) -> OperationalError:
    """A real "database is locked": a deferred transaction read, another wrote, it writes.

    SQLite can never upgrade a stale read snapshot to a write, and fails at once whatever
    the busy timeout: the case that write sessions (BEGIN IMMEDIATE) exist to avoid.
    """
    rng = random.Random(40)
    with get_sessionmaker(url, write=False)() as reader:
        reader.scalars(sa.select(Device)).all()
        with session_scope(url) as writer:
            crud.get_or_create_device(writer, info=_data.device_info(rng))
        reader.add(Template(name="late", version="v1"))
        with pytest.raises(OperationalError) as caught:
            reader.flush()
        reader.rollback()
    return caught.value


def test_lock_errors_are_retryable_and_others_not(sqlite_url: str) -> None:
    locked = _stale_snapshot_error(sqlite_url)
    assert "database is locked" in str(locked)
    assert is_retryable_error(locked)
    with session_scope(sqlite_url) as s:
        s.add(Template(name="t", version="v1"))
    with pytest.raises(IntegrityError) as duplicate, session_scope(sqlite_url) as s:
        s.add(Template(name="t", version="v1"))
        s.flush()
    assert not is_retryable_error(duplicate.value)
    assert not is_retryable_error(RuntimeError("database is locked"))  # not from the database


def test_run_in_transaction_reruns_after_a_lock_error(sqlite_url: str) -> None:
    locked = _stale_snapshot_error(sqlite_url)
    attempts: list[int] = []

    def add_template(s: Session) -> int:
        attempts.append(len(attempts))
        template = crud.get_or_create_template(s, name="retry", version=f"a{len(attempts)}",
                                               space={})
        if len(attempts) < 3:
            raise locked  # after writing: the retry must not keep the first attempts' rows
        return template.id

    template_id = run_in_transaction(sqlite_url, add_template, backoff_s=0.001)
    assert attempts == [0, 1, 2]
    with session_scope(sqlite_url, write=False) as s:
        assert [(t.id, t.version) for t in crud.list_templates(s)
                if t.name == "retry"] == [(template_id, "a3")]


def test_run_in_transaction_gives_up(sqlite_url: str) -> None:
    locked = _stale_snapshot_error(sqlite_url)
    calls: list[int] = []

    def always_locked(s: Session) -> None:
        calls.append(1)
        raise locked

    with pytest.raises(OperationalError, match="database is locked"):
        run_in_transaction(sqlite_url, always_locked, retries=2, backoff_s=0.001)
    assert len(calls) == 3

    def duplicate(s: Session) -> None:
        calls.append(1)
        s.add_all([Template(name="d", version="v"), Template(name="d", version="v")])
        s.flush()

    calls.clear()
    with pytest.raises(IntegrityError):
        run_in_transaction(sqlite_url, duplicate, backoff_s=0.001)
    assert len(calls) == 1  # a retry cannot fix a duplicate
    with pytest.raises(ValueError, match="retries must be >= 0, but got -1"):
        run_in_transaction(sqlite_url, duplicate, retries=-1)
