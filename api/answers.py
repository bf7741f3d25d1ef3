"""The service's answer to "which config for this problem on this device" (GET /v1/best).

Matching is ``tuner.lookup.match_candidates`` (exact problem, then bucket, then nearest
shape), the same rule the client applies to its local database. When nothing is tuned the
answer is the template's default for the device: the stored device when the service knows its
key, else the hardware the key names (``tuner.lookup.device_info_from_key``: an unknown or bare
name is taken as an H100).

The best configs of one device and template version are read and parsed once and kept in a
``BestCache`` snapshot, re-checked every ``ttl_s`` seconds with one small query (an upload
through this service drops them at once): parsing every stored row on every request cost
~10 ms, most of a lookup's time.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from db import crud
from db.models import BestConfig, Device, Sweep, Trial
from db.models import Template as TemplateRow
from db.session import get_sessionmaker
from templates.base import Problem, Template
from templates.device import DeviceInfo
from tuner.lookup import (
    Candidate,
    device_info_from_key,
    device_info_from_row,
    match_candidates,
    parse_candidates,
)
from tuner.wire import BestOut, Provenance

log = logging.getLogger("api")

_versions: dict[str, str] = {}


def template_version(template: Template) -> str:
    """The running kernel's version; hashing its source once per process is enough."""
    version = _versions.get(template.name)
    if version is None:
        version = _versions[template.name] = template.version()
    return version


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


@dataclass(frozen=True)
class Snapshot:
    device: DeviceInfo
    candidates: list[Candidate]
    expires_at: float
    fingerprint: tuple[Any, ...]  # changes whenever a best row is added or updated


