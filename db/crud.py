"""Reads and writes of the project database: keyword-only functions taking a Session first.

Every "create" here is safe when several processes do the same one at once: rows with a
natural key are inserted with ``INSERT ... ON CONFLICT DO NOTHING`` (or ``DO UPDATE`` for the
best configs) and then read back, so the loser of a race gets the winner's row instead of an
IntegrityError. The functions flush but never commit: the caller owns the transaction (see
``db.session.session_scope`` and ``run_in_transaction``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import ColumnElement, Select, and_, delete, func, or_, select, text, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session, contains_eager

from db.finalists import Measured, Readings, choose_best
from db.head_to_head import TrialSideBySide, side_by_side, side_by_side_of
from db.models import (
    BestConfig,
    Device,
    Remeasurement,
    RemeasurementClaim,
    Snapshot,
    Sweep,
    SweepStatus,
    Template,
    Trial,
    TrialStatus,
    utcnow,
)

__all__ = [
    "best_candidates",
    "dialect_insert",
    "best_fingerprint",
    "best_for",
    "best_readings",
    "best_versions",
    "catalog_fingerprint",
    "claim_remeasurement",
    "count_best",
    "count_snapshots",
    "create_snapshot",
    "create_sweep",
    "delete_snapshot",
    "drop_remeasurement_claim",
    "find_trial",
    "finish_sweep",
    "get_or_create_device",
    "get_or_create_template",
    "get_snapshot",
    "insert_new_trials",
    "insert_remeasurements",
    "list_best",
    "list_devices",
    "list_snapshots",
    "list_sweeps",
    "list_templates",
    "measured_configs",
    "problem_variant",
    "record_remeasurement",
    "record_trial",
    "refresh_best",
    "refresh_bests",
    "remeasurements_for",
    "renew_remeasurement_claim",
    "stored_trial_identities",
    "sweep_names",
    "template_versions",
    "trial_counts",
    "trial_dates",
    "trials_for",
]

# Columns of a device row that come from DeviceInfo (plus its key); other info keys, such as
# smem_per_block, describe the chip but are not stored. cudnn_version may be absent (info
# written before it was recorded): the device has none.
_DEVICE_FIELDS = ("key", "name", "compute_capability", "sm_count", "total_memory",
                  "driver_version", "triton_version", "torch_version", "cuda_version")
_OPTIONAL_DEVICE_FIELDS = ("cudnn_version",)
_DEFAULT_DTYPE = "bfloat16"  # templates.base.Problem's default


# PostgreSQL channel notified in every transaction that changes a best config.
BEST_CHANGES_CHANNEL = "tuner_best_configs"

# Ids or keys per IN (...) list: far below every backend's limit on bound parameters (SQLite's
# is 32766, older builds 999), so a list of any length takes a few queries, not one per row.
_KEYS_CHUNK = 500


# ----------------------------------------------------------------------------- upserts
def dialect_insert(s: Session, model: type[Any]) -> Any:
    """The dialect's INSERT, the one that knows ON CONFLICT."""
    dialect = s.get_bind().dialect.name
    if dialect == "postgresql":
        return postgresql.insert(model)
    if dialect == "sqlite":
        return sqlite.insert(model)
    raise ValueError(f"database backend must be sqlite or postgresql, but got {dialect!r}")


def _insert_if_absent(s: Session, model: type[Any], values: Mapping[str, object],
                      key: tuple[str, ...]) -> None:
    stmt = dialect_insert(s, model).values(**values).on_conflict_do_nothing(
        index_elements=list(key))
    s.execute(stmt)


# ----------------------------------------------------------------------------- devices, templates
def get_or_create_device(s: Session, *, info: Mapping[str, object]) -> Device:
    """The device row of ``info`` (``DeviceInfo.to_dict()`` plus ``"key"``), created if new."""
    missing = [f for f in _DEVICE_FIELDS if f not in info]
    if missing:
        raise ValueError(f"device info must have the fields {list(_DEVICE_FIELDS)}, "
                         f"but {missing} are missing (got {sorted(info)})")
    values = {f: info[f] for f in _DEVICE_FIELDS} | {
        f: info.get(f) for f in _OPTIONAL_DEVICE_FIELDS}
    if not isinstance(values["key"], str) or not values["key"]:
        raise ValueError(f"device info 'key' must be a non-empty string, got {values['key']!r}")
    device = s.scalars(select(Device).where(Device.key == values["key"])).one_or_none()
    if device is None:
        _insert_if_absent(s, Device, values, ("key",))
        device = s.scalars(select(Device).where(Device.key == values["key"])).one()
    return device


def get_or_create_template(s: Session, *, name: str, version: str, space: dict) -> Template:
    """The template row of ``name`` at ``version``; ``space`` is stored only when it is new."""
    if not name or not version:
        raise ValueError(f"template name and version must be non-empty, "
                         f"but got name={name!r}, version={version!r}")
    query = select(Template).where(Template.name == name, Template.version == version)
    template = s.scalars(query).one_or_none()
    if template is None:
        _insert_if_absent(s, Template,
                          {"name": name, "version": version, "space": space},
                          ("name", "version"))
        template = s.scalars(query).one()
    return template


