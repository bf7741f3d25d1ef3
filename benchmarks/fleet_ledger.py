"""What a fleet run left in its database, read from the tables themselves (benchmarks/fleet.py).

Duplicates: every config a worker measured is told to its Optuna study with the user
attribute ``source = "measured"`` and ``result.config_key`` (``tuner.tuning.search.loop``); a study
is one device x template version x shape bucket. Two such trials of one study with one config key
are one config measured twice: the measurement the fleet must never make. (``tuning_trials``
cannot show it: its unique key keeps the first row and drops the second.) Re-measurements of
finalists beyond ``final_repeats`` per trial are duplicates too.

Lost: a measured config told to its study without a ``tuning_trials`` row of that study and
config key was measured and not stored.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any

import sqlalchemy as sa

from db.models import Demand, Remeasurement, Trial
from db.session import session_scope

__all__ = ["Ledger", "QueueState", "read_ledger", "read_queue"]


@dataclass(frozen=True)
class QueueState:
    statuses: dict[str, int]  # demand status -> rows ("expired": claimed, lease passed)
    holders: dict[int, str]  # demand id -> worker, of the rows claimed now

    @property
    def settled(self) -> bool:
        """Nothing open or claimed: every row done or failed."""
        return all(s in ("done", "failed") for s, n in self.statuses.items() if n)

    @property
    def finished(self) -> int:
        return self.statuses.get("done", 0) + self.statuses.get("failed", 0)


def read_queue(db_url: str) -> QueueState:
    from db.demand import demand_status

    with session_scope(db_url, write=False) as s:
        rows = list(s.scalars(sa.select(Demand)))
    statuses = Counter(demand_status(r) for r in rows)
    return QueueState(dict(statuses), {r.id: r.worker for r in rows
                                       if r.status.value == "claimed"})


@dataclass
class Ledger:
    problems: int
    done: int
    failed: int
    not_finished: dict[str, int]  # stuck: open, claimed or expired at the end
    taken_over: list[int]  # demand ids claimed more than once
    measured: int  # configs measured (Optuna trials with source "measured")
    stored_trials: int  # rows of tuning_trials
    duplicate_measurements: list[dict[str, Any]]  # study, config key, times measured
    excess_remeasurements: list[dict[str, int]]  # trial id, re-measurements, wanted
    measured_not_stored: list[dict[str, str]]  # study, config key
    first_claim: datetime | None
    last_finish: datetime | None
    finished_by: dict[int, str] = field(default_factory=dict)  # demand id -> worker

    def summary(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("finished_by")
        for key in ("first_claim", "last_finish"):
            out[key] = out[key].isoformat() if out[key] else None
        out["duplicates"] = (sum(d["times"] - 1 for d in self.duplicate_measurements)
                             + sum(e["remeasurements"] - e["wanted"]
                                   for e in self.excess_remeasurements))
        return out


def read_ledger(db_url: str, *, final_repeats: int) -> Ledger:
    with session_scope(db_url, write=False) as s:
        rows = list(s.scalars(sa.select(Demand)))
        attrs = s.execute(sa.text(
            "SELECT s.study_name, t.trial_id, a.key, a.value_json FROM trial_user_attributes a "
            "JOIN trials t ON t.trial_id = a.trial_id JOIN studies s ON s.study_id = t.study_id "
            "WHERE a.key IN ('source', 'result')")).all()
        stored = set(s.execute(sa.select(Trial.optuna_study, Trial.config_key)).all())
        stored_count = s.scalar(sa.select(sa.func.count()).select_from(Trial)) or 0
        remeasured = s.execute(
            sa.select(Remeasurement.trial_id, sa.func.count())
            .group_by(Remeasurement.trial_id)
            .having(sa.func.count() > final_repeats)).all()
    by_trial: dict[int, dict[str, Any]] = {}
    for study, trial_id, key, value in attrs:
        by_trial.setdefault(trial_id, {"study": study})[key] = json.loads(value)
    measured = Counter((t["study"], t["result"]["config_key"]) for t in by_trial.values()
                       if t.get("source") == "measured" and "result" in t)
    from db.demand import demand_status

    statuses = Counter(demand_status(r) for r in rows)
    claims = [r.claimed_at for r in rows if r.claimed_at is not None]
    finishes = [r.finished_at for r in rows if r.finished_at is not None]
    return Ledger(
        problems=len(rows), done=statuses.pop("done", 0), failed=statuses.pop("failed", 0),
        not_finished=dict(statuses),
        taken_over=sorted(r.id for r in rows if r.attempts > 1),
        measured=sum(measured.values()), stored_trials=stored_count,
        duplicate_measurements=[{"study": st, "config_key": k, "times": n}
                                for (st, k), n in sorted(measured.items()) if n > 1],
        excess_remeasurements=[{"trial_id": t, "remeasurements": n, "wanted": final_repeats}
                               for t, n in remeasured],
        measured_not_stored=[{"study": st, "config_key": k} for st, k in sorted(measured)
                             if (st, k) not in stored],
        # Claims restart their clock on a take-over: the first of them is a lower bound.
        first_claim=min(claims, default=None), last_finish=max(finishes, default=None),
        finished_by={r.id: r.worker for r in rows if r.status.value in ("done", "failed")})


def trials_by_worker(db_url: str) -> Counter[str]:
    """Stored trials per worker (``host:pid:...`` as the sweep names them, cut to host:pid)."""
    with session_scope(db_url, write=False) as s:
        workers = s.scalars(sa.select(Trial.worker)).all()
    return Counter(":".join(w.split(":")[:2]) for w in workers)
