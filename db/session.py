"""Engines, sessions and transactions of the project database, one per URL and process.

SQLite is the default store and is written by several processes at once (sweep workers, the
service), so each connection gets WAL (readers never wait for the writer), a busy timeout and
foreign keys, and SQLAlchemy emits ``BEGIN`` itself instead of the sqlite3 driver: the driver's
legacy mode starts no transaction for SELECT or SAVEPOINT, which breaks savepoints and
read-then-write isolation.

Write sessions open with ``BEGIN IMMEDIATE`` on SQLite: the write lock is taken first, so a
second writer queues on the busy timeout. A deferred transaction that reads and then writes
fails at once with "database is locked" when another writer committed in between (a stale
WAL snapshot can never be upgraded), and no timeout helps. Read-only work passes
``write=False`` so it never waits for writers.

The same code runs on PostgreSQL (``postgresql+psycopg://...``), where the lock modes do not
apply and row-level locking plus :func:`run_in_transaction` retries on serialization failures
and deadlocks do the same job.
"""

from __future__ import annotations

import logging
import os
import random
import re
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import URL, Connection, make_url
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

from db.errors import DatabaseUnavailableError

__all__ = [
    "SQLITE_BEGIN_OPTION",
    "SQLITE_BUSY_TIMEOUT_S",
    "DatabaseUnavailableError",
    "check_connection",
    "check_sqlite_folder",
    "dispose_engine",
    "get_sessionmaker",
    "init_db",
    "is_retryable_error",
    "make_engine",
    "run_in_transaction",
    "session_scope",
]

log = logging.getLogger(__name__)

T = TypeVar("T")

# How long a SQLite writer waits for the write lock before "database is locked". A sweep
# worker's transaction holds it for milliseconds; 30 s covers a burst of many workers.
SQLITE_BUSY_TIMEOUT_S = 30.0
# Execution option read by the SQLite "begin" hook: "DEFERRED" (default) or "IMMEDIATE".
SQLITE_BEGIN_OPTION = "tuner_sqlite_begin"
# PostgreSQL SQLSTATEs after which re-running the whole transaction can succeed.
_RETRYABLE_SQLSTATES = frozenset({"40001", "40P01"})  # serialization_failure, deadlock_detected
_RETRYABLE_SQLITE_MESSAGES = ("database is locked", "database table is locked", "database is busy")

_lock = threading.Lock()
_migrate_lock = threading.Lock()
_engines: dict[str, Engine] = {}
_sessionmakers: dict[tuple[str, bool], sessionmaker[Session]] = {}
_migrated: set[str] = set()


# ----------------------------------------------------------------------------- engines
def make_engine(url: str) -> Engine:
    """The engine of ``url``, created once per process (SQLite or PostgreSQL).

    A plain ``postgresql://`` URL gets the psycopg (3) driver, the one the project installs.
    A SQLite file's folder must exist: a mistyped path is refused rather than created
    (``DatabaseUnavailableError``).
    """
    with _lock:
        engine = _engines.get(url)
        if engine is None:
            engine = _engines[url] = _create_engine(url)
        return engine


def with_installed_driver(url: str | URL) -> URL:
    """``url`` with the PostgreSQL driver the project installs (psycopg 3) where it names
    none: SQLAlchemy's default for a plain ``postgresql://`` is psycopg2, which is absent."""
    parsed = make_url(url)
    if parsed.drivername == "postgresql":
        parsed = parsed.set(drivername="postgresql+psycopg")
    return parsed


def _create_engine(url: str) -> Engine:
    parsed = make_url(url)
    backend = parsed.get_backend_name()
    if backend == "sqlite":
        check_sqlite_folder(parsed)
        engine = create_engine(parsed, pool_pre_ping=True,
                               connect_args={"timeout": SQLITE_BUSY_TIMEOUT_S})
        event.listen(engine, "connect", _on_sqlite_connect)
        event.listen(engine, "begin", _on_sqlite_begin)
        return engine
    if backend == "postgresql":
        return create_engine(with_installed_driver(parsed), pool_pre_ping=True)
    raise ValueError(f"database backend must be sqlite or postgresql, but got {backend!r} "
                     f"in {parsed.render_as_string(hide_password=True)}")


