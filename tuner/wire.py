"""The JSON shapes the config service answers with, shared by the service and its client.

They live here, not in ``api/``, because the client (and ``tuner.attention`` behind it) must
parse answers without importing FastAPI; ``api/schemas.py`` re-exports them.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

MatchKind = Literal["exact", "bucket", "nearest", "default"]
MATCH_KINDS: tuple[MatchKind, ...] = ("exact", "bucket", "nearest", "default")


def _as_utc(value: datetime) -> datetime:
    # The database stores UTC (db.models.utcnow), but SQLite hands times back without their
    # offset: a naive time here is UTC. An answer without an offset is no RFC 3339 date-time,
    # the format the OpenAPI schema promises.
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value


UtcDateTime = Annotated[datetime, AfterValidator(_as_utc)]


# The fields came after the others: an answer of an older service has neither (None here).
READINGS_DESCRIPTION = (
    "how many timings median_ms is the median of: the config's first reading and its OK "
    "re-measurements as a finalist (1: measured once)")
SPREAD_DESCRIPTION = (
    "(slowest - fastest) / median of those readings: the config's own run-to-run noise; "
    "None with a single reading")


def readings_text(readings: int | None, spread: float | None) -> str:
    """A stored best's readings for a table cell: their count and, with two or more, their
    spread, e.g. "3 (4.1%)"; "-" when unknown."""
    if readings is None:
        return "-"
    return f"{readings} ({spread * 100:.1f}%)" if spread is not None else str(readings)


class WireModel(BaseModel):
    # Answers from a newer service may carry fields this client does not know: ignore them.
    model_config = ConfigDict(extra="ignore", frozen=True)


class BackendTime(WireModel):
    """One SDPA backend's best measurement of a problem (``ProblemWinner.sdpa_backends``)."""

    median_ms: float
    tflops: float
    readings: int = Field(ge=1, description="how many timings median_ms is the median of, as "
                                            "for a stored best")


def backends_text(backends: Mapping[str, BackendTime]) -> str:
    """SDPA backends' times for a table cell, fastest first, e.g. "cudnn 0.912 ms, flash
    1.02 ms"; "-" when none."""
    ranked = sorted(backends.items(), key=lambda item: item[1].median_ms)
    return ", ".join(f"{name} {_ms_text(t.median_ms)} ms" for name, t in ranked) or "-"


def _ms_text(ms: float) -> str:
    # GPU times are fractions of a millisecond to tens; the interpreter's run to thousands.
    return f"{ms:.3g}" if ms < 100 else f"{ms:.0f}"


class DeviceOut(WireModel):
    key: str
    name: str
    compute_capability: str
    sm_count: int
    total_memory: int
    driver_version: str
    triton_version: str
    torch_version: str
    cuda_version: str
    cudnn_version: str | None = Field(
        None, description="cuDNN as torch loads it, part of the key; None: no cuDNN, or stored "
                          "before it was recorded")
    created_at: UtcDateTime | None = None


class TemplateOut(WireModel):
    name: str
    version: str = Field(description="hash of the kernel source this service runs")
    description: str
    config_schema: dict[str, Any] = Field(description="JSON schema of the template's config")
    grid_size: int = Field(description="number of configs in the full search space")
    versions_in_database: list[str] = Field(
        default_factory=list, description="versions with stored results, newest first")


class Provenance(WireModel):
    sweep_id: int | None = None
    sweep_name: str | None = None
    measured_at: UtcDateTime | None = None
    triton_version: str | None = None
    torch_version: str | None = None


class NeighbourOut(WireModel):
    """A stored best of a neighbouring bucket: what the dispatcher compares implementations on
    when the asked problem's own bucket has no torch SDPA measurement (docs/DISPATCH.md,
    "Deciding on a neighbour")."""

    problem_key: str = Field(description="the neighbouring bucket")
    problem: dict[str, Any] = Field(description="the problem measured there")
    config: dict[str, Any] = Field(description="its best config, which runs the asked problem")
    tflops: float = Field(description="measured on ``problem``")


class ImplementationTime(WireModel):
    """One implementation's time for a problem, as the dispatcher prices it
    (``ImplementationsCompared.times``)."""

    template: str = Field(description="the template that prices it (its forward kernel)")
    problem_key: str = Field(description="the bucket its stored best was measured on: the "
                                         "problem's own, or the neighbour decided on")
    config: dict[str, Any] = Field(description="its stored best's config (torch_sdpa's names "
                                               "the SDPA backend)")
    ms: float = Field(description="the compared time: the FLOPs of the problem compared on "
                                  "(the asked one, or on a neighbour the one SDPA measured "
                                  "there) over the stored TFLOP/s, as the dispatcher prices")
    tflops: float
    measured_ms: float = Field(description="the stored best's own median time, on the problem "
                                           "it measured")
    readings: int = Field(ge=1, description=READINGS_DESCRIPTION)
    head_to_head: int | None = Field(
        None, description="the head-to-head (session id) whose side-by-side readings "
                          "measured_ms and tflops are the median of; None: the config's own "
                          "search readings (no head-to-head of the problem finished with it)")


