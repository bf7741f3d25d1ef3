"""Bundles: best configs carried from one database to another as one JSON document.

``tuner export`` writes a bundle from a GPU host's database, ``tuner import`` and the service's
``POST /v1/results`` read one. The format::

    {"format": "attention-tuner/bundle", "version": 1,
     "host": "gpu-7", "exported_at": "2026-11-22T10:00:00Z",        (optional)
     "items": [{
        "device": {"key": ..., "name": ..., "compute_capability": "9.0", "sm_count": 132,
                   "total_memory": ..., "driver_version": ..., "triton_version": ...,
                   "torch_version": ..., "cuda_version": ..., "smem_per_block": ...,
                   "cudnn_version": "9.19.0"},                        (optional)
        "template": "flash_fwd", "template_version": "<16 hex>",
        "problem": {"batch": 4, "heads_q": 16, ...},                   (templates.Problem)
        "config": {"BLOCK_M": 128, ...},                               (the template's space)
        "tflops": 412.0, "median_ms": 1.33,
        "default_tflops": 301.0, "default_config": {...},              (optional)
        "sweep": "h100-standard", "error": 0.0004,                     (optional)
        "measurements": {"first_ms": 1.31, "first_tflops": 419.0,     (version 2, optional)
                         "remeasured": [{"status": "ok", "median_ms": 1.33,
                                         "tflops": 412.0, "error": 0.0004}, ...]},
        "default_measurements": {...}                                  (version 2, optional)
     }, ...]}

Version 2 added the readings of a finalist (``db.finalists``): ``measurements`` are those of
the item's config, whose ``median_ms`` is then the median of the first reading and the OK
re-measurements; ``default_measurements`` the default config's. ``make_bundle`` writes version
1 when no item has any (so hosts that read only version 1 still read it); every version-1
bundle still imports, each config as measured once at its stored time.

A best priced by a head-to-head (``tuner.tuning.head_to_head``: stored at the median of its readings
side by side with the other implementations' bests) is exported at its own readings' median,
the one its ``measurements`` give: bundles do not carry head-to-heads, which stay in the
database they were measured in (notes/dispatch_measurements.md, "What is left").

``validate_bundle`` checks everything before anything is stored: every item's template must
be registered here at exactly the item's version (a config tuned for other kernel source is
meaningless), the problem valid and supported, the config inside the space and allowed by the
template's static constraints on the item's device. The first bad item raises ``BundleError``
with its index and the reason; ``store_bundle`` then writes all items in the caller's
transaction, so a rejected upload stores nothing.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import time
from collections.abc import Generator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Annotated, Any, Literal, Self, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    model_validator,
)
from sqlalchemy import select

from db import crud, head_to_head
from db.finalists import Measured, Readings
from db.models import Remeasurement, Sweep, SweepStatus, Trial, TrialStatus
from db.session import run_in_transaction
from templates.base import KernelConfig, Problem, Template
from templates.device import DeviceInfo
from templates.registry import get_template
from tuner.errors import TunerError
from tuner.lookup.devices import smem_for_cc

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

T = TypeVar("T")

BUNDLE_FORMAT = "attention-tuner/bundle"
BUNDLE_VERSION = 2  # the newest, written when an item has readings; Bundle.version: all read
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
# Numbers are JSON numbers, never strings or booleans ("400", true), and finite (no NaN or
# Infinity, which Python's json reads): pydantic's lax mode took all of those (issue 19).
# Upper limits far above any real kernel (an H100 peaks near 1,000 TFLOP/s), so that no
# product or ratio of them overflows.
MAX_TFLOPS = 1e6
MAX_MS = 1e9  # ~12 days
Tflops = Annotated[float, Field(strict=True, allow_inf_nan=False, gt=0, le=MAX_TFLOPS)]
Millis = Annotated[float, Field(strict=True, allow_inf_nan=False, gt=0, le=MAX_MS)]
RelError = Annotated[float, Field(strict=True, allow_inf_nan=False, ge=0)]
# Items per bundle: an export of every best config of a large database is a few thousand; more
# is refused before any of them is validated (issue 19: 4,000,000 integers as items took 34 s to
# refuse). Bodies are capped too (TUNER_MAX_BODY_BYTES, 8 MiB: ~9,000 items).
MAX_BUNDLE_ITEMS = 10_000


class BundleError(TunerError, ValueError):
    """A bundle that cannot be stored; ``index`` is the bad item's (None: the bundle itself).
    A ValueError too: the service answers it 422."""

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
    # The database's INTEGER and BIGINT columns.
    sm_count: int = Field(strict=True, ge=1, le=(1 << 31) - 1)
    total_memory: int = Field(strict=True, ge=0, le=(1 << 63) - 1)
    smem_per_block: int | None = Field(None, strict=True, ge=0, le=(1 << 31) - 1)
    driver_version: Text = Field(max_length=64)
    triton_version: Text = Field(max_length=64)
    torch_version: Text = Field(max_length=64)
    cuda_version: Text = Field(max_length=64)
    # Absent from bundles of devices without cuDNN and of releases before it was recorded.
    # Never "": a device without cuDNN has none, and its key no cuDNN part.
    cudnn_version: Text | None = Field(None, min_length=1, max_length=64)

    def info(self) -> DeviceInfo:
        smem = self.smem_per_block if self.smem_per_block else smem_for_cc(self.compute_capability)
        return DeviceInfo(
            name=self.name, compute_capability=self.compute_capability, sm_count=self.sm_count,
            total_memory=self.total_memory, smem_per_block=smem,
            driver_version=self.driver_version, triton_version=self.triton_version,
            torch_version=self.torch_version, cuda_version=self.cuda_version,
            cudnn_version=self.cudnn_version)

    @classmethod
    def of(cls, info: DeviceInfo) -> BundleDevice:
        return cls.model_validate({"key": info.key, **info.to_dict()})


class BundleReading(_Strict):
    """One re-measurement of a finalist (a ``db.models.Remeasurement``)."""

    status: TrialStatus
    median_ms: Millis | None = None
    tflops: Tflops | None = None
    error: RelError | None = None
    reason: Text = Field("", max_length=10_000)

    @model_validator(mode="after")
    def _ok_has_a_time(self) -> Self:
        if self.status == TrialStatus.OK and (self.median_ms is None or self.tflops is None):
            raise ValueError("an ok re-measurement needs median_ms and tflops")
        return self


class BundleMeasurements(_Strict):
    """A config's readings: its first measurement (its trial's) and its re-measurements."""

    first_ms: Millis
    first_tflops: Tflops
    remeasured: list[BundleReading] = Field(default_factory=list, max_length=1000)

    @property
    def median_ms(self) -> float:
        """The median of the readings that gave a time, as ``db.finalists`` takes it."""
        return Readings((self.first_ms, *(r.median_ms for r in self.remeasured
                                          if r.status == TrialStatus.OK
                                          and r.median_ms is not None))).median_ms


def _measured_once(median_ms: float, tflops: float) -> BundleMeasurements:
    # Built from numbers of an item already checked, not validated again: a time derived from
    # an extreme (valid) TFLOP/s can round to 0 or inf, and is stored as it was before readings.
    return BundleMeasurements.model_construct(first_ms=median_ms, first_tflops=tflops,
                                              remeasured=[])


class BundleItem(_Strict):
    device: BundleDevice
    template: Text = Field(min_length=1, max_length=100)
    template_version: Text = Field(min_length=1, max_length=64)
    problem: dict[str, Any]
    config: dict[str, Any]
    tflops: Tflops
    median_ms: Millis
    default_tflops: Tflops | None = None
    default_config: dict[str, Any] | None = None
    sweep: Text | None = Field(None, max_length=200)
    error: RelError | None = None
    measurements: BundleMeasurements | None = None  # version 2
    default_measurements: BundleMeasurements | None = None  # version 2

    def readings(self) -> BundleMeasurements:
        """The config's readings; a version-1 item's config was measured once, at its time."""
        return self.measurements or _measured_once(self.median_ms, self.tflops)


class Bundle(_Strict):
    format: Literal["attention-tuner/bundle"]
    version: Literal[1, 2]
    host: Text | None = Field(None, max_length=200)
    exported_at: datetime | None = None
    items: list[Any] = Field(description="BundleItem objects, each validated on its own",
                             max_length=MAX_BUNDLE_ITEMS)


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


def first_error(exc: ValidationError) -> str:
    # Only ever called on bounded input (a header, one item): errors() builds every error.
    err = exc.errors(include_url=False)[0]
    where = ".".join(str(p) for p in err["loc"])
    return f"{where}: {err['msg']}" if where else str(err["msg"])


class BundleTextError(BundleError):
    """A body that is not text at all (not UTF-8): no JSON to speak of."""


@dataclass(frozen=True)
class ReadBundle:
    bundle: Bundle  # the header; its items are in ``items``, checked
    items: list[ValidItem]


def validate_bundle(data: object) -> list[ValidItem]:
    """Every item of ``data`` checked and typed; the first bad one raises ``BundleError``."""
    return drain(_validated(data)).items


def read_bundle(body: bytes) -> Generator[None, None, ReadBundle]:
    """A bundle's JSON text parsed and validated, a piece at a time: the generator yields
    between pieces (an item parsed, an item checked) and returns the result (``drain`` runs it
    at once). A service runs it on its event loop a few milliseconds at a time, so requests
    beside a large upload are not held up by it (issue 19). Raises ``BundleTextError`` for a
    body that is not UTF-8 and ``BundleError`` for anything else that is wrong, as soon as it
    is found: a bundle of too many items is refused before the rest of it is parsed."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BundleTextError(None, f"the body is not UTF-8 text ({exc})") from None
    data = yield from _parsed_object(text)
    return (yield from _validated(data))