def check_sqlite_folder(url: URL) -> None:
    database = url.database or ""
    if not database or database == ":memory:" or database.startswith("file:"):
        return
    folder = Path(database).expanduser().parent
    if not folder.is_dir():
        raise DatabaseUnavailableError(
            f"the SQLite database {database} is in a folder that does not exist ({folder})",
            f"create the folder first (mkdir -p {folder}), or name a file in an existing "
            "folder (--db, or TUNER_DATABASE_URL)")


def check_connection(engine: Engine) -> None:
    """Open one connection, so that a database that cannot be reached says so by name (the
    driver's own error is a long traceback deep inside the first query)."""
    try:
        engine.connect().close()
    except OperationalError as exc:
        shown = engine.url.render_as_string(hide_password=True)
        reason = " ".join(str(exc.orig).split())
        if engine.dialect.name == "postgresql":
            fix = _postgresql_fix(getattr(exc.orig, "sqlstate", None), reason,
                                  engine.url.database)
        else:
            fix = ("check that the file can be created and written there (permissions, free "
                   "space), or name another file (--db, or TUNER_DATABASE_URL)")
        raise DatabaseUnavailableError(f"cannot open the database {shown}: {reason}",
                                       fix) from exc


# SQLSTATEs of a server that answered but refused the connection (PostgreSQL's errcodes).
_NO_SUCH_DATABASE = "3D000"  # invalid_catalog_name
_LOGIN_REFUSED = ("28000", "28P01")  # invalid_authorization_specification, invalid_password


def _postgresql_fix(sqlstate: str | None, reason: str, database: str | None) -> str:
    """What to do about a first connection the PostgreSQL server (or its absence) refused."""
    where = "(--db, or TUNER_DATABASE_URL: postgresql+psycopg://user@host:port/database)"
    # psycopg gives a refused connection no SQLSTATE: the server's message tells them apart.
    if sqlstate == _NO_SUCH_DATABASE or re.search(r'database "[^"]*" does not exist', reason):
        return (f"the server runs but has no database {database!r}: create it (createdb "
                f"{database}, or CREATE DATABASE {database};), or name one it has {where}")
    if sqlstate in _LOGIN_REFUSED or re.search(r'role "[^"]*" does not exist|authentication '
                                               r"failed|no pg_hba.conf entry", reason):
        return f"the server runs but refused the login: check the user and password {where}"
    return f"start the PostgreSQL server, or name one that runs {where}"


def _on_sqlite_connect(dbapi_connection: Any, _record: Any) -> None:
    # Hand transaction control to SQLAlchemy (see _on_sqlite_begin); sqlite3 still COMMITs.
    dbapi_connection.isolation_level = None
    cursor = dbapi_connection.cursor()
    try:
        # busy_timeout first: switching a new file to WAL itself needs the lock.
        cursor.execute(f"PRAGMA busy_timeout = {int(SQLITE_BUSY_TIMEOUT_S * 1000)}")
        cursor.execute("PRAGMA foreign_keys = ON")
        _switch_to_wal(cursor)
        # In WAL mode NORMAL loses at most the last commits on power loss, never integrity.
        cursor.execute("PRAGMA synchronous = NORMAL")
    finally:
        cursor.close()


def _switch_to_wal(cursor: Any) -> None:
    """Put the file in WAL mode (it stays so), retrying a busy answer until the busy timeout.

    The switch needs the file's exclusive lock, and SQLite answers a lock upgrade that could
    deadlock (several new connections switching an empty file at once) with "database is
    locked" at once, without waiting in its busy handler: so the wait is here.
    """
    deadline = time.monotonic() + SQLITE_BUSY_TIMEOUT_S
    delay = 0.005
    while True:
        try:
            if cursor.execute("PRAGMA journal_mode").fetchone()[0].lower() != "wal":
                cursor.execute("PRAGMA journal_mode = WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() + delay > deadline:
                raise
        time.sleep(delay * random.uniform(0.5, 1.5))
        delay = min(0.5, delay * 2)


def _on_sqlite_begin(connection: Connection) -> None:
    mode = connection.get_execution_options().get(SQLITE_BEGIN_OPTION, "DEFERRED")
    if mode not in ("DEFERRED", "IMMEDIATE", "EXCLUSIVE"):
        raise ValueError(f"{SQLITE_BEGIN_OPTION} must be DEFERRED, IMMEDIATE or EXCLUSIVE, "
                         f"but got {mode!r}")
    connection.exec_driver_sql(f"BEGIN {mode}")


def dispose_engine(url: str) -> None:
    """Close the pooled connections of ``url`` and forget its engine, sessions and migration."""
    with _lock:
        engine = _engines.pop(url, None)
        for write in (False, True):
            _sessionmakers.pop((url, write), None)
        _migrated.discard(url)
    if engine is not None:
        engine.dispose()


def _forget_after_fork() -> None:
    # A forked child must not use (or close) the parent's pooled connections.
    for engine in _engines.values():
        engine.dispose(close=False)
    _engines.clear()
    _sessionmakers.clear()
    _migrated.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)