def list_devices(s: Session) -> list[Device]:
    return list(s.scalars(select(Device).order_by(Device.name, Device.id)))


def list_templates(s: Session) -> list[Template]:
    return list(s.scalars(select(Template).order_by(Template.name, Template.created_at,
                                                    Template.id)))


# ----------------------------------------------------------------------------- sweeps
def create_sweep(s: Session, *, name: str, spec: dict, host: str) -> Sweep:
    sweep = Sweep(name=name, spec=spec, host=host, status=SweepStatus.RUNNING,
                  started_at=utcnow())
    s.add(sweep)
    s.flush()
    return sweep


def finish_sweep(s: Session, *, sweep_id: int, status: SweepStatus) -> None:
    """Mark a sweep done, failed or interrupted, and stamp its end time."""
    status = SweepStatus(status)
    sweep = s.get(Sweep, sweep_id)
    if sweep is None:
        raise LookupError(f"no sweep with id {sweep_id}")
    sweep.status = status
    sweep.finished_at = utcnow()
    s.flush()


def list_sweeps(s: Session, *, limit: int = 50) -> list[Sweep]:
    """The newest ``limit`` sweeps, newest first."""
    _check_page(0, limit)
    return list(s.scalars(select(Sweep).order_by(Sweep.id.desc()).limit(limit)))


# ----------------------------------------------------------------------------- trials
def _trial_identity(device_id: int, template_id: int, problem_key: str,
                    config_key: str) -> tuple[ColumnElement[bool], ...]:
    return (Trial.device_id == device_id, Trial.template_id == template_id,
            Trial.problem_key == problem_key, Trial.config_key == config_key)


def find_trial(s: Session, *, device_id: int, template_id: int, problem_key: str,
               config_key: str) -> Trial | None:
    identity = _trial_identity(device_id, template_id, problem_key, config_key)
    return s.scalars(select(Trial).where(*identity)).one_or_none()


def record_trial(s: Session, *, device_id: int, template_id: int, problem_key: str,
                 problem: dict, config_key: str, config: dict, status: TrialStatus,
                 reason: str = "", median_ms: float | None = None,
                 tflops: float | None = None, compile_s: float | None = None,
                 error: float | None = None, is_default: bool = False,
                 sweep_id: int | None = None, optuna_study: str | None = None,
                 optuna_trial: int | None = None, worker: str = "",
                 phases: dict[str, Any] | None = None) -> Trial:
    """Store one trial, or return the row already stored for the same identity.

    The identity is (device, template version, problem_key, config_key). A config is measured
    once: a second record of it, from a resumed sweep or from another worker at the same
    moment, changes nothing and gets the first row back (an OK measurement is never replaced
    by a later failure, nor the other way round).
    """
    status = TrialStatus(status)
    existing = find_trial(s, device_id=device_id, template_id=template_id,
                          problem_key=problem_key, config_key=config_key)
    if existing is not None:
        return existing
    values = {
        "device_id": device_id, "template_id": template_id, "problem_key": problem_key,
        "problem": problem, "config_key": config_key, "config": config, "status": status,
        "reason": reason, "median_ms": median_ms, "tflops": tflops, "compile_s": compile_s,
        "error": error, "is_default": is_default, "sweep_id": sweep_id,
        "optuna_study": optuna_study, "optuna_trial": optuna_trial, "worker": worker,
        "phases": phases, "created_at": utcnow(),
    }
    _insert_if_absent(s, Trial, values,
                      ("device_id", "template_id", "problem_key", "config_key"))
    identity = _trial_identity(device_id, template_id, problem_key, config_key)
    return s.scalars(select(Trial).where(*identity)).one()


def stored_trial_identities(s: Session, *, identities: Sequence[tuple[int, int, str, str]]
                            ) -> set[tuple[int, int, str, str]]:
    """Which of ``identities`` (device_id, template_id, problem_key, config_key) have a stored
    trial: a few queries, by device, template and ``_KEYS_CHUNK`` problem keys."""
    wanted: dict[tuple[int, int], set[str]] = {}
    for device_id, template_id, problem_key, _ in identities:
        wanted.setdefault((device_id, template_id), set()).add(problem_key)
    stored: set[tuple[int, int, str, str]] = set()
    for (device_id, template_id), keys in wanted.items():
        ordered = sorted(keys)
        for start in range(0, len(ordered), _KEYS_CHUNK):
            stored.update((device_id, template_id, problem_key, config_key)
                          for problem_key, config_key in s.execute(
                              select(Trial.problem_key, Trial.config_key).where(
                                  Trial.device_id == device_id, Trial.template_id == template_id,
                                  Trial.problem_key.in_(ordered[start:start + _KEYS_CHUNK]))))
    return stored & set(identities)


# Columns a row of insert_new_trials must give (the rest take their defaults).
_NEW_TRIAL_FIELDS = ("device_id", "template_id", "problem_key", "problem", "config_key",
                     "config", "status", "median_ms", "tflops", "error", "is_default",
                     "sweep_id", "worker")


