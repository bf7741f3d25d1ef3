"""Uploads parsed, checked and stored in a process of their own, beside the service's event loop.

Why a process and not a thread: an upload is Python work from end to end (parsing and checking
its items, SQLAlchemy building the rows: ~10-30 ms for 20 items, seconds for thousands). In a
worker thread it holds the GIL, and the event loop, which gives the GIL up at every wait for
its sockets and at each cache's change check (``PRAGMA data_version``), gets it back only when
the thread yields it: after up to the switch interval (5 ms), again and again for as long as
the upload runs. Under the hostile mix (benchmarks/api_hey.py, 2-core VM, 2026-11-29; a probe
of the loop's lag inside the service) each upload stalled the loop 8-18 ms, and every read
meanwhile waited (an H200 host measured the reads' p99 at 10.8 ms beside 1 upload/s, 0.7 ms
without it; issue 44). Parsing the body on
the loop instead, in 2 ms slices, held each read back up to a slice; the first upload's
template-source hashing (``Template.version``: stats and reads of the kernels' files) once
held it 40-150 ms.

So the service's loop only receives the body and hands the bytes over; ``store_body`` runs in
one child process (a ``ProcessPoolExecutor`` of one worker), one upload at a time, and answers
with the summary or the reason a bundle was refused. The child is a fresh interpreter
(``spawn``): forking the serving process, whose threads may hold locks, is unsafe. It imports
what the service imports (torch with the templates): ~290 MB proportional set size more per
service process (2-core VM; a fork server that forks the child would make it ~330 MB, two
processes, for restarts in milliseconds instead of seconds), and ~2 s of imports, paid before
serving (``api.warm_up``) and again at a restart after a death. The child runs at
``STORE_NICENESS``: where it shares a core with the event loop, the loop preempts it.

What the service promises stays as it was:

* an upload is answered 201 only once ``store_body`` returned, i.e. after its transactions
  committed: an upload acknowledged is stored;
* a child that dies (killed, out of memory) fails the uploads it held, and the next call
  starts a new one; each such upload is stored once more in the new child (storing a bundle
  again keeps what is stored and completes the rest: ``tuner.lookup.bundle.store_bundle_in_batches``),
  and a second death is answered 503 (``StoreProcessDied``), never 201; every death is logged;
* readers see a change when its transaction commits, as with a thread (an upload of more
  than ``tuner.lookup.bundle.STORE_BATCH_ITEMS`` items commits in batches, as before).
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import multiprocessing
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any

from sqlalchemy.orm import configure_mappers
from starlette.concurrency import run_in_threadpool

from api.own_writes import OwnWrites, track_own_writes
from db.session import dispose_engine, init_db
from templates.registry import all_templates
from tuner.lookup.bundle import (
    BundleError,
    BundleTextError,
    StoreSummary,
    drain,
    read_bundle,
    store_bundle_in_batches,
)

__all__ = ["StoreOutcome", "StoreProcess", "StoreProcessDied", "registered_template_modules",
           "store_body"]

log = logging.getLogger("api")

# Tries of one upload: the first child, and one new child if that one died under it.
ATTEMPTS = 2
# How often the child checks that the service process is still there.
PARENT_CHECK_S = 0.5
# The child's niceness (Unix): where it shares a core with the event loop, the loop (nice 0)
# preempts it as soon as a request arrives, instead of waiting out its time slice.
STORE_NICENESS = 10


@dataclass(frozen=True)
class StoreOutcome:
    """What the child answers: the summary of what it stored, or why nothing was stored
    (the HTTP status and detail the route answers with)."""

    summary: StoreSummary | None = None
    refused_status: int | None = None
    refused_detail: Any = None


class StoreProcessDied(RuntimeError):
    """The store process died under an upload twice running: nothing acknowledged."""


_last_url: list[str] = []  # (the child's) database whose engine it keeps open
_own: list[OwnWrites] = []  # (the child's) where it publishes its own writes


def store_body(database_url: str, body: bytes, template_modules: Sequence[str]) -> StoreOutcome:
    """(In the child.) ``body`` parsed, checked and stored; a refused bundle stores nothing."""
    _prepare(database_url, template_modules)
    try:
        read = drain(read_bundle(body))
    except BundleTextError as exc:
        return StoreOutcome(refused_status=400, refused_detail=exc.reason)
    except BundleError as exc:
        return StoreOutcome(refused_status=422,
                            refused_detail={"index": exc.index, "reason": exc.reason})
    return StoreOutcome(summary=store_bundle_in_batches(database_url, read.items,
                                                        host=read.bundle.host))


def warm(database_url: str, template_modules: Sequence[str]) -> int:
    """(In the child.) Pay the first upload's one-time costs now: the templates' modules and
    source hashes, the ORM's set-up, the database's engine. Returns the child's pid."""
    _prepare(database_url, template_modules)
    for template in all_templates():
        template.version()
    configure_mappers()
    return multiprocessing.current_process().pid or 0


