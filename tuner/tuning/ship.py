"""A shipped table made from stored bests: of a database, or of a bundle file (``tuner ship``).

The records are the stored bests of one device in the buckets of a suite's problems (every
registered template's, not only the suite's: a sweep's training templates price gradients),
each as the dispatcher prices it from that database: the best's TFLOP/s, the median of the
head-to-head it took part in where there was one. A bundle (``tuner export``) carries each
config's own readings instead (bundles do not carry head-to-heads, ``tuner.lookup.bundle``): a table
made from one says so in ``source``, and its records' ``head_to_head`` is false.

Dropped, and said (``Shipped.dropped``): a best tuned for another version of its kernel than
the one installed here (configs tuned for the old kernel are never served for the new one), of
a template not registered here, or whose problem or config no longer validates.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from sqlalchemy.engine import make_url

from db import crud
from db.models import TrialStatus
from db.session import session_scope
from templates.base import Problem
from templates.device import DeviceInfo
from templates.registry import get_template
from tuner.dispatch.rule import BASELINE
from tuner.dispatch.winners import forward_templates
from tuner.lookup.bundle import Bundle, BundleItem, first_error
from tuner.lookup.devices import device_info_from_row
from tuner.lookup.shipped.table import (
    SHIPPED_FORMAT,
    SHIPPED_VERSION,
    ShippedDevice,
    ShippedError,
    ShippedRecord,
    ShippedTable,
)
from tuner.tuning.suites import SweepSpec

__all__ = ["Dropped", "Shipped", "StoredBests", "as_json", "build_table", "dropped_lines",
           "from_bundle", "from_database", "pick_device", "table_winners"]

VersionOf = Callable[[str], str]  # template name -> the kernel version installed here
MAX_BESTS = 100_000  # bests of one device read at most: far more than a device ever holds


@dataclass(frozen=True)
class StoredBests:
    """The bests of one device, as read from a database or a bundle."""

    device: DeviceInfo
    records: list[ShippedRecord]
    source: str  # where they came from, for the table and the user


@dataclass(frozen=True)
class Dropped:
    """A stored best not shipped, and why."""

    template: str
    template_version: str
    problem_key: str
    reason: str


@dataclass(frozen=True)
class Shipped:
    table: ShippedTable
    dropped: list[Dropped] = field(default_factory=list)
    # (problem key, template) of the suite's templates with no record to ship.
    missing: list[tuple[str, str]] = field(default_factory=list)


# ----------------------------------------------------------------------------- reading
def pick_device(devices: Mapping[str, str], wanted: str | None, where: str) -> str:
    """The key of the one device of ``devices`` (key -> name) that ``wanted`` names: its key,
    its name, or a part of its name (any case); with ``wanted`` None, the only device there."""
    if not devices:
        raise ShippedError(f"{where} holds no best config of any device",
                           "sweep first (`tuner sweep standard`), or name another source")
    if wanted is None:
        if len(devices) == 1:
            return next(iter(devices))
        raise ShippedError(f"{where} holds best configs of {len(devices)} devices: "
                           f"{sorted(devices)}", "name one with --device (its name or key)")
    if wanted in devices:
        return wanted
    low = wanted.lower()
    for matches in ([k for k, n in devices.items() if n.lower() == low],
                    [k for k, n in devices.items() if low in n.lower()]):
        if len(matches) == 1:
            return matches[0]
        if len(matches) > 1:
            raise ShippedError(f"--device {wanted!r} names {len(matches)} devices of {where}, "
                               f"whose measurements do not compare: {sorted(matches)}",
                               "name one by its key")
    raise ShippedError(f"--device {wanted!r} names no device of {where}; it holds "
                       f"{sorted(set(devices.values()))}", "name one of those (or its key)")


def from_database(url: str, device: str | None) -> StoredBests:
    """The stored bests of one device of the database at ``url`` (read-only), each at the
    TFLOP/s the dispatcher prices it by."""
    parsed = make_url(url)
    where = f"database {parsed.render_as_string(hide_password=True)}"
    if parsed.get_backend_name() == "sqlite" and (
            not parsed.database or not Path(parsed.database).expanduser().is_file()):
        raise ShippedError(f"{where}: no such database file",
                           "give the database a sweep wrote (--from sqlite:///path.db)")
    with session_scope(url, write=False) as s:
        devices = {d.key: d.name for d in crud.list_devices(s)}
        key = pick_device(devices, device, where)
        rows = crud.list_best(s, device=key, limit=MAX_BESTS)
        readings = crud.best_readings(s, rows)
        info = device_info_from_row(rows[0].device) if rows else None
        records = [ShippedRecord(
            template=r.template.name, template_version=r.template.version,
            problem=dict(r.problem), config=dict(r.config), tflops=float(r.tflops),
            median_ms=float(r.median_ms), readings=readings[r.id].count,
            head_to_head=readings[r.id].head_to_head is not None) for r in rows]
    if info is None:
        raise ShippedError(f"{where} holds no best config of {key}", "sweep it first")
    return StoredBests(info, records, where)


def from_bundle(path: Path, device: str | None) -> StoredBests:
    """The items of one device of a bundle file (``tuner export``), each at its own readings'
    median (a bundle carries no head-to-head)."""
    where = f"bundle {path}"
    try:
        data = json.loads(path.read_text())
        Bundle.model_validate({**data, "items": []})
    except (OSError, ValueError, TypeError) as exc:  # ValidationError is a ValueError
        raise ShippedError(f"{where} cannot be read as a bundle: {exc}",
                           "give a file that `tuner export` wrote") from None
    items = []
    for index, raw in enumerate(data.get("items", ())):
        try:
            items.append(BundleItem.model_validate(raw))
        except ValidationError as exc:
            raise ShippedError(f"{where}: item {index}: {first_error(exc)}",
                               "give a file that `tuner export` wrote") from None
    key = pick_device({i.device.key: i.device.name for i in items}, device, where)
    mine = [i for i in items if i.device.key == key]
    records = [ShippedRecord(
        template=i.template, template_version=i.template_version, problem=dict(i.problem),
        config=dict(i.config), tflops=i.tflops, median_ms=i.median_ms,
        readings=1 + sum(1 for r in (i.measurements.remeasured if i.measurements else ())
                         if r.status == TrialStatus.OK),
        head_to_head=False) for i in mine]
    return StoredBests(mine[0].device.info(), records,
                       f"{where} (each config's own readings: a bundle carries no "
                       "head-to-head)")


# ----------------------------------------------------------------------------- the table
def build_table(bests: StoredBests, suite: SweepSpec, version_of: VersionOf,
                now: datetime | None = None) -> Shipped:
    """The table of ``bests`` in the buckets of ``suite``'s problems, at this install's kernel
    versions; what was dropped, and what the suite's templates lack."""
    keys: dict[str, set[str]] = {}  # template -> the buckets of the suite's problems

    def suite_keys(template: str) -> set[str]:
        if template not in keys:
            keys[template] = _suite_keys(suite, template)
        return keys[template]

    dropped: list[Dropped] = []
    kept: dict[tuple[str, str], ShippedRecord] = {}
    for record in bests.records:
        key = _problem_key(record)
        if key not in suite_keys(record.template):
            continue
        why = _why_dropped(record, bests.device, version_of)
        if why is not None:
            dropped.append(Dropped(record.template, record.template_version, key, why))
        else:
            kept[(record.template, key)] = record
    missing = [(key, name) for name in suite.templates for key in sorted(suite_keys(name))
               if (name, key) not in kept]
    table = ShippedTable(
        format=SHIPPED_FORMAT, version=SHIPPED_VERSION, device=ShippedDevice.of(bests.device),
        suite=suite.name, source=bests.source, generated_at=now or datetime.now(UTC),
        records=[kept[k] for k in sorted(kept)])
    return Shipped(table, dropped, missing)


