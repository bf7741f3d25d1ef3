"""Error answers: every failure is JSON that says what was wrong, and bad input is never a 500."""

from __future__ import annotations

import logging
from collections.abc import Mapping

from fastapi import FastAPI, HTTPException, Request, status
from fastapi.responses import JSONResponse
from sqlalchemy.exc import OperationalError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.answers import AmbiguousDevice
from api.store_process import StoreProcessDied

log = logging.getLogger("api")


class BodyTooLarge(HTTPException):
    # An HTTPException, so FastAPI's body parsing passes it on instead of answering 400.
    def __init__(self, limit: int, which: str = "TUNER_MAX_BODY_BYTES") -> None:
        super().__init__(413,
                         detail=f"request body larger than the limit of {limit} bytes "
                                f"({which})")


class BodySizeLimit:
    """Rejects request bodies over ``max_bytes``: by Content-Length at once, else while reading.

    ``path_limits`` sets smaller limits for some paths (path -> bytes), such as the demand
    reports that jobs send without a token."""

    def __init__(self, app: ASGIApp, max_bytes: int,
                 path_limits: Mapping[str, int] | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.path_limits = dict(path_limits or {})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path_limit = self.path_limits.get(scope["path"])
        limit, which = ((path_limit, f"set for {scope['path']}")
                        if path_limit is not None and path_limit < self.max_bytes
                        else (self.max_bytes, "TUNER_MAX_BODY_BYTES"))
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            await _reject(send, limit, which)
            return
        seen = 0
        started = False

        async def counting_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:  # chunked uploads carry no Content-Length
                    raise BodyTooLarge(limit, which)
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except BodyTooLarge:
            if not started:
                await _reject(send, limit, which)


async def _reject(send: Send, limit: int, which: str) -> None:
    response = JSONResponse({"detail": BodyTooLarge(limit, which).detail}, status_code=413)
    await response({"type": "http"}, _no_receive, send)


async def _no_receive() -> Message:
    return {"type": "http.disconnect"}


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(AmbiguousDevice)
    async def ambiguous_device(_request: Request, exc: AmbiguousDevice) -> JSONResponse:
        return JSONResponse({"detail": {"reason": str(exc), "candidates": exc.candidates}},
                            status_code=422)

    @app.exception_handler(OperationalError)
    async def database_unavailable(_request: Request, exc: OperationalError) -> JSONResponse:
        log.error("database error: %s", exc)
        return JSONResponse({"detail": "the database is unavailable; try again later"},
                            status_code=status.HTTP_503_SERVICE_UNAVAILABLE)

    @app.exception_handler(StoreProcessDied)
    async def store_process_died(_request: Request, exc: StoreProcessDied) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, headers={"Retry-After": "1"},
                            status_code=status.HTTP_503_SERVICE_UNAVAILABLE)