def drain(steps: Generator[None, None, T]) -> T:
    """Run a generator of ``read_bundle``'s kind to its end, and return its result."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]


def _validated(data: object) -> Generator[None, None, ReadBundle]:
    if not isinstance(data, Mapping):
        raise BundleError(None, f"a bundle must be a JSON object (a dict), but got "
                                f"{type(data).__name__}")
    if data.get("format") != BUNDLE_FORMAT:
        raise BundleError(None, f"format must be {BUNDLE_FORMAT!r}, but got {data.get('format')!r}")
    items = data.get("items")
    if isinstance(items, list) and len(items) > MAX_BUNDLE_ITEMS:
        raise BundleError(None, f"items: a bundle holds at most {MAX_BUNDLE_ITEMS} items, but "
                                f"got {len(items)}; split it (tuner export takes filters)")
    try:
        # The header alone: each item is validated on its own, and the first bad one stops.
        bundle = Bundle.model_validate({**data, "items": []} if isinstance(items, list) else data)
    except ValidationError as exc:
        raise BundleError(None, first_error(exc)) from None
    versions: dict[str, str] = {}
    valid = []
    for i, raw in enumerate(items or ()):
        valid.append(_validate_item(i, raw, versions, bundle.version))
        yield
    return ReadBundle(bundle, valid)


# ----------------------------------------------------------------------------- JSON, piecewise
# A bundle's text is parsed member by member and item by item (json's own decoder for each):
# one json.loads of an 8 MB body holds the interpreter for ~0.2 s in one call, and a service
# answering other requests meanwhile must not be held that long. A member other than the
# header's scalars and "items" is refused before its value is parsed.
_WHITESPACE = re.compile(r"[ \t\n\r]*")
_JSON_KINDS = {"{": "an object", "[": "an array", '"': "a string", "t": "a boolean",
               "f": "a boolean", "n": "null"}
_HEADER_FIELDS = ("format", "version", "host", "exported_at")


class _Text:
    """A cursor over JSON text."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0
        self._decoder = json.JSONDecoder()

    def peek(self) -> str:
        self.pos = _WHITESPACE.match(self.text, self.pos).end()  # type: ignore[union-attr]
        return self.text[self.pos:self.pos + 1]

    def kind(self) -> str:
        first = self.peek()
        return _JSON_KINDS.get(first, "a number" if first else "empty")

    def take(self, allowed: str, where: str) -> str:
        char = self.peek()
        if not char or char not in allowed:
            got = repr(char) if char else "the end of the text"
            raise BundleError(None, f"the body is not valid JSON: expected one of "
                                    f"{' '.join(repr(c) for c in allowed)} {where} at "
                                    f"character {self.pos}, but got {got}")
        self.pos += 1
        return char

    def value(self) -> Any:
        self.peek()
        try:
            value, self.pos = self._decoder.raw_decode(self.text, self.pos)
        except json.JSONDecodeError as exc:
            raise BundleError(None, f"the body is not valid JSON: {exc}") from None
        return value

    def end(self) -> None:
        if self.peek():
            raise BundleError(None, f"the body is not valid JSON: extra data at character "
                                    f"{self.pos} after the bundle")


