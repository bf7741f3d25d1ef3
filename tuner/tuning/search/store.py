"""Where a search keeps its measurements: the project database, or memory for replays.

The store is the measurement cache: a config with a stored result is never run again, by
this worker or any other, in this sweep or a later one (the trial row is unique per device x
template version x problem key x config). The exception are the finalists, the few best
configs measured again at the end of a search: each re-measurement is stored beside the
trial, which keeps its first measurement, and the best is chosen by ``db.finalists``.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Protocol

from sqlalchemy import select

from db import crud
from db.finalists import Measured, choose_best
from db.models import BestConfig, TrialStatus
from db.session import run_in_transaction, session_scope
from templates.base import KernelConfig, Problem
from tuner.tuning.runner.outcome import TrialOutcome

__all__ = [
    "DbStore",
    "MemoryStore",
    "ProblemBest",
    "RemeasurementRecord",
    "ResultStore",
    "StoredRemeasurement",
    "StoredResult",
    "TrialRecord",
    "measured_configs",
]


@dataclass(frozen=True)
class StoredResult:
    config_key: str
    config: dict[str, Any]
    status: TrialStatus
    reason: str = ""
    tflops: float | None = None
    median_ms: float | None = None
    compile_s: float | None = None
    error: float | None = None
    is_default: bool = False

    @property
    def value(self) -> float:
        """What the study is told: TFLOP/s, 0 for a config that did not produce one."""
        return float(self.tflops) if self.status == TrialStatus.OK and self.tflops else 0.0


@dataclass(frozen=True)
class StoredRemeasurement:
    """One more measurement of a finalist (``db.models.Remeasurement``)."""

    status: TrialStatus
    reason: str = ""
    median_ms: float | None = None
    tflops: float | None = None

    @property
    def ok(self) -> bool:
        return self.status == TrialStatus.OK and bool(self.median_ms)


@dataclass(frozen=True)
class ProblemBest:
    """One problem's best config as a result store reports it to the search (memory or
    database); ``tuner.lookup.stored_bests.StoredBest`` is a best-config row as its readers read
    it."""

    config: dict[str, Any]
    tflops: float
    median_ms: float
    default_tflops: float | None
    speedup: float | None
    # Readings behind median_ms: the first and the finalist's re-measurements, or its latest
    # head-to-head's.
    runs: int = 1


@dataclass(frozen=True)
class TrialRecord:
    """One finished trial to store, with where it came from."""

    problem: Problem
    problem_key: str
    config: KernelConfig
    outcome: TrialOutcome
    is_default: bool
    study: str | None = None
    trial_number: int | None = None


@dataclass(frozen=True)
class RemeasurementRecord:
    """One re-measurement of a stored config (a finalist) to store."""

    problem_key: str
    config_key: str
    outcome: TrialOutcome
    claim: int | None = None  # the claim it was measured under, dropped as it is stored


# (claiming worker, last renewed, UTC) -> whether the claim is abandoned
StaleClaim = Callable[[str, datetime], bool]


class ResultStore(Protocol):
    def known(self, problem_key: str) -> dict[str, StoredResult]:
        """Every stored result of ``problem_key``, by config key."""

    def find(self, problem_key: str, config_key: str) -> StoredResult | None: ...

    def record(self, record: TrialRecord) -> ProblemBest | None:
        """Store one trial (a second record of a config keeps the first) and refresh the
        problem's best config, in one transaction; returns the best after it."""

    def best(self, problem_key: str) -> ProblemBest | None: ...

    def remeasurements(self, problem_key: str) -> dict[str, list[StoredRemeasurement]]:
        """Every re-measurement of ``problem_key``, by config key, oldest first."""

    def record_remeasurement(self, record: RemeasurementRecord) -> ProblemBest | None:
        """Store one re-measurement of a stored config (every one is kept) and refresh the
        problem's best config, in one transaction; returns the best after it."""

    def claim_remeasurement(self, problem_key: str, config_key: str, *, wanted: int,
                            worker: str, is_stale: StaleClaim) -> int | None:
        """Claim one more re-measurement of a stored config while its re-measurements and live
        claims are fewer than ``wanted`` (``db.crud.claim_remeasurement``); the claim, or
        None when it has enough."""

    def renew_claim(self, claim: int) -> bool:
        """Keep a claim alive while measuring; False when it was taken over."""

    def drop_claim(self, claim: int) -> None:
        """Give a claim up without storing a re-measurement (an interrupted one)."""


def measured_configs(known: Mapping[str, StoredResult],
                     remeasured: Mapping[str, list[StoredRemeasurement]]) -> list[Measured]:
    """The OK configs of a problem with their re-measurements, by config key, in the order they
    were stored (ties of ``db.finalists`` go to the earlier)."""
    measured: list[Measured] = []
    for order, (key, r) in enumerate(known.items()):
        if r.status != TrialStatus.OK or not r.tflops or not r.median_ms:
            continue
        again = remeasured.get(key, [])
        failed = next((f"{m.status.value}: {m.reason}" for m in again if not m.ok), None)
        measured.append(Measured(ref=key, order=order, first_ms=r.median_ms,
                                 first_tflops=r.tflops, is_default=r.is_default,
                                 remeasured_ms=tuple(m.median_ms for m in again
                                                     if m.ok and m.median_ms),
                                 failed=failed))
    return measured