# ----------------------------------------------------------------------------- migrations
def init_db(url: str) -> Engine:
    """Migrate the database of ``url`` to the newest schema (once per process) and return its engine.

    Safe when several processes call it at once on one database: the migration runs under the
    database's own lock (see ``db.migrate``). Later calls in the same process cost nothing.
    """
    engine = make_engine(url)
    if url in _migrated:
        return engine
    with _migrate_lock:
        if url not in _migrated:
            # Imported here: alembic costs 0.2 s (python -X importtime, 2-core CPU machine),
            # and a process that reads a migrated database never needs it.
            from db.migrate import upgrade_to_head

            check_connection(engine)
            upgrade_to_head(engine, sqlite_writer=engine.execution_options(
                **{SQLITE_BEGIN_OPTION: "IMMEDIATE"}))
            _migrated.add(url)
    return engine


# ----------------------------------------------------------------------------- sessions
def get_sessionmaker(url: str, *, write: bool = True) -> sessionmaker[Session]:
    """Session factory of ``url`` (migrated to the newest schema on first use).

    ``write=True`` sessions take SQLite's write lock when their transaction begins, so
    concurrent writers queue instead of failing; ``write=False`` suits read-only work.
    Objects stay usable after commit (``expire_on_commit=False``): callers return them.
    """
    key = (url, write)
    factory = _sessionmakers.get(key)
    if factory is not None and url in _migrated:
        return factory
    engine = init_db(url)
    bind = engine.execution_options(**{SQLITE_BEGIN_OPTION: "IMMEDIATE" if write else "DEFERRED"})
    with _lock:
        factory = _sessionmakers.get(key)
        if factory is None:
            factory = _sessionmakers[key] = sessionmaker(bind=bind, expire_on_commit=False)
        return factory


@contextmanager
def session_scope(url: str, *, write: bool = True) -> Iterator[Session]:
    """A session whose transaction commits when the block ends and rolls back on an error."""
    session = get_sessionmaker(url, write=write)()
    try:
        yield session
        session.commit()
    except BaseException:
        session.rollback()
        raise
    finally:
        session.close()


def is_retryable_error(exc: BaseException) -> bool:
    """True for errors after which re-running the same transaction can succeed.

    SQLite: the lock was not free within the busy timeout, or a deferred transaction's
    snapshot went stale. PostgreSQL: serialization failure or deadlock (the server aborted
    one of the transactions).
    """
    if not isinstance(exc, DBAPIError):
        return False
    sqlstate = getattr(exc.orig, "sqlstate", None) or getattr(exc.orig, "pgcode", None)
    if sqlstate in _RETRYABLE_SQLSTATES:
        return True
    message = str(exc.orig).lower()
    return any(m in message for m in _RETRYABLE_SQLITE_MESSAGES)


def run_in_transaction(url: str, fn: Callable[[Session], T], *, retries: int = 8,
                       backoff_s: float = 0.05) -> T:
    """Run ``fn(session)`` in one write transaction and commit; re-run it on lock conflicts.

    ``fn`` must touch nothing but the session (it may run more than once). Between attempts
    it waits ``backoff_s * 2**attempt`` seconds (capped at 2 s, jittered so that the workers
    that collided do not collide again). Errors that a retry cannot fix are raised at once.
    """
    if retries < 0:
        raise ValueError(f"retries must be >= 0, but got {retries}")
    factory = get_sessionmaker(url, write=True)
    for attempt in range(retries + 1):
        try:
            with factory() as session, session.begin():
                return fn(session)
        except DBAPIError as exc:
            if attempt == retries or not is_retryable_error(exc):
                raise
            delay = min(2.0, backoff_s * 2**attempt) * random.uniform(0.5, 1.5)
            log.debug("transaction on %s failed (%s); retry %d in %.3f s",
                      make_url(url).render_as_string(hide_password=True), exc.orig,
                      attempt + 1, delay)
            time.sleep(delay)
    raise AssertionError("unreachable: the loop returns or raises")
