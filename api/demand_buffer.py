"""Demand reports counted in the service's memory and stored in batches.

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
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from starlette.concurrency import run_in_threadpool

from api.demand_check import DemandBucket
from db.demand import DemandCount, add_demand
from db.session import run_in_transaction

__all__ = ["FLUSH_AFTER_S", "MAX_BUCKETS", "DemandBuffer"]

log = logging.getLogger("api")

FLUSH_AFTER_S = 1.0
MAX_BUCKETS = 20_000  # a few MB; far more distinct buckets than a fleet runs in a second


class DemandBuffer:
    def __init__(self, database_url: str, *, flush_after_s: float = FLUSH_AFTER_S,
                 max_buckets: int = MAX_BUCKETS) -> None:
        self.database_url = database_url
        self.flush_after_s = flush_after_s
        self.max_buckets = max_buckets
        self.dropped = 0  # reports not counted since the process started: the buffer was full
        self._counts: dict[DemandBucket, int] = {}
        self._problems: dict[DemandBucket, dict[str, Any]] = {}
        self._storing = asyncio.Lock()
        self._timer: asyncio.Task[None] | None = None

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
            rows = [DemandCount(b.device_key, b.template, b.template_version, b.problem_key,
                                problems[b], n) for b, n in counts.items()]
            try:
                await run_in_threadpool(run_in_transaction, self.database_url,
                                        lambda s: add_demand(s, counts=rows))
            except Exception as exc:  # database down or locked for long: keep the counts
                log.warning("could not store %d demand bucket(s) (%s: %s); trying again in "
                            "%g s", len(rows), type(exc).__name__, exc, self.flush_after_s)
                for bucket, n in counts.items():
                    self.add(bucket, problems[bucket], n)
                self.store_soon()

    async def _store_later(self) -> None:
        await asyncio.sleep(self.flush_after_s)
        self._timer = None
        await self.flush()
