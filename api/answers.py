"""The service's answer to "which config for this problem on this device" (GET /v1/best).

Matching is ``tuner.lookup.resolver.match_with_neighbours`` (exact problem, then bucket, then
nearest shape), the same rule the client applies to its local database; a nearest answer carries the
neighbouring buckets' bests, as a local lookup's does, so a client of the service decides on a
neighbour as a client of the database does (docs/DISPATCH.md). When nothing is tuned the
answer is the template's default for the device: the stored device when the service knows its
key, else the hardware the key names (``tuner.lookup.resolver.device_info_from_key``: an unknown or
bare name is taken as an H100).

``BestCache`` keeps in memory what answers need, so a lookup costs no database query:

* the catalog: every stored device (key, name, hardware) and template version. A device or
  version it does not hold has nothing tuned, and is answered from it alone: made-up device
  keys cost no query and take no room (issue 19: each random key cost a database load and
  flushed the whole cache);
* per device x template version with stored results, their best configs, parsed once
  (parsing every stored row on every request cost ~10 ms, most of a lookup's time), at most
  ``max_entries`` of them, the least recently used evicted one at a time.

A change of the database by another process (a sweep, an import, another worker of the
service) is noticed at the next lookup (``api.changes``: SQLite's data version, PostgreSQL
notifications), and every entry is re-checked before it answers again (a request waits for
that query, ~1 ms): the first answer after a change is not a stale one (issue 18: it said
``default`` for up to ``ttl_s`` after a sweep wrote). Besides, every entry is re-checked with
one small query once it is ``ttl_s / 2`` old, in the background while requests keep answering
from it, and an entry ``ttl_s`` old is not answered from until it is checked: where changes
cannot be watched (a notification lost), an answer reflects the database as it was at most
``ttl_s`` ago. A check that finds changes re-reads and re-parses only the best configs that
changed (issue 19: an upload used to drop every entry, and all requests waited on full
reloads). An upload through the service refreshes the entries it changed before it answers.
"""

from __future__ import annotations

import asyncio
import bisect
import dataclasses
import itertools
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Generic, TypeVar

from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from api.changes import Changes, watch_changes
from db import crud
from db.session import get_sessionmaker
from templates.base import Problem, Template
from templates.device import DeviceInfo
from templates.registry import get_template
from tuner.lookup.resolver import (
    Candidate,
    device_info_from_key,
    device_info_from_row,
    match_with_neighbours,
)
from tuner.lookup.stored_bests import StoredBest, stored_bests
from tuner.wire import BestOut, NeighbourOut

log = logging.getLogger("api")

_versions: dict[str, str] = {}


def template_version(template: Template) -> str:
    """The running kernel's version; hashing its source once per process is enough."""
    version = _versions.get(template.name)
    if version is None:
        version = _versions[template.name] = template.version()
    return version


def template_version_of(name: str) -> str:
    """``template_version`` of the registered template ``name``."""
    return template_version(get_template(name))


# Candidates listed in the answer to an ambiguous device; the rest are counted.
MAX_LISTED_DEVICES = 20


class AmbiguousDevice(ValueError):
    """A device name or key prefix that matches several stored devices."""

    def __init__(self, given: str, keys: list[str], how: str) -> None:
        self.given = given
        self.candidates = keys[:MAX_LISTED_DEVICES]
        more = len(keys) - len(self.candidates)
        super().__init__(
            f"device {given!r} is the {how} of {len(keys)} stored devices; ask with one of "
            f"their keys{f' (the first {len(self.candidates)} listed, {more} more)' if more else ''}")


@dataclass(frozen=True)
class Catalog:
    """The stored devices and template versions (what has tuned results at all)."""

    devices: dict[str, DeviceInfo]  # by key
    keys_by_name: dict[str, list[str]]
    sorted_keys: list[str]  # for key prefixes
    template_versions: frozenset[tuple[str, str]]
    fingerprint: tuple[Any, ...]

    def resolve(self, given: str) -> str | None:
        """The key of the stored device that ``given`` names: its key, its name, or a prefix of
        its key, in that order (None: no stored device); raises ``AmbiguousDevice`` when a
        name or prefix fits several."""
        if given in self.devices:
            return given
        named = self.keys_by_name.get(given, [])
        if len(named) > 1:
            raise AmbiguousDevice(given, named, "name")
        if named:
            return named[0]
        start = bisect.bisect_left(self.sorted_keys, given)
        matches = list(itertools.takewhile(lambda k: k.startswith(given),
                                           self.sorted_keys[start:]))
        if len(matches) > 1:
            raise AmbiguousDevice(given, matches, "key prefix")
        return matches[0] if matches else None


