"""Migrations from an empty database, repeated calls, Optuna's tables beside ours, 0001 -> 0002
(the remeasurements table), 0002 -> 0003 (remeasurement_claims), 0003 -> 0004
(devices.cudnn_version), 0004 -> 0005 (snapshots), 0005 -> 0006 (the demand queue), 0006 ->
0007 (head-to-head sessions), 0007 -> 0008 (the best_changes counter) and 0008 -> 0009 (the
phases of each measurement) up and down with data in place."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime

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
              "remeasurements", "remeasurement_claims", "snapshots", "demand",
              "head_to_heads", "head_to_head_readings", "best_changes"}
HEAD = "0009"


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


def _insert(s: Session, table: str, **values: object) -> int:
    """One row written with exactly ``values``' columns (those of an older schema, which
    lacks the model's later ones), dicts as JSON; its id."""
    columns = [sa.column(name, sa.JSON) if isinstance(value, dict) else sa.column(name)
               for name, value in values.items()]
    row = s.execute(sa.insert(sa.table(table, *columns, sa.column("id"))).values(**values)
                    .returning(sa.column("id")))
    return int(row.scalar_one())


def _one_trial(engine: sa.Engine) -> tuple[int, int, int]:
    """A device, a template and one OK trial, written through the schema as it is; their ids.

    The device and the trial are written with the columns of the first release (the models'
    later columns, such as devices.cudnn_version and tuning_trials.phases, are not in an
    older schema)."""
    with Session(engine) as s, s.begin():
        s.execute(sa.text(
            "INSERT INTO devices (key, name, compute_capability, sm_count, total_memory, "
            "driver_version, triton_version, torch_version, cuda_version, created_at) VALUES "
            "('gpu|1', 'gpu', '9.0', 1, 1, '1', '1', '1', '1', CURRENT_TIMESTAMP)"))
        device_id = s.scalar(sa.text("SELECT id FROM devices WHERE key = 'gpu|1'"))
        template = crud.get_or_create_template(s, name="t", version="v", space={})
        trial_id = _insert(s, "tuning_trials", device_id=device_id, template_id=template.id,
                           problem_key="p", problem={"dtype": "float16"}, config_key="c",
                           config={}, status="ok", reason="", median_ms=2.0, tflops=50.0,
                           is_default=False, worker="", created_at=datetime.now(UTC))
        return device_id, template.id, trial_id


def test_0002_adds_remeasurements_to_a_0001_database_and_downgrades_back(db_url: str) -> None:
    engine = make_engine(db_url)
    _migrate(engine, "0001")  # a database of the first release, with a trial and its best
    assert "remeasurements" not in sa.inspect(engine).get_table_names()
    ids = _one_trial(engine)

    init_db(db_url)  # what the next tuner or service start does
    with engine.connect() as connection:
        assert current_revision(connection) == head_revision() == HEAD
    with session_scope(db_url) as s:
        crud.record_remeasurement(s, trial_id=ids[2], status=TrialStatus.OK, median_ms=2.2,
                                  tflops=45.0)
        best = crud.refresh_best(s, device_id=ids[0], template_id=ids[1], problem_key="p")
        assert best is not None and best.median_ms == pytest.approx(2.1)  # of 2.0 and 2.2
    assert {i["name"] for i in sa.inspect(engine).get_indexes("remeasurements")} == {
        "ix_remeasurements_trial_id", "ix_remeasurements_sweep_id"}

    _migrate(engine, "0001", down=True)
    tables = set(sa.inspect(engine).get_table_names())
    assert tables == OUR_TABLES - {"remeasurements", "remeasurement_claims", "snapshots",
                                   "demand", "head_to_heads", "head_to_head_readings",
                                   "best_changes"} | {
        VERSION_TABLE}
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
    with Session(engine) as s, s.begin():  # with the columns of 0002
        _insert(s, "remeasurements", trial_id=trial_id, status="ok", reason="", median_ms=2.2,
                tflops=45.0, worker="", created_at=datetime.now(UTC))

    init_db(db_url)
    with engine.connect() as connection:
        assert current_revision(connection) == head_revision() == HEAD
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


