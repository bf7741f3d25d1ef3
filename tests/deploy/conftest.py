"""A fresh PostgreSQL database per deployment test, dropped afterwards.

A database rather than a schema (tests/db): the compose file builds its database URL from
host, port, user and database name, and the topology test uses that URL as compose builds
it. Skipped, with the reason, when no server answers (tests/db/conftest.py).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL

from tests.db.conftest import _process_alive, postgres_server  # noqa: F401

DATABASE_PREFIX = "tuner_deploy_"


@pytest.fixture
def fresh_database(postgres_server: URL) -> Iterator[URL]:  # noqa: F811
    """The server's URL with a new, empty database of its own."""
    admin = sa.create_engine(postgres_server, poolclass=sa.NullPool,
                             isolation_level="AUTOCOMMIT")
    _drop_databases_of_dead_runs(admin)
    name = f"{DATABASE_PREFIX}{os.getpid()}_{uuid.uuid4().hex[:10]}"
    with admin.connect() as connection:
        connection.execute(sa.text(f'CREATE DATABASE "{name}"'))
    try:
        yield postgres_server.set(database=name)
    finally:
        with admin.connect() as connection:  # FORCE: ends sessions a killed process left
            connection.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def _drop_databases_of_dead_runs(admin: sa.Engine) -> None:
    # A run killed before its teardown leaves its database behind: drop those whose process
    # (named in the database's name) no longer exists on this host.
    with admin.connect() as connection:
        names = connection.scalars(sa.text(
            "SELECT datname FROM pg_database WHERE starts_with(datname, :p)"),
            {"p": DATABASE_PREFIX}).all()
        for name in names:
            pid = name[len(DATABASE_PREFIX):].split("_")[0]
            if pid.isdigit() and not _process_alive(int(pid)):
                connection.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
