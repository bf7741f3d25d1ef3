"""Matching stored best configs to a problem: exact, else its shape bucket, else the nearest
shape of the same family (with that family's other buckets as neighbours), and the answer a
lookup gives (``Resolved``).

The rule is shared by a process's own lookups (``tuner.lookup.resolver``: database, snapshot), the
pinned snapshot (``tuner.lookup.pinned``) and the service's ``GET /v1/best``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from templates.base import KernelConfig, Problem, Template
from templates.device import DeviceInfo
from tuner.wire import MatchKind

__all__ = ["BestLike", "CacheKey", "Candidate", "Match", "Neighbour", "Resolved",
           "match_best", "match_candidates", "match_with_neighbours", "neighbours_of",
           "parse_candidates"]

log = logging.getLogger("tuner.lookup.matching")


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
    dispatcher reads to compare implementations on the same neighbour
    (tuner/dispatch/neighbours.py)."""

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
            if runs(template, problem, c.config, device):
                return Match(c.source, kind, c.config)
    return None


def runs(template: Template, problem: Problem, config: KernelConfig, device: DeviceInfo
         ) -> bool:
    """Whether a config measured on another shape can run ``problem``: the template's
    ``hard_constraint`` where it separates what cannot run from what is not worth a trial
    (flash_bwd: a tile larger than a short sequence needs, a register estimate), else its
    whole ``constraint``. A search leaves wasteful configs out; serving must not: on the H200
    a neighbour's flash_bwd config measured 10x faster than the default was refused for a
    slightly shorter call as "padding", and the call ran SDPA."""
    check = getattr(template, "hard_constraint", None) or template.constraint
    return check(problem, config, device) is None


def match_best(template: Template, problem: Problem, device: DeviceInfo,
               candidates: Iterable[BestLike]) -> Match | None:
    """``match_candidates`` over stored rows of one device and template version."""
    return match_candidates(template, problem, device, parse_candidates(template, candidates))


def neighbours_of(template: Template, problem: Problem, device: DeviceInfo,
                  candidates: Sequence[Candidate], *, for_search: bool = False
                  ) -> dict[str, Neighbour]:
    """The stored bests of the other buckets of ``problem``'s family whose configs run it on
    ``device`` (``runs``; ``for_search``: that a search of it would try, the template's whole
    ``constraint``), by problem key, nearest first (the order of ``match_candidates``'s
    nearest)."""
    want_bucket = template.problem_key(problem)
    near = (c for c in candidates if c.problem != problem and c.problem_key != want_bucket
            and _same_family(c.problem, problem))
    out: dict[str, Neighbour] = {}
    for c in _nearest_first(problem, near):
        # Checked here, once per answer, not per call: 1-2 us each (flash_bwd's 36 us) on
        # the dev VM.
        if c.problem_key not in out and (
                template.constraint(problem, c.config, device) is None if for_search
                else runs(template, problem, c.config, device)):
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
