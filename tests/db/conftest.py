"""Fixtures of the storage tests: one fresh database per test, on SQLite and on PostgreSQL.

Every test that takes ``db_url`` runs once per backend, as Optuna runs its storage tests.
The PostgreSQL server is named by ``TUNER_TEST_POSTGRES_URL`` (default: the CI server at
127.0.0.1:5432, database ``test``, user ``postgres`` or else ``root``); each test gets its own
schema (through ``search_path``), dropped afterwards, so the database is left as found.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL, make_url

from db.session import dispose_engine

DEFAULT_POSTGRES_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
SCHEMA_PREFIX = "tuner_test_"


def _postgres_candidates() -> list[URL]:
    configured = os.environ.get("TUNER_TEST_POSTGRES_URL")
    if configured:
        return [make_url(configured)]
    default = make_url(DEFAULT_POSTGRES_URL)
    return [default, default.set(username="root")]


def _connectable(url: URL) -> str | None:
    """None when ``url`` accepts a connection, else why not."""
    engine = sa.create_engine(url, poolclass=sa.NullPool, connect_args={"connect_timeout": 3})
    try:
        with engine.connect() as connection:
            connection.execute(sa.text("SELECT 1"))
        return None
    except Exception as exc:  # any failure means: no server to test against
        return f"{url.render_as_string(hide_password=True)}: {type(exc).__name__}: {exc}"
    finally:
        engine.dispose()


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[URL]:
    """A PostgreSQL URL that accepts connections; skips the PostgreSQL tests if none does."""
    failures = []
    for url in _postgres_candidates():
        why = _connectable(url)
        if why is None:
            _drop_schemas_of_dead_runs(url)
            yield url
            return
        failures.append(why)
    pytest.skip("PostgreSQL server unreachable (set TUNER_TEST_POSTGRES_URL): "
                + " | ".join(failures))


def _drop_schemas_of_dead_runs(url: URL) -> None:
    # A run killed before its teardown leaves its schemas behind: drop those whose process
    # (named in the schema) no longer exists on this host.
    engine = sa.create_engine(url, poolclass=sa.NullPool)
    try:
        with engine.begin() as connection:
            names = connection.scalars(sa.text(
                "SELECT nspname FROM pg_namespace WHERE nspname LIKE :p"),
                {"p": SCHEMA_PREFIX + "%"}).all()
            for name in names:
                pid = name[len(SCHEMA_PREFIX):].split("_")[0]
                if pid.isdigit() and not _process_alive(int(pid)):
                    connection.execute(sa.text(f'DROP SCHEMA IF EXISTS "{name}" CASCADE'))
    finally:
        engine.dispose()


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _fresh_postgres_url(server: URL) -> Iterator[str]:
    schema = f"{SCHEMA_PREFIX}{os.getpid()}_{uuid.uuid4().hex[:10]}"
    admin = sa.create_engine(server, poolclass=sa.NullPool)
    with admin.begin() as connection:
        connection.execute(sa.text(f'CREATE SCHEMA "{schema}"'))
    url = server.update_query_dict({"options": f"-csearch_path={schema}"})
    text_url = url.render_as_string(hide_password=False)
    try:
        yield text_url
    finally:
        dispose_engine(text_url)
        with admin.begin() as connection:
            connection.execute(sa.text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
        admin.dispose()


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """URL of an empty database (no tables yet) on each backend."""
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'tuner.db'}"
        yield url
        dispose_engine(url)
    else:
        server = request.getfixturevalue("postgres_server")
        yield from _fresh_postgres_url(server)


@pytest.fixture
def sqlite_url(tmp_path: Path) -> Iterator[str]:
    url = f"sqlite:///{tmp_path / 'tuner.db'}"
    yield url
    dispose_engine(url)
