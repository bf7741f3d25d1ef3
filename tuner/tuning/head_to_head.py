"""The head-to-head at the end of a sweep: the stored bests of every implementation of a problem
measured side by side, so that the dispatcher chooses between implementations by readings of
one session, not by two searches' readings taken minutes apart (notes/dispatch_measurements.md: gluon and
cuDNN's SDPA within 1-4% of each other on the H100 were ranked by that noise).

Who takes part: the templates of the sweep that price implementations serving the problem
(``tuner.dispatch.rule``: for inference, and for a training step), each with its stored best for the
problem on this device; at least two implementations must be priced entirely by them, or there
is nothing to compare and the step is skipped.

How: ``rounds`` rounds, each measuring every candidate once, as a trial is measured (the
sweep's runner: inputs made afresh, the reference check, ``time_gpu``; one seed for the
session, so that the worker's kept reference of a candidate serves its next readings:
``tuner.tuning.runner.reference_cache``); round r starts at candidate
r mod n (``rotation``), so each candidate runs first, and in every place, equally often (a
cyclic rotation: within a round each still follows the one before it in the list); a fixed
order slowed whatever ran right after gluon by up to 10% on the H100. Then, while the two
cheapest implementations of a call are a close call (``close_call_candidates``, decided by
``tuner.dispatch.close_calls.decided``) and fewer than ``max_rounds`` rounds ran, one more round of
their templates alone, rotated: the others are out of the running, and their readings stay
as they are. Each reading is
stored as it is measured; the session is marked finished, and the candidates' bests refreshed
from it, in one transaction at the end (``db.head_to_head``): a step killed half-way leaves
the sweep's bests as they were. A candidate whose reading fails (a wrong result, a crash) is
measured no more and disqualified: its config is not served (``db.finalists``).
"""

from __future__ import annotations

import random
import statistics
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.orm import Session

import tuner.dispatch.implementations  # noqa: F401  (registers the implementations compared here)
from db import crud, head_to_head
from db.session import run_in_transaction, session_scope
from templates.base import Problem, Template
from templates.device import DeviceInfo
from tuner.dispatch.close_calls import decided
from tuner.dispatch.rule import Call, implementations
from tuner.tuning.runner.outcome import Runner, TrialOutcome, TrialRequest

__all__ = [
    "DEFAULT_HEAD_TO_HEAD_ROUNDS",
    "DEFAULT_MAX_ROUNDS_FACTOR",
    "Candidate",
    "CandidateResult",
    "HeadToHeadResult",
    "HeadToHeadStore",
    "candidates_for",
    "close_call_candidates",
    "compared_templates",
    "priced_by",
    "rotation",
    "run_head_to_head",
]

# Rounds per head-to-head: each candidate's time is the median of this many side-by-side
# readings; as many as benchmarks/dispatch_bench.py's rotated rounds, whose noise floor on the
# H100 was up to 2.6% (notes/dispatch_measurements.md). Not yet measured as a head-to-head on a GPU.
DEFAULT_HEAD_TO_HEAD_ROUNDS = 5
# Close calls take more rounds, up to this many times ``rounds`` (``tuner.dispatch.close_calls``).
DEFAULT_MAX_ROUNDS_FACTOR = 2


def rotation(candidates: int, rounds: int) -> list[list[int]]:
    """The order of each round: round r runs candidates r mod n, r+1 mod n, ..."""
    return [[(r + i) % candidates for i in range(candidates)] for r in range(rounds)]


def priced_by(problem: Problem, swept: Sequence[str],
              device: DeviceInfo) -> list[list[tuple[str, ...]]]:
    """Per call of ``problem`` (inference, a training step) where at least two implementations
    are priced by ``swept`` alone: each such implementation's templates."""
    calls = []
    for needs_grad in (False, True):
        call = Call(problem, needs_grad, device)
        priced = [tuple(impl.templates_for(call)) for impl in implementations()
                  if impl.why_not(call) is None and set(impl.templates_for(call)) <= set(swept)]
        if len(priced) >= 2:
            calls.append(priced)
    return calls


def compared_templates(problem: Problem, swept: Sequence[str],
                       device: DeviceInfo) -> tuple[str, ...]:
    """Those of ``swept`` (templates with a stored best for ``problem``) that price an
    implementation serving ``problem``, for inference or a training step, where at least two
    implementations are priced by them alone; empty when there is nothing to compare."""
    chosen = {name for priced in priced_by(problem, swept, device)
              for names in priced for name in names}
    return tuple(name for name in swept if name in chosen)


