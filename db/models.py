"""Typed SQLAlchemy 2.0 models of the project database.

    Device ─┐
    Template ┼─< Trial >── Sweep
             │     ├──< Remeasurement >── Sweep   (a finalist measured again)
             │     └──< HeadToHeadReading >── HeadToHead >── Device, Sweep
             │                                (the bests of a problem's implementations,
             │                                 measured side by side)
             └─< BestConfig ── Trial (the one it came from)

    Snapshot (best configs frozen as a bundle, named by the hash of its content)
    Demand   (what jobs ran untuned, by device key, template version and shape bucket;
              keyed by strings: a job's device need not have any stored row)
    BestChanges (one row: changes of best configs, devices and templates, counted by
              triggers on SQLite, so the service's cache ignores other commits)

Optuna's own tables (studies, trials, ...) live in the same database, created by Optuna's
RDB storage, so ``optuna-dashboard <database url>`` shows every sweep.
"""

from __future__ import annotations

import enum
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    DateTime,
    Enum,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
    event,
    insert,
)
from sqlalchemy.engine import Connection
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship


def utcnow() -> datetime:
    return datetime.now(UTC)


class Base(DeclarativeBase):
    type_annotation_map = {dict[str, Any]: JSON, datetime: DateTime(timezone=True)}


class TrialStatus(enum.StrEnum):
    OK = "ok"
    INVALID = "invalid"  # rejected by a static constraint, never compiled
    COMPILE_ERROR = "compile_error"
    RUNTIME_ERROR = "runtime_error"  # includes crashes of the worker process
    WRONG_RESULT = "wrong_result"  # ran, but the output missed the reference tolerance
    TIMEOUT = "timeout"


class SweepStatus(enum.StrEnum):
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    INTERRUPTED = "interrupted"


class DemandStatus(enum.StrEnum):
    OPEN = "open"  # waiting for a worker
    CLAIMED = "claimed"  # a worker tunes it while its lease lasts
    DONE = "done"  # tuned: a best config is stored
    FAILED = "failed"  # the worker could not tune it (the note says why); not retried


class Device(Base):
    """A tuning target: the chip and the software versions that change which config wins."""

    __tablename__ = "devices"

    id: Mapped[int] = mapped_column(primary_key=True)
    key: Mapped[str] = mapped_column(String(400), unique=True)
    name: Mapped[str] = mapped_column(String(200), index=True)
    compute_capability: Mapped[str] = mapped_column(String(16))
    sm_count: Mapped[int] = mapped_column(Integer)
    total_memory: Mapped[int] = mapped_column(BigInteger)
    driver_version: Mapped[str] = mapped_column(String(64))
    triton_version: Mapped[str] = mapped_column(String(64))
    torch_version: Mapped[str] = mapped_column(String(64))
    cuda_version: Mapped[str] = mapped_column(String(64))
    # NULL: no cuDNN (the CPU), or a device stored before the cuDNN version was recorded
    # (migration 0004); either way its key has no cuDNN part.
    cudnn_version: Mapped[str | None] = mapped_column(String(64), default=None)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class Template(Base):
    """A kernel template at one version (hash of its kernel source)."""

    __tablename__ = "templates"
    __table_args__ = (UniqueConstraint("name", "version"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(100), index=True)
    version: Mapped[str] = mapped_column(String(64))
    space: Mapped[dict[str, Any]] = mapped_column(default=dict)  # JSON schema of its config
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class Sweep(Base):
    __tablename__ = "sweeps"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(200), index=True)
    spec: Mapped[dict[str, Any]] = mapped_column(default=dict)
    host: Mapped[str] = mapped_column(String(200))
    status: Mapped[SweepStatus] = mapped_column(
        Enum(SweepStatus, native_enum=False, length=20, values_callable=lambda e: [m.value for m in e]),
        default=SweepStatus.RUNNING)
    started_at: Mapped[datetime] = mapped_column(default=utcnow)
    finished_at: Mapped[datetime | None] = mapped_column(default=None)

    trials: Mapped[list[Trial]] = relationship(back_populates="sweep")


