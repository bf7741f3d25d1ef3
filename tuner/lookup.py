"""Config resolution: which tuned config runs a problem on a device.

With ``TUNER_SNAPSHOT`` set, every answer comes from that snapshot alone, loaded once at the
first lookup (``tuner.pinned``) and matched as the database's rows are, problem by problem;
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
4. the template's default heuristic.

An ``exact`` or ``bucket`` match ends the search at once; a ``nearest`` match from the
database is kept while the service is asked whether it knows better. A nearest answer
(database, snapshot or service) carries the bests of the neighbouring buckets
(``neighbours_of``; the service sends them in ``BestOut.neighbours``), on one of which the
dispatcher may compare implementations (docs/DISPATCH.md). Every answer
that is not tuned (``default``, ``nearest``) is noted as demand for the service
(``tuner.demand``), when ``TUNER_URL`` is set and ``TUNER_DEMAND`` is not off. Every config that comes
from outside (database or service) is re-validated against the template's space and static
constraints here: a served config is data, never code.

Stable within a process: an answer is re-asked only until a kernel runs with it. The caller
that runs a config says so (``ConfigResolver.keep``), and from then on its bucket answers the
same for the process's life, whatever the database or the service say later, so a kernel never
switches configs mid-run. ``TUNER_REFRESH=on`` opts in to newer answers instead: untuned ones
are re-asked after ``UNTUNED_TTL_S``, tuned ones after ``TUNED_TTL_S``, run or not.

``match_best`` is the matching rule itself, shared with the service's ``GET /v1/best``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from templates.base import KernelConfig, Problem, Template
from templates.device import CPU_INTERPRETER, DeviceInfo
from templates.offline_target import TARGETS
from tuner.demand import UNTUNED
from tuner.snapshot import SnapshotError
from tuner.wire import MatchKind

if TYPE_CHECKING:
    from sqlalchemy.engine import Engine

    from tuner.demand import DemandReporter
    from tuner.pinned import PinnedConfigs
    from tuner.settings import Settings

log = logging.getLogger("tuner.lookup")

RETRY_AFTER_S = 60.0
# An untuned answer (default, nearest) is asked again after this long: a sweep or an upload
# that lands while a job runs reaches it within about this (the service's own answers are at
# most 5 s old, docs/SERVING.md). A re-ask is one query per template and shape bucket.
UNTUNED_TTL_S = 5.0
# With TUNER_REFRESH=on, a tuned answer (exact, bucket) is asked again after this long: a
# sweep that finds a faster config reaches running jobs within about a minute.
TUNED_TTL_S = 60.0


# ----------------------------------------------------------------------------- matching
class BestLike(Protocol):
    """What matching reads of a stored best config (``db.models.BestConfig`` fits)."""

    @property
    def problem_key(self) -> str: ...
    @property
    def problem(self) -> dict[str, Any]: ...
    @property
    def config(self) -> dict[str, Any]: ...
    @property
    def tflops(self) -> float: ...


@dataclass(frozen=True)
class Candidate:
    """A stored best config, parsed and validated once (matching many problems against it)."""

    source: Any  # the BestLike row (or a snapshot of it) the config comes from
    problem: Problem
    problem_key: str
    config: KernelConfig
    tflops: float


@dataclass(frozen=True)
class Neighbour:
    """A stored best of a neighbouring bucket (same family, another shape): what the
    dispatcher reads to compare implementations on the same neighbour (tuner/neighbours.py)."""

    problem_key: str
    problem: Problem  # the problem it measured
    config: KernelConfig
    tflops: float


@dataclass(frozen=True)
class Match:
    candidate: Any  # the source row of the matched Candidate
    kind: MatchKind
    config: KernelConfig
    # A nearest match from ``match_with_neighbours``: every neighbouring bucket's best that
    # runs the problem, by problem key, nearest first (else empty).
    neighbours: Mapping[str, Neighbour] = dataclasses.field(default_factory=dict,
                                                            compare=False)


def parse_candidates(template: Template, rows: Iterable[BestLike]) -> list[Candidate]:
    """``rows`` as candidates; one whose problem or config no longer validates is dropped."""
    out = []
    for row in rows:
        try:
            out.append(Candidate(row, Problem.from_dict(row.problem), row.problem_key,
                                 template.config(row.config), float(row.tflops)))
        except (TypeError, ValueError) as exc:
            log.debug("skipping malformed stored config %s: %s", row.problem_key, exc)
    return out


def _log_distance(a: Problem, b: Problem) -> float:
    """How far apart two shapes are, in octaves of each size that changes the launch grid."""
    return (abs(math.log2(a.seqlen_q / b.seqlen_q)) + abs(math.log2(a.seqlen_kv / b.seqlen_kv))
            + abs(math.log2((a.batch * a.heads_q) / (b.batch * b.heads_q))))


def _same_family(a: Problem, b: Problem) -> bool:
    return (a.dtype == b.dtype and a.variant == b.variant and a.head_dim == b.head_dim
            and a.gqa_ratio == b.gqa_ratio)


def _nearest_first(problem: Problem, candidates: Iterable[Candidate]) -> list[Candidate]:
    """Candidates of other shapes, nearest to ``problem`` first (the faster of equals first)."""
    return sorted(candidates, key=lambda c: (_log_distance(c.problem, problem), -c.tflops))


def match_candidates(template: Template, problem: Problem, device: DeviceInfo,
                     candidates: Sequence[Candidate]) -> Match | None:
    """The candidate that best fits ``problem``: exact, else same bucket (fastest first), else
    the nearest shape of the same family; one that violates a static constraint for
    ``problem`` on ``device`` is passed over (it can never be returned)."""
    want_bucket = template.problem_key(problem)
    exact, bucket, nearest = [], [], []
    for c in candidates:
        if c.problem == problem:
            exact.append(c)
        elif c.problem_key == want_bucket:
            bucket.append(c)
        elif _same_family(c.problem, problem):
            nearest.append(c)
    ranked: list[tuple[MatchKind, list[Candidate]]] = [
        ("exact", exact),
        ("bucket", sorted(bucket, key=lambda c: -c.tflops)),
        ("nearest", _nearest_first(problem, nearest)),
    ]
    # Constraints are checked only until one candidate passes: they cost more than matching.
    for kind, group in ranked:
        for c in group:
            if template.constraint(problem, c.config, device) is None:
                return Match(c.source, kind, c.config)
    return None


def match_best(template: Template, problem: Problem, device: DeviceInfo,
               candidates: Iterable[BestLike]) -> Match | None:
    """``match_candidates`` over stored rows of one device and template version."""
    return match_candidates(template, problem, device, parse_candidates(template, candidates))


def neighbours_of(template: Template, problem: Problem, device: DeviceInfo,
                  candidates: Sequence[Candidate]) -> dict[str, Neighbour]:
    """The stored bests of the other buckets of ``problem``'s family whose configs run it on
    ``device``, by problem key, nearest first (the order of ``match_candidates``'s nearest)."""
    want_bucket = template.problem_key(problem)
    near = (c for c in candidates if c.problem != problem and c.problem_key != want_bucket
            and _same_family(c.problem, problem))
    out: dict[str, Neighbour] = {}
    for c in _nearest_first(problem, near):
        # Checked here, once per answer, not per call: 1-2 us each (flash_bwd's 36 us) on
        # the dev VM.
        if c.problem_key not in out and template.constraint(problem, c.config, device) is None:
            out[c.problem_key] = Neighbour(c.problem_key, c.problem, c.config, c.tflops)
    return out


def match_with_neighbours(template: Template, problem: Problem, device: DeviceInfo,
                          candidates: Sequence[Candidate]) -> Match | None:
    """``match_candidates``, a nearest match with ``neighbours_of`` too: a process's own
    lookups (database, snapshot) and the service's ``GET /v1/best``, whose answer carries them."""
    found = match_candidates(template, problem, device, candidates)
    if found is None or found.kind != "nearest":
        return found
    return dataclasses.replace(found, neighbours=neighbours_of(template, problem, device,
                                                               candidates))


# ----------------------------------------------------------------------------- devices
# Shared memory one program may opt into, by compute capability (CUDA programming guide,
# "Technical Specifications per Compute Capability"); the Device table does not store it.
_SMEM_BY_CC = {"7.0": 96, "7.5": 64, "8.0": 163, "8.6": 99, "8.7": 163, "8.9": 99, "9.0": 227,
               "10.0": 227, "12.0": 99}

# What a device that the service has never seen is assumed to be: the GPU family the project
# tunes first (H100 SXM, the offline compile target's table). Default-config heuristics only
# read family, SM count and smem.
HOPPER_DEFAULT = TARGETS["h100"]


def smem_for_cc(compute_capability: str) -> int:
    if not compute_capability:  # the interpreter: as templates.device.current_device says
        return 228 * 1024
    return _SMEM_BY_CC.get(compute_capability, 99) * 1024


def device_info_from_row(row: Any) -> DeviceInfo:
    """A ``DeviceInfo`` from a ``db.models.Device`` row (smem from the compute capability)."""
    return DeviceInfo(
        name=row.name, compute_capability=row.compute_capability, sm_count=row.sm_count,
        total_memory=row.total_memory, smem_per_block=smem_for_cc(row.compute_capability),
        driver_version=row.driver_version, triton_version=row.triton_version,
        torch_version=row.torch_version, cuda_version=row.cuda_version,
        cudnn_version=row.cudnn_version)


# The parts of a device key after the name, as ``DeviceInfo.key`` writes them: the cuDNN part
# only for devices with cuDNN (and never in keys written before it was recorded).
_KEY_PREFIXES = ("cc", "triton", "torch", "cuda")
_CUDNN_PREFIX = "cudnn"


def device_info_from_key(key: str) -> DeviceInfo:
    """Best guess at a device the database does not know, from its key or its name.

    A full key (``name|cc9.0|triton3.6.0|torch2.11.0|cuda12.8``, with ``|cudnn9.19.0`` after it
    for a device with cuDNN, as ``DeviceInfo.key`` writes it) gives the compute capability and
    versions; anything else is taken as a device name on the ``HOPPER_DEFAULT`` hardware.
    """
    parts = _key_parts(key)
    if parts is None:
        return dataclasses.replace(HOPPER_DEFAULT, name=key or HOPPER_DEFAULT.name)
    name, cc, triton_v, torch_v, cuda_v, cudnn_v = parts
    if name == CPU_INTERPRETER:
        return DeviceInfo(name=name, compute_capability="", sm_count=1, total_memory=0,
                          smem_per_block=smem_for_cc(""), driver_version="",
                          triton_version=triton_v, torch_version=torch_v, cuda_version="",
                          cudnn_version=cudnn_v)
    if not _valid_cc(cc):
        cc = HOPPER_DEFAULT.compute_capability
    return DeviceInfo(name=name, compute_capability=cc, sm_count=HOPPER_DEFAULT.sm_count,
                      total_memory=HOPPER_DEFAULT.total_memory, smem_per_block=smem_for_cc(cc),
                      driver_version="", triton_version=triton_v, torch_version=torch_v,
                      cuda_version=cuda_v, cudnn_version=cudnn_v)


def _key_parts(key: str) -> tuple[str, str, str, str, str, str | None] | None:
    """(name, cc, triton, torch, cuda, cudnn or None) of a full device key, else None."""
    name_and_rest, _, last = key.rpartition("|")
    cudnn = None
    if last.startswith(_CUDNN_PREFIX) and last != _CUDNN_PREFIX:
        key, cudnn = name_and_rest, last[len(_CUDNN_PREFIX):]
    parts = key.rsplit("|", len(_KEY_PREFIXES))
    if len(parts) != len(_KEY_PREFIXES) + 1 or not all(
            p.startswith(pre) for p, pre in zip(parts[1:], _KEY_PREFIXES, strict=True)):
        return None
    cc, triton_v, torch_v, cuda_v = (p[len(pre):] for p, pre in zip(parts[1:], _KEY_PREFIXES,
                                                                   strict=True))
    return parts[0], cc, triton_v, torch_v, cuda_v, cudnn


def _valid_cc(cc: str) -> bool:
    major, _, minor = cc.partition(".")
    return major.isdigit() and minor.isdigit()


# ----------------------------------------------------------------------------- resolution
CacheKey = tuple[str, str, str, str]  # device key, template, version, bucket key


@dataclass(frozen=True)
class Resolved:
    """The config to run and where it came from."""

    config: KernelConfig
    match: MatchKind
    source: str  # "snapshot", "database", "service" or "default"
    expires_at: float = math.inf  # time.monotonic() after which to ask again
    # TFLOP/s measured for the matched stored best (None: nothing measured, the default).
    # The dispatcher prices implementations by it, so only exact and bucket matches count
    # (``measured``); a nearest answer takes part through ``neighbours`` alone.
    tflops: float | None = None
    # The resolver's cache key of the answer (``ConfigResolver.keep`` keeps it by that).
    bucket: CacheKey | None = dataclasses.field(default=None, compare=False, repr=False)
    # A nearest answer (database, snapshot or service): the neighbouring buckets' bests that
    # run this problem, nearest first (``neighbours_of``; the service's ``BestOut.neighbours``).
    neighbours: Mapping[str, Neighbour] = dataclasses.field(
        default_factory=dict, compare=False, repr=False)
    # The neighbouring bucket whose config and TFLOP/s this answer carries, once the
    # dispatcher chose its implementation by the measurements there (None: its own match).
    neighbour: str | None = None

    @property
    def measured(self) -> bool:
        """A measurement of this problem's own bucket on this device backs the config."""
        return self.match in ("exact", "bucket") and self.tflops is not None


class ConfigResolver:
    """Resolves configs in the documented order; one per process is enough (``get_resolver``)."""

    def __init__(self, settings: Settings | None = None, *, retry_after_s: float = RETRY_AFTER_S,
                 untuned_ttl_s: float = UNTUNED_TTL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        from tuner.settings import load_settings

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
        self._database_down_until = 0.0
        self._service_down_until = 0.0
        self._pool: ThreadPoolExecutor | None = None
        self._pinned: PinnedConfigs | None = None
        self._pin_error: SnapshotError | None = None
        self._demand: DemandReporter | None = None

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
        if resolved.match in UNTUNED:
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
            from tuner.demand import DemandReporter

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
        if local is not None:
            return Resolved(local.config, local.kind, "database", untuned_until,
                            tflops=_tflops_of(local.candidate), neighbours=local.neighbours)
        if remote is not None:  # nearest: with its neighbours, as a local nearest answer
            return dataclasses.replace(remote, expires_at=untuned_until)
        return Resolved(template.default_config(problem, device), "default", "default",
                        untuned_until)

    def _pinned_configs(self) -> PinnedConfigs | None:
        """TUNER_SNAPSHOT's configs, loaded at the first call; a snapshot that cannot be
        loaded raises at every call (the job must not run other configs instead)."""
        if self.settings.snapshot is None:
            return None
        if self._pinned is None and self._pin_error is None:
            from tuner.pinned import load_pinned

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
        if self._engine is not None:
            return self._engine
        from sqlalchemy import create_engine
        from sqlalchemy.engine import make_url

        url = make_url(self.settings.database_url)
        if url.get_backend_name() == "sqlite":
            path = url.database
            if not path or path == ":memory:" or path.startswith("file:"):
                return None
            file = Path(path).expanduser().resolve()
            if not file.is_file():
                return None
            # Read-only URI: even a bug downstream cannot create or change the file.
            self._engine = create_engine(f"sqlite:///file:{file}?mode=ro&uri=true")
        else:
            from db.session import with_installed_driver

            url = with_installed_driver(url)
            timeout = max(1, math.ceil(self.settings.lookup_timeout))
            self._engine = create_engine(url, pool_pre_ping=True,
                                         connect_args={"connect_timeout": timeout})
        return self._engine

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
    from tuner.client import TunerClient, TunerError

    with TunerClient(url, token=token, timeout=timeout, retries=0) as client:
        try:
            return client.best(template, problem, device=device_key, template_version=version)
        except TunerError as exc:
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