@dataclass(frozen=True)
class Candidate:
    """One template's stored best for the problem: the config and the trial it came from."""

    template: Template
    template_id: int  # of its version's row
    problem_key: str
    config: dict[str, Any]
    trial_id: int


@dataclass
class CandidateResult:
    template: str
    config: dict[str, Any]
    by_round: dict[int, float] = field(default_factory=dict)  # its OK readings: round -> ms
    median_ms: float | None = None
    tflops: float | None = None
    failed: str | None = None  # the failed reading's status and reason: disqualified

    @property
    def runs_ms(self) -> list[float]:
        """Its OK readings, in round order."""
        return [self.by_round[r] for r in sorted(self.by_round)]

    def to_dict(self) -> dict[str, Any]:
        return {"template": self.template, "config": self.config, "runs_ms": self.runs_ms,
                "rounds": sorted(self.by_round), "median_ms": self.median_ms,
                "tflops": self.tflops,
                "status": "disqualified" if self.failed else "ok", "reason": self.failed or ""}


@dataclass
class HeadToHeadResult:
    label: str
    problem: dict[str, Any]
    rounds: int  # the rounds that ran: more than asked for where the call was close
    session: int | None = None  # the stored session
    finished: bool = False  # False: interrupted (or failed), its readings price nothing
    candidates: list[CandidateResult] = field(default_factory=list)
    failed: str | None = None  # why the step itself failed (the sweep's bests stay)
    wall_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"label": self.label, "problem": self.problem, "rounds": self.rounds,
                "session": self.session, "finished": self.finished, "failed": self.failed,
                "wall_s": self.wall_s, "candidates": [c.to_dict() for c in self.candidates]}


class HeadToHeadStore:
    """The database side of head-to-heads on one device: stored bests, sessions, readings."""

    def __init__(self, url: str, *, device: dict[str, Any], sweep_id: int | None = None,
                 worker: str = "") -> None:
        self.url = url
        self.device = device  # DeviceInfo fields plus "key", as the trial worker reports
        self.sweep_id = sweep_id
        self.worker = worker
        self.device_id = run_in_transaction(
            url, lambda s: crud.get_or_create_device(s, info=device).id)

    def candidate(self, template: Template, version: str, problem: Problem) -> Candidate | None:
        """``template``'s stored best for ``problem`` on this device, if it has one."""
        key = template.problem_key(problem)
        with session_scope(self.url, write=False) as s:
            best = crud.best_for(s, device_key=self.device["key"], template_name=template.name,
                                 template_version=version, problem_key=key)
            if best is None or best.trial_id is None:
                return None
            return Candidate(template, best.template_id, key, dict(best.config), best.trial_id)

    def start(self, problem: Problem, rounds: int) -> int:
        return run_in_transaction(self.url, lambda s: head_to_head.start_head_to_head(
            s, device_id=self.device_id, problem=problem.to_dict(), rounds=rounds,
            sweep_id=self.sweep_id, worker=self.worker))

    def record(self, session: int, candidate: Candidate, round: int, position: int,
               outcome: TrialOutcome) -> None:
        run_in_transaction(self.url, lambda s: head_to_head.record_head_to_head_reading(
            s, head_to_head_id=session, trial_id=candidate.trial_id, round=round,
            position=position, status=outcome.status, reason=outcome.reason,
            median_ms=outcome.median_ms, tflops=outcome.tflops, error=outcome.error,
            phases=outcome.phase_record()))

    def finish(self, session: int, candidates: Sequence[Candidate], rounds: int) -> None:
        """Mark the session finished after ``rounds`` rounds and refresh its candidates'
        bests, in one transaction."""
        def write(s: Session) -> None:
            head_to_head.finish_head_to_head(s, head_to_head_id=session, rounds=rounds)
            for c in candidates:
                crud.refresh_bests(s, device_id=self.device_id, template_id=c.template_id,
                                   problem_keys=[c.problem_key])

        run_in_transaction(self.url, write)


def candidates_for(store: HeadToHeadStore, problem: Problem, templates: Sequence[Template],
                   versions: dict[str, str], device: DeviceInfo) -> list[Candidate]:
    """The stored bests of those of ``templates`` (the sweep's, for ``problem``) that take
    part in its head-to-head; empty when there is nothing to compare (module docstring)."""
    found = {t.name: store.candidate(t, versions[t.name], problem) for t in templates}
    names = compared_templates(problem, [n for n, c in found.items() if c is not None], device)
    return [c for name in names if (c := found[name]) is not None]


