"""``tuner serve``: the config service (FastAPI, ``api.main:create_app``) under uvicorn."""

from __future__ import annotations

import os
from typing import Annotated

import typer

from tuner.cli.common import DbOption, JsonOption, console, print_json, settings_with
from tuner.errors import TunerError
from tuner.settings import TOKEN_FIX, write_token_problem

__all__ = ["serve"]

# Started by import string, so that ``tuner`` imports nothing of ``api`` and uvicorn can start
# the app in each of several worker processes.
APP = "api.main:create_app"


def serve(
    host: Annotated[str, typer.Option("--host", help="address to listen on")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="port to listen on")] = 8000,
    workers: Annotated[int, typer.Option(
        "--workers", help="server processes sharing the port (uvicorn workers); each keeps its "
                          "own cache, so an upload shows in the others' answers within 5 s")] = 1,
    db: DbOption = None,
    json_out: JsonOption = False,
) -> None:
    """Serve the stored best configs over HTTP (the API the client asks).

    Says where it serves before the server starts (with --json as one JSON object: url,
    database, workers, writes); the server's own log is at TUNER_LOG_LEVEL.
    """
    # lazy: sqlalchemy, uvicorn +0.18 s (2-core CPU); keeps `tuner --help` < 1 s
    import uvicorn
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import SQLAlchemyError

    from db.session import init_db

    if not 0 < port < 65536:
        raise TunerError(f"--port must be 1..65535, but got {port}", "e.g. --port 8000")
    if workers < 1:
        raise TunerError(f"--workers must be >= 1, but got {workers}",
                         "e.g. --workers 2, one per core the service may use")
    settings = settings_with(db)
    shown = make_url(settings.database_url).render_as_string(hide_password=True)
    if settings.token is not None and (problem := write_token_problem(settings.token)):
        raise TunerError(f"refusing to serve: {problem}", TOKEN_FIX)
    try:
        # Once, before the workers start: a database that cannot be reached (a
        # DatabaseUnavailableError, reported by the CLI) or migrated is reported here, not by
        # every worker.
        init_db(settings.database_url)
    except SQLAlchemyError as exc:
        raise TunerError(f"cannot open the database {shown}: "
                         f"{type(exc).__name__}: {str(exc).splitlines()[0]}",
                         "check --db / TUNER_DATABASE_URL and that the server is up") from None
    url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
    writes = settings.token is not None
    if json_out:
        print_json({"url": url, "database": shown, "workers": workers, "writes": writes})
    else:
        everywhere = " (every interface)" if host in ("0.0.0.0", "::") else ""
        console.print(f"serving {shown} at {url}{everywhere}, {workers} worker(s); "
                      + ("writes need TUNER_TOKEN" if writes else
                         "reads only (TUNER_TOKEN is not set)")
                      + f"; API docs at {url}/docs; Ctrl-C stops", highlight=False)
    if db:  # the workers read their settings from the environment (create_app())
        os.environ["TUNER_DATABASE_URL"] = db
    level = settings.log_level.lower()
    # lazy: uvicorn +0.03 s (2-core CPU); keeps `tuner --help` < 1 s
    from api.server_protocol import serving_protocol

    uvicorn.run(APP, factory=True, host=host, port=port, workers=workers, log_level=level,
                access_log=level in ("debug", "info"), http=serving_protocol())
