"""``tuner db upgrade``: migrate the database to the newest schema, and do nothing else.

Every command migrates on first use anyway; this one is for deployments that migrate once
before the service and the workers start (the api container of docker-compose.yml), so that
a database that cannot be migrated stops that start with the reason, instead of failing
inside a running worker.
"""

from __future__ import annotations

from typing import Any

import typer

from tuner.cli.common import DbOption, JsonOption, console, database_url, print_json
from tuner.errors import TunerError

__all__ = ["app", "upgrade"]

app = typer.Typer(name="db", no_args_is_help=True, add_completion=False,
                  help="The project database: migrations.")


@app.command("upgrade")
def upgrade(db: DbOption = None, json_out: JsonOption = False) -> None:
    """Migrate the project's tables to the newest revision and create Optuna's tables."""
    # lazy: sqlalchemy +0.19 s (2-core CPU); keeps `tuner --help` < 1 s
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import SQLAlchemyError

    url = database_url(db)
    shown = make_url(url).render_as_string(hide_password=True)
    try:
        result = _upgrade(url)
    except SQLAlchemyError as exc:
        reason = " ".join(str(getattr(exc, "orig", None) or exc).split())
        raise TunerError(f"cannot migrate {shown}: {type(exc).__name__}: {reason}",
                         "check that the database server runs and that TUNER_DATABASE_URL "
                         "(or --db) names it with a user that may create tables") from None
    result["database"] = shown
    if json_out:
        print_json(result)
    elif result["migrated"]:
        console.print(f"{shown}: migrated from {result['revision_before'] or 'an empty database'}"
                      f" to revision {result['revision']} (newest)")
    else:
        console.print(f"{shown}: already at revision {result['revision']} (newest)")


def _upgrade(url: str) -> dict[str, Any]:
    # lazy: alembic, optuna, sqlalchemy, torch+triton +2.5 s (2-core CPU); keeps `tuner --help` < 1 s
    from db.migrate import current_revision, head_revision
    from db.session import init_db, make_engine
    from tuner.tuning.search.study import make_storage

    engine = make_engine(url)
    with engine.connect() as connection:
        before = current_revision(connection)
    init_db(url)  # under the database's migration lock: safe beside other starting processes
    # Optuna's tables too, here once, rather than raced for by the first workers to start.
    make_storage(url).engine.dispose()
    with engine.connect() as connection:
        after = current_revision(connection)
    return {"revision_before": before, "revision": after, "head": head_revision(),
            "migrated": before != after}