def _not_stored(problem_key: str, config_key: str) -> LookupError:
    return LookupError(f"no stored trial of {config_key!r} for problem {problem_key!r}: only "
                       "stored configs are re-measured")


def _result(row: Any) -> StoredResult:
    return StoredResult(config_key=row.config_key, config=dict(row.config),
                        status=TrialStatus(row.status), reason=row.reason or "",
                        tflops=row.tflops, median_ms=row.median_ms, compile_s=row.compile_s,
                        error=row.error, is_default=bool(row.is_default))


def _best(row: Any, runs: int) -> ProblemBest | None:
    if row is None:
        return None
    return ProblemBest(config=dict(row.config), tflops=row.tflops, median_ms=row.median_ms,
                      default_tflops=row.default_tflops, speedup=row.speedup, runs=runs)


def _runs_of(s: Any, row: Any) -> int:
    """Readings behind a best config row's time (``db.crud.best_readings``): its trial's and
    the OK re-measurements, or those of its latest head-to-head."""
    if row is None:
        return 1
    return crud.best_readings(s, [row])[row.id].count


class DbStore:
    """Results of one device and template version in the project database."""

    def __init__(self, url: str, *, device: Mapping[str, Any], template_name: str,
                 template_version: str, space: dict[str, Any], sweep_id: int | None = None,
                 worker: str = "") -> None:
        self.url = url
        self.sweep_id = sweep_id
        self.worker = worker

        def ids(s: Any) -> tuple[int, int]:
            dev = crud.get_or_create_device(s, info=dict(device))
            tpl = crud.get_or_create_template(s, name=template_name, version=template_version,
                                              space=space)
            return dev.id, tpl.id

        self.device_id, self.template_id = run_in_transaction(url, ids)

    def known(self, problem_key: str) -> dict[str, StoredResult]:
        with session_scope(self.url, write=False) as s:
            rows = crud.trials_for(s, device_id=self.device_id, template_id=self.template_id,
                                   problem_key=problem_key)
            return {row.config_key: _result(row) for row in rows}

    def find(self, problem_key: str, config_key: str) -> StoredResult | None:
        with session_scope(self.url, write=False) as s:
            row = crud.find_trial(s, device_id=self.device_id, template_id=self.template_id,
                                  problem_key=problem_key, config_key=config_key)
            return _result(row) if row is not None else None

    def record(self, record: TrialRecord) -> ProblemBest | None:
        outcome = record.outcome

        def write(s: Any) -> ProblemBest | None:
            crud.record_trial(
                s, device_id=self.device_id, template_id=self.template_id,
                problem_key=record.problem_key, problem=record.problem.to_dict(),
                config_key=record.config.key(), config=record.config.to_dict(),
                status=outcome.status, reason=outcome.reason, median_ms=outcome.median_ms,
                tflops=outcome.tflops, compile_s=outcome.compile_s, error=outcome.error,
                is_default=record.is_default, sweep_id=self.sweep_id,
                optuna_study=record.study, optuna_trial=record.trial_number,
                worker=self.worker, phases=outcome.phase_record())
            row = crud.refresh_best(s, device_id=self.device_id, template_id=self.template_id,
                                    problem_key=record.problem_key)
            return _best(row, _runs_of(s, row))

        return run_in_transaction(self.url, write)

    def remeasurements(self, problem_key: str) -> dict[str, list[StoredRemeasurement]]:
        found: dict[str, list[StoredRemeasurement]] = {}
        with session_scope(self.url, write=False) as s:
            for key, row in crud.remeasurements_for(s, device_id=self.device_id,
                                                    template_id=self.template_id,
                                                    problem_key=problem_key):
                found.setdefault(key, []).append(StoredRemeasurement(
                    status=TrialStatus(row.status), reason=row.reason or "",
                    median_ms=row.median_ms, tflops=row.tflops))
        return found

    def record_remeasurement(self, record: RemeasurementRecord) -> ProblemBest | None:
        outcome = record.outcome

        def write(s: Any) -> ProblemBest | None:
            trial = crud.find_trial(s, device_id=self.device_id, template_id=self.template_id,
                                    problem_key=record.problem_key,
                                    config_key=record.config_key)
            if trial is None:
                raise _not_stored(record.problem_key, record.config_key)
            crud.record_remeasurement(
                s, trial_id=trial.id, status=outcome.status, reason=outcome.reason,
                median_ms=outcome.median_ms, tflops=outcome.tflops, error=outcome.error,
                sweep_id=self.sweep_id, worker=self.worker, phases=outcome.phase_record())
            if record.claim is not None:
                crud.drop_remeasurement_claim(s, claim_id=record.claim)
            row = crud.refresh_best(s, device_id=self.device_id, template_id=self.template_id,
                                    problem_key=record.problem_key)
            return _best(row, _runs_of(s, row))

        return run_in_transaction(self.url, write)

    def claim_remeasurement(self, problem_key: str, config_key: str, *, wanted: int,
                            worker: str, is_stale: StaleClaim) -> int | None:
        def claim(s: Any) -> int | None:
            trial = crud.find_trial(s, device_id=self.device_id, template_id=self.template_id,
                                    problem_key=problem_key, config_key=config_key)
            if trial is None:
                raise _not_stored(problem_key, config_key)
            return crud.claim_remeasurement(s, trial_id=trial.id, wanted=wanted, worker=worker,
                                            is_stale=is_stale)

        return run_in_transaction(self.url, claim)

    def renew_claim(self, claim: int) -> bool:
        return run_in_transaction(
            self.url, lambda s: crud.renew_remeasurement_claim(s, claim_id=claim))

    def drop_claim(self, claim: int) -> None:
        run_in_transaction(self.url, lambda s: crud.drop_remeasurement_claim(s, claim_id=claim))

    def best(self, problem_key: str) -> ProblemBest | None:
        with session_scope(self.url, write=False) as s:
            row = s.scalars(select(BestConfig).filter_by(
                device_id=self.device_id, template_id=self.template_id,
                problem_key=problem_key)).one_or_none()
            return _best(row, _runs_of(s, row))


