"""The shipped table's format: one JSON file per GPU model, the stored bests of one sweep.

::

    {"format": "attention-tuner/shipped", "version": 1,
     "device": {"key": ..., "name": "NVIDIA H200", "compute_capability": "9.0",
                "triton_version": "3.6.0", "torch_version": "2.11.0", "cuda_version": "13.0",
                "cudnn_version": "9.19.0"},                 (the device it was measured on)
     "suite": "standard", "source": "database sqlite:///sweep.db (sweeps: standard)",
     "generated_at": "2026-11-29T04:00:00Z",
     "records": [{
        "template": "flash_fwd", "template_version": "<16 hex>",
        "problem": {"batch": 4, ...},                       (templates.Problem)
        "config": {"BLOCK_M": 128, ...},
        "tflops": 612.0, "median_ms": 1.79,                 (the price the dispatcher reads)
        "readings": 5, "head_to_head": true                 (what the price is the median of)
     }, ...]}

A record is a stored best as the database holds it (``db.models.BestConfig``): its TFLOP/s is
the median of the head-to-head it took part in (``head_to_head`` true: every implementation's
best timed side by side) or of its config's own readings. The file of a device is named by
its name (``file_name``): ``h200.json`` for "NVIDIA H200".

Which devices a table answers for (``why_not_serving``): the GPU it was measured on (same name
and compute capability) under the same Triton and torch releases (major.minor: they compile
our kernels and run torch SDPA, so a new release can change which is faster). CUDA, cuDNN and
driver versions may differ.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from templates.base import Problem, Template
from templates.device import DeviceInfo
from tuner.errors import TunerError

__all__ = ["SHIPPED_FORMAT", "SHIPPED_VERSION", "ShippedDevice", "ShippedError",
           "ShippedRecord", "ShippedTable", "file_name", "keyed_records", "load_table",
           "release", "why_not_serving"]

log = logging.getLogger(__name__)

SHIPPED_FORMAT: Literal["attention-tuner/shipped"] = "attention-tuner/shipped"
SHIPPED_VERSION: Literal[1] = 1

# Finite, positive JSON numbers (never strings or booleans), as the bundle's (tuner.lookup.bundle).
_Positive = Annotated[float, Field(strict=True, allow_inf_nan=False, gt=0, le=1e9)]
_Text = Annotated[str, Field(min_length=1, max_length=400)]


class ShippedError(TunerError):
    """A shipped table that cannot be read, or cannot be made from what was given."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ShippedDevice(_Strict):
    """The device a table was measured on: the parts of its key that say what it was."""

    key: _Text
    name: _Text
    compute_capability: str = Field(max_length=16)
    triton_version: str = Field(max_length=64)
    torch_version: str = Field(max_length=64)
    cuda_version: str = Field(max_length=64)
    cudnn_version: str | None = Field(None, min_length=1, max_length=64)

    @model_validator(mode="after")
    def _key_matches(self) -> Self:
        made = DeviceInfo(name=self.name, compute_capability=self.compute_capability,
                          sm_count=1, total_memory=0, smem_per_block=0, driver_version="",
                          triton_version=self.triton_version, torch_version=self.torch_version,
                          cuda_version=self.cuda_version, cudnn_version=self.cudnn_version).key
        if made != self.key:
            raise ValueError(f"key {self.key!r} does not match the device's fields (they give "
                             f"{made!r})")
        return self

    @classmethod
    def of(cls, info: DeviceInfo) -> ShippedDevice:
        return cls(key=info.key, name=info.name, compute_capability=info.compute_capability,
                   triton_version=info.triton_version, torch_version=info.torch_version,
                   cuda_version=info.cuda_version, cudnn_version=info.cudnn_version)


class ShippedRecord(_Strict):
    """One stored best: a template's config for a problem's bucket, and its price."""

    template: _Text
    template_version: _Text
    problem: dict[str, Any]
    config: dict[str, Any]
    tflops: _Positive
    median_ms: _Positive
    readings: int = Field(strict=True, ge=1)
    head_to_head: bool = Field(strict=True)


class ShippedTable(_Strict):
    format: Literal["attention-tuner/shipped"]
    version: Literal[1]
    device: ShippedDevice
    suite: _Text
    source: _Text
    generated_at: datetime
    records: list[ShippedRecord]

    def to_json(self) -> str:
        return json.dumps(self.model_dump(mode="json"), indent=1) + "\n"


def file_name(device_name: str) -> str:
    """The file of a device's table: its name in lower case, words joined by '-', without the
    vendor ("NVIDIA H200" -> "h200.json", "NVIDIA H100 80GB HBM3" -> "h100-80gb-hbm3.json")."""
    words = re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-")
    words = words.removeprefix("nvidia-")
    if not words:
        raise ShippedError(f"device name {device_name!r} has no letters or digits to name a "
                           "shipped table by", "name the device by its stored name or key")
    return f"{words}.json"


def release(version: str) -> str:
    """A version's release, major.minor ("2.11.0+cu130" -> "2.11")."""
    return ".".join(version.split("+")[0].split(".")[:2])


def why_not_serving(table: ShippedDevice, device: DeviceInfo) -> str | None:
    """Why a table measured on ``table`` does not answer for ``device`` (None: it does)."""
    if (table.name, table.compute_capability) != (device.name, device.compute_capability):
        return (f"measured on {table.name} (cc {table.compute_capability}), this is "
                f"{device.name} (cc {device.compute_capability})")
    for what, theirs, ours in (("triton", table.triton_version, device.triton_version),
                               ("torch", table.torch_version, device.torch_version)):
        if release(theirs) != release(ours):
            return f"measured with {what} {theirs}, this is {what} {ours}"
    return None


def load_table(path: Path) -> ShippedTable:
    """The table in ``path``; ShippedError naming the file and what is wrong with it."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ShippedError(f"shipped table {path} cannot be read: {exc}",
                           "regenerate it with `tuner ship`") from None
    try:
        return ShippedTable.model_validate(data)
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        where = ".".join(str(p) for p in err["loc"])
        raise ShippedError(f"shipped table {path} is not a table of format "
                           f"{SHIPPED_FORMAT!r} version {SHIPPED_VERSION}: {where}: "
                           f"{err['msg']}", "regenerate it with `tuner ship`") from None


def keyed_records(table: ShippedTable, template: Template) -> Iterator[tuple[ShippedRecord, str]]:
    """``template``'s records in ``table``, each with its problem's key (every kernel
    version); a record whose problem no longer validates is left out, as ``parse_candidates``
    drops a bad row."""
    for record in table.records:
        if record.template != template.name:
            continue
        try:
            key = template.problem_key(Problem.from_dict(record.problem))
        except (TypeError, ValueError) as exc:
            log.debug("skipping a shipped record whose problem is invalid: %s", exc)
            continue
        yield record, key