def run_head_to_head(store: HeadToHeadStore, runner: Runner, candidates: Sequence[Candidate],
                     *, label: str, problem: Problem, device: DeviceInfo, rounds: int,
                     timeout_s: float, max_rounds: int | None = None, seed: int | None = None,
                     stop: threading.Event | None = None) -> HeadToHeadResult:
    """Measure ``candidates`` (``candidates_for``) side by side on ``problem`` and store the
    session; see the module docstring (``max_rounds``: the most rounds a close call takes,
    ``DEFAULT_MAX_ROUNDS_FACTOR`` x ``rounds`` by default). Returns unfinished when ``stop``
    was set."""
    stop = stop or threading.Event()
    started = time.monotonic()
    if max_rounds is None:
        max_rounds = DEFAULT_MAX_ROUNDS_FACTOR * rounds
    if len(candidates) < 2:
        raise ValueError(f"a head-to-head needs two candidates or more, but got "
                         f"{len(candidates)}")
    if max_rounds < rounds:
        raise ValueError(f"max_rounds ({max_rounds}) must be >= rounds ({rounds})")
    result = HeadToHeadResult(label=label, problem=problem.to_dict(), rounds=rounds,
                              candidates=[CandidateResult(c.template.name, c.config)
                                          for c in candidates])
    index = {c.template.name: i for i, c in enumerate(candidates)}
    calls = [[tuple(index[name] for name in names) for names in priced]
             for priced in priced_by(problem, list(index), device)]
    session = result.session = store.start(problem, rounds)
    inputs_seed = random.Random(seed).randrange(2**31)  # one for the session
    gflop: dict[int, float] = {}

    def measure(r: int, order: Sequence[int]) -> None:
        """Round ``r``: the candidates ``order`` names, in that order."""
        for position, i in enumerate(order):
            candidate, seen = candidates[i], result.candidates[i]
            if seen.failed is not None:
                continue  # disqualified: measured no more
            if stop.is_set():
                return
            outcome = runner.measure(TrialRequest(
                template=candidate.template.name,
                template_module=type(candidate.template).__module__,
                problem=problem.to_dict(), config=candidate.config,
                seed=inputs_seed), timeout_s)
            if stop.is_set() and not outcome.ok:
                return  # the runner was torn down under it: nothing to store (search.loop)
            store.record(session, candidate, r, position, outcome)
            if outcome.ok and outcome.median_ms and outcome.tflops:
                seen.by_round[r] = outcome.median_ms
                gflop[i] = outcome.median_ms * outcome.tflops
            else:
                seen.failed = f"{outcome.status.value}: {outcome.reason}"

    for r, order in enumerate(rotation(len(candidates), rounds)):
        measure(r, order)
    ran = rounds
    while ran < max_rounds and not stop.is_set():
        again = close_call_candidates(result.candidates, calls)
        if not again:
            break
        measure(ran, [again[(ran + k) % len(again)] for k in range(len(again))])
        ran += 1
    result.rounds = ran
    if not stop.is_set():
        store.finish(session, candidates, ran)
        result.finished = True
        for i, seen in enumerate(result.candidates):
            if seen.failed is None and seen.runs_ms:
                seen.median_ms = statistics.median(seen.runs_ms)
                seen.tflops = gflop[i] / seen.median_ms
    result.wall_s = time.monotonic() - started
    return result


def close_call_candidates(results: Sequence[CandidateResult],
                          calls: Sequence[Sequence[tuple[int, ...]]]) -> list[int]:
    """The candidates to measure in one more round: per call (its implementations, each as
    the indices of its templates' candidates), the two cheapest implementations still in
    the running, priced as the dispatcher prices them (the sum of their templates' medians),
    where their per-round prices do not yet decide which is cheaper (``decided``)."""
    again: set[int] = set()
    for implementations_of_call in calls:
        running = sorted((sum(statistics.median(results[i].runs_ms) for i in impl), impl)
                         for impl in implementations_of_call
                         if all(results[i].failed is None and results[i].by_round
                                for i in impl))
        if len(running) < 2:
            continue
        (_, cheapest), (_, next_cheapest) = running[:2]
        if not decided(_per_round(results, cheapest), _per_round(results, next_cheapest)):
            again.update(cheapest + next_cheapest)
    return sorted(again)


def _per_round(results: Sequence[CandidateResult], impl: tuple[int, ...]) -> dict[int, float]:
    """An implementation's price in each round where all of its templates were read."""
    rounds = set.intersection(*(set(results[i].by_round) for i in impl))
    return {r: sum(results[i].by_round[r] for i in impl) for r in sorted(rounds)}