@dataclass(frozen=True)
class ParsedBests:
    """The parsed best configs of one device x template version."""

    candidates: list[Candidate]  # ordered by problem key, as the rows were before
    by_key: dict[str, Candidate]
    versions: dict[str, tuple[int, Any]]  # problem key -> (id, updated_at), see crud
    fingerprint: tuple[Any, ...]


T = TypeVar("T")


@dataclass
class _Kept(Generic[T]):
    """One cached value, when the database was last checked for it, and its refresh."""

    value: T | None = None
    checked_at: float = float("-inf")  # clock at the start of the load that gave value
    seq: int = -1  # loads are numbered as they start: a newer load's value is never replaced
    generation: int = -1  # the cache's generation (database changes seen) when value loaded
    loading: asyncio.Future[Loaded[T]] | None = field(default=None, repr=False)
    loading_generation: int = -1


BestsKey = tuple[str, str, str]  # device key, template name, template version
Loaded = tuple[T, float, int, int]  # value, clock at its start, seq, generation


class BestCache:
    """The catalog and best configs of the database at ``database_url``, kept in memory and
    re-checked every ``ttl_s`` seconds (see the module docstring).

    Everything but the loads runs on the event loop; a load (a few queries and parsing) runs
    in a worker thread and hands its result back to the loop, one load per entry at a time.
    """

    def __init__(self, database_url: str, ttl_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic, max_entries: int = 1024,
                 watch: bool = True, own_changes: Callable[[int, int], bool] | None = None
                 ) -> None:
        if ttl_s <= 0 or max_entries < 1:
            raise ValueError(f"ttl_s must be > 0 and max_entries >= 1, but got ttl_s={ttl_s}, "
                             f"max_entries={max_entries}")
        self.database_url = database_url
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._clock = clock
        self._seq = itertools.count()
        self._catalog: _Kept[Catalog] = _Kept()
        self._bests: OrderedDict[BestsKey, _Kept[ParsedBests]] = OrderedDict()
        # watch=False: only the ttl bounds how stale an answer gets (the fallback where
        # changes cannot be watched, e.g. a PostgreSQL notification lost).
        self._watch = watch
        self._changes: Changes | None = None
        self._last_change: int | None = None
        self._generation = 0  # database changes seen so far
        # (seen, now) -> whether every change between the two counts of ``best_changes`` was
        # this service's own upload, which refreshes what it changed before it is answered
        # (api/own_writes.py): then nothing else is re-checked, and no read waits for it.
        self._own_changes = own_changes

    def close(self) -> None:
        """Stop watching the database for changes (the service's shutdown)."""
        if self._changes is not None:
            self._changes.close()
            self._changes = None

    def _notice_changes(self) -> None:
        """A new generation if the database changed since the last lookup: every entry then
        loaded before is re-checked before it answers again."""
        if not self._watch:
            return
        if self._changes is None:
            self._changes = watch_changes(self.database_url)
            if self._changes is None:
                self._watch = False
                return
        count = self._changes.count()
        if count != self._last_change:
            if self._last_change is not None and not self._own(self._last_change, count):
                self._generation += 1
            self._last_change = count

    def _own(self, seen: int, now: int) -> bool:
        return (self._own_changes is not None and self._changes is not None
                and self._changes.counts_best_changes and self._own_changes(seen, now))

    # -- reading ----------------------------------------------------------------------------
    async def catalog(self) -> Catalog:
        return await self._fresh(self._catalog, self._load_catalog)

    async def bests(self, template: Template, version: str, device_key: str) -> ParsedBests:
        key = (device_key, template.name, version)
        kept = self._bests.get(key)
        if kept is None:
            kept = self._bests[key] = _Kept()
            while len(self._bests) > self.max_entries:
                self._bests.popitem(last=False)  # the least recently used
        else:
            self._bests.move_to_end(key)
        return await self._fresh(kept, partial(self._load_bests, key))

    def __len__(self) -> int:
        """Entries of parsed best configs held (the catalog not counted)."""
        return len(self._bests)

    @property
    def changes_seen(self) -> int:
        """Changes of the database by others noticed so far (each made every entry re-check)."""
        return self._generation

    async def refresh(self, changed: Iterable[BestsKey]) -> None:
        """Re-read the catalog and the held best configs of ``changed`` now (after an upload
        through this service: its uploader's next lookup sees what it stored), while requests
        keep answering from the entries as they are until each new one is in place."""
        self._notice_changes()  # its own write: the loads below are of the new generation
        loads: list[asyncio.Future[Any]] = [
            self._start(self._catalog, self._load_catalog, force=True)]
        for key in set(changed):
            kept = self._bests.get(key)
            if kept is not None:
                loads.append(self._start(kept, partial(self._load_bests, key), force=True))
        try:
            await asyncio.gather(*(asyncio.shield(load) for load in loads))
        except Exception:
            # Its own change was not re-checked (api/own_writes.py): now every entry is.
            self._generation += 1
            raise

    async def _fresh(self, kept: _Kept[T], load: Callable[[T | None], T]) -> T:
        self._notice_changes()
        age = self._clock() - kept.checked_at
        if kept.value is not None and age < self.ttl_s and kept.generation == self._generation:
            if age >= self.ttl_s / 2:
                self._start(kept, load)  # checked in the background; answered from as it is
            return kept.value
        # A load that began before the change was seen may have read the database before it:
        # not waited for, another one starts.
        older = kept.loading is not None and kept.loading_generation != self._generation
        try:
            value, _, _, _ = await asyncio.shield(self._start(kept, load, force=older))
        except Exception:
            if kept.value is None:
                raise
            # The database failed: an old answer serves better than none (logged by _loaded).
            return kept.value
        return value

    def _start(self, kept: _Kept[T], load: Callable[[T | None], T], *,
               force: bool = False) -> asyncio.Future[Loaded[T]]:
        if kept.loading is not None and not force:
            return kept.loading
        seq, started, generation = next(self._seq), self._clock(), self._generation

        def run() -> Loaded[T]:
            return load(kept.value), started, seq, generation

        loading = asyncio.ensure_future(run_in_threadpool(run))
        loading.add_done_callback(partial(self._loaded, kept))
        kept.loading, kept.loading_generation = loading, generation
        return loading

    def _loaded(self, kept: _Kept[T], done: asyncio.Future[Loaded[T]]) -> None:
        if kept.loading is done:
            kept.loading = None
        if done.cancelled():
            return
        if done.exception() is not None:  # retrieved: logged, not lost
            log.warning("reloading cached answers failed: %s", done.exception())
            return
        value, started, seq, generation = done.result()
        if seq > kept.seq:  # a load that started earlier but ended later is older: dropped
            kept.value, kept.checked_at, kept.seq = value, started, seq
            kept.generation = generation

    # -- loading (worker threads) -----------------------------------------------------------
    def _session(self) -> Session:
        return get_sessionmaker(self.database_url, write=False)()

    def _load_catalog(self, old: Catalog | None) -> Catalog:
        with self._session() as session:
            mark = crud.catalog_fingerprint(session)
            if old is not None and old.fingerprint == mark:
                return old
            devices = {row.key: device_info_from_row(row) for row in crud.list_devices(session)}
            versions = frozenset(crud.template_versions(session))
        names: dict[str, list[str]] = {}
        for key in sorted(devices):
            names.setdefault(devices[key].name, []).append(key)
        return Catalog(devices, names, sorted(devices), versions, mark)

    def _load_bests(self, key: BestsKey, old: ParsedBests | None) -> ParsedBests:
        device_key, template_name, version = key
        of_key = {"device_key": device_key, "template_name": template_name,
                  "template_version": version}
        with self._session() as session:
            mark = crud.best_fingerprint(session, **of_key)
            if old is not None and old.fingerprint == mark:
                return old
            versions = crud.best_versions(session, **of_key)
            old_versions = old.versions if old is not None else {}
            stale = [k for k, v in versions.items() if old_versions.get(k) != v]
            rows = crud.best_candidates(session, **of_key, problem_keys=stale) if stale else []
            fresh = stored_bests(session, get_template(template_name), rows)
        kept = {k: c for k, c in (old.by_key.items() if old is not None else ())
                if k in versions and k not in fresh and old_versions.get(k) == versions[k]}
        by_key = {**kept, **fresh}
        return ParsedBests(candidates=[by_key[k] for k in sorted(by_key)], by_key=by_key,
                        versions=versions, fingerprint=mark)


