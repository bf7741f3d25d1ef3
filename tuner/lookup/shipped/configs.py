"""The shipped tables as the resolver reads them: a device's table, matched as the database is.

``ShippedConfigs.match`` answers a template's problem on a device from the table of that
device's GPU model in a folder (the package's, ``PACKAGED_DIR``, or the one TUNER_SHIPPED
names: ``shipped_folder``), loaded at the device's first
question: the records of the installed kernel version, matched by
``tuner.lookup.matching.match_with_neighbours`` (exact, bucket, nearest with its neighbours' bests),
as the database's rows are. Records tuned for another version of the kernel are never matched:
configs tuned for the old kernel are not served for the new one (logged once per template).

A table that does not serve the device (``tuner.lookup.shipped.table.why_not_serving``), or cannot
be read, answers nothing: the problem runs what it would without a table (logged once; a broken
table as a warning, since the package shipped it).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from templates.base import Problem, Template
from templates.device import DeviceInfo
from tuner.lookup.matching import Candidate, Match, match_with_neighbours, parse_candidates
from tuner.lookup.shipped.table import (
    ShippedError,
    ShippedRecord,
    ShippedTable,
    file_name,
    keyed_records,
    load_table,
    why_not_serving,
)
from tuner.settings import SHIPPED_OFF, SHIPPED_ON

__all__ = ["PACKAGED_DIR", "ShippedBest", "ShippedConfigs", "shipped_folder"]

log = logging.getLogger("tuner.lookup.shipped")

PACKAGED_DIR = Path(__file__).resolve().parent  # the tables that ship with the package


def shipped_folder(setting: str) -> Path | None:
    """The folder of tables that TUNER_SHIPPED (``Settings.shipped``) names: the package's for
    on, None (no table consulted) for off, else the folder given."""
    if setting == SHIPPED_OFF:
        return None
    return PACKAGED_DIR if setting == SHIPPED_ON else Path(setting)


@dataclass(frozen=True)
class ShippedBest:
    """One record, as matching reads a stored best (``tuner.lookup.matching.BestLike``)."""

    problem_key: str
    problem: dict[str, Any]
    config: dict[str, Any]
    tflops: float
    record: ShippedRecord


@dataclass
class _Loaded:
    path: Path
    table: ShippedTable
    candidates: dict[tuple[str, str], list[Candidate]]  # (template, version) -> parsed


class ShippedConfigs:
    """The shipped tables of ``folder``, each loaded once, at its device's first question."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._tables: dict[str, _Loaded | None] = {}  # device key -> its table, or None
        self._lock = threading.Lock()

    def match(self, template: Template, version: str, problem: Problem,
              device: DeviceInfo) -> Match | None:
        loaded = self._loaded(device)
        if loaded is None:
            return None
        return match_with_neighbours(template, problem, device,
                                     self._candidates(loaded, template, version))

    def table_for(self, device: DeviceInfo) -> ShippedTable | None:
        """The table that answers for ``device`` (None: none does)."""
        loaded = self._loaded(device)
        return None if loaded is None else loaded.table

    def _loaded(self, device: DeviceInfo) -> _Loaded | None:
        if device.key in self._tables:
            return self._tables[device.key]
        with self._lock:  # one load per device; other threads wait for it
            if device.key in self._tables:
                return self._tables[device.key]
            self._tables[device.key] = loaded = self._read(device)
            return loaded

    def _read(self, device: DeviceInfo) -> _Loaded | None:
        try:
            path = self.folder / file_name(device.name)
        except ShippedError:
            return None
        if not path.is_file():
            log.debug("no shipped measurements for %s (%s)", device.name, path)
            return None
        try:
            table = load_table(path)
        except ShippedError as exc:
            log.warning("%s; its measurements are not used", exc)
            return None
        why = why_not_serving(table.device, device)
        if why is not None:
            log.info("shipped measurements %s not used: %s", path, why)
            return None
        log.info("shipped measurements for %s: %s (%d records, measured on %s)", device.name,
                 path, len(table.records), table.device.key)
        return _Loaded(path, table, {})

    def _candidates(self, loaded: _Loaded, template: Template, version: str
                    ) -> list[Candidate]:
        key = (template.name, version)
        found = loaded.candidates.get(key)
        if found is None:
            with self._lock:
                found = loaded.candidates.get(key)
                if found is None:
                    found = loaded.candidates[key] = self._parse(loaded, template, version)
        return found

    @staticmethod
    def _parse(loaded: _Loaded, template: Template, version: str) -> list[Candidate]:
        bests, stale = [], set()
        for record, key in keyed_records(loaded.table, template):
            if record.template_version != version:
                stale.add(record.template_version)
                continue
            bests.append(ShippedBest(key, record.problem, record.config, record.tflops, record))
        if stale:
            log.info("shipped measurements %s: %s records of version %s not used: the "
                     "installed kernel is version %s (configs tuned for other kernel source "
                     "are never served)", loaded.path, template.name,
                     ", ".join(sorted(stale)), version)
        return parse_candidates(template, bests)