class Trial(Base):
    """One measured (or rejected) config of one problem on one device.

    Unique per device x template version x problem x config: a config measured once is never
    measured again (resume after a kill, several workers on one sweep).
    """

    # Not "trials": Optuna's table of that name lives in the same database.
    __tablename__ = "tuning_trials"
    __table_args__ = (UniqueConstraint("device_id", "template_id", "problem_key", "config_key"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    sweep_id: Mapped[int | None] = mapped_column(ForeignKey("sweeps.id"), index=True)
    device_id: Mapped[int] = mapped_column(ForeignKey("devices.id"), index=True)
    template_id: Mapped[int] = mapped_column(ForeignKey("templates.id"), index=True)
    problem_key: Mapped[str] = mapped_column(String(300), index=True)
    problem: Mapped[dict[str, Any]] = mapped_column()
    config_key: Mapped[str] = mapped_column(String(500))
    config: Mapped[dict[str, Any]] = mapped_column()
    status: Mapped[TrialStatus] = mapped_column(
        Enum(TrialStatus, native_enum=False, length=20, values_callable=lambda e: [m.value for m in e]))
    reason: Mapped[str] = mapped_column(Text, default="")
    median_ms: Mapped[float | None] = mapped_column(Float, default=None)
    tflops: Mapped[float | None] = mapped_column(Float, default=None)
    compile_s: Mapped[float | None] = mapped_column(Float, default=None)
    error: Mapped[float | None] = mapped_column(Float, default=None)  # relative error vs reference
    is_default: Mapped[bool] = mapped_column(default=False)
    # Where the worker's time went (seconds per phase: TrialOutcome.phase_record); NULL for a
    # config rejected by a constraint, or a row stored before migration 0009.
    phases: Mapped[dict[str, Any] | None] = mapped_column(default=None)
    optuna_study: Mapped[str | None] = mapped_column(String(500), default=None)
    optuna_trial: Mapped[int | None] = mapped_column(Integer, default=None)
    worker: Mapped[str] = mapped_column(String(200), default="")
    created_at: Mapped[datetime] = mapped_column(default=utcnow)

    sweep: Mapped[Sweep | None] = relationship(back_populates="trials")
    device: Mapped[Device] = relationship()
    template: Mapped[Template] = relationship()


class BestConfig(Base):
    """The best measured config per device x template version x problem key (shape bucket)."""

    __tablename__ = "best_configs"
    __table_args__ = (UniqueConstraint("device_id", "template_id", "problem_key"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    device_id: Mapped[int] = mapped_column(ForeignKey("devices.id"), index=True)
    template_id: Mapped[int] = mapped_column(ForeignKey("templates.id"), index=True)
    problem_key: Mapped[str] = mapped_column(String(300), index=True)
    problem: Mapped[dict[str, Any]] = mapped_column()
    dtype: Mapped[str] = mapped_column(String(20), index=True)
    variant: Mapped[str] = mapped_column(String(100), index=True)
    config: Mapped[dict[str, Any]] = mapped_column()
    median_ms: Mapped[float] = mapped_column(Float)
    tflops: Mapped[float] = mapped_column(Float)
    default_tflops: Mapped[float | None] = mapped_column(Float, default=None)
    speedup: Mapped[float | None] = mapped_column(Float, default=None)  # over the default config
    trial_id: Mapped[int | None] = mapped_column(ForeignKey("tuning_trials.id"), default=None)
    sweep_id: Mapped[int | None] = mapped_column(ForeignKey("sweeps.id"), default=None)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)

    device: Mapped[Device] = relationship()
    template: Mapped[Template] = relationship()
    trial: Mapped[Trial | None] = relationship()


class Reading:
    """The columns of one more measurement of a stored trial: a finalist's re-measurement or a
    head-to-head reading."""

    status: Mapped[TrialStatus] = mapped_column(
        Enum(TrialStatus, native_enum=False, length=20, values_callable=lambda e: [m.value for m in e]))
    reason: Mapped[str] = mapped_column(Text, default="")
    median_ms: Mapped[float | None] = mapped_column(Float, default=None)
    tflops: Mapped[float | None] = mapped_column(Float, default=None)
    error: Mapped[float | None] = mapped_column(Float, default=None)  # relative error vs reference
    # Where the worker's time went, as Trial.phases (NULL before migration 0009)
    phases: Mapped[dict[str, Any] | None] = mapped_column(default=None)


class Remeasurement(Reading, Base):
    """One more measurement of a finalist, one of the few best configs of a problem, taken at
    the end of a search (``db.finalists``). The trial keeps its first measurement; every
    re-measurement is a row of its own, so nothing measured is lost or rewritten."""

    __tablename__ = "remeasurements"

    id: Mapped[int] = mapped_column(primary_key=True)
    trial_id: Mapped[int] = mapped_column(ForeignKey("tuning_trials.id"), index=True)
    sweep_id: Mapped[int | None] = mapped_column(ForeignKey("sweeps.id"), index=True)
    worker: Mapped[str] = mapped_column(String(200), default="")
    created_at: Mapped[datetime] = mapped_column(default=utcnow)

    trial: Mapped[Trial] = relationship()


class RemeasurementClaim(Base):
    """A worker's claim on one re-measurement of a finalist while it measures it: taken before
    measuring, only while the finalist's re-measurements and live claims are fewer than it
    needs, and dropped with the re-measurement it stands for. Workers that finish a search
    together then share the finalists' re-measurements instead of each taking them all
    (issue 19: 2x the requested count). ``beat_at`` is renewed while the worker measures; a
    claim whose worker stopped renewing it (or died) is taken over."""

    __tablename__ = "remeasurement_claims"

    id: Mapped[int] = mapped_column(primary_key=True)
    trial_id: Mapped[int] = mapped_column(ForeignKey("tuning_trials.id"), index=True)
    worker: Mapped[str] = mapped_column(String(200))
    beat_at: Mapped[datetime] = mapped_column(default=utcnow)


class HeadToHead(Base):
    """One side-by-side session of a problem on a device: the stored best config of each of
    its implementations' templates measured in one process, interleaved and rotated over
    ``rounds`` rounds (``tuner.tuning.head_to_head``; once finished, the rounds that ran: a close
    call's two fastest take more). Its readings price those bests only once it is
    finished (``finished_at``): a session killed half-way keeps what it measured, for the
    record, but changes no choice."""

    __tablename__ = "head_to_heads"

    id: Mapped[int] = mapped_column(primary_key=True)
    device_id: Mapped[int] = mapped_column(ForeignKey("devices.id"), index=True)
    sweep_id: Mapped[int | None] = mapped_column(ForeignKey("sweeps.id"), index=True,
                                                 default=None)
    problem: Mapped[dict[str, Any]] = mapped_column()  # what every candidate ran
    rounds: Mapped[int] = mapped_column(Integer)
    worker: Mapped[str] = mapped_column(String(200), default="")
    started_at: Mapped[datetime] = mapped_column(default=utcnow)
    finished_at: Mapped[datetime | None] = mapped_column(default=None)


class HeadToHeadReading(Reading, Base):
    """One measurement of one candidate (a template's best trial) in one round of a
    head-to-head session; ``position`` is its place in the round's order."""

    __tablename__ = "head_to_head_readings"

    id: Mapped[int] = mapped_column(primary_key=True)
    head_to_head_id: Mapped[int] = mapped_column(ForeignKey("head_to_heads.id"), index=True)
    trial_id: Mapped[int] = mapped_column(ForeignKey("tuning_trials.id"), index=True)
    round: Mapped[int] = mapped_column(Integer)
    position: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class Snapshot(Base):
    """Best configs frozen at one moment: a bundle's canonical JSON text, named by its SHA-256
    (``tuner.lookup.snapshot``). Rows are inserted, and deleted whole by an operator (``tuner
    snapshot delete``), never updated: the same content is the same row, and a row's content
    never changes (a reader re-hashes it against its id)."""

    __tablename__ = "snapshots"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)  # sha256 hex of content
    content: Mapped[str] = mapped_column(Text)  # canonical JSON of the bundle
    items: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(default=utcnow, index=True)


class Demand(Base):
    """How often jobs ran one shape bucket of one template version on one device without a
    tuned config (``tuner.demand.reporter`` counts them, ``POST /v1/demand`` stores them), and who
    tunes it (``tuner worker``). One row per bucket: a sweep tunes one problem per bucket and
    its config serves them all; ``problem`` is the first one reported, the one a worker tunes.

    A worker claims an open row (or one whose ``lease_until`` has passed: its worker died)
    and renews the lease while it tunes; ``attempts`` counts the claims, so a problem that
    kills every worker that takes it is given up after a few."""

    __tablename__ = "demand"
    __table_args__ = (
        UniqueConstraint("device_key", "template", "template_version", "problem_key"),
        # The claim's query: one device's rows by status, most reported first.
        Index("ix_demand_device_status", "device_key", "status"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    device_key: Mapped[str] = mapped_column(String(400))
    template: Mapped[str] = mapped_column(String(100))
    template_version: Mapped[str] = mapped_column(String(64))
    problem_key: Mapped[str] = mapped_column(String(300))
    problem: Mapped[dict[str, Any]] = mapped_column()
    reports: Mapped[int] = mapped_column(BigInteger, default=0)
    status: Mapped[DemandStatus] = mapped_column(
        Enum(DemandStatus, native_enum=False, length=20, values_callable=lambda e: [m.value for m in e]),
        default=DemandStatus.OPEN)
    worker: Mapped[str] = mapped_column(String(200), default="")
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    claimed_at: Mapped[datetime | None] = mapped_column(default=None)
    lease_until: Mapped[datetime | None] = mapped_column(default=None)
    finished_at: Mapped[datetime | None] = mapped_column(default=None)
    note: Mapped[str] = mapped_column(Text, default="")
    first_seen: Mapped[datetime] = mapped_column(default=utcnow)
    last_seen: Mapped[datetime] = mapped_column(default=utcnow)


class BestChanges(Base):
    """One row (``id`` 1) counting the changes of what the service's answers are cached from:
    best configs, devices and template versions (``api.answers.BestCache``).

    On SQLite, triggers on those three tables add one to ``changes`` for every row inserted,
    updated or deleted, by whichever process writes (a sweep, an upload, an import). The
    service learns that *some* connection committed from SQLite's ``data_version`` (cheap, no
    query) and then reads this counter, so a commit that changed none of those tables (demand
    counts stored once a second, a worker's claim) does not make every cached answer be
    re-checked before the next read (issue 18: that stall, once a second, was part of the
    reads' tail beside 10,000 demand reports/s). ``api.changes`` uses the counter only where
    all the triggers exist (``BEST_CHANGES_TRIGGERS``), else it takes every commit as a
    change, as before: a migration that rebuilds one of the tables on SQLite (Alembic's batch
    mode copies it) drops its triggers and must create them again.

    PostgreSQL does not use it: ``db.crud.refresh_bests`` notifies the service there."""

    __tablename__ = "best_changes"

    id: Mapped[int] = mapped_column(primary_key=True)
    changes: Mapped[int] = mapped_column(BigInteger, default=0)


BEST_CHANGES_WATCHED = ("best_configs", "devices", "templates")
BEST_CHANGES_TRIGGERS = tuple(f"best_changes_{table}_{op}" for table in BEST_CHANGES_WATCHED
                              for op in ("insert", "update", "delete"))


def best_changes_sqlite_triggers() -> list[str]:
    """The ``CREATE TRIGGER`` statements of ``BestChanges`` (SQLite only)."""
    return [f"CREATE TRIGGER best_changes_{table}_{op} AFTER {op.upper()} ON {table} "
            f"BEGIN UPDATE best_changes SET changes = changes + 1 WHERE id = 1; END"
            for table in BEST_CHANGES_WATCHED for op in ("insert", "update", "delete")]


@event.listens_for(Base.metadata, "after_create")
def _create_best_changes(_metadata: Any, connection: Connection, **kw: Any) -> None:
    """``create_all`` (tests, scripts) makes the counter's row and triggers, as migration 0008
    does."""
    if BestChanges.__table__ not in kw.get("tables", ()):
        return
    connection.execute(insert(BestChanges).values(id=1, changes=0))
    if connection.dialect.name == "sqlite":
        for statement in best_changes_sqlite_triggers():
            connection.exec_driver_sql(statement)
