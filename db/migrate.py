"""Alembic migrations of the project's tables, run from code under a database-wide lock.

Optuna keeps its own tables, and its own Alembic history in the table ``alembic_version``, in
the same database. Ours is recorded in ``tuner_alembic_version`` and our migrations (and
autogenerate) see only the tables of ``db.models``: the two histories never touch each other.

Several processes may start on a fresh database at once. Each checks the revision without a
lock first (the common case: nothing to do); otherwise it takes the database's lock, checks
again and migrates. SQLite: the lock is the write lock of a ``BEGIN IMMEDIATE`` transaction
holding the whole migration (SQLite's DDL is transactional). PostgreSQL: an advisory lock.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, Engine, inspect, text
from sqlalchemy.exc import OperationalError

from db.models import Base

__all__ = [
    "MIGRATIONS_DIR",
    "VERSION_TABLE",
    "alembic_config",
    "current_revision",
    "head_revision",
    "include_object",
    "upgrade_to_head",
]

log = logging.getLogger(__name__)

MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"
VERSION_TABLE = "tuner_alembic_version"
# Key of the PostgreSQL advisory lock serializing migrations (any constant unique to us).
_PG_MIGRATION_LOCK = 0x7475_6E65_725F_6462  # "tuner_db"
_SQLITE_LOCK_ATTEMPTS = 5


def alembic_config(connection: Connection | None = None) -> Config:
    """An Alembic config pointing at ``db/migrations``; ``connection`` is the one env.py uses."""
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.attributes["connection"] = connection
    return config


def head_revision() -> str:
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    if head is None:
        raise RuntimeError(f"no migration revisions found in {MIGRATIONS_DIR}")
    return head


def current_revision(connection: Connection) -> str | None:
    """The revision the database is at, or None when it has none of our tables yet."""
    context = MigrationContext.configure(connection, opts={"version_table": VERSION_TABLE})
    return context.get_current_revision()


def include_object(obj: Any, name: str | None, type_: str, reflected: bool,
                   compare_to: Any) -> bool:
    """Autogenerate filter: tables that are not ours (Optuna's) are neither created nor dropped."""
    if type_ == "table":
        return name in Base.metadata.tables
    return True


def upgrade_to_head(engine: Engine, *, sqlite_writer: Engine | None = None) -> None:
    """Migrate ``engine``'s database to the newest revision under the database's lock.

    ``sqlite_writer``: ``engine`` set to begin its transactions with SQLite's write lock
    (``db.session`` makes it, with BEGIN IMMEDIATE); the migration holds that lock.
    """
    head = head_revision()
    with engine.connect() as connection:
        at = current_revision(connection)
        connection.rollback()
    if at == head:
        return
    if engine.dialect.name == "postgresql":
        _upgrade_postgresql(engine)
    elif engine.dialect.name == "sqlite":
        _upgrade_sqlite(sqlite_writer or engine)
    else:
        raise ValueError(f"database backend must be sqlite or postgresql, "
                         f"but got {engine.dialect.name!r}")


def _upgrade(connection: Connection) -> None:
    # Runs inside the caller's transaction: env.py sees it and adds none of its own.
    config = alembic_config(connection)
    if current_revision(connection) is None and _has_all_tables(connection):
        # Made by Base.metadata.create_all (tests, scripts) from the current models: record
        # it as the newest revision instead of failing on "table already exists".
        log.warning("the database has the project's tables but no migration record; "
                    "recording it as revision %s", head_revision())
        command.stamp(config, "head")
        return
    command.upgrade(config, "head")


def _has_all_tables(connection: Connection) -> bool:
    return set(Base.metadata.tables) <= set(inspect(connection).get_table_names())


def _upgrade_postgresql(engine: Engine) -> None:
    with engine.connect() as connection:
        connection.execute(text("SELECT pg_advisory_lock(:key)"), {"key": _PG_MIGRATION_LOCK})
        connection.commit()
        try:
            with connection.begin():
                _upgrade(connection)
        finally:
            connection.execute(text("SELECT pg_advisory_unlock(:key)"),
                               {"key": _PG_MIGRATION_LOCK})
            connection.commit()


def _upgrade_sqlite(immediate: Engine) -> None:
    # Each transaction of ``immediate`` begins with the write lock (BEGIN IMMEDIATE): whoever
    # holds it migrates; the others wait on the busy timeout and then find the schema at head.
    for attempt in range(_SQLITE_LOCK_ATTEMPTS):
        try:
            with immediate.connect() as connection, connection.begin():
                _upgrade(connection)
            return
        except OperationalError as exc:
            # Only a lock held past the busy timeout is worth another try.
            if attempt == _SQLITE_LOCK_ATTEMPTS - 1 or "locked" not in str(exc.orig).lower():
                raise
            time.sleep(0.1 * 2**attempt)