def test_0004_adds_the_cudnn_version_to_a_0003_database_and_downgrades_back(
        db_url: str) -> None:
    from tuner.lookup.resolver import device_info_from_row

    engine = make_engine(db_url)
    _migrate(engine, "0003")
    assert "cudnn_version" not in {c["name"] for c in sa.inspect(engine).get_columns("devices")}
    old_id = _one_trial(engine)[0]

    init_db(db_url)
    with engine.connect() as connection:
        assert current_revision(connection) == head_revision()
    with session_scope(db_url) as s:
        # The device stored before: readable, no cuDNN, its key unchanged.
        [old] = [d for d in crud.list_devices(s) if d.id == old_id]
        assert (old.key, old.cudnn_version) == ("gpu|1", None)
        assert device_info_from_row(old).cudnn_version is None
        new = crud.get_or_create_device(s, info={
            "key": "gpu|2", "name": "gpu", "compute_capability": "9.0", "sm_count": 1,
            "total_memory": 1, "driver_version": "1", "triton_version": "1",
            "torch_version": "1", "cuda_version": "1", "cudnn_version": "9.19.0"})
        assert device_info_from_row(new).cudnn_version == "9.19.0"

    _migrate(engine, "0003", down=True)
    assert "cudnn_version" not in {c["name"] for c in sa.inspect(engine).get_columns("devices")}
    with engine.connect() as connection:
        assert current_revision(connection) == "0003"
        assert connection.scalars(sa.text("SELECT key FROM devices ORDER BY id")).all() == [
            "gpu|1", "gpu|2"]
        assert connection.scalar(sa.text("SELECT count(*) FROM tuning_trials")) == 1
    _migrate(engine, "head")
    with engine.connect() as connection:
        assert connection.scalar(sa.text(
            "SELECT count(*) FROM devices WHERE cudnn_version IS NULL")) == 2


def test_0005_adds_snapshots_to_a_0004_database_and_downgrades_back(db_url: str) -> None:
    engine = make_engine(db_url)
    _migrate(engine, "0004")
    assert "snapshots" not in sa.inspect(engine).get_table_names()
    trial_id = _one_trial(engine)[2]

    init_db(db_url)
    with session_scope(db_url) as s:
        row, created = crud.create_snapshot(s, snapshot_id="a" * 64, content="{}", items=0)
        assert created and row.items == 0
    assert {i["name"] for i in sa.inspect(engine).get_indexes("snapshots")} == {
        "ix_snapshots_created_at"}

    _migrate(engine, "0004", down=True)
    assert "snapshots" not in sa.inspect(engine).get_table_names()
    with engine.connect() as connection:
        assert current_revision(connection) == "0004"
        assert connection.scalar(sa.text("SELECT id FROM tuning_trials")) == trial_id
    _migrate(engine, "head")
    with engine.connect() as connection:
        assert connection.scalar(sa.text("SELECT count(*) FROM snapshots")) == 0


def test_0006_adds_the_demand_queue_to_a_0005_database_and_downgrades_back(
        db_url: str) -> None:
    from db import demand

    engine = make_engine(db_url)
    _migrate(engine, "0005")
    assert "demand" not in sa.inspect(engine).get_table_names()
    ids = _one_trial(engine)

    init_db(db_url)
    with engine.connect() as connection:
        assert current_revision(connection) == head_revision() == HEAD
    count = demand.DemandCount("gpu|1", "t", "v", "p", {"dtype": "float16"}, 3)
    with session_scope(db_url) as s:
        demand.add_demand(s, counts=[count])
    with session_scope(db_url) as s:
        demand.add_demand(s, counts=[count])
    with session_scope(db_url) as s:
        claimed = demand.claim_demand(s, device_key="gpu|1", versions={"t": "v"}, worker="w",
                                      lease_s=60, max_attempts=3)
        assert claimed is not None and claimed.reports == 6
    # (PostgreSQL lists the unique constraint's index too.)
    assert {i["name"] for i in sa.inspect(engine).get_indexes("demand")
            if i["name"].startswith("ix_")} == {"ix_demand_device_status"}

    _migrate(engine, "0005", down=True)
    assert "demand" not in sa.inspect(engine).get_table_names()
    with engine.connect() as connection:
        assert current_revision(connection) == "0005"
        assert connection.scalar(sa.text("SELECT id FROM tuning_trials")) == ids[2]
    _migrate(engine, "head")
    with engine.connect() as connection:
        assert connection.scalar(sa.text("SELECT count(*) FROM demand")) == 0


