"""``tuner serve``: the config service (FastAPI, api.main.create_app) under uvicorn."""

from __future__ import annotations

from typing import Annotated

import typer

from tuner.cli.common import DbOption, settings_with
from tuner.errors import TunerError

__all__ = ["serve"]


def serve(
    host: Annotated[str, typer.Option("--host", help="address to listen on")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="port to listen on")] = 8000,
    db: DbOption = None,
) -> None:
    """Serve the stored best configs over HTTP (the API the client asks)."""
    import uvicorn

    if not 0 < port < 65536:
        raise TunerError(f"--port must be 1..65535, but got {port}", "e.g. --port 8000")
    settings = settings_with(db)
    from api.main import create_app

    app = create_app(settings)
    uvicorn.run(app, host=host, port=port, log_level=settings.log_level.lower())
