"""Stored best configs as their readers read them, detached from their database session: one
read model of a best-config row for the service's answers (``api.answers``), the
implementations' comparison (``tuner.dispatch.comparison``), verification (``tuner.tuning.verify``)
and the transfer prior (``tuner.tuning.search.prior``), parsed once per row."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy.orm import Session

from db import crud
from db.finalists import Readings
from templates.base import Template
from tuner.lookup.resolver import Candidate, parse_candidates
from tuner.wire import Provenance

__all__ = ["StoredBest", "stored_bests"]


@dataclass(frozen=True)
class StoredBest:
    """A best-config row (``db.models.BestConfig``), detached from its session."""

    device_key: str
    template: str
    template_version: str
    problem_key: str
    problem: dict[str, Any]
    config: dict[str, Any]
    tflops: float
    median_ms: float
    default_tflops: float | None = None
    speedup: float | None = None
    readings: int = 1  # how many readings median_ms is the median of (db.finalists.Readings)
    spread: float | None = None  # (slowest - fastest) / median of them; None with one
    # Where and when it was measured (None: the reader did not ask; the service's answers do).
    provenance: Provenance | None = None
    # The head-to-head whose readings ``median_ms`` is the median of (None: the config's own
    # readings: no head-to-head of the problem finished with it).
    head_to_head: int | None = None

    @classmethod
    def of_row(cls, row: Any, readings: Readings | None = None,
               provenance: Provenance | None = None) -> StoredBest:
        """``row`` as read; ``readings`` (``crud.best_readings``) where the reader needs them."""
        return cls(device_key=row.device.key, template=row.template.name,
                   template_version=row.template.version, problem_key=row.problem_key,
                   problem=dict(row.problem), config=dict(row.config), tflops=row.tflops,
                   median_ms=row.median_ms, default_tflops=row.default_tflops,
                   speedup=row.speedup,
                   readings=readings.count if readings is not None else 1,
                   spread=readings.spread if readings is not None else None,
                   provenance=provenance,
                   head_to_head=readings.head_to_head if readings is not None else None)


def stored_bests(session: Session, template: Template, rows: list[Any]) -> dict[str, Candidate]:
    """``rows`` (``db.models.BestConfig`` of one device and template version) as candidates
    whose source is a ``StoredBest``, by problem key; a row whose problem or config no longer
    validates is left out. A few queries (sweep names, trial dates, readings) for all rows."""
    if not rows:
        return {}
    names = crud.sweep_names(session, sweep_ids={r.sweep_id for r in rows
                                                  if r.sweep_id is not None})
    measured = crud.trial_dates(session, trial_ids={r.trial_id for r in rows
                                                    if r.trial_id is not None})
    readings = crud.best_readings(session, rows)
    stored = [StoredBest.of_row(r, readings[r.id], Provenance(
        sweep_id=r.sweep_id, sweep_name=names.get(r.sweep_id) if r.sweep_id else None,
        measured_at=measured.get(r.trial_id, r.updated_at) if r.trial_id else r.updated_at,
        triton_version=r.device.triton_version, torch_version=r.device.torch_version))
        for r in rows]
    return {c.problem_key: c for c in parse_candidates(template, stored)}
