"""``tuner db upgrade``: the migration step a deployment runs before the service starts."""

from __future__ import annotations

import json

import sqlalchemy as sa

from db.migrate import head_revision
from db.session import make_engine
from tests.tuner.cli.test_sweep_cli import cli


def test_upgrade_migrates_once_and_creates_optunas_tables_too(db_url: str) -> None:
    code, out, err = cli("db", "upgrade", "--db", db_url, "--json")
    assert code == 0, err
    first = json.loads(out)
    assert (first["revision_before"], first["revision"], first["migrated"]) == (
        None, head_revision(), True)
    tables = set(sa.inspect(make_engine(db_url)).get_table_names())
    assert {"tuning_trials", "best_configs", "sweeps"} <= tables  # ours
    assert {"studies", "trials", "trial_heartbeats"} <= tables  # Optuna's

    code, out, err = cli("db", "upgrade", "--db", db_url, "--json")
    assert code == 0, err
    again = json.loads(out)
    assert (again["revision_before"], again["revision"], again["migrated"]) == (
        head_revision(), head_revision(), False)


def test_an_unreachable_database_is_named_without_its_password() -> None:
    url = "postgresql+psycopg://tuner:s3cret-pass@127.0.0.1:1/tuner"
    code, out, _ = cli("db", "upgrade", "--db", url, "--json")
    assert code == 2
    error = json.loads(out)
    assert "127.0.0.1:1/tuner" in error["error"] and "s3cret-pass" not in error["error"]
    assert "TUNER_DATABASE_URL" in error["fix"]