class ImplementationsCompared(WireModel):
    """Which implementation ``tuner.attention`` runs a problem with on a device (inference),
    the runner-up, every measured implementation's time and each SDPA backend's: the
    dispatcher's rule (``tuner.dispatch.rule.decide``) over the stored bests (docs/DISPATCH.md)."""

    winner: str = Field(description="the implementation that runs")
    runner_up: str | None = Field(
        None, description="the fastest other implementation compared (None: none measured)")
    runner_up_ratio: float | None = Field(
        None, description="the runner-up's time over the winner's (> 1: the winner is "
                          "faster; below 1 only where a neighbour's win fell short of the "
                          "margin and SDPA runs)")
    why: str = Field(description="the dispatcher's reason")
    neighbour: str | None = Field(
        None, description="the neighbouring bucket the choice was decided on (the problem's "
                          "own bucket has no torch_sdpa measurement); the times are then "
                          "the neighbour's")
    times: dict[str, ImplementationTime] = Field(
        default_factory=dict, description="by implementation, fastest first: those compared")
    sdpa_backends: dict[str, BackendTime] = Field(
        default_factory=dict,
        description="by SDPA backend, fastest first: its best OK measurement of the bucket "
                    "torch_sdpa's time comes from (as GET /v1/winners' sdpa_backends)")


class BestOut(WireModel):
    template: str
    template_version: str
    device: str = Field(description="device key the answer is for")
    problem: dict[str, Any] = Field(description="the problem asked about")
    problem_key: str = Field(description="its shape bucket")
    match: MatchKind = Field(description="exact: this very problem was tuned; bucket: a problem "
                             "of the same shape bucket; nearest: the closest tuned shape with the "
                             "same dtype, variant, head dim and GQA ratio; default: the "
                             "template's heuristic, nothing tuned")
    config: dict[str, Any]
    matched_problem: dict[str, Any] | None = Field(
        None, description="the tuned problem the config comes from (None for default)")
    tflops: float | None = None
    median_ms: float | None = None
    default_tflops: float | None = None
    speedup: float | None = Field(None, description="tuned over default config, same problem")
    readings: int | None = Field(None, ge=1, description=READINGS_DESCRIPTION
                                 + " (None for match default)")
    spread: float | None = Field(None, ge=0, description=SPREAD_DESCRIPTION)
    provenance: Provenance | None = None
    # Came after the others: an answer of an older service has none ([] here).
    neighbours: list[NeighbourOut] = Field(
        default_factory=list,
        description="for a nearest match: the stored bests of the other buckets of the "
                    "problem's family (dtype, variant, head dim, GQA ratio) whose configs run "
                    "it, nearest first, as a local database's lookup finds them; a client "
                    "decides on them which implementation runs (docs/DISPATCH.md); else empty")
    implementations: ImplementationsCompared | None = Field(
        None, description="with compare=true: which implementation runs the problem, the "
                          "runner-up, every implementation's and each SDPA backend's time "
                          "(None without it)")


class ConfigRow(WireModel):
    device: str
    device_name: str
    template: str
    template_version: str
    problem_key: str
    problem: dict[str, Any]
    dtype: str
    variant: str
    config: dict[str, Any]
    tflops: float
    median_ms: float
    default_tflops: float | None = None
    speedup: float | None = None
    readings: int | None = Field(None, ge=1, description=READINGS_DESCRIPTION)
    spread: float | None = Field(None, ge=0, description=SPREAD_DESCRIPTION)
    sweep_id: int | None = None
    updated_at: UtcDateTime | None = None


class ConfigPage(WireModel):
    items: list[ConfigRow]
    total: int
    offset: int
    limit: int