def insert_new_trials(s: Session, *, rows: Sequence[Mapping[str, Any]]
                      ) -> dict[tuple[int, int, str, str], int]:
    """Store many trials at once, each unless one of the same identity is stored (as
    ``record_trial``: the first measurement stays); returns the id of each trial this call
    stored, by identity (device_id, template_id, problem_key, config_key).

    One multi-row INSERT ... ON CONFLICT DO NOTHING RETURNING: a row that conflicts, with a
    stored trial or an earlier row of ``rows``, is skipped and returns nothing, so a trial
    another process stores at the same moment is never counted twice.
    """
    if not rows:
        return {}
    now = utcnow()
    values = []
    for row in rows:
        missing = [f for f in _NEW_TRIAL_FIELDS if f not in row]
        if missing:
            raise ValueError(f"a new trial needs the fields {list(_NEW_TRIAL_FIELDS)}, but "
                             f"{missing} are missing (got {sorted(row)})")
        values.append({**{f: row[f] for f in _NEW_TRIAL_FIELDS},
                       "status": TrialStatus(row["status"]), "reason": row.get("reason", ""),
                       "phases": row.get("phases"), "created_at": now})
    stmt = (dialect_insert(s, Trial)
            .on_conflict_do_nothing(index_elements=["device_id", "template_id", "problem_key",
                                                    "config_key"])
            .returning(Trial.id, Trial.device_id, Trial.template_id, Trial.problem_key,
                       Trial.config_key))
    inserted = s.connection().execute(stmt, values)  # Core: multi-row VALUES, not row by row
    return {(device_id, template_id, problem_key, config_key): trial_id
            for trial_id, device_id, template_id, problem_key, config_key in inserted}


def trials_for(s: Session, *, device_id: int, template_id: int,
               problem_key: str) -> list[Trial]:
    return list(s.scalars(select(Trial).where(
        Trial.device_id == device_id, Trial.template_id == template_id,
        Trial.problem_key == problem_key).order_by(Trial.id)))


def trial_counts(s: Session, *, sweep_id: int | None = None) -> dict[str, int]:
    """Number of trials per status value (every status present, zero if none)."""
    query = select(Trial.status, func.count()).group_by(Trial.status)
    if sweep_id is not None:
        query = query.where(Trial.sweep_id == sweep_id)
    counts = {status.value: 0 for status in TrialStatus}
    for status, n in s.execute(query):
        counts[TrialStatus(status).value] = int(n)
    return counts


# ----------------------------------------------------------------------------- re-measurements
def record_remeasurement(s: Session, *, trial_id: int, status: TrialStatus, reason: str = "",
                         median_ms: float | None = None, tflops: float | None = None,
                         error: float | None = None, sweep_id: int | None = None,
                         worker: str = "", phases: dict[str, Any] | None = None
                         ) -> Remeasurement:
    """Store one more measurement of a trial's config (a finalist's, ``db.finalists``).

    Unlike trials, every call adds a row: two workers that re-measure one finalist at once
    both keep theirs, and its median takes both.
    """
    row = Remeasurement(trial_id=trial_id, status=TrialStatus(status), reason=reason,
                        median_ms=median_ms, tflops=tflops, error=error, sweep_id=sweep_id,
                        worker=worker, phases=phases, created_at=utcnow())
    s.add(row)
    s.flush()
    return row


def insert_remeasurements(s: Session, *, rows: Sequence[Mapping[str, Any]]) -> int:
    """``record_remeasurement`` for many rows at once (one multi-row INSERT); returns how many.
    Each row gives trial_id and status, and any of reason, median_ms, tflops, error, sweep_id,
    worker and phases."""
    if not rows:
        return 0
    now = utcnow()
    fields = ("reason", "median_ms", "tflops", "error", "sweep_id", "worker", "phases")
    defaults: dict[str, Any] = {"reason": "", "worker": ""}
    values = [{"trial_id": row["trial_id"], "status": TrialStatus(row["status"]),
               "created_at": now, **{f: row.get(f, defaults.get(f)) for f in fields}}
              for row in rows]
    s.connection().execute(dialect_insert(s, Remeasurement), values)  # Core executemany
    return len(values)


