"""Bundles: best configs carried from one database to another as one JSON document.

``tuner export`` writes a bundle from a GPU host's database, ``tuner import`` and the service's
``POST /v1/results`` read one. The format::

    {"format": "attention-tuner/bundle", "version": 1,
     "host": "gpu-7", "exported_at": "2026-11-22T10:00:00Z",        (optional)
     "items": [{
        "device": {"key": ..., "name": ..., "compute_capability": "9.0", "sm_count": 132,
                   "total_memory": ..., "driver_version": ..., "triton_version": ...,
                   "torch_version": ..., "cuda_version": ..., "smem_per_block": ...},
        "template": "flash_fwd", "template_version": "<16 hex>",
        "problem": {"batch": 4, "heads_q": 16, ...},                   (templates.Problem)
        "config": {"BLOCK_M": 128, ...},                               (the template's space)
        "tflops": 412.0, "median_ms": 1.33,
        "default_tflops": 301.0, "default_config": {...},              (optional)
        "sweep": "h100-standard", "error": 0.0004                      (optional)
     }, ...]}

``validate_bundle`` checks everything before anything is stored: every item's template must
be registered here at exactly the item's version (a config tuned for other kernel source is
meaningless), the problem valid and supported, the config inside the space and allowed by the
template's static constraints on the item's device. The first bad item raises ``BundleError``
with its index and the reason; ``store_bundle`` then writes all items in the caller's
transaction, so a rejected upload stores nothing.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from templates.base import KernelConfig, Problem, Template
from templates.device import DeviceInfo
from templates.registry import get_template

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

BUNDLE_FORMAT = "attention-tuner/bundle"
BUNDLE_VERSION = 1
DEFAULT_SWEEP_NAME = "bundle-import"

# Largest problem size (batch, heads, sequence lengths) and head dim a bundle or a query of the
# service may name: larger than any real attention problem, small enough that FLOP counts and
# bucket keys stay finite and short (api/schemas.py takes the same limits).
MAX_PROBLEM_SIZE = 1 << 24
MAX_HEAD_DIM = 4096
# PostgreSQL text cannot hold NUL characters (the driver raises, and the upload would be a 500):
# strings that are stored or compared in the database are refused with the bundle instead.
NO_NUL = r"^[^\x00]*$"
Text = Annotated[str, Field(pattern=NO_NUL)]


class BundleError(ValueError):
    """A bundle that cannot be stored; ``index`` is the bad item's (None: the bundle itself)."""

    def __init__(self, index: int | None, reason: str) -> None:
        self.index = index
        self.reason = reason
        where = "bundle" if index is None else f"bundle item {index}"
        super().__init__(f"{where}: {reason}")


# ----------------------------------------------------------------------------- the format
class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class BundleDevice(_Strict):
    key: Text = Field(min_length=1, max_length=400)
    name: Text = Field(min_length=1, max_length=200)
    compute_capability: Text = Field(max_length=16)
    sm_count: int = Field(ge=1, le=(1 << 31) - 1)  # the database's INTEGER and BIGINT columns
    total_memory: int = Field(ge=0, le=(1 << 63) - 1)
    smem_per_block: int | None = Field(None, ge=0, le=(1 << 31) - 1)
    driver_version: Text = Field(max_length=64)
    triton_version: Text = Field(max_length=64)
    torch_version: Text = Field(max_length=64)
    cuda_version: Text = Field(max_length=64)

    def info(self) -> DeviceInfo:
        from tuner.lookup import smem_for_cc

        smem = self.smem_per_block if self.smem_per_block else smem_for_cc(self.compute_capability)
        return DeviceInfo(
            name=self.name, compute_capability=self.compute_capability, sm_count=self.sm_count,
            total_memory=self.total_memory, smem_per_block=smem,
            driver_version=self.driver_version, triton_version=self.triton_version,
            torch_version=self.torch_version, cuda_version=self.cuda_version)

    @classmethod
    def of(cls, info: DeviceInfo) -> BundleDevice:
        return cls.model_validate({"key": info.key, **info.to_dict()})


def _finite_positive(value: float | None) -> float | None:
    if value is not None and not (math.isfinite(value) and value > 0):
        raise ValueError(f"must be a finite number > 0, but got {value!r}")
    return value


class BundleItem(_Strict):
    device: BundleDevice
    template: Text = Field(min_length=1, max_length=100)
    template_version: Text = Field(min_length=1, max_length=64)
    problem: dict[str, Any]
    config: dict[str, Any]
    tflops: float
    median_ms: float
    default_tflops: float | None = None
    default_config: dict[str, Any] | None = None
    sweep: Text | None = Field(None, max_length=200)
    error: float | None = Field(None, ge=0)

    _positive = field_validator("tflops", "median_ms", "default_tflops")(_finite_positive)


