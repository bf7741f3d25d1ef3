"""Which implementation runs a problem, and by how much: the winner, the runner-up, every
implementation's time and each SDPA backend's, for people (``tuner best --shape``,
``GET /v1/best?compare=true``; docs/DISPATCH.md).

One computation with the dispatcher: ``tuner.dispatch.rule.decide`` for an inference call, each
forward template's config matched among a database's stored bests as a process's lookup of
that database matches it (``tuner.lookup.resolver.match_with_neighbours``: exact, bucket, else
nearest with the neighbours). The times are then read off the choice: the prices of the problem's
own bucket, or, where it was decided on a neighbour, every implementation's time there.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any

from sqlalchemy.orm import Session

import tuner.dispatch.implementations  # noqa: F401  (registers the implementations compared)
from db import crud
from templates.base import Problem, Template
from templates.device import DeviceInfo
from templates.registry import get_template
from tuner.dispatch.rule import BASELINE, Call, Choice, decide, get_implementation
from tuner.dispatch.winners import VersionOf, backend_times, forward_templates
from tuner.lookup.resolver import Candidate, Resolved, match_with_neighbours
from tuner.lookup.stored_bests import StoredBest, stored_bests
from tuner.wire import BackendTime, ImplementationsCompared, ImplementationTime

__all__ = ["compare_implementations", "compare_in_database", "sdpa_backends_of"]

# The bucket torch_sdpa's compared time comes from -> each SDPA backend's time there.
BackendsOf = Callable[[str], Mapping[str, BackendTime]]


def compare_implementations(problem: Problem, device: DeviceInfo,
                            bests: Mapping[str, Collection[Candidate]], *, margin: float,
                            source: str, backends_of: BackendsOf | None = None
                            ) -> ImplementationsCompared:
    """The implementations of an inference call of ``problem`` on ``device`` compared, each
    forward template's config matched among ``bests`` (by template name: candidates whose
    source is a ``StoredBest``, of one device and the compared kernel versions)."""
    matched: dict[str, StoredBest] = {}

    def resolve(template: Template, p: Problem, d: DeviceInfo) -> Resolved:
        found = match_with_neighbours(template, p, d, list(bests.get(template.name, ())))
        if found is None:
            return Resolved(template.default_config(p, d), "default", "default")
        matched[template.name] = found.candidate
        return Resolved(found.config, found.kind, source, tflops=found.candidate.tflops,
                        neighbours=found.neighbours)

    choice = decide(Call(problem, False, device), resolve=resolve, margin=margin)
    times = _times(choice, matched, bests)
    winner = choice.implementation.name
    others = [name for name in times if name != winner]
    runner_up = others[0] if others and winner in times else None
    sdpa = times.get(BASELINE)
    return ImplementationsCompared(
        winner=winner, runner_up=runner_up,
        runner_up_ratio=(times[runner_up].ms / times[winner].ms
                         if runner_up is not None else None),
        why=choice.why, neighbour=choice.neighbour, times=times,
        sdpa_backends=dict(backends_of(sdpa.problem_key))
        if sdpa is not None and backends_of is not None else {})


def _times(choice: Choice, matched: Mapping[str, StoredBest],
           bests: Mapping[str, Collection[Candidate]]) -> dict[str, ImplementationTime]:
    """By implementation, fastest first: the neighbour's times where the choice was decided
    on one, else every implementation priced on the problem's own bucket."""
    found: dict[str, tuple[str, float, StoredBest]] = {}
    if choice.verdict is not None:
        for name, ms in choice.verdict.ms.items():
            template = get_implementation(name).forward
            row = next(c.source for c in bests.get(template, ())
                       if c.problem_key == choice.verdict.neighbour)
            found[name] = (template, ms, row)
    else:
        for e in choice.estimates:
            template = get_implementation(e.implementation).forward
            if e.ms is not None and template in matched:
                found[e.implementation] = (template, e.ms, matched[template])
    return {name: _time(template, ms, row) for name, (template, ms, row)
            in sorted(found.items(), key=lambda item: item[1][1])}


def _time(template: str, ms: float, row: StoredBest) -> ImplementationTime:
    return ImplementationTime(template=template, problem_key=row.problem_key,
                              config=dict(row.config), ms=ms, tflops=row.tflops,
                              measured_ms=row.median_ms, readings=row.readings,
                              head_to_head=row.head_to_head)


def sdpa_backends_of(session: Session, *, device_key: str, version: str,
                     problem_key: str) -> dict[str, BackendTime]:
    """Each SDPA backend's time on one bucket (``tuner.dispatch.winners.backend_times``): two
    queries."""
    sdpa = get_implementation(BASELINE).forward
    trials = crud.measured_configs(session, device_key=device_key, template_name=sdpa,
                                   template_version=version, problem_keys=[problem_key])
    return backend_times(trials.get(problem_key, []))


def compare_in_database(session: Session, problem: Problem, device: DeviceInfo, *,
                        version_of: VersionOf, margin: float) -> ImplementationsCompared:
    """``compare_implementations`` over the bests ``session``'s database stores for
    ``device`` (its key) at ``version_of``'s kernel versions (``tuner best --shape``)."""
    bests: dict[str, Any] = {}
    for name in forward_templates():
        rows = crud.best_candidates(session, device_key=device.key, template_name=name,
                                    template_version=version_of(name))
        bests[name] = list(stored_bests(session, get_template(name), list(rows)).values())
    sdpa = get_implementation(BASELINE).forward
    return compare_implementations(
        problem, device, bests, margin=margin, source="database",
        backends_of=lambda key: sdpa_backends_of(session, device_key=device.key,
                                                 version=version_of(sdpa), problem_key=key))
