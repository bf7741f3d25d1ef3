"""Stored best configs as matching reads them, detached from their database session: what the
service's answers (``api.answers``) and the implementations' comparison (``tuner.comparison``)
need of a best-config row, parsed once per row."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy.orm import Session

from db import crud
from templates.base import Template
from tuner.lookup import Candidate, parse_candidates
from tuner.wire import Provenance

__all__ = ["StoredBest", "stored_bests"]


@dataclass(frozen=True)
class StoredBest:
    """What an answer needs of a best-config row, detached from its session."""

    problem_key: str
    problem: dict[str, Any]
    config: dict[str, Any]
    tflops: float
    median_ms: float
    default_tflops: float | None
    speedup: float | None
    readings: int
    spread: float | None
    provenance: Provenance
    # The head-to-head whose readings ``median_ms`` is the median of (None: the config's own
    # readings: no head-to-head of the problem finished with it).
    head_to_head: int | None = None


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
    stored = [StoredBest(
        problem_key=r.problem_key, problem=dict(r.problem), config=dict(r.config),
        tflops=r.tflops, median_ms=r.median_ms, default_tflops=r.default_tflops,
        speedup=r.speedup, readings=readings[r.id].count, spread=readings[r.id].spread,
        provenance=Provenance(
            sweep_id=r.sweep_id, sweep_name=names.get(r.sweep_id) if r.sweep_id else None,
            measured_at=measured.get(r.trial_id, r.updated_at) if r.trial_id else r.updated_at,
            triton_version=r.device.triton_version, torch_version=r.device.torch_version),
        head_to_head=readings[r.id].head_to_head)
        for r in rows]
    return {c.problem_key: c for c in parse_candidates(template, stored)}