def claim_remeasurement(s: Session, *, trial_id: int, wanted: int, worker: str,
                        is_stale: Callable[[str, datetime], bool]) -> int | None:
    """Claim one more re-measurement of a trial for ``worker``: granted while its stored
    re-measurements and live claims are fewer than ``wanted``. Returns the claim's id (hand
    it to ``renew_remeasurement_claim`` while measuring and ``drop_remeasurement_claim`` with
    the result), or None when the trial has enough.

    Claims for which ``is_stale(worker, beat_at)`` is true (their worker died, or stopped
    renewing them) are dropped first, so a dead worker's share is taken over. Two claims of
    one trial are serialized: by SQLite's write lock (a write transaction), by a row lock on
    the trial on PostgreSQL.
    """
    if wanted < 1:
        raise ValueError(f"wanted must be >= 1, but got {wanted}")
    s.execute(select(Trial.id).where(Trial.id == trial_id).with_for_update())
    claims = s.execute(select(RemeasurementClaim.id, RemeasurementClaim.worker,
                              RemeasurementClaim.beat_at)
                       .where(RemeasurementClaim.trial_id == trial_id)).all()
    stale = [claim_id for claim_id, holder, beat_at in claims
             if is_stale(holder, _utc(beat_at))]
    if stale:
        s.execute(delete(RemeasurementClaim).where(RemeasurementClaim.id.in_(stale)))
    done = s.scalar(select(func.count()).select_from(Remeasurement)
                    .where(Remeasurement.trial_id == trial_id)) or 0
    if done + len(claims) - len(stale) >= wanted:
        return None
    claim = RemeasurementClaim(trial_id=trial_id, worker=worker, beat_at=utcnow())
    s.add(claim)
    s.flush()
    return claim.id


def renew_remeasurement_claim(s: Session, *, claim_id: int) -> bool:
    """Mark a claim alive now; False when it is gone (taken over as stale)."""
    result = s.execute(update(RemeasurementClaim).where(RemeasurementClaim.id == claim_id)
                       .values(beat_at=utcnow()))
    return bool(result.rowcount)  # type: ignore[attr-defined]


def drop_remeasurement_claim(s: Session, *, claim_id: int) -> None:
    """Drop a claim: its re-measurement is stored, or will not be taken."""
    s.execute(delete(RemeasurementClaim).where(RemeasurementClaim.id == claim_id))


def _utc(value: datetime) -> datetime:
    # SQLite hands times back without their offset; they are stored as UTC (models.utcnow).
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value


def remeasurements_for(s: Session, *, device_id: int, template_id: int,
                       problem_key: str) -> list[tuple[str, Remeasurement]]:
    """(config key, re-measurement) of every re-measurement of one problem, oldest first."""
    rows = s.execute(select(Trial.config_key, Remeasurement)
                     .join(Trial, Remeasurement.trial_id == Trial.id)
                     .where(Trial.device_id == device_id, Trial.template_id == template_id,
                            Trial.problem_key == problem_key)
                     .order_by(Remeasurement.id))
    return [(key, row) for key, row in rows]


# ----------------------------------------------------------------------------- best configs
def problem_variant(problem: Mapping[str, object]) -> str:
    """The variant name of a problem dict, by the rule of ``templates.base.Problem.variant``.

    ``db`` imports nothing of the project's, so the rule is repeated here (and tested
    against ``Problem`` in tests/db).
    """
    causal = str(problem.get("causal", "none"))
    mask = str(problem.get("mask", "none"))
    parts = [] if causal == "none" else [f"causal-{causal}"]
    if mask != "none":
        parts.append(f"sparse-{mask}")
    return "+".join(parts) or "dense"


def _lock_best_row(s: Session, device_id: int, template_id: int, problem_key: str) -> None:
    """Serialize refreshes of one best row on PostgreSQL until the transaction ends.

    Without it, a refresher whose snapshot predates another worker's better trial could
    overwrite that worker's newer best. SQLite needs nothing: it has one writer at a time,
    and a deferred transaction with a stale snapshot cannot write at all.
    """
    if s.get_bind().dialect.name != "postgresql":
        return
    digest = hashlib.blake2b(f"best|{device_id}|{template_id}|{problem_key}".encode(),
                             digest_size=8).digest()
    s.execute(text("SELECT pg_advisory_xact_lock(:key)"),
              {"key": int.from_bytes(digest, "big", signed=True)})


def _measured_by_key(s: Session, device_id: int, template_id: int,
                     problem_keys: Sequence[str]) -> dict[str, list[Measured]]:
    """The OK trials of some problems with their re-measurements, for ``db.finalists``: two
    queries per ``_KEYS_CHUNK`` problems, whatever their number."""
    remeasured: dict[int, list[float]] = {}
    failed: dict[int, str] = {}
    out: dict[str, list[Measured]] = {key: [] for key in problem_keys}
    for start in range(0, len(problem_keys), _KEYS_CHUNK):
        chunk = problem_keys[start:start + _KEYS_CHUNK]
        of_keys = (Trial.device_id == device_id, Trial.template_id == template_id,
                   Trial.problem_key.in_(chunk), Trial.status == TrialStatus.OK,
                   Trial.tflops.is_not(None), Trial.median_ms.is_not(None))
        for trial_id, status, ms, reason in s.execute(
                select(Remeasurement.trial_id, Remeasurement.status, Remeasurement.median_ms,
                       Remeasurement.reason)
                .join(Trial, Remeasurement.trial_id == Trial.id).where(*of_keys)
                .order_by(Remeasurement.id)):
            if TrialStatus(status) == TrialStatus.OK and ms:
                remeasured.setdefault(trial_id, []).append(ms)
            else:
                failed.setdefault(trial_id, f"{TrialStatus(status).value}: {reason}")
        for trial_id, key, ms, tflops, is_default in s.execute(
                select(Trial.id, Trial.problem_key, Trial.median_ms, Trial.tflops,
                       Trial.is_default).where(*of_keys).order_by(Trial.id)):
            if ms is None or tflops is None:  # excluded by of_keys already
                continue
            out[key].append(Measured(ref=trial_id, order=trial_id, first_ms=ms,
                                     first_tflops=tflops, is_default=bool(is_default),
                                     remeasured_ms=tuple(remeasured.get(trial_id, ())),
                                     failed=failed.get(trial_id)))
    return _with_side_by_side(s, out)