def _parsed_object(text: str) -> Generator[None, None, dict[str, Any]]:
    cursor = _Text(text)
    if cursor.peek() != "{":
        raise BundleError(None, f"a bundle must be a JSON object (a dict), but the body is "
                                f"{cursor.kind()}")
    cursor.take("{", "")
    data: dict[str, Any] = {}
    if cursor.peek() == "}":
        cursor.take("}", "")
    else:
        while True:
            if cursor.peek() != '"':
                cursor.take('"', "(a member name)")
            name = cursor.value()
            cursor.take(":", f"after {name!r}")
            if name in data:
                raise BundleError(None, f"{name!r} appears twice in the bundle")
            if name == "items":
                data[name] = yield from _parsed_items(cursor)
            elif name in _HEADER_FIELDS:
                if cursor.peek() in ("{", "["):
                    raise BundleError(None, f"{name}: must be a string or a number, but got "
                                            f"{cursor.kind()}")
                data[name] = cursor.value()
            else:
                raise BundleError(None, f"{name}: not a field of a bundle (Extra inputs are "
                                        f"not permitted); the fields are "
                                        f"{[*_HEADER_FIELDS, 'items']}")
            if cursor.take(",}", "between the bundle's members") == "}":
                break
    cursor.end()
    return data


def _parsed_items(cursor: _Text) -> Generator[None, None, Any]:
    if cursor.peek() == "{":  # refused before it is parsed, as any value that is no list
        raise BundleError(None, f"items: must be an array of items, but got {cursor.kind()}")
    if cursor.peek() != "[":
        return cursor.value()  # a scalar: the header's validation says what is wrong
    cursor.take("[", "")
    items: list[Any] = []
    if cursor.peek() == "]":
        cursor.take("]", "")
        return items
    while True:
        if not cursor.peek():
            raise BundleError(None, "the body is not valid JSON: it ends inside 'items'")
        if len(items) == MAX_BUNDLE_ITEMS:
            raise BundleError(None, f"items: a bundle holds at most {MAX_BUNDLE_ITEMS} items, "
                                    "but got more; split it (tuner export takes filters)")
        if cursor.peek() != "{":  # refused now, before the rest is parsed
            raise BundleError(len(items), f"an item must be a JSON object, but got "
                                          f"{cursor.kind()}")
        items.append(cursor.value())
        yield
        if cursor.take(",]", "between items") == "]":
            return items


