"""Fixtures the benchmark scripts' tests share with the tuner's: no tuned config in the
process, and the storages of tests/db (a fresh SQLite file, a fresh PostgreSQL schema)."""

from tests.db.conftest import db_url, postgres_server, sqlite_url  # noqa: F401
from tests.tuner.conftest import no_tuned_configs  # noqa: F401