def _with_side_by_side(s: Session, measured: dict[str, list[Measured]]
                       ) -> dict[str, list[Measured]]:
    """``measured`` with each config's head-to-head readings, and disqualified where one
    failed (``db.head_to_head``)."""
    return _with_found(measured, side_by_side(
        s, trial_ids=[int(m.ref) for ms in measured.values() for m in ms]))


def _with_found(measured: dict[str, list[Measured]], found: Mapping[int, TrialSideBySide]
                ) -> dict[str, list[Measured]]:
    if not found:
        return measured
    out: dict[str, list[Measured]] = {}
    for key, configs in measured.items():
        out[key] = []
        for m in configs:
            h2h = found.get(int(m.ref))
            if h2h is not None:
                m = replace(m, side_by_side=h2h.readings, failed=m.failed or h2h.failed)
            out[key].append(m)
    return out


# What a best row says; a refresh that would write the same is no change and writes nothing
# (its updated_at stays, so readers that watch it reload nothing).
_BEST_FIELDS = ("problem", "dtype", "variant", "config", "median_ms", "tflops",
                "default_tflops", "speedup", "trial_id", "sweep_id")


def refresh_best(s: Session, *, device_id: int, template_id: int,
                 problem_key: str) -> BestConfig | None:
    """Recompute the best config of one device x template x problem key from its trials and
    their re-measurements, by the rule of ``db.finalists``.

    Before any re-measurement: the OK trial with the highest TFLOP/s (ties: the faster time,
    then the earlier trial). After: the finalist with the fastest median of its readings,
    ``median_ms`` and ``tflops`` being that median's, or the median of its readings in the
    latest finished head-to-head it took part in (``db.finalists``, ``db.head_to_head``). ``default_tflops`` is the OK default
    config's (at its median when re-measured) and ``speedup`` the ratio. Returns None, and
    leaves no row, while no config qualifies (none OK, or every OK one disqualified by a
    failed re-measurement: a config that crashed or computed wrongly is not served). A row
    that would not change is not written (see ``refresh_bests``).
    """
    refresh_bests(s, device_id=device_id, template_id=template_id, problem_keys=[problem_key])
    return s.scalars(select(BestConfig).filter_by(
        device_id=device_id, template_id=template_id, problem_key=problem_key)
        .execution_options(populate_existing=True)).one_or_none()


def refresh_bests(s: Session, *, device_id: int, template_id: int,
                  problem_keys: Sequence[str]) -> list[str]:
    """``refresh_best`` for many problem keys of one device and template at once (a few
    queries, not a few per key); returns the keys whose best row was created, changed or
    deleted. A row whose recomputed values equal the stored ones is left alone, ``updated_at``
    included: an upload that changes nothing must not look like a change to the service's
    cache (issue 19)."""
    keys = sorted(set(problem_keys))
    for key in keys:  # in one order everywhere: two refreshers cannot deadlock on the locks
        _lock_best_row(s, device_id, template_id, key)
    measured = _measured_by_key(s, device_id, template_id, keys)
    stored: dict[str, BestConfig] = {}
    for start in range(0, len(keys), _KEYS_CHUNK):
        stored.update((row.problem_key, row) for row in s.scalars(
            select(BestConfig).where(BestConfig.device_id == device_id,
                                     BestConfig.template_id == template_id,
                                     BestConfig.problem_key.in_(keys[start:start + _KEYS_CHUNK]))
            .execution_options(populate_existing=True)))
    choices = {key: choose_best(measured[key]) for key in keys}
    winners = sorted({int(c.best.ref) for c in choices.values() if c is not None})
    trials = {t.id: t for start in range(0, len(winners), _KEYS_CHUNK)
              for t in s.scalars(select(Trial).where(
                  Trial.id.in_(winners[start:start + _KEYS_CHUNK])))}
    changed, gone, upserts = [], [], []
    for key in keys:
        choice, row = choices[key], stored.get(key)
        if choice is None:
            if row is not None:
                gone.append(key)
            continue
        best = trials[int(choice.best.ref)]
        values: dict[str, Any] = {
            "problem": best.problem,
            "dtype": str(best.problem.get("dtype", _DEFAULT_DTYPE)),
            "variant": problem_variant(best.problem),
            "config": best.config,
            "median_ms": choice.best.priced_median_ms,
            "tflops": choice.best.priced_tflops,
            "default_tflops": choice.default.tflops if choice.default else None,
            "speedup": choice.speedup,
            "trial_id": best.id,
            "sweep_id": best.sweep_id,
        }
        if row is not None and all(getattr(row, f) == values[f] for f in _BEST_FIELDS):
            continue
        upserts.append({"device_id": device_id, "template_id": template_id, "problem_key": key,
                        **values, "updated_at": utcnow()})
        changed.append(key)
    for start in range(0, len(gone), _KEYS_CHUNK):
        s.execute(delete(BestConfig).where(
            BestConfig.device_id == device_id, BestConfig.template_id == template_id,
            BestConfig.problem_key.in_(gone[start:start + _KEYS_CHUNK])))
    if upserts:
        # One statement for every row (Core executemany; the ORM ran it row by row): building
        # one statement per row cost ~2 ms each.
        stmt = dialect_insert(s, BestConfig)
        s.connection().execute(stmt.on_conflict_do_update(
            index_elements=["device_id", "template_id", "problem_key"],
            set_={f: stmt.excluded[f] for f in (*_BEST_FIELDS, "updated_at")}), upserts)
    if (changed or gone) and s.get_bind().dialect.name == "postgresql":
        # Delivered when the transaction commits, to every service listening (api/changes.py):
        # their caches re-check before the next answer instead of answering stale.
        s.execute(text("SELECT pg_notify(:channel, '')"), {"channel": BEST_CHANGES_CHANNEL})
    return sorted(changed + gone)




