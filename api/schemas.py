"""Request and response models of the service.

Responses are the wire models of ``tuner.wire`` (shared with the client); requests are the
query models here. Problem fields come as query parameters and are checked by
``templates.Problem`` itself, so the service and the kernels agree on what a valid problem is.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

from templates.base import Problem
from tuner.lookup.bundle import MAX_HEAD_DIM, MAX_PROBLEM_SIZE, NO_NUL
from tuner.wire import (
    BestOut,
    ConfigPage,
    ConfigRow,
    DemandAccepted,
    DemandClaimOut,
    DemandPage,
    DemandRow,
    DemandStatusName,
    DeviceOut,
    ErrorOut,
    HealthOut,
    Provenance,
    SnapshotCreated,
    SnapshotList,
    SnapshotOut,
    TemplateOut,
    UploadResult,
    WinnersOut,
)

__all__ = [
    "BestOut",
    "BestQuery",
    "ConfigPage",
    "ConfigRow",
    "ConfigsQuery",
    "DemandAccepted",
    "DemandClaimIn",
    "DemandClaimOut",
    "DemandFinishIn",
    "DemandItemIn",
    "DemandLeaseIn",
    "DemandPage",
    "DemandQuery",
    "DemandReleaseIn",
    "DemandReportIn",
    "DemandRow",
    "DeviceOut",
    "ErrorOut",
    "HealthOut",
    "KernelSourceQuery",
    "ProblemQuery",
    "Provenance",
    "SnapshotCreated",
    "SnapshotList",
    "SnapshotOut",
    "SnapshotsQuery",
    "SnapshotFilters",
    "TemplateOut",
    "UploadResult",
    "WinnersOut",
    "WinnersQuery",
]

# Larger than any real attention problem, small enough that products of sizes stay exact (the
# limits of bundle uploads too).
_MAX_SIZE = MAX_PROBLEM_SIZE


class ProblemQuery(BaseModel):
    """An attention problem as query parameters (unknown parameters are an error)."""

    model_config = ConfigDict(extra="forbid")

    batch: int = Field(ge=1, le=_MAX_SIZE)
    heads_q: int = Field(ge=1, le=_MAX_SIZE)
    heads_kv: int | None = Field(None, ge=1, le=_MAX_SIZE, description="default: heads_q")
    seqlen_q: int = Field(ge=1, le=_MAX_SIZE)
    seqlen_kv: int | None = Field(None, ge=1, le=_MAX_SIZE, description="default: seqlen_q")
    head_dim: int = Field(ge=1, le=MAX_HEAD_DIM)
    dtype: Literal["float16", "bfloat16", "float32"] = "bfloat16"
    causal: Literal["none", "top_left", "bottom_right"] = "none"
    mask: str = Field("none", min_length=1, max_length=100, pattern=r"^[A-Za-z0-9_.:+-]+$",
                      description="block-sparse pattern name (e.g. sliding:1024), 'none' for dense")
    softcap: float = Field(0.0, ge=0, allow_inf_nan=False,
                           description="cap of softcapped scores (Gemma 2), 0 for none")

    @model_validator(mode="after")
    def _valid_problem(self) -> Self:
        self.problem()  # Problem's own checks (e.g. heads_q a multiple of heads_kv) -> 422
        return self

    def problem(self) -> Problem:
        return Problem(batch=self.batch, heads_q=self.heads_q,
                       heads_kv=self.heads_kv or self.heads_q, seqlen_q=self.seqlen_q,
                       seqlen_kv=self.seqlen_kv or self.seqlen_q, head_dim=self.head_dim,
                       dtype=self.dtype, causal=self.causal, mask=self.mask,
                       softcap=self.softcap)


class KernelSourceQuery(ProblemQuery):
    # NO_NUL on strings the database compares: PostgreSQL refuses NUL characters outright.
    device: str = Field(min_length=1, max_length=400, pattern=NO_NUL,
                        description="a stored device's key (see /v1/devices), name or unique "
                                    "key prefix (one that fits several is a 422 listing "
                                    "them); other keys get the default config of the family "
                                    "the key names")


class BestQuery(KernelSourceQuery):
    template: str = Field(min_length=1, max_length=100, pattern=NO_NUL)
    template_version: str | None = Field(
        None, min_length=1, max_length=64, pattern=NO_NUL,
        description="kernel version the caller runs (default: the service's)")
    compare: bool = Field(
        False, description="also compare the implementations of the problem "
                           "(``implementations``: the winner, the runner-up, each one's and "
                           "each SDPA backend's time), at the service's kernel versions")


class ConfigsQuery(BaseModel):
    model_config = ConfigDict(extra="forbid")

    device: str | None = Field(None, max_length=400, pattern=NO_NUL,
                               description="device name or key")
    template: str | None = Field(None, max_length=100, pattern=NO_NUL)
    dtype: Literal["float16", "bfloat16", "float32"] | None = None
    variant: str | None = Field(None, max_length=100, pattern=NO_NUL,
                                description="e.g. dense, causal-top_left")
    offset: int = Field(0, ge=0, le=10_000_000)
    limit: int = Field(100, ge=1, le=1000)


class WinnersQuery(BaseModel):
    model_config = ConfigDict(extra="forbid")

    device: str = Field(min_length=1, max_length=400, pattern=NO_NUL,
                        description="a stored device's key (see /v1/devices), name or unique key "
                                    "prefix (one that fits several is a 422 listing them)")
    dtype: Literal["float16", "bfloat16", "float32"] | None = Field(
        None, description="only problems of this dtype (default: every dtype)")


class SnapshotFilters(BaseModel):
    """Which best configs ``POST /v1/snapshots`` freezes (none given: all of them)."""

    model_config = ConfigDict(extra="forbid")

    device: str | None = Field(None, min_length=1, max_length=400, pattern=NO_NUL,
                               description="device name or key")
    template: str | None = Field(None, min_length=1, max_length=100, pattern=NO_NUL)
    dtype: Literal["float16", "bfloat16", "float32"] | None = None
    variant: str | None = Field(None, min_length=1, max_length=100, pattern=NO_NUL,
                                description="e.g. dense, causal-top_left")


class SnapshotsQuery(BaseModel):
    model_config = ConfigDict(extra="forbid")

    offset: int = Field(0, ge=0, le=10_000_000)
    limit: int = Field(100, ge=1, le=1000)


# A device key as templates.device.DeviceInfo.key writes it:
# name|cc<cc>|triton<v>|torch<v>|cuda<v>, then |cudnn<v> where the device has cuDNN.
DEVICE_KEY = (r"^[^|\x00]+\|cc[0-9.]*\|triton[^|\x00]*\|torch[^|\x00]*\|cuda[^|\x00]*"
              r"(\|cudnn[^|\x00]*)?$")
MAX_DEMAND_ITEMS = 500  # per report; a client sends at most tuner.demand.reporter.BATCH_ITEMS
MAX_DEMAND_COUNT = 1_000_000  # per item: far above what one process notes between reports


class DemandItemIn(BaseModel):
    """One problem a job ran without a tuned config, and how often since its last report."""

    model_config = ConfigDict(extra="forbid")

    template: str = Field(min_length=1, max_length=100, pattern=NO_NUL)
    template_version: str = Field(min_length=1, max_length=64, pattern=NO_NUL,
                                  description="the version the job runs: the service's own")
    device: str = Field(min_length=1, max_length=400, pattern=DEVICE_KEY,
                        description="the job's device key (DeviceInfo.key)")
    problem: dict[str, Any] = Field(description="the problem's fields, as /v1/best takes them "
                                                "(batch, heads_q, ..., checked per item)")
    count: int = Field(strict=True, ge=1, le=MAX_DEMAND_COUNT,
                       description="how often it ran untuned since the last report")


class DemandReportIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    items: list[DemandItemIn] = Field(min_length=1, max_length=MAX_DEMAND_ITEMS)


class DemandQuery(BaseModel):
    model_config = ConfigDict(extra="forbid")

    device: str | None = Field(None, max_length=400, pattern=NO_NUL, description="device key")
    template: str | None = Field(None, max_length=100, pattern=NO_NUL)
    status: DemandStatusName | None = None
    offset: int = Field(0, ge=0, le=10_000_000)
    limit: int = Field(100, ge=1, le=1000)


# ----------------------------------------------------------------------------- workers' claims
# What a claim asks for, as ``tuner worker`` sets it (tuner.demand.worker.WorkerOptions checks the
# same bounds on its side).
MAX_LEASE_S = 24 * 3600.0
MAX_CLAIM_ATTEMPTS = 100
MAX_NOTE = 2000
WorkerName = Annotated[str, Field(min_length=1, max_length=200, pattern=NO_NUL,
                                  description="who holds the claim (tuner worker: host:pid)")]
TemplateName = Annotated[str, Field(min_length=1, max_length=100, pattern=NO_NUL)]
TemplateVersion = Annotated[str, Field(min_length=1, max_length=64, pattern=NO_NUL)]


class DemandClaimIn(BaseModel):
    """A worker asking for the most reported problem of its device and kernel versions."""

    model_config = ConfigDict(extra="forbid")

    device: str = Field(min_length=1, max_length=400, pattern=DEVICE_KEY,
                        description="the worker's device key (DeviceInfo.key)")
    templates: dict[TemplateName, TemplateVersion] = Field(
        min_length=1, max_length=200,
        description="template name -> the version the worker runs: the rows it can tune")
    worker: WorkerName
    lease_s: float = Field(300.0, ge=3, le=MAX_LEASE_S,
                           description="seconds the claim holds unless renewed")
    max_attempts: int = Field(3, ge=1, le=MAX_CLAIM_ATTEMPTS,
                              description="claims of one row whose workers all stopped "
                                          "renewing before it is given up (failed)")


class DemandLeaseIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    worker: WorkerName
    lease_s: float = Field(300.0, ge=3, le=MAX_LEASE_S,
                           description="seconds from now the claim holds unless renewed")


class DemandFinishIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    worker: WorkerName
    status: Literal["done", "failed"]
    note: str = Field("", max_length=MAX_NOTE, pattern=NO_NUL,
                      description="what the worker found: the best TFLOP/s, or why it failed")


class DemandReleaseIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    worker: WorkerName
    note: str = Field("", max_length=MAX_NOTE, pattern=NO_NUL,
                      description="why it is given back")