class ProblemWinner(WireModel):
    """One stored problem of a device: which implementation ``tuner.attention`` runs for it,
    and every measured implementation beside it (``tuner.dispatch.winners``)."""

    problem_key: str = Field(description="the shape bucket the bests are stored under")
    problem: dict[str, Any] = Field(description="the tuned problem of the bucket")
    winner: str = Field(description="the implementation the dispatcher runs (docs/DISPATCH.md)")
    runner_up: str | None = Field(
        None, description="the fastest other measured implementation (None: only one measured)")
    margin: float | None = Field(
        None, description="winner's TFLOP/s over the runner-up's; None when torch_sdpa is not "
                          "measured (SDPA then runs by rule, not by measurement) or nothing else is")
    why: str
    tflops: dict[str, float] = Field(description="by implementation: its stored best's TFLOP/s")
    median_ms: dict[str, float] = Field(
        default_factory=dict, description="by implementation: its stored best's median time")
    configs: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="by implementation: the config of its stored best "
                                          "(torch_sdpa's names the SDPA backend)")
    # Came after the others: an answer of an older service has none ({} here).
    head_to_head: dict[str, int] = Field(
        default_factory=dict,
        description="by implementation whose stored best took part in a finished head-to-head "
                    "of the problem: that head-to-head's id (its tflops and median_ms are the "
                    "median of the side-by-side readings there); others are absent")
    decided: bool | None = Field(
        None, description="whether the winner's and the runner-up's readings in the head-to-head "
                          "both come from tell them apart (their ranges apart, or a sign test "
                          "over its rounds at p <= 0.05, tuner.dispatch.close_calls); false: "
                          "within the readings' noise, either would do; null: not read in one "
                          "head-to-head")
    sdpa_backends: dict[str, BackendTime] = Field(
        default_factory=dict,
        description="by SDPA backend (torch_sdpa's backend knob: cudnn, flash, efficient, "
                    "default), fastest first: its best OK measurement of this problem at the "
                    "compared kernel version, timed as a stored best is (the median of its "
                    "re-measurements, or of its latest head-to-head); a backend that failed, "
                    "or was not measured, is absent")


class WinnersOut(WireModel):
    device: str = Field(description="key of the device the problems were tuned on")
    device_name: str
    items: list[ProblemWinner]
    stale: int = Field(0, description="bests of these implementations stored for other kernel "
                                      "versions than the ones compared (left out)")


class UploadResult(WireModel):
    items: int = Field(description="items in the bundle, all stored")
    trials: int = Field(description="trial rows written (default-config measurements included)")
    best_updated: int = Field(description="best-config rows created or changed")
    remeasurements: int = Field(0, description="finalists' re-measurement rows written with "
                                "the new trials (bundle version 2)")


class SnapshotSummary(WireModel):
    id: str = Field(description="SHA-256 of the snapshot's canonical content, 64 hex digits")
    items: int = Field(description="best configs it holds")
    created_at: UtcDateTime


class SnapshotCreated(SnapshotSummary):
    created: bool = Field(description="false: the same content was frozen before, under the "
                          "same id")


class SnapshotOut(SnapshotSummary):
    bundle: dict[str, Any] = Field(description="its content: a bundle (as `tuner export` "
                                   "writes one) whose canonical JSON text hashes to the id")


class SnapshotList(WireModel):
    items: list[SnapshotSummary]
    total: int
    offset: int
    limit: int


class HealthOut(WireModel):
    status: Literal["ok", "degraded"]
    database: str
    templates: int


DemandStatusName = Literal["open", "claimed", "expired", "done", "failed"]
DEMAND_STATUS_DESCRIPTION = (
    "open: waiting for a worker; claimed: a worker tunes it (lease_until: until when its claim "
    "holds unless renewed); expired: claimed, but the lease passed (the worker died): the "
    "next worker takes it over; done: tuned; failed: could not be tuned (note says why)")


class DemandRejection(WireModel):
    index: int = Field(description="the item's index in the report")
    reason: str


class DemandAccepted(WireModel):
    accepted: int = Field(description="items counted")
    reports: int = Field(description="the reports they carry (the sum of their counts)")
    rejected: list[DemandRejection] = Field(
        default_factory=list, description="items refused, and why (at most the first 20)")
    rejected_count: int = Field(0, description="items refused in all")
    dropped: int = Field(0, description="valid items not counted: the service held as many "
                                        "uncounted buckets as it may (try again later)")


class DemandRow(WireModel):
    # Optional: a service of an older release does not send it.
    id: int | None = Field(None, description="the row's id: what a worker's claim names")
    device: str = Field(description="device key the problem ran on")
    template: str
    template_version: str
    problem_key: str = Field(description="its shape bucket: one row per bucket")
    problem: dict[str, Any] = Field(description="the first problem reported for the bucket: "
                                                "the one a worker tunes")
    reports: int = Field(description="how often jobs reported running the bucket untuned")
    status: DemandStatusName = Field(description=DEMAND_STATUS_DESCRIPTION)
    worker: str = Field(description="the worker that holds (or last held) the claim")
    attempts: int = Field(description="claims taken so far")
    claimed_at: UtcDateTime | None = None
    lease_until: UtcDateTime | None = None
    finished_at: UtcDateTime | None = None
    note: str = Field(description="what the worker found (best TFLOP/s, or why it failed)")
    first_seen: UtcDateTime
    last_seen: UtcDateTime


class DemandPage(WireModel):
    items: list[DemandRow]
    total: int
    offset: int
    limit: int


class DemandClaimOut(WireModel):
    claim: DemandRow | None = Field(description="the row claimed for the worker (its status "
                                                "claimed, until lease_until unless renewed), or "
                                                "null: nothing of its device and versions waits")


class ErrorOut(WireModel):
    detail: Any = Field(description="what was wrong: a sentence, or a list of field errors")