# Defaults already computed, by the hardware they are for (least recently used first out).
_DEFAULTS_KEPT = 4096
_defaults: OrderedDict[tuple[str, str, Problem, DeviceInfo], dict[str, Any]] = OrderedDict()


def default_config(template: Template, problem: Problem, info: DeviceInfo) -> dict[str, Any]:
    """``template.default_config(problem, info)`` as a dict, computed once per hardware.

    A device's name only labels the templates' error messages (and tells the CPU interpreter
    apart), so made-up keys naming the same hardware share one computation: a flood of them
    (issue 19's 300 lookups a second) spent ~40 % of each lookup validating the configs the
    heuristic tried (cProfile, 2026-11-29)."""
    hardware = info if info.is_interpreter else dataclasses.replace(info, name="")
    key = (template.name, template_version(template), problem, hardware)
    config = _defaults.get(key)
    if config is None:
        config = _defaults[key] = template.default_config(problem, info).to_dict()
        while len(_defaults) > _DEFAULTS_KEPT:
            _defaults.popitem(last=False)
    else:
        _defaults.move_to_end(key)
    return dict(config)


@dataclass(frozen=True)
class Answered:
    """An answer and the cache entries it was computed from (``api.answer_memo`` keeps it
    while the cache holds the same ones)."""

    answer: BestOut
    catalog: Catalog
    stored_device: bool  # the device is a stored one (else answered from its key alone)
    version: str  # the template version asked for (or the running one)
    bests: ParsedBests | None  # the device's bests of that version, if any are stored


