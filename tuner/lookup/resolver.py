"""Config resolution: which tuned config runs a problem on a device.

With ``TUNER_SNAPSHOT`` set, every answer comes from that snapshot alone, loaded once at the
first lookup (``tuner.lookup.pinned``) and matched as the database's rows are, problem by problem;
nothing else is asked, ever. Without it, the order, first answer wins
(``ConfigResolver.resolve``):

1. in-process cache (per device x template version x shape bucket: every problem of a bucket
   runs the config its first lookup found, so a decode loop whose KV length grows by one token
   per step asks the database or service once per bucket, not once per step),
2. the local database named by ``TUNER_DATABASE_URL``, read-only, and only if it already exists
   (a lookup never creates a database file),
3. the config service at ``TUNER_URL``, when set: at most ``TUNER_LOOKUP_TIMEOUT`` seconds per
   question; a failure is remembered for ``retry_after_s`` (60 s) so a dead service costs one
   timeout a minute, not one per call,
4. the shipped measurements of this GPU model (``tuner.lookup.shipped``: a table in the package, of
   the installed kernel versions only), source ``shipped``; ``TUNER_SHIPPED=off`` leaves them
   out (the untuned state), a folder given there replaces the package's,
5. the template's default heuristic.

An ``exact`` or ``bucket`` match ends the search at once; a ``nearest`` match from the
database is kept while the service and the shipped table are asked whether they know better
(a nearest answer is kept from the first of them that has one). A nearest answer (database,
snapshot, service or shipped) carries the bests of the neighbouring buckets
(``neighbours_of``; the service sends them in ``BestOut.neighbours``), on one of which the
dispatcher may compare implementations (docs/DISPATCH.md). Every answer
that is not tuned here (``default``, ``nearest``, ``shipped``) is noted as demand for the
service (``tuner.demand.reporter``), when ``TUNER_URL`` is set and ``TUNER_DEMAND`` is not off.
Every config that comes from outside (database, service or shipped table) is re-validated against
the template's space and static constraints here: a served config is data, never code. A shipped
answer is re-asked after ``UNTUNED_TTL_S`` until a kernel runs with it, as an untuned one: a
sweep that lands meanwhile replaces it.

Stable within a process: an answer is re-asked only until a kernel runs with it. The caller
that runs a config says so (``ConfigResolver.keep``), and from then on its bucket answers the
same for the process's life, whatever the database or the service say later, so a kernel never
switches configs mid-run. ``TUNER_REFRESH=on`` opts in to newer answers instead: untuned ones
are re-asked after ``UNTUNED_TTL_S``, tuned ones after ``TUNED_TTL_S``, run or not.

The matching rule itself is ``tuner.lookup.matching``, shared with the service's ``GET /v1/best``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from db.errors import DatabaseUnavailableError
from templates.base import Problem, Template
from templates.device import DeviceInfo
from tuner.demand.reporter import UNTUNED, DemandReporter
from tuner.errors import ServiceError
from tuner.lookup.devices import (
    HOPPER_DEFAULT,
    device_info_from_key,
    device_info_from_row,
    smem_for_cc,
)
from tuner.lookup.matching import (
    BestLike,
    CacheKey,
    Candidate,
    Match,
    Neighbour,
    Resolved,
    match_best,
    match_candidates,
    match_with_neighbours,
    neighbours_of,
    parse_candidates,
)
from tuner.lookup.shipped import ShippedConfigs, shipped_folder
from tuner.lookup.shipped.table import ShippedTable
from tuner.lookup.snapshot import SnapshotError
from tuner.settings import load_settings

if TYPE_CHECKING:
    from sqlalchemy.engine import Engine

    from tuner.demand.reporter import DemandReporter
    from tuner.lookup.pinned import PinnedConfigs
    from tuner.settings import Settings

# The matching rule (tuner.lookup.matching) and the device facts (tuner.lookup.devices) are their
# own modules, which tuner.lookup.pinned and tuner.lookup.bundle import without importing the
# resolver; the resolver's callers find them here too.
__all__ = [
    "HOPPER_DEFAULT", "RETRY_AFTER_S", "SHIPPED", "TUNED_TTL_S", "UNTUNED_TTL_S", "BestLike",
    "Candidate", "ConfigResolver", "Match", "Neighbour", "Resolved", "device_info_from_key",
    "device_info_from_row", "get_resolver", "keep_config", "match_best", "match_candidates",
    "match_with_neighbours", "neighbours_of", "parse_candidates", "resolve_config",
    "set_resolver", "smem_for_cc",
]

log = logging.getLogger("tuner.lookup.resolver")

RETRY_AFTER_S = 60.0
# An untuned answer (default, nearest) is asked again after this long: a sweep or an upload
# that lands while a job runs reaches it within about this (the service's own answers are at
# most 5 s old, docs/SERVING.md). A re-ask is one query per template and shape bucket.
UNTUNED_TTL_S = 5.0
# With TUNER_REFRESH=on, a tuned answer (exact, bucket) is asked again after this long: a
# sweep that finds a faster config reaches running jobs within about a minute.
TUNED_TTL_S = 60.0
SHIPPED = "shipped"  # the source of an answer from the package's shipped measurements


# ----------------------------------------------------------------------------- resolution

class ConfigResolver:
    """Resolves configs in the documented order; one per process is enough (``get_resolver``)."""

    def __init__(self, settings: Settings | None = None, *, retry_after_s: float = RETRY_AFTER_S,
                 untuned_ttl_s: float = UNTUNED_TTL_S,
                 clock: Callable[[], float] = time.monotonic,
                 shipped_dir: Path | Literal["setting"] | None = "setting") -> None:
        self.settings = settings if settings is not None else load_settings()
        self.retry_after_s = retry_after_s
        # Answers that are not tuned (default, nearest) are asked again after this long, so a
        # config uploaded while the process runs is picked up within seconds.
        self.untuned_ttl_s = untuned_ttl_s
        self._clock = clock
        self._cache: dict[CacheKey, Resolved] = {}
        self._versions: dict[str, str] = {}
        self._lock = threading.Lock()
        self._engine: Engine | None = None
        self._engine_error: DatabaseUnavailableError | None = None
        self._database_down_until = 0.0
        self._service_down_until = 0.0
        self._pool: ThreadPoolExecutor | None = None
        self._pinned: PinnedConfigs | None = None
        self._pin_error: SnapshotError | None = None
        self._demand: DemandReporter | None = None
        # The shipped tables (tuner.lookup.shipped) of ``shipped_dir``: by default the folder that
        # TUNER_SHIPPED names (the package's unless off); None: none consulted.
        folder = (shipped_folder(self.settings.shipped) if shipped_dir == "setting"
                  else shipped_dir)
        self._shipped = ShippedConfigs(folder) if folder is not None else None

    # -- public -------------------------------------------------------------------------
    def resolve(self, template: Template, problem: Problem, device: DeviceInfo) -> Resolved:
        version = self.version_of(template)
        pinned = self._pinned_configs()
        if pinned is not None:
            return pinned.resolve(template, version, problem, device)
        key = (device.key, template.name, version, template.problem_key(problem))
        hit = self._cache.get(key)
        if hit is not None and hit.expires_at > self._clock():
            resolved = hit
        else:
            resolved = dataclasses.replace(
                self._resolve_uncached(template, version, problem, device), bucket=key)
            self._cache[key] = resolved
        if resolved.match in UNTUNED or resolved.source == SHIPPED:
            self._note_demand(template.name, version, device.key, problem)
        return resolved

    def keep(self, resolved: Resolved) -> Resolved:
        """A kernel is about to run with ``resolved``: the answer to run, kept for its bucket
        for the rest of the process (unless TUNER_REFRESH=on), so later lookups of the bucket
        answer the same. Where another caller kept an answer for the bucket first, that one
        is returned: one config per bucket runs in a process.

        With TUNER_REFRESH=on an answer the dispatcher took from a neighbour (``neighbour``)
        is the bucket's until it expires, not for good: other lookups of the bucket (the
        custom op's) would otherwise answer the bucket's own nearest config instead."""
        if resolved.bucket is None or resolved.expires_at == math.inf:
            return resolved
        if self.settings.refresh:
            if resolved.neighbour is not None:
                with self._lock:
                    self._cache[resolved.bucket] = resolved
            return resolved
        with self._lock:
            current = self._cache.get(resolved.bucket)
            if current is not None and current.expires_at == math.inf:
                return current
            kept = dataclasses.replace(resolved, expires_at=math.inf)
            self._cache[resolved.bucket] = kept
            return kept

    @property
    def demand(self) -> DemandReporter | None:
        """The reporter of this process's untuned problems (None: nothing noted yet, or no
        service to report to)."""
        return self._demand

    def version_of(self, template: Template) -> str:
        # Template.version() hashes module source text: far too slow for every call.
        version = self._versions.get(template.name)
        if version is None:
            version = self._versions[template.name] = template.version()
        return version

    def clear(self) -> None:
        """Forget every cached answer (kept ones too) and remembered failure (e.g. after a new
        sweep). A pinned snapshot stays: it cannot change."""
        with self._lock:
            self._cache.clear()
            self._versions.clear()
            self._database_down_until = self._service_down_until = 0.0
            self._engine_error = None
            if self._engine is not None:
                self._engine.dispose()
                self._engine = None

    @property
    def service_down(self) -> bool:
        return self._clock() < self._service_down_until

    def _note_demand(self, template: str, version: str, device_key: str,
                     problem: Problem) -> None:
        reporter = self._demand
        if reporter is None:
            url = self.settings.url
            if not url or not self.settings.demand:
                return

            with self._lock:
                if self._demand is None:
                    self._demand = DemandReporter(url, interval_s=self.settings.demand_interval,
                                                  timeout_s=self.settings.lookup_timeout)
                reporter = self._demand
        reporter.note(template, version, device_key, problem)

    # -- the chain ----------------------------------------------------------------------
    def _resolve_uncached(self, template: Template, version: str, problem: Problem,
                          device: DeviceInfo) -> Resolved:
        now = self._clock()
        untuned_until = now + self.untuned_ttl_s
        tuned_until = now + TUNED_TTL_S if self.settings.refresh else math.inf
        local = self._from_database(template, version, problem, device)
        if local is not None and local.kind in ("exact", "bucket"):
            return Resolved(local.config, local.kind, "database", tuned_until,
                            tflops=_tflops_of(local.candidate))
        remote = self._from_service(template, version, problem, device)
        if remote is not None and remote.match in ("exact", "bucket"):
            return dataclasses.replace(remote, expires_at=tuned_until)
        shipped = self._from_shipped(template, version, problem, device)
        if shipped is not None and shipped.kind in ("exact", "bucket"):
            return Resolved(shipped.config, shipped.kind, SHIPPED, untuned_until,
                            tflops=_tflops_of(shipped.candidate))
        if local is not None:
            return Resolved(local.config, local.kind, "database", untuned_until,
                            tflops=_tflops_of(local.candidate), neighbours=local.neighbours)
        if remote is not None:  # nearest: with its neighbours, as a local nearest answer
            return dataclasses.replace(remote, expires_at=untuned_until)
        if shipped is not None:  # nearest, with its neighbours
            return Resolved(shipped.config, shipped.kind, SHIPPED, untuned_until,
                            tflops=_tflops_of(shipped.candidate), neighbours=shipped.neighbours)
        return Resolved(template.default_config(problem, device), "default", "default",
                        untuned_until)

    def shipped_table(self, device: DeviceInfo) -> ShippedTable | None:
        """The shipped table that answers for ``device`` (None: none does, or none is read)."""
        return None if self._shipped is None else self._shipped.table_for(device)

    def _from_shipped(self, template: Template, version: str, problem: Problem,
                      device: DeviceInfo) -> Match | None:
        if self._shipped is None:
            return None
        return self._shipped.match(template, version, problem, device)

    def _pinned_configs(self) -> PinnedConfigs | None:
        """TUNER_SNAPSHOT's configs, loaded at the first call; a snapshot that cannot be
        loaded raises at every call (the job must not run other configs instead)."""
        if self.settings.snapshot is None:
            return None
        if self._pinned is None and self._pin_error is None:
            # lazy: sqlalchemy +0.35 s (2-core CPU); `import tuner.attention` skips it
            from tuner.lookup.pinned import load_pinned

            with self._lock:  # one load per process; other threads wait for it
                if self._pinned is None and self._pin_error is None:
                    try:
                        self._pinned = load_pinned(
                            self.settings.snapshot, local_engine=self._local_engine,
                            database_url=self.settings.database_url,
                            service_url=self.settings.url)
                    except SnapshotError as exc:
                        self._pin_error = exc
        if self._pin_error is not None:
            raise SnapshotError(self._pin_error.message, self._pin_error.fix)
        return self._pinned

    @property
    def shipped(self) -> ShippedConfigs | None:
        """The shipped tables consulted after the database and the service (None: none)."""
        return self._shipped

    @property
    def pinned(self) -> PinnedConfigs | None:
        """The loaded TUNER_SNAPSHOT (None: none set, or not loaded yet)."""
        return self._pinned

    def _from_database(self, template: Template, version: str, problem: Problem,
                       device: DeviceInfo) -> Match | None:
        if self._clock() < self._database_down_until:
            return None
        engine = self._local_engine()
        if engine is None:
            # No database (yet): look again soon (a file check), a sweep may create one.
            self._database_down_until = self._clock() + self.untuned_ttl_s
            return None
        # lazy: sqlalchemy +0.36 s (2-core CPU); `import tuner.attention` skips it
        from sqlalchemy.exc import SQLAlchemyError
        from sqlalchemy.orm import Session

        from db import crud

        try:
            with Session(engine) as session:
                rows = crud.best_candidates(session, device_key=device.key,
                                            template_name=template.name,
                                            template_version=version)
                return match_with_neighbours(template, problem, device,
                                             parse_candidates(template, rows))
        except SQLAlchemyError as exc:  # no tables yet, locked, server gone: not our failure
            log.warning("local database %s unusable for config lookup (%s); retrying in %.0f s",
                        engine.url.render_as_string(hide_password=True), exc, self.retry_after_s)
            self._database_down_until = self._clock() + self.retry_after_s
            return None

    def _local_engine(self) -> Engine | None:
        """The read-only engine of TUNER_DATABASE_URL; None while a SQLite file does not exist
        yet (no sweep has run: not an error). A database that cannot be opened at all, a
        SQLite file in a folder that does not exist or a server whose first connection fails,
        raises DatabaseUnavailableError at this and every later lookup: a mistyped URL must
        not pass for "nothing tuned". A database that worked and then fails is retried."""
        if self._engine is not None:
            return self._engine
        if self._engine_error is not None:
            raise DatabaseUnavailableError(self._engine_error.message, self._engine_error.fix)
        try:
            self._engine = self._open_engine()
        except DatabaseUnavailableError as exc:
            self._engine_error = exc
            raise
        return self._engine

    def _open_engine(self) -> Engine | None:
        # lazy: sqlalchemy +0.15 s (2-core CPU); `import tuner.attention` skips it
        from sqlalchemy import create_engine
        from sqlalchemy.engine import make_url

        from db.session import check_connection, check_sqlite_folder, with_installed_driver

        url = make_url(self.settings.database_url)
        if url.get_backend_name() == "sqlite":
            path = url.database
            if not path or path == ":memory:" or path.startswith("file:"):
                return None
            check_sqlite_folder(url)
            file = Path(path).expanduser().resolve()
            if not file.is_file():
                return None
            # Read-only URI: even a bug downstream cannot create or change the file.
            return create_engine(f"sqlite:///file:{file}?mode=ro&uri=true")
        timeout = max(1, math.ceil(self.settings.lookup_timeout))
        engine = create_engine(with_installed_driver(url), pool_pre_ping=True,
                               connect_args={"connect_timeout": timeout})
        check_connection(engine)
        return engine

    def _from_service(self, template: Template, version: str, problem: Problem,
                      device: DeviceInfo) -> Resolved | None:
        url = self.settings.url
        if not url or self._clock() < self._service_down_until:
            return None
        if self._pool is None:
            with self._lock:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(max_workers=2,
                                                    thread_name_prefix="tuner-lookup")
        timeout = self.settings.lookup_timeout
        future = self._pool.submit(_ask_service, url, self.settings.token or "", timeout,
                                   template.name, version, problem, device.key)
        try:
            answer = future.result(timeout=timeout)
        except FutureTimeout:
            self._mark_service_down(url, f"no answer within {timeout:g} s")
            return None
        except _NoAnswer as exc:  # the service answered, but not with a usable config
            log.info("config service %s: %s", url, exc)
            return None
        except Exception as exc:  # any transport or server failure: fall back, remember
            self._mark_service_down(url, f"{type(exc).__name__}: {exc}")
            return None
        return _validated(template, version, problem, device, answer)

    def _mark_service_down(self, url: str, why: str) -> None:
        self._service_down_until = self._clock() + self.retry_after_s
        log.warning("config service %s unusable (%s); using defaults for %.0f s",
                    url, why, self.retry_after_s)


class _NoAnswer(Exception):
    """The service answered with a client error (unknown template, problem it rejects)."""


def _ask_service(url: str, token: str | None, timeout: float, template: str, version: str,
                 problem: Problem, device_key: str) -> Any:
    # lazy: httpx +0.05 s (2-core CPU); `import tuner.attention` skips it
    from tuner.client import TunerClient

    with TunerClient(url, token=token, timeout=timeout, retries=0) as client:
        try:
            return client.best(template, problem, device=device_key, template_version=version)
        except ServiceError as exc:
            if exc.status is not None and 400 <= exc.status < 500:
                raise _NoAnswer(str(exc)) from exc
            raise


def _validated(template: Template, version: str, problem: Problem, device: DeviceInfo,
               answer: Any) -> Resolved | None:
    """The service's answer as a config this process may run, or None if it is unusable."""
    if answer.match == "default":
        return None  # our own default is for our device and version; prefer it
    if answer.template_version != version:
        log.warning("config service answered for %s version %s, this kernel is %s: ignored",
                    template.name, answer.template_version, version)
        return None
    try:
        config = template.config(answer.config)
    except (TypeError, ValueError) as exc:
        log.warning("config service sent a config outside %s's space (%s): ignored",
                    template.name, exc)
        return None
    why = template.constraint(problem, config, device)
    if why is not None:
        log.warning("config service sent a config this device cannot run (%s): ignored", why)
        return None
    return Resolved(config, answer.match, "service", tflops=answer.tflops,
                    neighbours=_validated_neighbours(template, problem, device, answer))


