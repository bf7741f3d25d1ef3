"""Which changes of the best configs the service's own store process made (SQLite), so that
its readers need not wait for a re-check that the upload's own refresh does anyway.

``BestCache`` (api/answers.py) takes a move of the ``best_changes`` counter (db.models) as
"another process changed the database": every entry is re-checked before it answers again, and
the reads in that window wait for the re-check queries. After an upload through this service
that wait is needless: the upload refreshes what it changed before it is acknowledged
(``BestCache.refresh``), and until then no client has been told it is stored. Under the hostile
mix (2-core VM, 2026-11-29) those waits were 3-6 reads per upload at 3-9 ms in the service,
once the upload itself no longer stalled the loop (api/store_process.py): the reads' tail.

So the store process publishes, in shared memory and *before* each transaction commits, the
range of counter values its transactions produce: the value when its write transaction began
(it holds SQLite's write lock from then on, so no one else moves the counter) to the value
before its commit, chained over consecutive transactions of its own. A move of the counter
inside that range is the service's own; any other move (a sweep, another worker of the
service, an import) is re-checked as before.

Where it could be wrong, it errs towards a re-check: a range is published only for the
database it was written to, a torn read (the two numbers half-written) is not a range, and a
transaction that rolls back withdraws it. What it cannot see: a store process that dies
between publishing and committing (its transaction rolls back) leaves its range until the
service notices the death (milliseconds; ``StoreProcess`` then withdraws it); a commit by
another process landing inside that range in those milliseconds would be answered from the
cache, stale, until the cache's ttl re-check.
"""

from __future__ import annotations

import zlib
from multiprocessing.context import BaseContext
from typing import Any

from sqlalchemy import Engine, event
from sqlalchemy.engine import Connection

from db.session import SQLITE_BEGIN_OPTION

__all__ = ["OwnWrites", "database_tag", "track_own_writes"]

_SEQ, _TAG, _FIRST, _LAST = range(4)  # the cells; _SEQ is odd while a range is being written
NONE = -1
COUNTER_QUERY = "SELECT changes FROM best_changes WHERE id = 1"


def database_tag(database_url: str) -> int:
    """A number naming the database, for shared memory (not a secret, only a label)."""
    return zlib.crc32(database_url.encode())


class OwnWrites:
    """The published range of ``best_changes`` values (a sequence lock over four cells of
    shared memory: one writer, the store process; readers, the service's event loop)."""

    def __init__(self, context: BaseContext) -> None:
        self._cells: Any = context.Array("q", [0, NONE, NONE, NONE], lock=False)

    def publish(self, database_url: str, first: int, last: int) -> None:
        cells = self._cells
        cells[_SEQ] += 1
        cells[_TAG], cells[_FIRST], cells[_LAST] = database_tag(database_url), first, last
        cells[_SEQ] += 1

    def withdraw(self) -> None:
        self.publish("", NONE, NONE)

    def owns(self, database_url: str, seen: int, now: int) -> bool:
        """Whether every move of the counter from ``seen`` to ``now`` was the store process's."""
        cells = self._cells
        seq = cells[_SEQ]
        tag, first, last = cells[_TAG], cells[_FIRST], cells[_LAST]
        if seq % 2 or cells[_SEQ] != seq or first == NONE:
            return False
        return tag == database_tag(database_url) and first <= seen <= now <= last


def track_own_writes(engine: Engine, database_url: str, own: OwnWrites) -> None:
    """(In the store process.) Publish the counter range of every write transaction of
    ``engine`` before it commits; withdraw it when one rolls back."""
    chain = {"first": NONE, "last": NONE, "began": NONE}

    def is_write(connection: Connection) -> bool:
        return connection.get_execution_options().get(SQLITE_BEGIN_OPTION) == "IMMEDIATE"

    def counter(connection: Connection) -> int:
        return int(connection.exec_driver_sql(COUNTER_QUERY).scalar_one())

    def began(connection: Connection) -> None:  # after db.session's BEGIN IMMEDIATE
        chain["began"] = counter(connection) if is_write(connection) else NONE

    def committing(connection: Connection) -> None:
        if chain["began"] == NONE:
            return
        last = counter(connection)
        if chain["last"] != chain["began"]:  # someone wrote since our last commit: a new chain
            chain["first"] = chain["began"]
        chain["last"], chain["began"] = last, NONE
        own.publish(database_url, chain["first"], last)

    def rolled_back(_connection: Connection) -> None:
        if chain["began"] == NONE:  # not a write transaction of ours
            return
        own.withdraw()
        chain.update(first=NONE, last=NONE, began=NONE)

    event.listen(engine, "begin", began)
    event.listen(engine, "commit", committing)
    event.listen(engine, "rollback", rolled_back)