def _validate_item(index: int, raw: Mapping[str, Any], versions: dict[str, str],
                   bundle_version: int) -> ValidItem:
    try:
        item = BundleItem.model_validate(raw)
    except ValidationError as exc:
        raise BundleError(index, first_error(exc)) from None
    _check_measurements(index, item, bundle_version)
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


def _check_measurements(index: int, item: BundleItem, bundle_version: int) -> None:
    """The readings agree with the rest of the item: the import chooses the best from them
    (``db.crud.refresh_best``), so an item that contradicts them would be stored otherwise
    than it says."""
    if bundle_version < 2 and (item.measurements or item.default_measurements):
        raise BundleError(index, "measurements and default_measurements came with bundle "
                                 f"version 2, but the bundle says version {bundle_version}")
    if item.measurements is not None:
        failed = [r.status.value for r in item.measurements.remeasured
                  if r.status != TrialStatus.OK]
        if failed:
            raise BundleError(index, f"measurements: a re-measurement of the config failed "
                                     f"({failed[0]}), which disqualifies it: it cannot be the "
                                     "best config")
        median = item.measurements.median_ms
        if not math.isclose(median, item.median_ms, rel_tol=1e-9):
            raise BundleError(index, f"measurements: the median of the readings is {median!r} "
                                     f"ms, but median_ms is {item.median_ms!r}")
    if item.default_measurements is not None:
        if item.default_tflops is None:
            raise BundleError(index, "default_measurements need default_tflops (the default "
                                     "config's TFLOP/s)")
        if item.default_config == item.config:
            raise BundleError(index, "default_measurements: the default config is the item's "
                                     "config; its readings go in measurements")


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
# Items per transaction of store_bundle_in_batches. On SQLite a write transaction holds the one
# write lock for its whole length, and a sweep writing to the same file waits for it: 100 items
# take ~0.1-0.3 s to store on the 2-core development VM (benchmarks/api_load.py --big-upload).
STORE_BATCH_ITEMS = 100
# Pause after each batch on SQLite: a writer that found the lock taken polls with sleeps of up
# to 100 ms (SQLite's busy handler), so without a pause the next batch would take the lock
# again before a waiting sweep wakes up.
SQLITE_BATCH_PAUSE_S = 0.1


