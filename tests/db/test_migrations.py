"""Migrations from an empty database, repeated calls, Optuna's tables beside ours, 0001 -> 0002
(the remeasurements table) and 0002 -> 0003 (remeasurement_claims) up and down with data in
place."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import optuna
import pytest
import sqlalchemy as sa
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy.orm import Session

from db import crud
from db.migrate import (
    VERSION_TABLE,
    alembic_config,
    current_revision,
    head_revision,
    include_object,
)
from db.models import Base, TrialStatus
from db.session import dispose_engine, init_db, make_engine, session_scope

OUR_TABLES = {"devices", "templates", "sweeps", "tuning_trials", "best_configs",
              "remeasurements", "remeasurement_claims"}


@contextmanager
def _statements(engine: sa.Engine) -> Iterator[list[str]]:
    seen: list[str] = []

    def record(conn: object, cursor: object, statement: str, *args: object) -> None:
        seen.append(statement)

    sa.event.listen(engine, "before_cursor_execute", record)
    try:
        yield seen
    finally:
        sa.event.remove(engine, "before_cursor_execute", record)


def test_init_db_creates_the_schema_the_models_describe(db_url: str) -> None:
    engine = make_engine(db_url)
    assert not set(sa.inspect(engine).get_table_names()) & OUR_TABLES
    init_db(db_url)
    assert set(sa.inspect(engine).get_table_names()) == OUR_TABLES | {VERSION_TABLE}
    with engine.connect() as connection:
        assert current_revision(connection) == head_revision()
        context = MigrationContext.configure(connection, opts={
            "compare_type": True, "include_object": include_object,
            "version_table": VERSION_TABLE})
        # Nothing for autogenerate to add, drop or alter: the migration matches db.models.
        assert compare_metadata(context, Base.metadata) == []


def test_init_db_again_does_nothing(db_url: str) -> None:
    engine = init_db(db_url)
    with _statements(engine) as seen:
        assert init_db(db_url) is engine
    assert seen == []  # cached in the process: not even a query
    dispose_engine(db_url)  # as a new process would: only reads the revision
    engine = make_engine(db_url)
    with _statements(engine) as seen:
        init_db(db_url)
    assert seen, "a new process checks the revision"
    writes = [q for q in seen if q.lstrip().split()[0].upper() in
              ("CREATE", "ALTER", "DROP", "INSERT", "UPDATE", "DELETE")]
    assert writes == []


def test_optuna_tables_and_ours_share_the_database(db_url: str) -> None:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = optuna.storages.RDBStorage(db_url)
    study = optuna.create_study(storage=storage, study_name="fwd-sweep")
    study.optimize(lambda trial: trial.suggest_float("x", -1.0, 1.0) ** 2, n_trials=3)
    storage.remove_session()
    storage.engine.dispose()
    engine = make_engine(db_url)
    optuna_tables = set(sa.inspect(engine).get_table_names())
    assert "studies" in optuna_tables and "alembic_version" in optuna_tables

    init_db(db_url)
    assert set(sa.inspect(engine).get_table_names()) == optuna_tables | OUR_TABLES | {VERSION_TABLE}
    with engine.connect() as connection:  # Optuna's history is its own
        optuna_revision = connection.scalar(sa.text("SELECT version_num FROM alembic_version"))
        assert optuna_revision != head_revision()

    # Downgrading ours to nothing drops our tables only.
    with engine.connect() as connection, connection.begin():
        command.downgrade(alembic_config(connection), "base")
    assert set(sa.inspect(engine).get_table_names()) == optuna_tables | {VERSION_TABLE}
    dispose_engine(db_url)
    init_db(db_url)
    reopened = optuna.load_study(study_name="fwd-sweep", storage=db_url)
    assert len(reopened.trials) == 3
    with make_engine(db_url).connect() as connection:
        assert connection.scalar(sa.text("SELECT version_num FROM alembic_version")) == optuna_revision


def test_no_table_name_is_also_optunas() -> None:
    from optuna.storages._rdb.models import BaseModel as OptunaBase

    ours = set(Base.metadata.tables)
    assert ours == OUR_TABLES
    assert not ours & (set(OptunaBase.metadata.tables) | {"alembic_version"})


def test_init_db_adopts_tables_made_by_create_all(db_url: str) -> None:
    engine = make_engine(db_url)
    Base.metadata.create_all(engine)
    init_db(db_url)
    with engine.connect() as connection:
        assert current_revision(connection) == head_revision()
    assert set(sa.inspect(engine).get_table_names()) == OUR_TABLES | {VERSION_TABLE}


def _migrate(engine: sa.Engine, revision: str, *, down: bool = False) -> None:
    with engine.connect() as connection, connection.begin():
        (command.downgrade if down else command.upgrade)(alembic_config(connection), revision)


def _one_trial(engine: sa.Engine) -> tuple[int, int, int]:
    """A device, a template and one OK trial, written through the schema as it is; their ids."""
    with Session(engine) as s, s.begin():
        device = crud.get_or_create_device(s, info={
            "key": "gpu|1", "name": "gpu", "compute_capability": "9.0", "sm_count": 1,
            "total_memory": 1, "driver_version": "1", "triton_version": "1",
            "torch_version": "1", "cuda_version": "1"})
        template = crud.get_or_create_template(s, name="t", version="v", space={})
        trial = crud.record_trial(s, device_id=device.id, template_id=template.id,
                                  problem_key="p", problem={"dtype": "float16"},
                                  config_key="c", config={}, status=TrialStatus.OK,
                                  median_ms=2.0, tflops=50.0)
        return device.id, template.id, trial.id


def test_0002_adds_remeasurements_to_a_0001_database_and_downgrades_back(db_url: str) -> None:
    engine = make_engine(db_url)
    _migrate(engine, "0001")  # a database of the first release, with a trial and its best
    assert "remeasurements" not in sa.inspect(engine).get_table_names()
    ids = _one_trial(engine)

    init_db(db_url)  # what the next tuner or service start does
    with engine.connect() as connection:
        assert current_revision(connection) == head_revision() == "0003"
    with session_scope(db_url) as s:
        crud.record_remeasurement(s, trial_id=ids[2], status=TrialStatus.OK, median_ms=2.2,
                                  tflops=45.0)
        best = crud.refresh_best(s, device_id=ids[0], template_id=ids[1], problem_key="p")
        assert best is not None and best.median_ms == pytest.approx(2.1)  # of 2.0 and 2.2
    assert {i["name"] for i in sa.inspect(engine).get_indexes("remeasurements")} == {
        "ix_remeasurements_trial_id", "ix_remeasurements_sweep_id"}

    _migrate(engine, "0001", down=True)
    tables = set(sa.inspect(engine).get_table_names())
    assert tables == OUR_TABLES - {"remeasurements", "remeasurement_claims"} | {VERSION_TABLE}
    with engine.connect() as connection:
        assert current_revision(connection) == "0001"
        assert connection.scalar(sa.text("SELECT median_ms FROM tuning_trials")) == 2.0
        assert connection.scalar(sa.text("SELECT median_ms FROM best_configs")) == (
            pytest.approx(2.1))  # as the finalists left it
    _migrate(engine, "head")
    with engine.connect() as connection:
        assert connection.scalar(sa.text("SELECT count(*) FROM remeasurements")) == 0


def test_0003_adds_remeasurement_claims_to_a_0002_database_and_downgrades_back(
        db_url: str) -> None:
    engine = make_engine(db_url)
    _migrate(engine, "0002")
    assert "remeasurement_claims" not in sa.inspect(engine).get_table_names()
    trial_id = _one_trial(engine)[2]
    with Session(engine) as s, s.begin():
        crud.record_remeasurement(s, trial_id=trial_id, status=TrialStatus.OK, median_ms=2.2,
                                  tflops=45.0)

    init_db(db_url)
    with engine.connect() as connection:
        assert current_revision(connection) == head_revision() == "0003"
    with session_scope(db_url) as s:
        claim = crud.claim_remeasurement(s, trial_id=trial_id, wanted=2, worker="w",
                                         is_stale=lambda *_: False)
        assert claim is not None
    assert {i["name"] for i in sa.inspect(engine).get_indexes("remeasurement_claims")} == {
        "ix_remeasurement_claims_trial_id"}

    _migrate(engine, "0002", down=True)
    assert "remeasurement_claims" not in sa.inspect(engine).get_table_names()
    with engine.connect() as connection:
        assert current_revision(connection) == "0002"
        assert connection.scalar(sa.text("SELECT count(*) FROM remeasurements")) == 1
    _migrate(engine, "head")
    with engine.connect() as connection:
        assert connection.scalar(sa.text("SELECT count(*) FROM remeasurement_claims")) == 0
