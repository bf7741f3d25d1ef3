"""Dependencies of the routes: settings, database sessions, the write-token check."""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import Depends, HTTPException, Request, Security, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session

from api.answers import BestCache
from db.session import get_sessionmaker
from templates.base import Template
from templates.registry import all_templates, get_template
from tuner.settings import Settings, SettingsError


# The small dependencies are `async def`: FastAPI runs a plain `def` dependency in its thread
# pool, and each such hop cost ~0.3 ms per request under load (benchmarks/api_load.py).
async def get_app_settings(request: Request) -> Settings:
    return request.app.state.settings  # type: ignore[no-any-return]


SettingsDep = Annotated[Settings, Depends(get_app_settings)]


async def get_session(settings: SettingsDep) -> AsyncIterator[Session]:
    """A read-only session (it never takes SQLite's write lock); writes use run_in_transaction.

    Creating it does not connect (the first query does, in the endpoint's worker thread);
    closing it returns a pooled connection, which does not block either.
    """
    with get_sessionmaker(settings.database_url, write=False)() as session:
        yield session


SessionDep = Annotated[Session, Depends(get_session)]


async def get_best_cache(request: Request) -> BestCache:
    return request.app.state.best_cache  # type: ignore[no-any-return]


BestCacheDep = Annotated[BestCache, Depends(get_best_cache)]


# Declares the bearer scheme in OpenAPI (and /docs' Authorize button) for the operations that
# need it; the header is checked below, by hand, for the service's own 401/403/503 answers.
bearer_scheme = HTTPBearer(auto_error=False, scheme_name="bearer",
                           description="TUNER_TOKEN of the service; needed for writes")


# A refused write's body is never read. After the answer the server would still receive and
# discard the rest of it; for a large (or unannounced) body, closing the connection stops that
# (at the cost that a client still sending may see a reset instead of the answer). A small one
# is received whole: its sender then reads the answer reliably.
DRAIN_AT_MOST = 64 * 1024


def refusal_headers(request: Request) -> dict[str, str]:
    declared = request.headers.get("content-length", "")
    small = declared.isdigit() and int(declared) <= DRAIN_AT_MOST
    return {} if small else {"Connection": "close"}


def client_address(request: Request) -> str:
    """The address the per-client limits count (behind a proxy, see api/rate_limit.py)."""
    return request.client.host if request.client else "unknown"


async def require_write_token(
    request: Request, settings: SettingsDep,
    _documented: Annotated[HTTPAuthorizationCredentials | None, Security(bearer_scheme)],
) -> None:
    """Writes need ``Authorization: Bearer <TUNER_TOKEN>``; without a configured token, none pass.

    Only headers are read: a route that writes takes no body parameter, so this runs before
    its body is received, and a refused request is answered without reading it (issue 19).
    """
    try:
        expected = settings.require_write_token()
    except SettingsError as exc:
        raise HTTPException(status.HTTP_503_SERVICE_UNAVAILABLE,
                            detail=f"writes are disabled on this service: {exc}",
                            headers=refusal_headers(request)) from None
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        await _slow_down_refusals(request)
        raise HTTPException(status.HTTP_401_UNAUTHORIZED,
                            detail="this endpoint needs the header 'Authorization: Bearer <token>'",
                            headers={"WWW-Authenticate": "Bearer", **refusal_headers(request)})
    # Constant time: the comparison must not reveal how many leading characters matched.
    if not hmac.compare_digest(given.strip().encode(), expected.encode()):
        await _slow_down_refusals(request)
        raise HTTPException(status.HTTP_403_FORBIDDEN, detail="the bearer token is not valid",
                            headers=refusal_headers(request))


# Longest a refusal is held back, and how many may be held at once (each holds a connection;
# past that, refusals are answered at once, so a flood cannot pin the server's sockets).
MAX_REFUSAL_DELAY_S = 1.0
MAX_HELD_REFUSALS = 256
_hold = asyncio.sleep  # (tests record the holds instead of waiting)


async def _slow_down_refusals(request: Request) -> None:
    """Hold back a refused write from an address past its refusal rate
    (TUNER_REFUSED_WRITE_RATE): the refusals of one address line up at that rate (each held
    at most MAX_REFUSAL_DELAY_S), so clients retrying without a valid token are answered at
    that pace, not as fast as they can reconnect. Refused at once, 16 clients sending 8 MB bodies
    came back ~230 times a second, each refusal ~0.6 ms of the service's CPU, and pushed the
    reads' p99 on two cores from ~4 to ~20 ms (notes/serving_performance.md). Waiting costs no CPU."""
    state = request.app.state
    address = client_address(request)
    if state.held_refusals >= MAX_HELD_REFUSALS:
        return
    wait = state.refusal_limiter.queue(address, MAX_REFUSAL_DELAY_S)
    if wait <= 0:
        return
    state.held_refusals += 1
    try:
        await _hold(wait)
    finally:
        state.held_refusals -= 1


WriteAuth = Depends(require_write_token)


def template_or_404(name: str) -> Template:
    try:
        return get_template(name)
    except ValueError:
        known = [t.name for t in all_templates()]
        raise HTTPException(status.HTTP_404_NOT_FOUND,
                            detail=f"unknown template {name!r}; known: {known}") from None
