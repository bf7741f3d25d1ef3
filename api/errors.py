"""Error answers: every failure is JSON that says what was wrong, and bad input is never a 500."""

from __future__ import annotations

import logging

from fastapi import FastAPI, HTTPException, Request, status
from fastapi.responses import JSONResponse
from sqlalchemy.exc import OperationalError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.answers import AmbiguousDevice

log = logging.getLogger("api")


class BodyTooLarge(HTTPException):
    # An HTTPException, so FastAPI's body parsing passes it on instead of answering 400.
    def __init__(self, limit: int) -> None:
        super().__init__(413,
                         detail=f"request body larger than the limit of {limit} bytes "
                                "(TUNER_MAX_BODY_BYTES)")


class BodySizeLimit:
    """Rejects request bodies over ``max_bytes``: by Content-Length at once, else while reading."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            await self._reject(send)
            return
        seen = 0
        started = False

        async def counting_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:  # chunked uploads carry no Content-Length
                    raise BodyTooLarge(self.max_bytes)
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except BodyTooLarge:
            if not started:
                await self._reject(send)

    async def _reject(self, send: Send) -> None:
        response = JSONResponse({"detail": BodyTooLarge(self.max_bytes).detail},
                                status_code=413)
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
