"""Alembic environment of the project's tables (not Optuna's; see db/migrate.py).

Run from code by ``db.session.init_db``, which passes an open connection in a transaction
(``config.attributes["connection"]``). From the command line, for writing a new revision:

    alembic -c db/alembic.ini -x url=sqlite:///tuner.db revision --autogenerate -m "what"

The URL comes from ``-x url=...``, else ``TUNER_DATABASE_URL``, else ``sqlite:///tuner.db``.
No logging set-up happens here: this runs inside the tuner and the service.
"""

from __future__ import annotations

import os
from typing import Any

from alembic import context
from sqlalchemy import Connection

from db.migrate import VERSION_TABLE, include_object
from db.models import Base

config = context.config


def _url() -> str:
    return (context.get_x_argument(as_dictionary=True).get("url")
            or os.environ.get("TUNER_DATABASE_URL") or "sqlite:///tuner.db")


def _configure(**kwargs: Any) -> None:
    context.configure(target_metadata=Base.metadata, version_table=VERSION_TABLE,
                      include_object=include_object, compare_type=True, **kwargs)


def _run_online(connection: Connection) -> None:
    # SQLite cannot ALTER most things: later revisions rebuild tables in batch mode.
    _configure(connection=connection, render_as_batch=connection.dialect.name == "sqlite",
               transactional_ddl=True)
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    _configure(url=_url(), literal_binds=True, dialect_opts={"paramstyle": "named"})
    with context.begin_transaction():
        context.run_migrations()
elif (shared := config.attributes.get("connection")) is not None:
    _run_online(shared)
else:
    from db.session import make_engine

    with make_engine(_url()).connect() as own:
        _run_online(own)
        own.commit()
