"""First-request costs of the routes that hostile and ordinary clients write to, paid at
start-up instead of by the reads beside the first such request.

The first request to a route does work no later one does: FastAPI (0.165 at least) builds the
route's validation models and reads its endpoint's source file for error context (it stats
the file), and SQLAlchemy configures the ORM's mappers at the first session that uses them.
Under the hostile mix (2-core VM, 2026-11-29; a thread sampling the event loop's stack) the
first ``POST /v1/results`` (a client without a token, or the first upload) held the loop 26 ms
building the route and 73 ms in the stat of its endpoint's file, and while the ORM set-up ran
in the upload's thread the loop was late by 10-24 ms several times: every read meanwhile
waited. With this warm-up none of them showed in the same run.

``warm_up`` sends one request per route below through the app itself, in-process (no socket),
from the client address ``WARM_UP_CLIENT``: without a token and without a body, so each is
refused (401, or 503 without ``TUNER_TOKEN``) or answered 422, and nothing is stored.

``warm_store`` starts the process that stores uploads (api/store_process.py) and pays its
first upload's costs in it (template source hashes, the ORM, the engine): seconds of imports,
before the service answers rather than beside its first upload.
"""

from __future__ import annotations

import logging

from sqlalchemy.orm import configure_mappers
from starlette.types import ASGIApp, Message

from api.store_process import StoreProcess, registered_template_modules
from tuner.settings import Settings

__all__ = ["WARM_UP_CLIENT", "WARM_UP_REQUESTS", "warm_store", "warm_up"]

log = logging.getLogger("api")

WARM_UP_CLIENT = ("warm-up", 0)
WARM_UP_REQUESTS = (("POST", "/v1/results"), ("POST", "/v1/demand"), ("GET", "/v1/best"))


async def warm_up(app: ASGIApp) -> dict[str, int]:
    """Each of ``WARM_UP_REQUESTS`` answered once by ``app``: its status, by "METHOD path".

    A failure is logged and the service starts all the same (it then pays the costs later)."""
    configure_mappers()
    statuses: dict[str, int] = {}
    for method, path in WARM_UP_REQUESTS:
        try:
            statuses[f"{method} {path}"] = await _request(app, method, path)
        except Exception as exc:  # noqa: BLE001 (a warm-up must not stop the service)
            log.warning("warming up %s %s failed: %s: %s", method, path,
                        type(exc).__name__, exc)
    return statuses


async def _request(app: ASGIApp, method: str, path: str) -> int:
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
             "http_version": "1.1", "method": method, "scheme": "http", "path": path,
             "raw_path": path.encode(), "root_path": "", "query_string": b"",
             "headers": [(b"host", b"warm-up"), (b"content-length", b"0")],
             "client": WARM_UP_CLIENT, "server": WARM_UP_CLIENT, "state": {}}
    status: list[int] = []

    async def receive() -> Message:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Message) -> None:
        if message["type"] == "http.response.start":
            status.append(message["status"])

    await app(scope, receive, send)
    return status[0]


async def warm_store(store: StoreProcess, settings: Settings) -> int | None:
    """The store process started and warmed: its pid (None: it failed, logged; the first
    upload then starts it)."""
    try:
        return await store.warm_up(settings.database_url, registered_template_modules())
    except Exception as exc:  # noqa: BLE001 (a warm-up must not stop the service)
        log.warning("warming up the upload store process failed: %s: %s",
                    type(exc).__name__, exc)
        return None
