"""Demand reports counted in the service's memory and stored in batches, within a cap on the
problems waiting to be tuned.

Every accepted report is added to a count per shape bucket here, on the event loop (a dict
update), and the counts are stored (``db.demand.add_demand``, one statement) at most
``flush_after_s`` after the first one arrived, in a worker thread. So the database sees one
short write transaction a second per service process, however many reports come in: on
SQLite that is one short hold of the write lock that sweeps and uploads also need, and reads
never wait on it. ``GET /v1/demand`` stores what is held before it answers.

Memory is bounded: at most ``max_buckets`` buckets wait to be stored; reports of a new bucket
beyond that are dropped and counted (the answer says how many), until the next store. Counts
held when the process stops are stored by the app's shutdown (``api.main``); a process killed
outright loses at most the last second of counts: they are counts of how often a problem ran,
not results.

The table is bounded too: reports need no token, and many client addresses could each stay
under the rate limit and still add rows without end. At most ``max_pending`` rows may wait for
a worker (open: ``TUNER_DEMAND_MAX_PENDING``). ``refused_for_cap`` tells the route which new
buckets of a report no longer fit, before they are counted, so their senders are told; buckets
that have a row already (open, claimed, done or failed) always have their counts added. It
answers from what it knows while there is room for every new bucket (no query: the open rows
at the last store, plus the new buckets held since); near the cap it asks the database which
of them have rows, and how many rows are open. The store enforces the cap again
(``add_demand(max_open=...)``), for what this process cannot see: other service processes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

from starlette.concurrency import run_in_threadpool

from api.demand_check import DemandBucket
from db.demand import DemandCount, add_demand, count_open, stored_buckets
from db.session import run_in_transaction, session_scope
from tuner.settings import DEFAULT_DEMAND_MAX_PENDING

__all__ = ["FLUSH_AFTER_S", "MAX_BUCKETS", "MAX_PENDING", "DemandBuffer"]

log = logging.getLogger("api")

FLUSH_AFTER_S = 1.0
MAX_BUCKETS = 20_000  # a few MB; far more distinct buckets than a fleet runs in a second
MAX_PENDING = DEFAULT_DEMAND_MAX_PENDING  # open rows (TUNER_DEMAND_MAX_PENDING)
# Buckets remembered as having a row (their reports are never refused): a few MB at most.
MAX_KNOWN = 100_000
# How old the count of open rows may be when the queue is near its cap: workers claiming rows
# make room, and a count per refused report would let a flood cost a query each.
RECOUNT_AFTER_S = 1.0


class DemandBuffer:
    def __init__(self, database_url: str, *, flush_after_s: float = FLUSH_AFTER_S,
                 max_buckets: int = MAX_BUCKETS, max_pending: int = MAX_PENDING,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, but got {max_pending}")
        self.database_url = database_url
        self.flush_after_s = flush_after_s
        self.max_buckets = max_buckets
        self.max_pending = max_pending
        self.dropped = 0  # reports not counted since the process started: the buffer was full
        self.over_cap = 0  # reports of new buckets not counted: max_pending rows were open
        self._clock = clock
        self._counts: dict[DemandBucket, int] = {}
        self._problems: dict[DemandBucket, dict[str, Any]] = {}
        self._storing = asyncio.Lock()
        self._timer: asyncio.Task[None] | None = None
        # The room left: open rows at the last count, less the buckets let in since that may
        # be new rows (held, or being stored). Buckets known to have a row take none.
        self._open: int | None = None
        self._counted_at = float("-inf")
        self._let_in: set[DemandBucket] = set()
        self._in_store: set[DemandBucket] = set()
        self._known: set[DemandBucket] = set()

    @property
    def held(self) -> int:
        """Buckets counted and not stored yet."""
        return len(self._counts)

    def add(self, bucket: DemandBucket, problem: dict[str, Any], count: int) -> bool:
        """Count ``count`` reports of ``bucket``; False (dropped) when the buffer is full.
        Called on the event loop, which owns the buffer: no lock needed. ``store_soon``
        then stores them."""
        held = self._counts.get(bucket)
        if held is not None:
            self._counts[bucket] = held + count
        elif len(self._counts) < self.max_buckets:
            self._counts[bucket] = count
            self._problems[bucket] = problem
        else:
            self.dropped += count
            return False
        return True

    # -- the cap ------------------------------------------------------------------------------
    def _room(self) -> int:
        assert self._open is not None
        return self.max_pending - self._open - len(self._let_in | self._in_store)

    async def refused_for_cap(self, buckets: Iterable[DemandBucket]) -> set[DemandBucket]:
        """Which of ``buckets`` (about to be ``add``-ed) are new rows the queue has no room
        for; the others are let in, first come first (and take room until they are stored)."""
        fresh = self._unknown(buckets)
        if not fresh:
            return set()
        if self._open is None or self._room() < len(fresh):
            await self._recheck(set(fresh))  # near the cap: which are new, how many are open
            # What other reports let in or counted meanwhile has taken its room already.
            fresh = self._unknown(fresh)
            if self._open is None:  # the database could not say: the store checks the cap
                self._let_in.update(fresh)
                return set()
        room = max(0, self._room())
        self._let_in.update(fresh[:room])
        return set(fresh[room:])

    def _unknown(self, buckets: Iterable[DemandBucket]) -> list[DemandBucket]:
        """``buckets`` that are neither held, let in, nor known to have a row; in order."""
        return list(dict.fromkeys(b for b in buckets if b not in self._counts
                                  and b not in self._let_in and b not in self._known))

    async def _recheck(self, fresh: set[DemandBucket]) -> None:
        recount = self._open is None or self._clock() - self._counted_at >= RECOUNT_AFTER_S

        def read() -> tuple[set[tuple[str, str, str, str]], int | None]:
            with session_scope(self.database_url, write=False) as s:
                stored = stored_buckets(s, keys=[_key(b) for b in fresh])
                return stored, count_open(s) if recount else None

        async with self._storing:  # not while a store is under way: its rows not yet counted
            started = self._clock()
            try:
                stored, open_rows = await run_in_threadpool(read)
            except Exception as exc:  # database away: answered from what is known
                log.warning("could not check the demand queue's room (%s: %s)",
                            type(exc).__name__, exc)
                return
        self._remember(b for b in fresh if _key(b) in stored)
        if open_rows is not None:
            self._open, self._counted_at = open_rows, started

    def _remember(self, buckets: Iterable[DemandBucket]) -> None:
        for bucket in buckets:
            if len(self._known) >= MAX_KNOWN:
                self._known.clear()  # forgotten at once: they are asked again when near the cap
            self._known.add(bucket)

    # -- storing ------------------------------------------------------------------------------
    def store_soon(self) -> None:
        """Store what is held within ``flush_after_s`` (a timer on the running event loop,
        started unless one runs)."""
        timer = self._timer
        loop = asyncio.get_running_loop()
        # A timer of another event loop never fires here (a test client runs each of its
        # portals on a loop of its own): start one on this loop.
        if self._counts and (timer is None or timer.done() or timer.get_loop() is not loop):
            self._timer = loop.create_task(self._store_later())

    async def flush(self) -> None:
        """Store every count held now (the next flush takes what arrives meanwhile)."""
        async with self._storing:
            counts, problems = self._counts, self._problems
            if not counts:
                return
            self._counts, self._problems = {}, {}
            self._in_store, self._let_in = self._let_in, set()
            rows = [DemandCount(b.device_key, b.template, b.template_version, b.problem_key,
                                problems[b], n) for b, n in counts.items()]

            def store(s: Any) -> tuple[list[DemandCount], int]:
                refused = add_demand(s, counts=rows, max_open=self.max_pending)
                return refused, count_open(s)

            try:
                started = self._clock()
                refused, open_rows = await run_in_threadpool(
                    run_in_transaction, self.database_url, store)
            except Exception as exc:  # database down or locked for long: keep the counts
                log.warning("could not store %d demand bucket(s) (%s: %s); trying again in "
                            "%g s", len(rows), type(exc).__name__, exc, self.flush_after_s)
                self._let_in |= self._in_store
                self._in_store = set()
                for bucket, n in counts.items():
                    self.add(bucket, problems[bucket], n)
                self.store_soon()
                return
            self._in_store = set()
            self._open, self._counted_at = open_rows, started
            not_stored = {c.bucket for c in refused}
            self._remember(b for b in counts if _key(b) not in not_stored)
            if refused:  # let in here, but another process filled the queue meanwhile
                self.over_cap += sum(c.reports for c in refused)
                log.warning("demand queue full (%d open, TUNER_DEMAND_MAX_PENDING): %d new "
                            "bucket(s) not stored", self.max_pending, len(refused))

    async def _store_later(self) -> None:
        await asyncio.sleep(self.flush_after_s)
        self._timer = None
        await self.flush()


def _key(bucket: DemandBucket) -> tuple[str, str, str, str]:
    return (bucket.device_key, bucket.template, bucket.template_version, bucket.problem_key)