class BestCache:
    """Parsed best configs per (device key, template, version), refreshed every ``ttl_s`` s.

    One load per key at a time, in a worker thread; while a key refreshes, requests keep
    answering from its previous snapshot (stale by at most one load). Without that, every
    request in flight when a snapshot expired reloaded it at once: a 0.5 s stall every ttl_s
    at 500 req/s (benchmarks/api_load.py).
    """

    # Device keys come from callers: bound the entries so random keys cannot grow memory.
    MAX_ENTRIES = 1024

    def __init__(self, database_url: str, ttl_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.database_url = database_url
        self.ttl_s = ttl_s
        self._clock = clock
        self._entries: dict[tuple[str, str, str], Snapshot] = {}
        self._loading: dict[tuple[str, str, str], asyncio.Future[Snapshot]] = {}
        self._generation = 0  # bumped by invalidate(): loads begun before it are not kept
        self._lock = threading.Lock()

    def invalidate(self) -> None:
        with self._lock:
            self._generation += 1
            self._entries.clear()

    async def snapshot(self, template: Template, version: str, device_key: str) -> Snapshot:
        key = (device_key, template.name, version)
        hit = self._entries.get(key)
        if hit is not None and hit.expires_at > self._clock():
            return hit
        loading = self._loading.get(key)
        if loading is None:
            loading = asyncio.ensure_future(run_in_threadpool(
                self._load_and_keep, key, template, version, device_key))
            self._loading[key] = loading
            loading.add_done_callback(lambda done: self._loaded(key, done))
        if hit is not None:
            return hit
        return await asyncio.shield(loading)

    def _loaded(self, key: tuple[str, str, str], done: asyncio.Future[Snapshot]) -> None:
        self._loading.pop(key, None)
        if not done.cancelled() and done.exception() is not None:  # retrieved: logged, not lost
            log.warning("reloading best configs of %s failed: %s", key, done.exception())

    def _load_and_keep(self, key: tuple[str, str, str], template: Template, version: str,
                       device_key: str) -> Snapshot:
        generation = self._generation
        old = self._entries.get(key)
        with get_sessionmaker(self.database_url, write=False)() as session:
            mark = _fingerprint(session, template.name, version, device_key)
            if old is not None and old.fingerprint == mark:
                # Nothing changed: keep the parsed candidates (a reload parses every row).
                snapshot = replace(old, expires_at=self._clock() + self.ttl_s)
            else:
                snapshot = self._load(session, template, version, device_key, mark)
        with self._lock:
            if generation == self._generation:
                if len(self._entries) >= self.MAX_ENTRIES:
                    self._entries.clear()
                self._entries[key] = snapshot
        return snapshot

    def _load(self, session: Session, template: Template, version: str, device_key: str,
              fingerprint: tuple[Any, ...]) -> Snapshot:
        rows = crud.best_candidates(session, device_key=device_key, template_name=template.name,
                                    template_version=version)
        if rows:
            device = device_info_from_row(rows[0].device)
        else:
            row = session.scalars(select(Device).where(Device.key == device_key)).one_or_none()
            device = device_info_from_row(row) if row else device_info_from_key(device_key)
        sweep_names = _names_of(session, {r.sweep_id for r in rows if r.sweep_id is not None})
        measured = _trial_dates(session, {r.trial_id for r in rows if r.trial_id is not None})
        readings = crud.best_readings(session, rows)
        stored = [StoredBest(
            problem_key=r.problem_key, problem=dict(r.problem), config=dict(r.config),
            tflops=r.tflops, median_ms=r.median_ms, default_tflops=r.default_tflops,
            speedup=r.speedup, readings=readings[r.id].count, spread=readings[r.id].spread,
            provenance=Provenance(
                sweep_id=r.sweep_id, sweep_name=sweep_names.get(r.sweep_id),
                measured_at=measured.get(r.trial_id, r.updated_at),
                triton_version=r.device.triton_version, torch_version=r.device.torch_version))
            for r in rows]
        return Snapshot(device, parse_candidates(template, stored), self._clock() + self.ttl_s,
                        fingerprint)


def _fingerprint(session: Session, template_name: str, version: str,
                 device_key: str) -> tuple[Any, ...]:
    """Row count, newest update and largest id of one key's best configs (one indexed query)."""
    row = session.execute(
        select(func.count(BestConfig.id), func.max(BestConfig.updated_at), func.max(BestConfig.id))
        .join(BestConfig.device).join(BestConfig.template)
        .where(Device.key == device_key, TemplateRow.name == template_name,
               TemplateRow.version == version)).one()
    return tuple(row)


def _names_of(session: Session, sweep_ids: set[int]) -> dict[int | None, str]:
    if not sweep_ids:
        return {}
    return dict(session.execute(select(Sweep.id, Sweep.name).where(Sweep.id.in_(sweep_ids)))
                .tuples().all())


def _trial_dates(session: Session, trial_ids: set[int]) -> dict[int | None, datetime]:
    if not trial_ids:
        return {}
    return dict(session.execute(select(Trial.id, Trial.created_at)
                                .where(Trial.id.in_(trial_ids))).tuples().all())


async def best_answer(cache: BestCache, *, template: Template, version: str | None,
                      problem: Problem, device_key: str) -> BestOut:
    """Answer on the event loop; only loading a snapshot goes to a worker thread.

    Matching a cached snapshot takes ~0.1 ms; two thread-pool hops per request (a plain `def`
    endpoint and its response serialization) cost more than that under load.
    """
    current = template_version(template)
    version = version or current
    snapshot = await cache.snapshot(template, version, device_key)
    found = match_candidates(template, problem, snapshot.device, snapshot.candidates)
    base: dict[str, Any] = {"template": template.name, "device": device_key, "problem": problem.to_dict(),
            "problem_key": template.problem_key(problem)}
    if found is None:
        return BestOut(**base, template_version=current, match="default",
                       config=template.default_config(problem, snapshot.device).to_dict())
    row: StoredBest = found.candidate
    return BestOut(**base, template_version=version, match=found.kind,
                   config=found.config.to_dict(), matched_problem=row.problem,
                   tflops=row.tflops, median_ms=row.median_ms, default_tflops=row.default_tflops,
                   speedup=row.speedup, readings=row.readings, spread=row.spread,
                   provenance=row.provenance)
