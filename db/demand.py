"""Reads and writes of the demand queue (``db.models.Demand``): counts from jobs, claims of
workers. Keyword-only functions taking a Session first; they flush but never commit (the
caller owns the transaction, as in ``db.crud``).

A claim must be taken in a write transaction (``db.session.run_in_transaction``): on
PostgreSQL the candidate row is locked with ``FOR UPDATE SKIP LOCKED``, so workers claiming at
once each get a different row without waiting for one another; on SQLite the write
transaction begins with ``BEGIN IMMEDIATE`` (``db.session``), which serializes the claims of
every process on the file (SQLite has no row locks, and SQLAlchemy leaves ``FOR UPDATE`` out
there).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import ColumnElement, Select, and_, false, func, or_, select, tuple_, update
from sqlalchemy.orm import Session

from db.crud import dialect_insert
from db.models import Demand, DemandStatus, utcnow

__all__ = [
    "EXPIRED",
    "BucketKey",
    "DemandCount",
    "add_demand",
    "claim_demand",
    "count_demand",
    "count_open",
    "demand_status",
    "finish_demand",
    "held_claim",
    "list_demand",
    "release_demand",
    "renew_demand_claim",
    "stored_buckets",
]

# A claimed row whose lease has passed: stored as "claimed", shown (and claimable) as this.
EXPIRED = "expired"
SHOWN_STATUSES = (*(s.value for s in DemandStatus), EXPIRED)


BucketKey = tuple[str, str, str, str]  # device key, template, template version, problem key


@dataclass(frozen=True)
class DemandCount:
    """Reports of one shape bucket, to add to its row (created with ``problem`` if new)."""

    device_key: str
    template: str
    template_version: str
    problem_key: str
    problem: dict[str, Any]
    reports: int

    @property
    def bucket(self) -> BucketKey:
        return (self.device_key, self.template, self.template_version, self.problem_key)


def add_demand(s: Session, *, counts: Sequence[DemandCount], now: datetime | None = None,
               max_open: int | None = None) -> list[DemandCount]:
    """Add ``counts`` to their rows, creating the missing ones, in one statement.

    With ``max_open``, rows are created only while fewer than ``max_open`` rows are open
    (waiting for a worker): counts of existing rows are always added, those of new buckets
    beyond the cap are returned, not stored (the most reported new ones are stored first).
    On SQLite the write transaction serializes this exactly; on PostgreSQL two service
    processes storing at once may each see room for the same last rows, so the cap can be
    passed by what one store of each other process adds (a second's new buckets)."""
    refused: list[DemandCount] = []
    if max_open is not None and counts:
        open_now = count_open(s)
        if open_now + len(counts) > max_open:  # some may be new beyond the cap: which?
            stored = stored_buckets(s, keys=[c.bucket for c in counts])
            new = sorted((c for c in counts if c.bucket not in stored),
                         key=lambda c: -c.reports)
            refused = new[max(0, max_open - open_now):]
            if refused:
                dropped = {c.bucket for c in refused}
                counts = [c for c in counts if c.bucket not in dropped]
    if not counts:
        return refused
    now = now or utcnow()
    # Sorted by key: two service processes flushing at once lock rows in the same order
    # (PostgreSQL), so they queue instead of deadlocking.
    rows = [{"device_key": c.device_key, "template": c.template,
             "template_version": c.template_version, "problem_key": c.problem_key,
             "problem": c.problem, "reports": c.reports, "status": DemandStatus.OPEN.value,
             "worker": "", "attempts": 0, "note": "", "first_seen": now, "last_seen": now}
            for c in sorted(counts, key=lambda c: c.bucket)]
    stmt = dialect_insert(s, Demand)
    stmt = stmt.on_conflict_do_update(
        index_elements=["device_key", "template", "template_version", "problem_key"],
        set_={"reports": Demand.reports + stmt.excluded.reports,
              "last_seen": stmt.excluded.last_seen})
    s.connection().execute(stmt, rows)  # Core executemany
    return refused


def count_open(s: Session) -> int:
    """Rows waiting for a worker (open): what ``add_demand``'s ``max_open`` caps."""
    return int(s.scalar(select(func.count(Demand.id)).where(
        Demand.status == DemandStatus.OPEN)) or 0)


# Keys per query: 4 bound parameters each, far below SQLite's 32,766 and PostgreSQL's 65,535.
_KEYS_PER_QUERY = 500


def stored_buckets(s: Session, *, keys: Sequence[BucketKey]) -> set[BucketKey]:
    """Which of ``keys`` have a row, whatever its status."""
    columns = (Demand.device_key, Demand.template, Demand.template_version, Demand.problem_key)
    found: set[BucketKey] = set()
    unique = sorted(set(keys))
    for start in range(0, len(unique), _KEYS_PER_QUERY):
        chunk = unique[start:start + _KEYS_PER_QUERY]
        found.update((a, b, c, d) for a, b, c, d in s.execute(
            select(*columns).where(tuple_(*columns).in_(chunk))))
    return found


def _of_templates(versions: Mapping[str, str]) -> ColumnElement[bool]:
    """Rows of these (template, version) pairs: what a worker's own code can tune."""
    pairs = [and_(Demand.template == name, Demand.template_version == version)
             for name, version in sorted(versions.items())]
    return or_(*pairs) if pairs else false()


def _utc(value: datetime | None) -> datetime | None:
    # SQLite hands times back without their offset; they are stored as UTC (models.utcnow).
    return value.replace(tzinfo=UTC) if value is not None and value.tzinfo is None else value


def claim_demand(s: Session, *, device_key: str, versions: Mapping[str, str], worker: str,
                 lease_s: float, max_attempts: int, now: datetime | None = None
                 ) -> Demand | None:
    """Claim for ``worker`` the most reported row of ``device_key`` whose template is at the
    version ``versions`` names: an open one, or one whose worker's lease has passed (it died,
    or stopped renewing). None when there is none. Rows already claimed ``max_attempts`` times
    whose lease passed are given up first (failed, with a note): a problem that kills every
    worker must not take them all, one after another, for ever."""
    if lease_s <= 0 or max_attempts < 1:
        raise ValueError(f"lease_s must be > 0 and max_attempts >= 1, but got {lease_s} and "
                         f"{max_attempts}")
    now = now or utcnow()
    mine = (Demand.device_key == device_key, _of_templates(versions))
    lapsed = and_(Demand.status == DemandStatus.CLAIMED, Demand.lease_until < now)
    s.execute(update(Demand).where(*mine, lapsed, Demand.attempts >= max_attempts).values(
        status=DemandStatus.FAILED, finished_at=now, lease_until=None,
        note=f"given up: claimed {max_attempts} times, and each worker stopped renewing its "
             "lease (killed, or lost the database) before it finished"))
    row = s.scalars(
        select(Demand).where(*mine, or_(Demand.status == DemandStatus.OPEN, lapsed),
                             Demand.attempts < max_attempts)
        .order_by(Demand.reports.desc(), Demand.id).limit(1)
        .with_for_update(skip_locked=True)).first()
    if row is None:
        return None
    row.status = DemandStatus.CLAIMED
    row.worker = worker
    row.claimed_at = now
    row.lease_until = now + timedelta(seconds=lease_s)
    row.attempts += 1
    row.note = ""
    s.flush()
    return row


def held_claim(s: Session, *, device_key: str, worker: str, now: datetime | None = None
               ) -> Demand | None:
    """The row of ``device_key`` that ``worker`` holds a live claim on, if any: a worker asking
    to claim again while it holds one lost the answer to its claim (a retried request), and
    gets the row it holds instead of a second one."""
    return s.scalars(select(Demand).where(
        Demand.device_key == device_key, Demand.worker == worker,
        Demand.status == DemandStatus.CLAIMED, Demand.lease_until >= (now or utcnow()))
        .order_by(Demand.id).limit(1)).first()


def renew_demand_claim(s: Session, *, demand_id: int, worker: str, lease_s: float) -> bool:
    """Extend ``worker``'s lease on its claim; False when the claim is no longer its own."""
    result = s.execute(update(Demand).where(
        Demand.id == demand_id, Demand.worker == worker, Demand.status == DemandStatus.CLAIMED)
        .values(lease_until=utcnow() + timedelta(seconds=lease_s)))
    return bool(result.rowcount)  # type: ignore[attr-defined]


def finish_demand(s: Session, *, demand_id: int, worker: str, status: DemandStatus,
                  note: str) -> bool:
    """Mark ``worker``'s claim done or failed; False when the claim is no longer its own
    (its lease passed and another worker took the row over: that one finishes it)."""
    if status not in (DemandStatus.DONE, DemandStatus.FAILED):
        raise ValueError(f"a claim finishes as done or failed, not {status.value!r}")
    result = s.execute(update(Demand).where(
        Demand.id == demand_id, Demand.worker == worker, Demand.status == DemandStatus.CLAIMED)
        .values(status=status, finished_at=utcnow(), lease_until=None, note=note))
    return bool(result.rowcount)  # type: ignore[attr-defined]


def release_demand(s: Session, *, demand_id: int, worker: str, note: str) -> bool:
    """Give ``worker``'s claim back, open, as if never taken (a worker stopped on request:
    the next one starts on it at once and the claim does not count as an attempt)."""
    result = s.execute(update(Demand).where(
        Demand.id == demand_id, Demand.worker == worker, Demand.status == DemandStatus.CLAIMED)
        .values(status=DemandStatus.OPEN, worker="", claimed_at=None, lease_until=None,
                attempts=Demand.attempts - 1, note=note))
    return bool(result.rowcount)  # type: ignore[attr-defined]


def demand_status(row: Demand, now: datetime | None = None) -> str:
    """The row's status as people read it: a claim whose lease has passed is ``expired``."""
    lease = _utc(row.lease_until)
    if row.status == DemandStatus.CLAIMED and lease is not None and lease < (now or utcnow()):
        return EXPIRED
    return DemandStatus(row.status).value


def _filtered(query: Select[Any], *, device: str | None, template: str | None,
              status: str | None, now: datetime) -> Select[Any]:
    if device is not None:
        query = query.where(Demand.device_key == device)
    if template is not None:
        query = query.where(Demand.template == template)
    if status is None:
        return query
    if status not in SHOWN_STATUSES:
        raise ValueError(f"status must be one of {list(SHOWN_STATUSES)}, but got {status!r}")
    if status == EXPIRED:
        return query.where(Demand.status == DemandStatus.CLAIMED, Demand.lease_until < now)
    if status == DemandStatus.CLAIMED.value:
        return query.where(Demand.status == DemandStatus.CLAIMED, Demand.lease_until >= now)
    return query.where(Demand.status == DemandStatus(status))


def list_demand(s: Session, *, device: str | None = None, template: str | None = None,
                status: str | None = None, offset: int = 0, limit: int = 100,
                now: datetime | None = None) -> list[Demand]:
    """The queue, most reported first (``status`` as ``demand_status`` shows it)."""
    query = _filtered(select(Demand), device=device, template=template, status=status,
                      now=now or utcnow())
    return list(s.scalars(query.order_by(Demand.reports.desc(), Demand.id)
                          .offset(offset).limit(limit)))


def count_demand(s: Session, *, device: str | None = None, template: str | None = None,
                 status: str | None = None, now: datetime | None = None) -> int:
    query = _filtered(select(func.count(Demand.id)), device=device, template=template,
                      status=status, now=now or utcnow())
    return int(s.scalar(query) or 0)