def best_readings(s: Session, bests: Sequence[BestConfig]) -> dict[int, Readings]:
    """The readings each stored best rests on, by best-config id: its trial's first time and
    the OK re-measurements of that trial (failed ones give no time), oldest first; or, where
    the trial took part in a finished head-to-head, the readings of the latest one (the time
    is then their median, ``db.finalists``).

    Two queries per ``_KEYS_CHUNK`` bests. A best without a trial (or whose trial has no time)
    rests on its stored time alone.
    """
    trial_ids = sorted({b.trial_id for b in bests if b.trial_id is not None})
    priced = {trial_id: found.readings
              for trial_id, found in side_by_side(s, trial_ids=trial_ids).items()
              if found.readings is not None}
    times: dict[int, list[float]] = {}
    for start in range(0, len(trial_ids), _KEYS_CHUNK):
        chunk = trial_ids[start:start + _KEYS_CHUNK]
        rows = s.execute(
            select(Trial.id, Trial.median_ms, Remeasurement.median_ms)
            .outerjoin(Remeasurement, and_(Remeasurement.trial_id == Trial.id,
                                           Remeasurement.status == TrialStatus.OK,
                                           Remeasurement.median_ms.is_not(None)))
            .where(Trial.id.in_(chunk)).order_by(Trial.id, Remeasurement.id))
        for trial_id, first_ms, again_ms in rows:
            if first_ms is None:  # not OK: no best comes from it
                continue
            readings = times.setdefault(trial_id, [first_ms])
            if again_ms is not None:
                readings.append(again_ms)
    out = {}
    for best in bests:
        side = priced.get(best.trial_id) if best.trial_id is not None else None
        if side is not None:
            out[best.id] = side.readings()
            continue
        found = times.get(best.trial_id) if best.trial_id is not None else None
        out[best.id] = Readings(tuple(found) if found else (best.median_ms,))
    return out


def measured_configs(s: Session, *, device_key: str, template_name: str,
                     template_version: str, problem_keys: Collection[str] | None = None
                     ) -> dict[str, list[tuple[dict[str, Any], Measured]]]:
    """Every OK trial of one device and template version, by problem key: its config, and
    the trial as ``db.finalists`` sees it (``Measured``, ``ref`` its id): its OK
    re-measurements, disqualified by a failed one, and its latest finished head-to-head's
    readings. What ``refresh_bests`` chooses each problem's best among.

    Two queries for all the device's problems of the template, whatever their number: the
    trials with their re-measurements, then the head-to-head readings of those trials. Trials
    of other versions of the template are not read; with ``problem_keys``, nor are other
    problems'.
    """
    of_trials: tuple[ColumnElement[bool], ...] = (
        Device.key == device_key, Template.name == template_name,
        Template.version == template_version, Trial.status == TrialStatus.OK,
        Trial.tflops.is_not(None), Trial.median_ms.is_not(None))
    if problem_keys is not None:
        of_trials += (Trial.problem_key.in_(sorted(set(problem_keys))),)
    firsts: dict[int, tuple[str, dict[str, Any], float, float, bool]] = {}
    remeasured: dict[int, list[float]] = {}
    failed: dict[int, str] = {}
    for trial_id, key, config, ms, tflops, is_default, again, again_ms, reason in s.execute(
            select(Trial.id, Trial.problem_key, Trial.config, Trial.median_ms, Trial.tflops,
                   Trial.is_default, Remeasurement.status, Remeasurement.median_ms,
                   Remeasurement.reason)
            .join(Trial.device).join(Trial.template)
            .outerjoin(Remeasurement, Remeasurement.trial_id == Trial.id)
            .where(*of_trials).order_by(Trial.id, Remeasurement.id)):
        firsts.setdefault(trial_id, (key, config, ms, tflops, bool(is_default)))
        if again is None:  # no re-measurement (the outer join's empty side)
            continue
        if TrialStatus(again) == TrialStatus.OK and again_ms:
            remeasured.setdefault(trial_id, []).append(again_ms)
        else:
            failed.setdefault(trial_id, f"{TrialStatus(again).value}: {reason}")
    measured: dict[str, list[Measured]] = {}
    for trial_id, (key, _, ms, tflops, is_default) in firsts.items():
        measured.setdefault(key, []).append(Measured(
            ref=trial_id, order=trial_id, first_ms=ms, first_tflops=tflops,
            is_default=is_default, remeasured_ms=tuple(remeasured.get(trial_id, ())),
            failed=failed.get(trial_id)))
    if measured:
        trial_ids = (select(Trial.id).join(Trial.device).join(Trial.template)
                     .where(*of_trials))
        measured = _with_found(measured, side_by_side_of(s, trials=trial_ids))
    return {key: [(firsts[int(m.ref)][1], m) for m in configs]
            for key, configs in measured.items()}


