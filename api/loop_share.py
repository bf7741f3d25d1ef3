"""Work on the event loop in short slices, one request's work at a time, so that reads keep
being answered beside it.

Everything a route does between two ``await`` points runs on the event loop and holds back
every other request of the process, reads included. A demand report is such work: its items
are checked and counted in memory, ~10 us each (~25 us for a problem seen the first time), so
a report of 50 items holds the loop for 0.5-2 ms. Reports arriving together (a job's ranks
report at about the same time; ``benchmarks/api_load.py --demand-clients 8`` sends its 8
clients' reports within a few ms of each other) ran back to back: 8 reports held the loop for
10-15 ms once a second, and every read arriving meanwhile waited for all of them; that was the
reads' p99 of 11-12 ms beside 10,000 reports/s, against 2.4-3.2 ms alone (notes/serving_performance.md).

``LoopShare.turn()`` lets one request's work run at a time, in arrival order, and
``Slices.pause()`` gives the loop back once ``slice_s`` of work has run since the last time:
a read then waits for a slice or two, not for every report that came in with it. The work of
the reports is the same; it is spread out instead of taken at once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

__all__ = ["SLICE_S", "LoopShare", "Slices"]

# The most work run without giving the loop back: about a read's own time on the loop
# (~0.3-0.7 ms on the 2-core VM), so a read waits for a slice or two at most.
SLICE_S = 0.0005


class Slices:
    """Marks the time since the loop was last given back; ``pause`` gives it back when due."""

    def __init__(self, slice_s: float = SLICE_S) -> None:
        self.slice_s = slice_s
        self.pauses = 0
        self._since = time.perf_counter()

    async def pause(self) -> None:
        """Give the loop back (one round of other tasks and of the sockets) if ``slice_s``
        has run since the last time; else nothing, at the cost of reading the clock."""
        if time.perf_counter() - self._since >= self.slice_s:
            await asyncio.sleep(0)
            self.pauses += 1
            self._since = time.perf_counter()


class LoopShare:
    """One holder of a turn at a time, in arrival order (``asyncio.Lock`` is fair)."""

    def __init__(self, slice_s: float = SLICE_S) -> None:
        if slice_s <= 0:
            raise ValueError(f"slice_s must be > 0, but got {slice_s}")
        self.slice_s = slice_s
        self._lock: asyncio.Lock | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @asynccontextmanager
    async def turn(self) -> AsyncIterator[Slices]:
        """Wait for the turn; the work inside paces itself with the ``Slices`` given."""
        loop = asyncio.get_running_loop()
        if self._lock is None or self._loop is not loop:
            # A lock serves the loop it first waited on; a test client runs each of its
            # portals on a loop of its own, and one app may outlive several.
            self._lock, self._loop = asyncio.Lock(), loop
        async with self._lock:
            yield Slices(self.slice_s)