def registered_template_modules() -> list[str]:
    """The modules of every template registered in this (the serving) process: the child
    imports them, so it checks uploads against the same templates, however they came to be
    registered (``TUNER_TEMPLATE_MODULES``, or an import by the program embedding the
    service)."""
    return sorted({type(template).__module__ for template in all_templates()})


def _prepare(database_url: str, template_modules: Sequence[str]) -> None:
    for module in template_modules:  # the service imported them: they register templates
        importlib.import_module(module)
    if _last_url and _last_url[0] != database_url:
        # One database per service; tests give each app its own: keep one engine open at most.
        dispose_engine(_last_url.pop())
    if not _last_url:
        engine = init_db(database_url)
        if engine.dialect.name == "sqlite" and _own:
            track_own_writes(engine, database_url, _own[0])
        _last_url.append(database_url)


def _start_child(niceness: int, own: OwnWrites, parent: int) -> None:
    """(In the child, at its start.) Uploads give way to reads on a shared core; the child
    publishes the changes it makes (api/own_writes.py) and ends with the service."""
    if hasattr(os, "nice"):
        os.nice(niceness)
    _own.append(own)
    threading.Thread(target=_exit_with, args=(parent,), daemon=True,
                     name="tuner-store-parent").start()


def _exit_with(parent: int) -> None:
    """End this process once ``parent`` has: a service process that ends without shutting
    its executor down (a uvicorn worker ends with os._exit; a kill) would leave the child
    waiting forever on a queue whose write end it holds itself (seen: ``--workers 2``
    stopped, both children left running). Not prctl's parent-death signal: that follows the
    thread that started the child, and thread-pool threads come and go."""
    while os.getppid() == parent:
        time.sleep(PARENT_CHECK_S)
    os._exit(0)


class StoreProcess:
    """One child process that stores uploads, one at a time, restarted when it dies.

    ``target`` (a module-level function, run in the child) is ``store_body`` but in tests."""

    def __init__(self, target: Callable[..., Any] = store_body) -> None:
        self.target = target
        self.deaths = 0  # children that died under a call (each logged)
        self._context = multiprocessing.get_context("spawn")
        self.own = OwnWrites(self._context)  # what its children wrote (api/own_writes.py)
        self._pool: ProcessPoolExecutor | None = None
        self._lock = threading.Lock()  # calls come from the loops and threads of this process

    async def store(self, database_url: str, body: bytes,
                    template_modules: Sequence[str]) -> StoreOutcome:
        try:
            return await self.call(self.target, database_url, body, list(template_modules))  # type: ignore[no-any-return]
        except BaseException:
            # Whatever it published may not have committed: readers re-check instead.
            self.own.withdraw()
            raise

    async def warm_up(self, database_url: str, template_modules: Sequence[str]) -> int:
        """Start the child and warm it; its pid."""
        return await self.call(warm, database_url, list(template_modules))  # type: ignore[no-any-return]

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` in the child; once more in a new child if the child died under it."""
        for attempt in range(1, ATTEMPTS + 1):
            pool = self._current()
            try:
                # Submitted from a thread: starting a child (the first call, or after a death)
                # forks and execs a new interpreter (milliseconds the event loop need not wait).
                future = await run_in_threadpool(pool.submit, fn, *args)
                return await asyncio.wrap_future(future)
            except BrokenProcessPool as exc:
                self._replace(pool)
                log.error("the upload store process died (%s); %s", exc,
                          "storing again in a new one" if attempt < ATTEMPTS
                          else "the upload is answered 503")
        raise StoreProcessDied(f"the process that stores uploads died {ATTEMPTS} times under "
                               "this upload; nothing of it is acknowledged (what was stored is "
                               "kept): send it again")

    def close(self) -> None:
        """Let the child finish what it holds, then stop it."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    def _current(self) -> ProcessPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ProcessPoolExecutor(max_workers=1, mp_context=self._context,
                                                 initializer=_start_child,
                                                 initargs=(STORE_NICENESS, self.own,
                                                           os.getpid()))
            return self._pool

    def _replace(self, broken: ProcessPoolExecutor) -> None:
        with self._lock:
            if self._pool is broken:  # not replaced already by another call that saw it die
                self._pool = None
                self.deaths += 1
                self.own.withdraw()  # its last range may not have committed
        broken.shutdown(wait=False)


_shared: list[StoreProcess] = []
_shared_lock = threading.Lock()


def shared_store() -> StoreProcess:
    """This process's store process (one per service process: its apps share it)."""
    with _shared_lock:
        if not _shared:
            _shared.append(StoreProcess())
        return _shared[0]