class Bundle(_Strict):
    format: Literal["attention-tuner/bundle"]
    version: Literal[1]
    host: Text | None = Field(None, max_length=200)
    exported_at: datetime | None = None
    items: list[dict[str, Any]] = Field(description="BundleItem objects")


# ----------------------------------------------------------------------------- validation
@dataclass(frozen=True)
class ValidItem:
    """One bundle item, checked against this process's templates."""

    item: BundleItem
    template: Template
    device: DeviceInfo
    problem: Problem
    config: KernelConfig
    default_config: KernelConfig | None


def _first_error(exc: ValidationError) -> str:
    err = exc.errors()[0]
    where = ".".join(str(p) for p in err["loc"])
    return f"{where}: {err['msg']}" if where else str(err["msg"])


def validate_bundle(data: object) -> list[ValidItem]:
    """Every item of ``data`` checked and typed; the first bad one raises ``BundleError``."""
    if not isinstance(data, Mapping):
        raise BundleError(None, f"a bundle must be a JSON object, but got {type(data).__name__}")
    if data.get("format") != BUNDLE_FORMAT:
        raise BundleError(None, f"format must be {BUNDLE_FORMAT!r}, but got {data.get('format')!r}")
    try:
        bundle = Bundle.model_validate(data)
    except ValidationError as exc:
        raise BundleError(None, _first_error(exc)) from None
    versions: dict[str, str] = {}
    return [_validate_item(i, raw, versions) for i, raw in enumerate(bundle.items)]


def _validate_item(index: int, raw: Mapping[str, Any], versions: dict[str, str]) -> ValidItem:
    try:
        item = BundleItem.model_validate(raw)
    except ValidationError as exc:
        raise BundleError(index, _first_error(exc)) from None
    try:
        template = get_template(item.template)
    except ValueError as exc:
        raise BundleError(index, str(exc)) from None
    version = versions.get(template.name)
    if version is None:  # hashing the kernel source once per template, not per item
        version = versions[template.name] = template.version()
    if item.template_version != version:
        raise BundleError(index, f"template {template.name!r} is at version {version} here, but "
                                 f"the item was tuned for version {item.template_version}: "
                                 "its configs are for other kernel source; re-tune")
    device = item.device.info()
    if device.key != item.device.key:
        raise BundleError(index, f"device.key {item.device.key!r} does not match its fields "
                                 f"(they give {device.key!r})")
    try:
        problem = Problem.from_dict(item.problem)
    except (TypeError, ValueError) as exc:
        raise BundleError(index, f"problem: {exc}") from None
    too_large = [f"{name}={getattr(problem, name)}" for name, limit in _SIZE_LIMITS.items()
                 if getattr(problem, name) > limit]
    if too_large:
        raise BundleError(index, f"problem: {', '.join(too_large)} above the limit "
                                 f"({MAX_PROBLEM_SIZE}, head_dim {MAX_HEAD_DIM})")
    why = template.unsupported(problem)
    if why:
        raise BundleError(index, f"problem: {template.name} cannot run it: {why}")
    config = _checked_config(index, "config", template, problem, device, item.config)
    default = None
    if item.default_config is not None:
        default = _checked_config(index, "default_config", template, problem, device,
                                  item.default_config)
    elif item.default_tflops is not None:
        default = template.default_config(problem, device)
    return ValidItem(item, template, device, problem, config, default)


_SIZE_LIMITS = {"batch": MAX_PROBLEM_SIZE, "heads_q": MAX_PROBLEM_SIZE,
                "heads_kv": MAX_PROBLEM_SIZE, "seqlen_q": MAX_PROBLEM_SIZE,
                "seqlen_kv": MAX_PROBLEM_SIZE, "head_dim": MAX_HEAD_DIM}


def _checked_config(index: int, field: str, template: Template, problem: Problem,
                    device: DeviceInfo, data: Mapping[str, Any]) -> KernelConfig:
    try:
        config = template.config(data)
    except (TypeError, ValueError) as exc:
        raise BundleError(index, f"{field}: {exc}") from None
    why = template.constraint(problem, config, device)
    if why:
        raise BundleError(index, f"{field}: {template.name} cannot run it on "
                                 f"{device.name}: {why}")
    return config


# ----------------------------------------------------------------------------- storing
@dataclass(frozen=True)
class StoreSummary:
    items: int
    trials: int  # trial rows written by this call (already-known measurements are kept)
    best_updated: int  # best-config rows created or changed