def _best_joined() -> Select[Any]:
    return (select(BestConfig).join(BestConfig.device).join(BestConfig.template)
            .options(contains_eager(BestConfig.device), contains_eager(BestConfig.template)))


def best_for(s: Session, *, device_key: str, template_name: str, template_version: str,
             problem_key: str) -> BestConfig | None:
    return s.scalars(_best_joined().where(
        Device.key == device_key, Template.name == template_name,
        Template.version == template_version,
        BestConfig.problem_key == problem_key)).one_or_none()


def _best_of(device_key: str, template_name: str,
             template_version: str) -> tuple[ColumnElement[bool], ...]:
    return (Device.key == device_key, Template.name == template_name,
            Template.version == template_version)


def best_candidates(s: Session, *, device_key: str, template_name: str, template_version: str,
                    problem_keys: Sequence[str] | None = None) -> list[BestConfig]:
    """Every best config of one device and template version (for nearest-shape lookups), or
    those of ``problem_keys`` only."""
    of_key = _best_of(device_key, template_name, template_version)
    if problem_keys is None:
        return list(s.scalars(_best_joined().where(*of_key).order_by(BestConfig.problem_key)))
    keys = sorted(set(problem_keys))
    return [row for start in range(0, len(keys), _KEYS_CHUNK)
            for row in s.scalars(_best_joined().where(
                *of_key, BestConfig.problem_key.in_(keys[start:start + _KEYS_CHUNK]))
                .order_by(BestConfig.problem_key))]


def best_fingerprint(s: Session, *, device_key: str, template_name: str,
                     template_version: str) -> tuple[Any, ...]:
    """A value that changes whenever a best config of one device and template version is
    added, changed or deleted (one indexed query): row count, newest update, largest id, and
    sums of trial ids and TFLOP/s, which move even when a change commits with an older
    ``updated_at`` than one already seen (PostgreSQL commits concurrent writers in any order)."""
    row = s.execute(
        select(func.count(BestConfig.id), func.max(BestConfig.updated_at),
               func.max(BestConfig.id), func.sum(BestConfig.trial_id),
               func.sum(BestConfig.tflops))
        .join(BestConfig.device).join(BestConfig.template)
        .where(*_best_of(device_key, template_name, template_version))).one()
    return tuple(row)


def best_versions(s: Session, *, device_key: str, template_name: str,
                  template_version: str) -> dict[str, tuple[int, Any]]:
    """(id, updated_at) of every best config of one device and template version, by problem
    key: a row whose pair is unchanged holds what it held (``refresh_bests`` stamps every
    change)."""
    rows = s.execute(select(BestConfig.problem_key, BestConfig.id, BestConfig.updated_at)
                     .join(BestConfig.device).join(BestConfig.template)
                     .where(*_best_of(device_key, template_name, template_version)))
    return {key: (row_id, updated_at) for key, row_id, updated_at in rows}


def sweep_names(s: Session, *, sweep_ids: Collection[int]) -> dict[int, str]:
    ids = sorted(sweep_ids)
    return {sweep_id: name for start in range(0, len(ids), _KEYS_CHUNK)
            for sweep_id, name in s.execute(select(Sweep.id, Sweep.name).where(
                Sweep.id.in_(ids[start:start + _KEYS_CHUNK])))}


def trial_dates(s: Session, *, trial_ids: Collection[int]) -> dict[int, Any]:
    """When each trial was measured (its ``created_at``), by id."""
    ids = sorted(trial_ids)
    return {trial_id: created for start in range(0, len(ids), _KEYS_CHUNK)
            for trial_id, created in s.execute(select(Trial.id, Trial.created_at).where(
                Trial.id.in_(ids[start:start + _KEYS_CHUNK])))}


def catalog_fingerprint(s: Session) -> tuple[Any, ...]:
    """A value that changes whenever a device or a template version is added (rows of both
    are never changed nor deleted): their counts and largest ids."""
    devices = s.execute(select(func.count(Device.id), func.max(Device.id))).one()
    templates = s.execute(select(func.count(Template.id), func.max(Template.id))).one()
    return (*devices, *templates)


