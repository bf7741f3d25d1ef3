"""Serialized ``GET /v1/best`` answers kept by query string, while what they came from holds.

A fleet asks the same few shapes over and over (every rank of every job). Building an answer
(validating the query, matching, building and serializing the model) was ~60 % of a read's
time on the service's event loop (cProfile of the app under load, 2026-11-29), and it gives the
same bytes as long as the cache entries it read are the same objects: ``BestCache`` replaces
its catalog or a device's parsed bests with a new object only when the database changed them
(a re-check that finds nothing new keeps the old one). So an answer is kept with the objects
it was computed from, and served again only while the cache still hands out exactly those.

The route (``api.routes.best``) computes, validates and documents every answer and keeps
it here; ``ServeKeptAnswers``, a middleware in front of the app, answers a request whose
query string has a kept answer still valid, before FastAPI's routing, dependency resolution
and query parsing (together ~50 % of what remained of a read's time once answers were kept:
cProfile, 2026-11-29). Anything else (a miss, an answer no longer valid, an error while
checking) goes to the app as before.

Only answers for stored devices are kept: made-up device keys (a client's typo, a hostile
flood) would otherwise push the fleet's answers out. Bounded (least recently used first out).
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from dataclasses import dataclass

from starlette.types import ASGIApp, Receive, Scope, Send

from api.answers import BestCache, Catalog, ParsedBests
from templates.base import Template

__all__ = ["PATH", "AnswerMemo", "KeptAnswer", "ServeKeptAnswers"]

PATH = "/v1/best"


@dataclass(frozen=True)
class KeptAnswer:
    """An answer's JSON and the cache entries it was computed from, weakly referenced: a kept
    answer never keeps an entry the cache has replaced alive (it could pin one generation of a
    device's parsed bests per kept answer), and one whose entry is gone is simply not valid."""

    body: bytes
    catalog: weakref.ref[Catalog]
    template: Template
    version: str
    device_key: str
    bests: weakref.ref[ParsedBests] | None  # None: nothing stored for the version (catalog alone)

    @classmethod
    def of(cls, body: bytes, catalog: Catalog, template: Template, version: str,
           device_key: str, bests: ParsedBests | None) -> KeptAnswer:
        return cls(body, weakref.ref(catalog), template, version, device_key,
                   None if bests is None else weakref.ref(bests))


class AnswerMemo:
    def __init__(self, max_entries: int = 4096) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, but got {max_entries}")
        self.max_entries = max_entries
        self._kept: OrderedDict[bytes, KeptAnswer] = OrderedDict()

    def __len__(self) -> int:
        return len(self._kept)

    async def get(self, query: bytes, cache: BestCache) -> bytes | None:
        """The kept answer to ``query`` if the cache still holds what it was computed from.

        Asking the cache is what any lookup does first (a change of the database is noticed
        here too, and a stale entry is re-checked before it answers)."""
        kept = self._kept.get(query)
        if kept is None:
            return None
        if await cache.catalog() is kept.catalog() and (
                kept.bests is None
                or await cache.bests(kept.template, kept.version, kept.device_key)
                is kept.bests()):
            self._kept.move_to_end(query)
            return kept.body
        del self._kept[query]
        return None

    def put(self, query: bytes, answer: KeptAnswer) -> None:
        self._kept[query] = answer
        self._kept.move_to_end(query)
        while len(self._kept) > self.max_entries:
            self._kept.popitem(last=False)


class ServeKeptAnswers:
    """Answers ``GET /v1/best`` from the app's ``answer_memo`` where it holds a valid answer,
    as the route would (same status, body and headers); passes every other request on.

    The memo and the cache are the app's (``app.state``) at each request, as the route's are."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "GET" and scope["path"] == PATH:
            state = scope["app"].state
            try:
                body = await state.answer_memo.get(scope["query_string"], state.best_cache)
            except Exception:  # e.g. the database is down: the route answers it as usual
                body = None
            if body is not None:
                await send({"type": "http.response.start", "status": 200,
                            "headers": [(b"content-length", str(len(body)).encode()),
                                        (b"content-type", b"application/json")]})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)