class MemoryStore:
    """The same contract in memory (replays, tests of the search logic)."""

    def __init__(self) -> None:
        self._rows: dict[str, dict[str, StoredResult]] = {}
        self._again: dict[str, dict[str, list[StoredRemeasurement]]] = {}
        # claim id -> (problem key, config key, worker, last renewed)
        self._claims: dict[int, tuple[str, str, str, datetime]] = {}
        self._claim_ids = itertools.count(1)
        self._lock = threading.Lock()

    def known(self, problem_key: str) -> dict[str, StoredResult]:
        with self._lock:
            return dict(self._rows.get(problem_key, {}))

    def find(self, problem_key: str, config_key: str) -> StoredResult | None:
        with self._lock:
            return self._rows.get(problem_key, {}).get(config_key)

    def record(self, record: TrialRecord) -> ProblemBest | None:
        o = record.outcome
        result = StoredResult(config_key=record.config.key(), config=record.config.to_dict(),
                              status=o.status, reason=o.reason, tflops=o.tflops,
                              median_ms=o.median_ms, compile_s=o.compile_s, error=o.error,
                              is_default=record.is_default)
        with self._lock:
            self._rows.setdefault(record.problem_key, {}).setdefault(result.config_key, result)
        return self.best(record.problem_key)

    def remeasurements(self, problem_key: str) -> dict[str, list[StoredRemeasurement]]:
        with self._lock:
            return {key: list(runs) for key, runs in self._again.get(problem_key, {}).items()}

    def record_remeasurement(self, record: RemeasurementRecord) -> ProblemBest | None:
        o = record.outcome
        with self._lock:
            if record.config_key not in self._rows.get(record.problem_key, {}):
                raise _not_stored(record.problem_key, record.config_key)
            self._again.setdefault(record.problem_key, {}).setdefault(
                record.config_key, []).append(StoredRemeasurement(
                    status=o.status, reason=o.reason, median_ms=o.median_ms, tflops=o.tflops))
            if record.claim is not None:
                self._claims.pop(record.claim, None)
        return self.best(record.problem_key)

    def claim_remeasurement(self, problem_key: str, config_key: str, *, wanted: int,
                            worker: str, is_stale: StaleClaim) -> int | None:
        with self._lock:
            if config_key not in self._rows.get(problem_key, {}):
                raise _not_stored(problem_key, config_key)
            mine = {i: c for i, c in self._claims.items() if c[:2] == (problem_key, config_key)}
            for claim_id, (_, _, holder, beat_at) in mine.items():
                if is_stale(holder, beat_at):
                    del self._claims[claim_id]
            live = sum(1 for i in mine if i in self._claims)
            done = len(self._again.get(problem_key, {}).get(config_key, []))
            if done + live >= wanted:
                return None
            claim_id = next(self._claim_ids)
            self._claims[claim_id] = (problem_key, config_key, worker, datetime.now(UTC))
            return claim_id

    def renew_claim(self, claim: int) -> bool:
        with self._lock:
            if claim not in self._claims:
                return False
            self._claims[claim] = (*self._claims[claim][:3], datetime.now(UTC))
            return True

    def drop_claim(self, claim: int) -> None:
        with self._lock:
            self._claims.pop(claim, None)

    def best(self, problem_key: str) -> ProblemBest | None:
        known = self.known(problem_key)
        choice = choose_best(measured_configs(known, self.remeasurements(problem_key)))
        if choice is None:
            return None
        best, default = choice.best, choice.default
        return ProblemBest(config=known[str(best.ref)].config, tflops=best.tflops,
                          median_ms=best.median_ms,
                          default_tflops=default.tflops if default else None,
                          speedup=choice.speedup, runs=best.runs)
