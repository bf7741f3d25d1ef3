"""Migrations from an empty database, repeated calls, and Optuna's tables beside ours."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import optuna
import sqlalchemy as sa
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext

from db.migrate import (
    VERSION_TABLE,
    alembic_config,
    current_revision,
    head_revision,
    include_object,
)
from db.models import Base
from db.session import dispose_engine, init_db, make_engine

OUR_TABLES = {"devices", "templates", "sweeps", "tuning_trials", "best_configs"}


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
