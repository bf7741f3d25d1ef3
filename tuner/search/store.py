"""Where a search keeps its measurements: the project database, or memory for replays.

The store is the measurement cache: a config with a stored result is never run again, by
this worker or any other, in this sweep or a later one (the trial row is unique per device x
template version x problem key x config).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from db.models import TrialStatus
from templates.base import KernelConfig, Problem
from tuner.runner.outcome import TrialOutcome

__all__ = ["DbStore", "MemoryStore", "ResultStore", "StoredBest", "StoredResult", "TrialRecord"]


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
class StoredBest:
    config: dict[str, Any]
    tflops: float
    median_ms: float
    default_tflops: float | None
    speedup: float | None


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


class ResultStore(Protocol):
    def known(self, problem_key: str) -> dict[str, StoredResult]:
        """Every stored result of ``problem_key``, by config key."""

    def find(self, problem_key: str, config_key: str) -> StoredResult | None: ...

    def record(self, record: TrialRecord) -> StoredBest | None:
        """Store one trial (a second record of a config keeps the first) and refresh the
        problem's best config, in one transaction; returns the best after it."""

    def best(self, problem_key: str) -> StoredBest | None: ...


def _result(row: Any) -> StoredResult:
    return StoredResult(config_key=row.config_key, config=dict(row.config),
                        status=TrialStatus(row.status), reason=row.reason or "",
                        tflops=row.tflops, median_ms=row.median_ms, compile_s=row.compile_s,
                        error=row.error, is_default=bool(row.is_default))


def _best(row: Any) -> StoredBest | None:
    if row is None:
        return None
    return StoredBest(config=dict(row.config), tflops=row.tflops, median_ms=row.median_ms,
                      default_tflops=row.default_tflops, speedup=row.speedup)


class DbStore:
    """Results of one device and template version in the project database."""

    def __init__(self, url: str, *, device: Mapping[str, Any], template_name: str,
                 template_version: str, space: dict[str, Any], sweep_id: int | None = None,
                 worker: str = "") -> None:
        from db import crud
        from db.session import run_in_transaction

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
        from db import crud
        from db.session import session_scope

        with session_scope(self.url, write=False) as s:
            rows = crud.trials_for(s, device_id=self.device_id, template_id=self.template_id,
                                   problem_key=problem_key)
            return {row.config_key: _result(row) for row in rows}

    def find(self, problem_key: str, config_key: str) -> StoredResult | None:
        from db import crud
        from db.session import session_scope

        with session_scope(self.url, write=False) as s:
            row = crud.find_trial(s, device_id=self.device_id, template_id=self.template_id,
                                  problem_key=problem_key, config_key=config_key)
            return _result(row) if row is not None else None

    def record(self, record: TrialRecord) -> StoredBest | None:
        from db import crud
        from db.session import run_in_transaction

        outcome = record.outcome

        def write(s: Any) -> StoredBest | None:
            crud.record_trial(
                s, device_id=self.device_id, template_id=self.template_id,
                problem_key=record.problem_key, problem=record.problem.to_dict(),
                config_key=record.config.key(), config=record.config.to_dict(),
                status=outcome.status, reason=outcome.reason, median_ms=outcome.median_ms,
                tflops=outcome.tflops, compile_s=outcome.compile_s, error=outcome.error,
                is_default=record.is_default, sweep_id=self.sweep_id,
                optuna_study=record.study, optuna_trial=record.trial_number,
                worker=self.worker)
            return _best(crud.refresh_best(s, device_id=self.device_id,
                                           template_id=self.template_id,
                                           problem_key=record.problem_key))

        return run_in_transaction(self.url, write)

    def best(self, problem_key: str) -> StoredBest | None:
        from sqlalchemy import select

        from db.models import BestConfig
        from db.session import session_scope

        with session_scope(self.url, write=False) as s:
            row = s.scalars(select(BestConfig).filter_by(
                device_id=self.device_id, template_id=self.template_id,
                problem_key=problem_key)).one_or_none()
            return _best(row)


class MemoryStore:
    """The same contract in memory (replays, tests of the search logic)."""

    def __init__(self) -> None:
        self._rows: dict[str, dict[str, StoredResult]] = {}
        self._lock = threading.Lock()

    def known(self, problem_key: str) -> dict[str, StoredResult]:
        with self._lock:
            return dict(self._rows.get(problem_key, {}))

    def find(self, problem_key: str, config_key: str) -> StoredResult | None:
        with self._lock:
            return self._rows.get(problem_key, {}).get(config_key)

    def record(self, record: TrialRecord) -> StoredBest | None:
        o = record.outcome
        result = StoredResult(config_key=record.config.key(), config=record.config.to_dict(),
                              status=o.status, reason=o.reason, tflops=o.tflops,
                              median_ms=o.median_ms, compile_s=o.compile_s, error=o.error,
                              is_default=record.is_default)
        with self._lock:
            self._rows.setdefault(record.problem_key, {}).setdefault(result.config_key, result)
        return self.best(record.problem_key)

    def best(self, problem_key: str) -> StoredBest | None:
        rows = self.known(problem_key).values()
        ok = [r for r in rows if r.status == TrialStatus.OK and r.tflops and r.median_ms]
        if not ok:
            return None
        top = max(ok, key=lambda r: (r.tflops or 0.0))
        default = next((r.tflops for r in ok if r.is_default), None)
        assert top.tflops is not None and top.median_ms is not None
        return StoredBest(config=top.config, tflops=top.tflops, median_ms=top.median_ms,
                          default_tflops=default,
                          speedup=top.tflops / default if default else None)
