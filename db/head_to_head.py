"""Reads and writes of head-to-head sessions (``db.models.HeadToHead``): the stored bests of a
problem's implementations measured side by side (``tuner.tuning.head_to_head``). Keyword-only
functions taking a Session first; they flush but never commit (``db.crud``'s rule).

Every reading is stored as it is measured; a session prices its candidates only once
``finish_head_to_head`` marks it done, in the transaction that refreshes their bests
(``db.crud.refresh_bests`` reads ``side_by_side``). Which readings price a trial: those of the
latest finished session it took part in (the highest id: ids grow as sessions start, on
SQLite and PostgreSQL alike). A failed reading disqualifies its trial in any session, finished
or not: a config that computed wrongly once is not served (``db.finalists``).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Select, select
from sqlalchemy.orm import Session

from db.finalists import SideBySide
from db.models import HeadToHead, HeadToHeadReading, TrialStatus, utcnow

__all__ = [
    "TrialSideBySide",
    "finish_head_to_head",
    "record_head_to_head_reading",
    "side_by_side",
    "side_by_side_of",
    "start_head_to_head",
]

# Trial ids per IN (...) list (as db.crud's _KEYS_CHUNK: far below every backend's limit).
_IDS_CHUNK = 500


@dataclass(frozen=True)
class TrialSideBySide:
    """What the head-to-heads say of one trial: its pricing readings and why it failed."""

    readings: SideBySide | None  # the latest finished session's OK readings
    failed: str | None  # a failed reading's status and reason (any session)


def start_head_to_head(s: Session, *, device_id: int, problem: dict, rounds: int,
                       sweep_id: int | None = None, worker: str = "") -> int:
    """A new, unfinished session; its id."""
    row = HeadToHead(device_id=device_id, sweep_id=sweep_id, problem=problem, rounds=rounds,
                     worker=worker, started_at=utcnow())
    s.add(row)
    s.flush()
    return row.id


def record_head_to_head_reading(s: Session, *, head_to_head_id: int, trial_id: int,
                                round: int, position: int, status: TrialStatus,
                                reason: str = "", median_ms: float | None = None,
                                tflops: float | None = None,
                                error: float | None = None,
                                phases: dict[str, Any] | None = None) -> None:
    s.add(HeadToHeadReading(head_to_head_id=head_to_head_id, trial_id=trial_id, round=round,
                            position=position, status=TrialStatus(status), reason=reason,
                            median_ms=median_ms, tflops=tflops, error=error, phases=phases,
                            created_at=utcnow()))
    s.flush()


def finish_head_to_head(s: Session, *, head_to_head_id: int, rounds: int | None = None) -> None:
    """Mark a session finished: from now on its readings price its candidates. ``rounds``:
    the rounds that ran, where a close call took more than the session started with."""
    row = s.get(HeadToHead, head_to_head_id)
    if row is None:
        raise LookupError(f"no head-to-head with id {head_to_head_id}")
    row.finished_at = utcnow()
    if rounds is not None:
        row.rounds = rounds
    s.flush()


def side_by_side(s: Session, *, trial_ids: Collection[int]) -> dict[int, TrialSideBySide]:
    """What the head-to-heads say of each of ``trial_ids`` that took part in one (others are
    absent): one query per ``_IDS_CHUNK`` trials."""
    ids = sorted(set(trial_ids))
    return _fold([row for start in range(0, len(ids), _IDS_CHUNK)
                  for row in s.execute(_readings().where(
                      HeadToHeadReading.trial_id.in_(ids[start:start + _IDS_CHUNK])))])


def side_by_side_of(s: Session, *, trials: Select[Any]) -> dict[int, TrialSideBySide]:
    """``side_by_side`` of the trials ``trials`` selects (a query of trial ids, such as every
    trial of one device and template version): one query, whatever their number."""
    return _fold(list(s.execute(_readings().where(HeadToHeadReading.trial_id.in_(trials)))))


def _readings() -> Select[*tuple[Any, ...]]:
    return (select(HeadToHeadReading.trial_id, HeadToHeadReading.head_to_head_id,
                   HeadToHead.finished_at, HeadToHeadReading.status, HeadToHeadReading.reason,
                   HeadToHeadReading.median_ms, HeadToHeadReading.tflops,
                   HeadToHeadReading.round)
            .join(HeadToHead, HeadToHeadReading.head_to_head_id == HeadToHead.id)
            .order_by(HeadToHeadReading.head_to_head_id, HeadToHeadReading.id))


def _fold(rows: Iterable[Any]) -> dict[int, TrialSideBySide]:
    """``_readings`` rows, in their order (sessions ascending), by trial."""
    # trial id -> (session id, [(ms, tflops, round)]) of its latest finished session so far
    latest: dict[int, tuple[int, list[tuple[float, float, int]]]] = {}
    failed: dict[int, str] = {}
    for trial_id, session, finished_at, status, reason, ms, tflops, round_ in rows:
        if TrialStatus(status) != TrialStatus.OK or not ms or not tflops:
            failed.setdefault(trial_id, f"{TrialStatus(status).value}: {reason} "
                                        f"(head-to-head {session})")
            continue
        if finished_at is None:
            continue
        current = latest.get(trial_id)
        if current is None or current[0] != session:  # sessions come in ascending order
            current = latest[trial_id] = (session, [])
        current[1].append((ms, tflops, round_))
    out: dict[int, TrialSideBySide] = {}
    for trial_id in latest.keys() | failed.keys():
        found = latest.get(trial_id)
        readings = None
        if found is not None:
            session, times = found
            readings = SideBySide(session=session, times_ms=tuple(t[0] for t in times),
                                  gflop=times[0][0] * times[0][1],
                                  rounds=tuple(t[2] for t in times))
        out[trial_id] = TrialSideBySide(readings, failed.get(trial_id))
    return out
