"""Request and response models of the service.

Responses are the wire models of ``tuner.wire`` (shared with the client); requests are the
query models here. Problem fields come as query parameters and are checked by
``templates.Problem`` itself, so the service and the kernels agree on what a valid problem is.
"""

from __future__ import annotations

from typing import Literal, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

from templates.base import Problem
from tuner.bundle import MAX_HEAD_DIM, MAX_PROBLEM_SIZE, NO_NUL
from tuner.wire import (
    BestOut,
    ConfigPage,
    ConfigRow,
    DeviceOut,
    ErrorOut,
    HealthOut,
    Provenance,
    TemplateOut,
    UploadResult,
)

__all__ = [
    "BestOut",
    "BestQuery",
    "ConfigPage",
    "ConfigRow",
    "ConfigsQuery",
    "DeviceOut",
    "ErrorOut",
    "HealthOut",
    "KernelSourceQuery",
    "ProblemQuery",
    "Provenance",
    "TemplateOut",
    "UploadResult",
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

    @model_validator(mode="after")
    def _valid_problem(self) -> Self:
        self.problem()  # Problem's own checks (e.g. heads_q a multiple of heads_kv) -> 422
        return self

    def problem(self) -> Problem:
        return Problem(batch=self.batch, heads_q=self.heads_q,
                       heads_kv=self.heads_kv or self.heads_q, seqlen_q=self.seqlen_q,
                       seqlen_kv=self.seqlen_kv or self.seqlen_q, head_dim=self.head_dim,
                       dtype=self.dtype, causal=self.causal, mask=self.mask)


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
