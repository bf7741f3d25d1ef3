"""How the service learns, cheaply and at once, that another process changed the database.

The best-answer cache (``api.answers.BestCache``) reads ``count()`` at every lookup; a count
that moved means "re-check before answering", so the first answer after a sweep (which writes
the database directly, not through the service) or an upload to another worker of the
service is not a stale one (issue 18, item 5).

* SQLite: ``PRAGMA data_version`` on one read-only connection of this process. It moves when
  any other connection commits, and is read from the WAL index without a lock: ~6 us, cheap
  enough for every lookup. When it moved, the count is read from the ``best_changes`` row
  (``db.models.BestChanges``), which triggers move only when best configs, devices or
  templates change: a commit of anything else (demand counts, stored once a second; a
  worker's claim) is not a change to the cache. A commit that returned before a lookup began
  is always seen. A database without those triggers: every commit counts, as before.
* PostgreSQL: ``LISTEN`` on the channel that ``db.crud.refresh_bests`` notifies in every
  transaction that changes a best config; a thread of the service waits for notifications and
  counts them. A notification arrives a few milliseconds after its commit, so a lookup in
  those milliseconds may still be answered from the cache; a lost connection counts as a
  change (notifications may have been missed meanwhile) and is reopened.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
from pathlib import Path
from typing import Protocol

from sqlalchemy.engine import make_url

from db.crud import BEST_CHANGES_CHANNEL
from db.models import BEST_CHANGES_TRIGGERS

__all__ = ["Changes", "watch_changes"]

log = logging.getLogger("api")

RECONNECT_S = 1.0
WAIT_S = 0.5  # how often the listener looks up from waiting (to notice close())


class Changes(Protocol):
    def count(self) -> int:
        """A number that moves whenever the database changed (compare with the last one)."""
        ...

    @property
    def counts_best_changes(self) -> bool:
        """Whether ``count`` is the ``best_changes`` counter (db.models.BestChanges)."""
        ...

    def close(self) -> None: ...


def watch_changes(database_url: str) -> Changes | None:
    """The change counter of ``database_url`` (None: a backend or a file it cannot watch)."""
    url = make_url(database_url)
    if url.get_backend_name() == "sqlite":
        path = url.database
        if not path or path == ":memory:" or path.startswith("file:"):
            return None
        return SqliteChanges(Path(path).expanduser().resolve())
    if url.get_backend_name() == "postgresql":
        return PostgresChanges(url.set(drivername="postgresql")
                               .render_as_string(hide_password=False))
    return None


class SqliteChanges:
    def __init__(self, path: Path) -> None:
        self._path = path
        self._lock = threading.Lock()
        self._last = 0
        self._version: int | None = None
        self._counted = False  # the database counts the changes the cache cares about
        self._connection: sqlite3.Connection | None = None

    def count(self) -> int:
        with self._lock:
            try:
                if self._connection is None:
                    self._connection = sqlite3.connect(f"file:{self._path}?mode=ro", uri=True,
                                                       check_same_thread=False)
                    self._counted = _has_best_changes(self._connection)
                version = int(self._connection.execute("PRAGMA data_version").fetchone()[0])
                if version != self._version:  # some connection committed: what changed?
                    self._version = version
                    self._last = _best_changes(self._connection) if self._counted else version
            except sqlite3.Error as exc:  # the ttl still bounds how stale an answer gets
                log.warning("cannot watch %s for changes: %s", self._path, exc)
            return self._last

    @property
    def counts_best_changes(self) -> bool:
        return self._counted

    def close(self) -> None:
        with self._lock:
            if self._connection is not None:
                self._connection.close()
                self._connection = None


def _has_best_changes(connection: sqlite3.Connection) -> bool:
    """Whether the triggers that count changes of best configs, devices and templates are all
    there (``db.models.BestChanges``); else every commit is taken as a change."""
    names = {name for (name,) in connection.execute(
        "SELECT name FROM sqlite_master WHERE type = 'trigger'").fetchall()}
    return set(BEST_CHANGES_TRIGGERS) <= names


def _best_changes(connection: sqlite3.Connection) -> int:
    (row,) = connection.execute("SELECT changes FROM best_changes WHERE id = 1").fetchall()
    return int(row[0])


class PostgresChanges:
    def __init__(self, conninfo: str) -> None:
        self._conninfo = conninfo
        self._count = 0
        self._stop = threading.Event()
        listening = threading.Event()
        self._thread = threading.Thread(target=self._listen, args=(listening,), daemon=True,
                                        name="tuner-best-changes")
        self._thread.start()
        # Listening before the first lookup relies on it (else the ttl bounds staleness).
        listening.wait(timeout=5.0)

    def count(self) -> int:
        return self._count

    @property
    def counts_best_changes(self) -> bool:
        return False  # notifications counted

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * WAIT_S + 1)

    def _listen(self, listening: threading.Event) -> None:
        import psycopg  # PostgreSQL only: SQLite services never start this listener

        while not self._stop.is_set():
            try:
                with psycopg.connect(self._conninfo, autocommit=True,
                                     connect_timeout=5) as connection:
                    connection.execute(f"LISTEN {BEST_CHANGES_CHANNEL}")
                    self._count += 1  # (re)connected: changes may have been missed meanwhile
                    listening.set()
                    while not self._stop.is_set():
                        for _ in connection.notifies(timeout=WAIT_S):
                            self._count += 1
            except psycopg.Error as exc:
                log.warning("listening for database changes failed (%s); retrying in %.0f s",
                            exc, RECONNECT_S)
                self._count += 1
                self._stop.wait(RECONNECT_S)