@dataclass(frozen=True)
class StoreSummary:
    items: int
    trials: int  # trial rows written by this call (already-known measurements are kept)
    best_updated: int  # best-config rows created or changed
    remeasurements: int = 0  # re-measurement rows written, beside the new trials
    # (device key, template name, template version) of every best config created or changed:
    # the answers a cache of best configs must refresh.
    changed: frozenset[tuple[str, str, str]] = frozenset()

    def __add__(self, other: StoreSummary) -> StoreSummary:
        return StoreSummary(items=self.items + other.items, trials=self.trials + other.trials,
                            best_updated=self.best_updated + other.best_updated,
                            remeasurements=self.remeasurements + other.remeasurements,
                            changed=self.changed | other.changed)


@dataclass
class _Rows:
    """Ids of the rows that items refer to: devices and templates, made before the items are
    stored; sweeps, made with the first trial that names them."""

    devices: dict[str, int]
    templates: dict[tuple[str, str], int]
    sweeps: dict[str, int]
    host: str | None

    @classmethod
    def of(cls, session: Session, items: Sequence[ValidItem], host: str | None) -> _Rows:
        devices: dict[str, int] = {}
        templates: dict[tuple[str, str], int] = {}
        for valid in items:
            if valid.device.key not in devices:
                devices[valid.device.key] = crud.get_or_create_device(
                    session, info={**valid.device.to_dict(), "key": valid.device.key}).id
            ident = (valid.template.name, valid.item.template_version)
            if ident not in templates:
                templates[ident] = crud.get_or_create_template(
                    session, name=ident[0], version=ident[1],
                    space=valid.template.config_cls.json_schema()).id
        return cls(devices, templates, {}, host)

    def sweep_id(self, session: Session, name: str | None) -> int:
        """The sweep row of ``name``, created in ``session`` when this upload first needs it
        (an upload that stores nothing creates none)."""
        name = name or DEFAULT_SWEEP_NAME
        if name not in self.sweeps:
            sweep = crud.create_sweep(session, name=name, host=self.host or "unknown",
                                      spec={"source": "bundle", "host": self.host})
            crud.finish_sweep(session, sweep_id=sweep.id, status=SweepStatus.DONE)
            self.sweeps[name] = sweep.id
        return self.sweeps[name]


def store_bundle(session: Session, items: Sequence[ValidItem], *, host: str | None = None
                 ) -> StoreSummary:
    """Write validated items as OK trials and refresh the best configs they touch.

    Runs in the caller's transaction and never commits: on any error the caller rolls back
    and nothing of the bundle stays. A measurement already stored (same device, template
    version, bucket and config) is kept as it is, with its own re-measurements: a config's
    re-measurements are written only with its new trial, so importing a bundle twice adds
    nothing the second time.
    """
    return _store_items(session, items, _Rows.of(session, items, host))


def store_bundle_in_batches(database_url: str, items: Sequence[ValidItem], *,
                            host: str | None = None, batch_items: int = STORE_BATCH_ITEMS
                            ) -> StoreSummary:
    """``store_bundle`` in transactions of ``batch_items`` items each, so that a large upload
    never holds SQLite's write lock for long (a sweep on the same file writes between the
    batches). Items are validated before, so a bad bundle stores nothing; a failure of the
    database midway leaves the batches before it stored, and storing the same bundle again
    completes it (what is stored already is kept, not stored twice)."""
    if batch_items < 1:
        raise ValueError(f"batch_items must be >= 1, but got {batch_items}")
    rows = run_in_transaction(database_url, lambda s: _Rows.of(s, items, host))
    pause = SQLITE_BATCH_PAUSE_S if database_url.startswith("sqlite") else 0.0
    summary = StoreSummary(items=0, trials=0, best_updated=0)
    for start in range(0, len(items), batch_items):
        if start and pause:
            time.sleep(pause)
        batch = items[start:start + batch_items]

        def store(session: Session, batch: Sequence[ValidItem] = batch) -> tuple[
                StoreSummary, dict[str, int]]:
            # A retried transaction must not reuse sweeps created by the rolled-back attempt.
            attempt = dataclasses.replace(rows, sweeps=dict(rows.sweeps))
            return _store_items(session, batch, attempt), attempt.sweeps

        stored, rows.sweeps = run_in_transaction(database_url, store)
        summary += stored
    return summary