def _suite_keys(suite: SweepSpec, template: str) -> set[str]:
    try:
        t = get_template(template)
    except ValueError:  # its records are dropped, and said: matched by the default bucket
        return {p.bucket_key() for p in suite.problems}
    return {t.problem_key(p) for p in suite.problems if t.unsupported(p) is None}


def _problem_key(record: ShippedRecord) -> str | None:
    """The bucket ``record`` was stored under (None: its problem no longer validates)."""
    try:
        problem = Problem.from_dict(record.problem)
    except (TypeError, ValueError):
        return None
    try:
        return get_template(record.template).problem_key(problem)
    except ValueError:
        return problem.bucket_key()


def _why_dropped(record: ShippedRecord, device: DeviceInfo, version_of: VersionOf
                 ) -> str | None:
    """Why ``record`` (of a valid problem) is not shipped; None: it is."""
    try:
        template = get_template(record.template)
    except ValueError:
        return f"template {record.template!r} is not registered here"
    installed = version_of(template.name)
    if record.template_version != installed:
        return (f"tuned for version {record.template_version} of the kernel, the installed "
                f"one is {installed}")
    try:
        config = template.config(record.config)
    except (TypeError, ValueError) as exc:
        return f"its config is outside the space: {exc}"
    why = template.constraint(Problem.from_dict(record.problem), config, device)
    if why is not None:
        return f"its config cannot run on {device.name}: {why}"
    return None


def table_winners(records: Iterable[ShippedRecord]) -> dict[str, str]:
    """By problem key: the implementation whose forward template the table prices fastest
    (``tuner winners``' rule for inference calls); torch SDPA where it has no record (ours
    must be measured faster to run)."""
    impl_of = forward_templates()
    by_key: dict[str, dict[str, float]] = {}
    for r in records:
        if r.template in impl_of:
            key = get_template(r.template).problem_key(Problem.from_dict(r.problem))
            by_key.setdefault(key, {})[impl_of[r.template]] = r.tflops
    return {key: (max(tflops, key=tflops.__getitem__) if BASELINE in tflops else BASELINE)
            for key, tflops in sorted(by_key.items())}


def dropped_lines(dropped: Iterable[Dropped]) -> list[str]:
    """``dropped`` for people: one line per template, version and reason."""
    groups: dict[tuple[str, str, str], list[str]] = {}
    for d in dropped:
        groups.setdefault((d.template, d.template_version, d.reason), []).append(d.problem_key)
    return [f"{name}: {len(keys)} record(s) dropped, {reason}: {', '.join(keys)}"
            for (name, version, reason), keys in sorted(groups.items())]


def as_json(shipped: Shipped, path: Path) -> dict[str, Any]:
    """What ``tuner ship --json`` prints."""
    return {"file": str(path), "device": shipped.table.device.key,
            "records": len(shipped.table.records),
            "winners": table_winners(shipped.table.records),
            "dropped": [vars(d) for d in shipped.dropped],
            "missing": [{"problem_key": k, "template": t} for k, t in shipped.missing]}