def template_versions(s: Session) -> list[tuple[str, str]]:
    """(name, version) of every stored template version."""
    return [(name, version) for name, version in s.execute(
        select(Template.name, Template.version).order_by(Template.name, Template.version))]


def _filter_best(query: Select[Any], device: str | None, template: str | None,
                 dtype: str | None, variant: str | None,
                 templates: Collection[str] | None = None) -> Select[Any]:
    if device is not None:
        query = query.where(or_(Device.name == device, Device.key == device))
    if template is not None:
        query = query.where(Template.name == template)
    if templates is not None:
        query = query.where(Template.name.in_(list(templates)))
    if dtype is not None:
        query = query.where(BestConfig.dtype == dtype)
    if variant is not None:
        query = query.where(BestConfig.variant == variant)
    return query


def _check_page(offset: int, limit: int) -> None:
    if offset < 0 or limit < 0:
        raise ValueError(f"offset and limit must be >= 0, but got offset={offset}, limit={limit}")


# The problem's numeric fields, outermost first: the sequence lengths vary fastest, as along the
# dashboard's x axis. Ordering by the problem key (a string) put "q16384" before "q2048".
_PROBLEM_ORDER = ("head_dim", "heads_q", "heads_kv", "batch", "seqlen_q", "seqlen_kv")


def list_best(s: Session, *, device: str | None = None, template: str | None = None,
              dtype: str | None = None, variant: str | None = None, offset: int = 0,
              limit: int = 100, templates: Collection[str] | None = None) -> list[BestConfig]:
    """Best configs, filtered, in a stable order: device, template, version, dtype, variant,
    then the problem's numbers (head dim, heads, batch, sequence lengths) compared as numbers.

    ``device`` matches a device's name or its key; ``template`` a template's name (any version);
    ``templates`` any of these names.
    """
    _check_page(offset, limit)
    query = _filter_best(_best_joined(), device, template, dtype, variant, templates)
    numbers = [BestConfig.problem[name].as_integer() for name in _PROBLEM_ORDER]
    query = query.order_by(Device.name, Device.key, Template.name, Template.version,
                           BestConfig.dtype, BestConfig.variant, *numbers,
                           BestConfig.problem_key, BestConfig.id)
    return list(s.scalars(query.offset(offset).limit(limit)))


def count_best(s: Session, *, device: str | None = None, template: str | None = None,
               dtype: str | None = None, variant: str | None = None) -> int:
    """How many best configs ``list_best`` would page through with the same filters."""
    query = (select(func.count(BestConfig.id)).select_from(BestConfig)
             .join(BestConfig.device).join(BestConfig.template))
    return int(s.scalar(_filter_best(query, device, template, dtype, variant)) or 0)



# ----------------------------------------------------------------------------- snapshots
def create_snapshot(s: Session, *, snapshot_id: str, content: str, items: int
                    ) -> tuple[Snapshot, bool]:
    """The snapshot row of ``snapshot_id``, inserted if new, and whether this call inserted it.

    A row is never updated: ``snapshot_id`` is the hash of ``content`` (``tuner.lookup.snapshot``),
    so a row that exists already holds the same content; two processes creating it at once
    both get the one row."""
    existing = s.get(Snapshot, snapshot_id)
    if existing is not None:
        return existing, False
    result = s.execute(dialect_insert(s, Snapshot).values(
        id=snapshot_id, content=content, items=items, created_at=utcnow())
        .on_conflict_do_nothing(index_elements=["id"]))
    row = s.get(Snapshot, snapshot_id)
    assert row is not None  # inserted now or by the winner of a race
    return row, bool(result.rowcount)  # type: ignore[attr-defined]


def get_snapshot(s: Session, *, snapshot_id: str) -> Snapshot | None:
    return s.get(Snapshot, snapshot_id)


def list_snapshots(s: Session, *, offset: int = 0, limit: int = 100
                   ) -> list[tuple[str, int, datetime]]:
    """(id, items, created_at) of stored snapshots, newest first (their content not read)."""
    _check_page(offset, limit)
    return [(sid, items, created) for sid, items, created in s.execute(
        select(Snapshot.id, Snapshot.items, Snapshot.created_at)
        .order_by(Snapshot.created_at.desc(), Snapshot.id).offset(offset).limit(limit))]


def count_snapshots(s: Session) -> int:
    return int(s.scalar(select(func.count(Snapshot.id))) or 0)


def delete_snapshot(s: Session, *, snapshot_id: str) -> tuple[str, int, datetime] | None:
    """Delete the snapshot row of ``snapshot_id``; its (id, items, created_at), or None when
    there is none. Deleting is the only change a snapshot ever sees (an operator removing one
    that no job pins); its content is never rewritten."""
    result = s.execute(delete(Snapshot).where(Snapshot.id == snapshot_id)
                       .returning(Snapshot.id, Snapshot.items, Snapshot.created_at))
    row = result.first()
    return (row[0], row[1], row[2]) if row is not None else None