def _store_items(session: Session, items: Sequence[ValidItem], rows: _Rows) -> StoreSummary:
    worker = f"bundle:{rows.host}" if rows.host else "bundle"
    new: dict[tuple[int, int, str, str], dict[str, Any]] = {}  # identity -> trial row
    readings: dict[tuple[int, int, str, str], BundleMeasurements] = {}
    sweep_names: dict[tuple[int, int, str, str], str | None] = {}
    for valid in items:
        item = valid.item
        device_id = rows.devices[valid.device.key]
        template_id = rows.templates[(valid.template.name, item.template_version)]
        problem_key = valid.template.problem_key(valid.problem)
        measured = [(valid.config, item.readings(), item.error)]
        if valid.default_config is not None and item.default_tflops is not None:
            default = item.default_measurements
            if default is None:
                # The default's TFLOP/s alone; its time follows from the FLOP count.
                default_ms = valid.template.flops(valid.problem) / (item.default_tflops * 1e9)
                default = _measured_once(default_ms, item.default_tflops)
            measured.append((valid.default_config, default, None))
        for config, reading, error in measured:
            ident = (device_id, template_id, problem_key, config.key())
            if ident in new:  # the first item that measured a config wins, as in the database
                continue
            new[ident] = {
                "device_id": device_id, "template_id": template_id, "problem_key": problem_key,
                "problem": valid.problem.to_dict(), "config_key": ident[3],
                "config": config.to_dict(), "status": TrialStatus.OK,
                "median_ms": reading.first_ms, "tflops": reading.first_tflops, "error": error,
                "is_default": config == valid.default_config, "sweep_id": None,
                "worker": worker}
            readings[ident] = reading
            sweep_names[ident] = item.sweep
    known = crud.stored_trial_identities(session, identities=list(new))
    for ident in known:
        del new[ident]
    for ident, row in new.items():
        row["sweep_id"] = rows.sweep_id(session, sweep_names[ident])
    stored = crud.insert_new_trials(session, rows=list(new.values()))
    again = [{"trial_id": trial_id, "status": r.status, "reason": r.reason,
              "median_ms": r.median_ms, "tflops": r.tflops, "error": r.error,
              "sweep_id": new[ident]["sweep_id"], "worker": worker}
             for ident, trial_id in stored.items() for r in readings[ident].remeasured]
    remeasurements = crud.insert_remeasurements(session, rows=again)
    touched: dict[tuple[int, int], set[str]] = {}
    for device_id, template_id, problem_key, _ in stored:
        touched.setdefault((device_id, template_id), set()).add(problem_key)
    names = {device_id: key for key, device_id in rows.devices.items()}
    templates = {template_id: ident for ident, template_id in rows.templates.items()}
    updated = 0
    changed: set[tuple[str, str, str]] = set()
    for (device_id, template_id), keys in touched.items():
        refreshed = crud.refresh_bests(session, device_id=device_id, template_id=template_id,
                                       problem_keys=sorted(keys))
        updated += len(refreshed)
        if refreshed:
            changed.add((names[device_id], *templates[template_id]))
    return StoreSummary(items=len(items), trials=len(stored), best_updated=updated,
                        remeasurements=remeasurements, changed=frozenset(changed))