def test_0007_adds_head_to_heads_to_a_0006_database_and_downgrades_back(db_url: str) -> None:
    from db import head_to_head

    engine = make_engine(db_url)
    _migrate(engine, "0006")
    assert not {"head_to_heads", "head_to_head_readings"} & set(
        sa.inspect(engine).get_table_names())
    device_id, template_id, trial_id = _one_trial(engine)

    init_db(db_url)
    with engine.connect() as connection:
        assert current_revision(connection) == head_revision() == HEAD
    with session_scope(db_url) as s:
        session = head_to_head.start_head_to_head(s, device_id=device_id, problem={}, rounds=2)
        for n, ms in enumerate((2.4, 2.6)):
            head_to_head.record_head_to_head_reading(
                s, head_to_head_id=session, trial_id=trial_id, round=n, position=0,
                status=TrialStatus.OK, median_ms=ms, tflops=100.0 / ms)
        head_to_head.finish_head_to_head(s, head_to_head_id=session)
        best = crud.refresh_best(s, device_id=device_id, template_id=template_id,
                                 problem_key="p")
        assert best is not None and best.median_ms == pytest.approx(2.5)  # of 2.4 and 2.6
    assert {i["name"] for i in sa.inspect(engine).get_indexes("head_to_heads")} == {
        "ix_head_to_heads_device_id", "ix_head_to_heads_sweep_id"}
    assert {i["name"] for i in sa.inspect(engine).get_indexes("head_to_head_readings")} == {
        "ix_head_to_head_readings_head_to_head_id", "ix_head_to_head_readings_trial_id"}

    _migrate(engine, "0006", down=True)
    assert not {"head_to_heads", "head_to_head_readings"} & set(
        sa.inspect(engine).get_table_names())
    with engine.connect() as connection:
        assert current_revision(connection) == "0006"
        assert connection.scalar(sa.text("SELECT median_ms FROM tuning_trials")) == 2.0
        assert connection.scalar(sa.text("SELECT median_ms FROM best_configs")) == (
            pytest.approx(2.5))  # as the head-to-head left it, until its next refresh
    _migrate(engine, "head")
    with session_scope(db_url) as s:
        best = crud.refresh_best(s, device_id=device_id, template_id=template_id,
                                 problem_key="p")
        assert best is not None and best.median_ms == 2.0  # the sweep's own reading again


def _changes(engine: sa.Engine) -> int:
    with engine.connect() as connection:
        return int(connection.scalar(sa.text("SELECT changes FROM best_changes WHERE id = 1")))