def _validated_neighbours(template: Template, problem: Problem, device: DeviceInfo,
                          answer: Any) -> dict[str, Neighbour]:
    """The neighbouring buckets' bests of a nearest answer (``BestOut.neighbours``, nearest
    first) that this process may run, as ``neighbours_of`` finds them in a local database:
    each config re-validated against the template's space and this device's constraints."""
    out: dict[str, Neighbour] = {}
    for n in getattr(answer, "neighbours", ()):
        try:
            measured_on = Problem.from_dict(n.problem)
            config = template.config(n.config)
        except (TypeError, ValueError) as exc:
            log.debug("config service sent a malformed neighbour %s: %s", n.problem_key, exc)
            continue
        if (n.problem_key not in out and n.tflops > 0
                and template.constraint(problem, config, device) is None):
            out[n.problem_key] = Neighbour(n.problem_key, measured_on, config, float(n.tflops))
    return out


def _tflops_of(row: Any) -> float | None:
    value = getattr(row, "tflops", None)
    return float(value) if value is not None else None


_resolver: ConfigResolver | None = None
_resolver_lock = threading.Lock()


def get_resolver() -> ConfigResolver:
    """The process-wide resolver, reading ``TUNER_*`` settings on first use."""
    global _resolver
    if _resolver is None:
        with _resolver_lock:
            if _resolver is None:
                _resolver = ConfigResolver()
    return _resolver


def set_resolver(resolver: ConfigResolver | None) -> None:
    """Replace the process-wide resolver (None: build a fresh one from the environment)."""
    global _resolver
    with _resolver_lock:
        _resolver = resolver


def resolve_config(template: Template, problem: Problem, device: DeviceInfo) -> Resolved:
    return get_resolver().resolve(template, problem, device)


def keep_config(resolved: Resolved) -> Resolved:
    """``ConfigResolver.keep`` of the process-wide resolver: call it with an answer a kernel
    is about to run with, and run what it returns."""
    return get_resolver().keep(resolved)