# ----------------------------------------------------------------------------- exporting
def make_bundle(session: Session, *, device: str | None = None, template: str | None = None,
                dtype: str | None = None, variant: str | None = None,
                host: str | None = None, exported_at: datetime | None = None
                ) -> dict[str, Any]:
    """A bundle of the stored best configs matching the filters (``crud.list_best``'s)."""
    items: list[dict[str, Any]] = []
    page = 500
    offset = 0
    while True:
        rows = crud.list_best(session, device=device, template=template, dtype=dtype,
                              variant=variant, offset=offset, limit=page)
        defaults = {row.id: session.scalars(select(Trial).where(
            Trial.device_id == row.device_id, Trial.template_id == row.template_id,
            Trial.problem_key == row.problem_key, Trial.status == TrialStatus.OK,
            Trial.is_default.is_(True)).order_by(Trial.id).limit(1)).first() for row in rows}
        # The re-measurements of the page's best and default configs, in one query.
        trial_ids = ({r.trial_id for r in rows if r.trial_id is not None}
                     | {d.id for d in defaults.values() if d is not None})
        again: dict[int, list[Remeasurement]] = {}
        if trial_ids:
            for remeasured in session.scalars(select(Remeasurement).where(
                    Remeasurement.trial_id.in_(trial_ids)).order_by(Remeasurement.id)):
                again.setdefault(remeasured.trial_id, []).append(remeasured)
        side_by_side = head_to_head.side_by_side(
            session, trial_ids=[r.trial_id for r in rows if r.trial_id is not None])
        for row in rows:
            default = defaults[row.id]
            sweep = session.get(Sweep, row.sweep_id) if row.sweep_id is not None else None
            dev = row.device
            item: dict[str, Any] = {
                "device": {"key": dev.key, "name": dev.name,
                           "compute_capability": dev.compute_capability,
                           "sm_count": dev.sm_count, "total_memory": dev.total_memory,
                           "driver_version": dev.driver_version,
                           "triton_version": dev.triton_version,
                           "torch_version": dev.torch_version, "cuda_version": dev.cuda_version,
                           # Only where there is one: hosts of older releases refuse the field.
                           **({"cudnn_version": dev.cudnn_version}
                              if dev.cudnn_version is not None else {})},
                "template": row.template.name, "template_version": row.template.version,
                "problem": dict(row.problem), "config": dict(row.config),
                "tflops": row.tflops, "median_ms": row.median_ms,
            }
            priced = side_by_side.get(row.trial_id) if row.trial_id is not None else None
            if row.trial is not None and priced is not None and priced.readings is not None:
                item["tflops"], item["median_ms"] = _own_numbers(
                    row.trial, again.get(row.trial.id, []))
            if default is not None and default.tflops:
                # The stored number: the default's median where it was re-measured with the
                # finalists, as the best's (db.finalists).
                item["default_tflops"] = row.default_tflops or default.tflops
                item["default_config"] = dict(default.config)
                if default.id != row.trial_id and again.get(default.id):
                    item["default_measurements"] = _measurements(default, again[default.id])
            if sweep is not None:
                item["sweep"] = sweep.name
            if row.trial is not None and row.trial.error is not None:
                item["error"] = row.trial.error
            if row.trial is not None and again.get(row.trial.id):
                item["measurements"] = _measurements(row.trial, again[row.trial.id])
            items.append(item)
        if len(rows) < page:
            break
        offset += page
    # Version 1 while no item has readings: hosts that read only version 1 still read it.
    readings = any("measurements" in it or "default_measurements" in it for it in items)
    bundle: dict[str, Any] = {"format": BUNDLE_FORMAT,
                              "version": BUNDLE_VERSION if readings else 1, "items": items}
    if host:
        bundle["host"] = host
    if exported_at is not None:
        bundle["exported_at"] = exported_at.isoformat()
    return bundle


def _own_numbers(trial: Trial, remeasured: Sequence[Remeasurement]) -> tuple[float, float]:
    """(TFLOP/s, ms) of a trial at the median of its own readings (``db.finalists``): its
    first and its OK re-measurements, not its head-to-head's."""
    measured = Measured(ref=trial.id, order=trial.id, first_ms=trial.median_ms or 0.0,
                        first_tflops=trial.tflops or 0.0,
                        remeasured_ms=tuple(r.median_ms for r in remeasured
                                            if r.status == TrialStatus.OK and r.median_ms))
    return measured.tflops, measured.median_ms


def _measurements(trial: Trial, remeasured: Sequence[Remeasurement]) -> dict[str, Any]:
    """A trial's readings as a bundle's ``measurements``."""
    return {"first_ms": trial.median_ms, "first_tflops": trial.tflops,
            "remeasured": [_reading(r) for r in remeasured]}


def _reading(row: Remeasurement) -> dict[str, Any]:
    """One re-measurement row as a bundle's ``BundleReading``. Numbers that are no finite
    positive time or TFLOP/s (none on an OK row) and a NaN error (a wrong result can measure
    one) are left out: the status and reason say what went wrong, and JSON has no NaN."""
    out: dict[str, Any] = {"status": TrialStatus(row.status).value}
    for name in ("median_ms", "tflops"):
        value = getattr(row, name)
        if value is not None and math.isfinite(value) and value > 0:
            out[name] = value
    if row.error is not None and math.isfinite(row.error) and row.error >= 0:
        out["error"] = row.error
    if row.reason:
        out["reason"] = row.reason
    return out