async def best_answer(cache: BestCache, *, template: Template, version: str | None,
                      problem: Problem, device: str) -> BestOut:
    """``answer_with_sources``' answer."""
    answered = await answer_with_sources(cache, template=template, version=version,
                                         problem=problem, device=device)
    return answered.answer


async def answer_with_sources(cache: BestCache, *, template: Template, version: str | None,
                              problem: Problem, device: str) -> Answered:
    """Answer on the event loop; only loading from the database goes to a worker thread.

    ``device`` is a stored device's key, name or unique key prefix (``AmbiguousDevice`` when
    it fits several), or any other key, answered with the default for the hardware it names.
    Matching cached parsed bests takes ~0.1 ms; two thread-pool hops per request (a plain `def`
    endpoint and its response serialization) cost more than that under load.
    """
    current = template_version(template)
    version = version or current
    catalog = await cache.catalog()
    device_key = catalog.resolve(device)
    stored_device = device_key is not None
    found = bests = None
    if device_key is None:  # nothing stored for it: no query, no cache entry
        device_key, info = device, device_info_from_key(device)
    else:
        info = catalog.devices[device_key]
        if (template.name, version) in catalog.template_versions:
            bests = await cache.bests(template, version, device_key)
            found = match_with_neighbours(template, problem, info, bests.candidates)
    base: dict[str, Any] = {"template": template.name, "device": device_key,
                            "problem": problem.to_dict(),
                            "problem_key": template.problem_key(problem)}
    if found is None:
        answer = BestOut(**base, template_version=current, match="default",
                         config=default_config(template, problem, info))
        return Answered(answer, catalog, stored_device, version, bests)
    row: StoredBest = found.candidate
    answer = BestOut(**base, template_version=version, match=found.kind,
                     config=found.config.to_dict(), matched_problem=row.problem,
                     tflops=row.tflops, median_ms=row.median_ms,
                     default_tflops=row.default_tflops, speedup=row.speedup,
                     readings=row.readings, spread=row.spread, provenance=row.provenance,
                     neighbours=[NeighbourOut(problem_key=n.problem_key,
                                              problem=n.problem.to_dict(),
                                              config=n.config.to_dict(), tflops=n.tflops)
                                 for n in found.neighbours.values()])
    return Answered(answer, catalog, stored_device, version, bests)