def store_bundle(session: Session, items: Sequence[ValidItem], *, host: str | None = None
                 ) -> StoreSummary:
    """Write validated items as OK trials and refresh the best configs they touch.

    Runs in the caller's transaction and never commits: on any error the caller rolls back
    and nothing of the bundle stays. A measurement already stored (same device, template
    version, bucket and config) is kept as it is.
    """
    from sqlalchemy import select

    from db import crud
    from db.models import BestConfig, SweepStatus, TrialStatus

    sweeps: dict[str, int] = {}
    touched: dict[tuple[int, int, str], tuple[int | None, float | None]] = {}
    trials = 0
    worker = f"bundle:{host}" if host else "bundle"

    def sweep_id(name: str | None) -> int:
        name = name or DEFAULT_SWEEP_NAME
        if name not in sweeps:
            sweep = crud.create_sweep(session, name=name, host=host or "unknown",
                                      spec={"source": "bundle", "host": host})
            crud.finish_sweep(session, sweep_id=sweep.id, status=SweepStatus.DONE)
            sweeps[name] = sweep.id
        return sweeps[name]

    for valid in items:
        item = valid.item
        device = crud.get_or_create_device(session, info={**valid.device.to_dict(),
                                                          "key": valid.device.key})
        template = crud.get_or_create_template(
            session, name=valid.template.name, version=item.template_version,
            space=valid.template.config_cls.json_schema())
        problem_key = valid.template.problem_key(valid.problem)
        ident = (device.id, template.id, problem_key)
        if ident not in touched:
            old = session.scalars(select(BestConfig).filter_by(
                device_id=device.id, template_id=template.id, problem_key=problem_key)).first()
            touched[ident] = (old.trial_id, old.tflops) if old else (None, None)
        measured = [(valid.config, item.tflops, item.median_ms, item.error)]
        if valid.default_config is not None and item.default_tflops is not None:
            # The bundle carries the default's TFLOP/s; its time follows from the FLOP count.
            default_ms = valid.template.flops(valid.problem) / (item.default_tflops * 1e9)
            measured.append((valid.default_config, item.default_tflops, default_ms, None))
        for config, tflops, median_ms, error in measured:
            if crud.find_trial(session, device_id=device.id, template_id=template.id,
                               problem_key=problem_key, config_key=config.key()) is not None:
                continue
            crud.record_trial(
                session, device_id=device.id, template_id=template.id, problem_key=problem_key,
                problem=valid.problem.to_dict(), config_key=config.key(),
                config=config.to_dict(), status=TrialStatus.OK, median_ms=median_ms,
                tflops=tflops, error=error, is_default=config == valid.default_config,
                sweep_id=sweep_id(item.sweep), worker=worker)
            trials += 1
    updated = 0
    for (device_id, template_id, problem_key), before in touched.items():
        best = crud.refresh_best(session, device_id=device_id, template_id=template_id,
                                 problem_key=problem_key)
        if best is not None and (best.trial_id, best.tflops) != before:
            updated += 1
    return StoreSummary(items=len(items), trials=trials, best_updated=updated)


# ----------------------------------------------------------------------------- exporting
def make_bundle(session: Session, *, device: str | None = None, template: str | None = None,
                dtype: str | None = None, variant: str | None = None,
                host: str | None = None, exported_at: datetime | None = None
                ) -> dict[str, Any]:
    """A bundle of the stored best configs matching the filters (``crud.list_best``'s)."""
    from sqlalchemy import select

    from db import crud
    from db.models import Sweep, Trial, TrialStatus

    items: list[dict[str, Any]] = []
    page = 500
    offset = 0
    while True:
        rows = crud.list_best(session, device=device, template=template, dtype=dtype,
                              variant=variant, offset=offset, limit=page)
        for row in rows:
            default = session.scalars(select(Trial).where(
                Trial.device_id == row.device_id, Trial.template_id == row.template_id,
                Trial.problem_key == row.problem_key, Trial.status == TrialStatus.OK,
                Trial.is_default.is_(True)).order_by(Trial.id).limit(1)).first()
            sweep = session.get(Sweep, row.sweep_id) if row.sweep_id is not None else None
            dev = row.device
            item: dict[str, Any] = {
                "device": {"key": dev.key, "name": dev.name,
                           "compute_capability": dev.compute_capability,
                           "sm_count": dev.sm_count, "total_memory": dev.total_memory,
                           "driver_version": dev.driver_version,
                           "triton_version": dev.triton_version,
                           "torch_version": dev.torch_version, "cuda_version": dev.cuda_version},
                "template": row.template.name, "template_version": row.template.version,
                "problem": dict(row.problem), "config": dict(row.config),
                "tflops": row.tflops, "median_ms": row.median_ms,
            }
            if default is not None and default.tflops:
                # The stored number: the default's median where it was re-measured with the
                # finalists, as the best's (db.finalists).
                item["default_tflops"] = row.default_tflops or default.tflops
                item["default_config"] = dict(default.config)
            if sweep is not None:
                item["sweep"] = sweep.name
            if row.trial is not None and row.trial.error is not None:
                item["error"] = row.trial.error
            items.append(item)
        if len(rows) < page:
            break
        offset += page
    bundle: dict[str, Any] = {"format": BUNDLE_FORMAT, "version": BUNDLE_VERSION, "items": items}
    if host:
        bundle["host"] = host
    if exported_at is not None:
        bundle["exported_at"] = exported_at.isoformat()
    return bundle