def test_0008_counts_changes_of_what_the_service_caches_and_downgrades_back(
        db_url: str) -> None:
    from db.demand import DemandCount, add_demand
    from db.models import BEST_CHANGES_TRIGGERS

    engine = make_engine(db_url)
    _migrate(engine, "0007")
    device_id, template_id, _ = _one_trial(engine)
    assert "best_changes" not in sa.inspect(engine).get_table_names()

    init_db(db_url)
    with engine.connect() as connection:
        assert current_revision(connection) == head_revision() == HEAD
    sqlite = engine.dialect.name == "sqlite"
    if sqlite:
        with engine.connect() as connection:
            triggers = {name for (name,) in connection.execute(sa.text(
                "SELECT name FROM sqlite_master WHERE type = 'trigger'"))}
        assert triggers == set(BEST_CHANGES_TRIGGERS)
    assert _changes(engine) == 0
    with session_scope(db_url) as s:  # not what the service caches: not counted
        add_demand(s, counts=[DemandCount("gpu|1", "t", "v", "p", {}, 3)])
    assert _changes(engine) == 0
    with session_scope(db_url) as s:
        crud.refresh_best(s, device_id=device_id, template_id=template_id, problem_key="p")
    with session_scope(db_url) as s:
        crud.get_or_create_template(s, name="t", version="v2", space={})
    # On PostgreSQL, notifications say it (db.crud.refresh_bests): nothing counts there.
    assert _changes(engine) == (2 if sqlite else 0)  # a best config made, a template version

    _migrate(engine, "0007", down=True)
    assert "best_changes" not in sa.inspect(engine).get_table_names()
    with engine.connect() as connection:
        assert current_revision(connection) == "0007"
        if sqlite:
            assert connection.scalar(sa.text(
                "SELECT count(*) FROM sqlite_master WHERE type = 'trigger'")) == 0
    with session_scope(db_url) as s:  # the tables work without their triggers' table
        crud.get_or_create_template(s, name="t", version="v3", space={})
    _migrate(engine, "head")
    assert _changes(engine) == 0


def test_0009_adds_the_phases_of_each_measurement_and_downgrades_back(db_url: str) -> None:
    from db import head_to_head

    tables = ("tuning_trials", "remeasurements", "head_to_head_readings")
    engine = make_engine(db_url)
    _migrate(engine, "0008")
    for table in tables:
        assert "phases" not in {c["name"] for c in sa.inspect(engine).get_columns(table)}
    device_id, template_id, old_trial = _one_trial(engine)

    init_db(db_url)
    with engine.connect() as connection:
        assert current_revision(connection) == head_revision() == HEAD
    phases = {"inputs_s": 0.5, "compile_s": 2.0, "reference_s": 4.0, "check_s": 0.1,
              "bench_s": 0.4, "runner_s": 7.1, "reference_kept": True}
    with session_scope(db_url) as s:
        assert crud.find_trial(s, device_id=device_id, template_id=template_id,
                               problem_key="p", config_key="c").phases is None  # not recorded
        trial = crud.record_trial(s, device_id=device_id, template_id=template_id,
                                  problem_key="p", problem={}, config_key="d", config={},
                                  status=TrialStatus.OK, median_ms=1.0, tflops=9.0,
                                  phases=phases)
        again = crud.record_remeasurement(s, trial_id=trial.id, status=TrialStatus.OK,
                                          median_ms=1.1, tflops=8.0, phases=phases)
        session = head_to_head.start_head_to_head(s, device_id=device_id, problem={}, rounds=1)
        head_to_head.record_head_to_head_reading(
            s, head_to_head_id=session, trial_id=old_trial, round=0, position=0,
            status=TrialStatus.OK, median_ms=2.0, tflops=50.0, phases=phases)
        s.flush()
        assert (trial.phases, again.phases) == (phases, phases)
    with session_scope(db_url) as s:
        assert crud.trials_for(s, device_id=device_id, template_id=template_id,
                               problem_key="p")[1].phases == phases

    _migrate(engine, "0008", down=True)
    for table in tables:
        assert "phases" not in {c["name"] for c in sa.inspect(engine).get_columns(table)}
    with engine.connect() as connection:
        assert current_revision(connection) == "0008"
        assert connection.scalars(sa.text(
            "SELECT median_ms FROM tuning_trials ORDER BY id")).all() == [2.0, 1.0]
        assert connection.scalar(sa.text("SELECT median_ms FROM remeasurements")) == 1.1
        assert connection.scalar(sa.text("SELECT median_ms FROM head_to_head_readings")) == 2.0
    _migrate(engine, "head")
    with engine.connect() as connection:
        assert connection.scalar(sa.text(
            "SELECT count(*) FROM tuning_trials WHERE phases IS NULL")) == 2
