"""Deciding on a neighbour: which implementation runs a problem whose own bucket has no torch
SDPA measurement, from measurements of a neighbouring bucket (docs/DISPATCH.md).

A ``nearest`` answer is another shape's measurement: its time is no price for this problem, and
two implementations' nearest answers may come from different shapes. What does compare is two
implementations measured on the same neighbouring bucket: their ratio there is a measurement,
and the prediction for this problem. So:

* the neighbour is the nearest bucket (``tuner.lookup.resolver``'s order, read from SDPA's answer)
on
  which torch SDPA and at least one other implementation that serves the call were measured,
  every template of each, with configs that run this problem; one neighbour for all of them;
* there, each is priced on the problem SDPA measured (FLOPs over the stored TFLOP/s, summed as
  ``tuner.dispatch.rule.price`` sums them); the fastest runs, with its configs from that neighbour,
  if it beat SDPA there by ``TUNER_NEIGHBOUR_MARGIN``: the ratio is a prediction for another
  shape, so it must clear the noise of the measurements behind it. Otherwise SDPA runs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from templates.base import Problem, Template
from tuner.lookup.resolver import Neighbour, Resolved

__all__ = ["Contender", "Verdict", "decide_on_neighbour"]


@dataclass(frozen=True)
class Contender:
    """An implementation as compared on a neighbour: its templates and their answers here."""

    name: str
    templates: tuple[Template, ...]
    resolved: tuple[Resolved, ...]  # one per template


@dataclass(frozen=True)
class Verdict:
    """What the measurements on one neighbouring bucket decided."""

    neighbour: str  # the neighbouring bucket's problem key
    problem: Problem  # the problem SDPA measured there: every time is of this problem
    baseline: str
    ms: dict[str, float]  # implementation -> its time on ``problem``, the baseline's included
    winner: str  # the baseline where none beat it by the margin
    resolved: tuple[Resolved, ...]  # the winner's answers (a candidate's configs from there)
    margin: float

    def ratio(self, name: str) -> float:
        """The baseline's time over ``name``'s, on the neighbour (> 1: ``name`` is faster)."""
        return self.ms[self.baseline] / self.ms[name]

    @property
    def why(self) -> str:
        rivals = sorted((n for n in self.ms if n != self.baseline), key=self.ms.__getitem__)
        ratios = ", ".join(f"{n} {self.ratio(n):.3g}x" for n in rivals)
        head = (f"decided on neighbour {self.neighbour} (no torch SDPA measurement for this "
                f"problem; measured there, against SDPA: {ratios}; {1 + self.margin:.3g}x "
                f"needed)")
        if self.winner == self.baseline:
            return f"{head}: running what SDPA would run"
        return f"{head}: running {self.winner} with its config from {self.neighbour}"


def decide_on_neighbour(baseline: Contender, others: Sequence[Contender], margin: float
                        ) -> Verdict | None:
    """The verdict on the nearest neighbour where ``baseline`` and one of ``others`` were both
    measured (module docstring); None where there is no such neighbour."""
    if not baseline.resolved:
        return None
    for key in baseline.resolved[0].neighbours:  # nearest first
        base = _readings(baseline, key)
        if base is None:
            continue
        rivals = [(c, found) for c in others if (found := _readings(c, key)) is not None]
        if not rivals:
            continue
        problem = base[0].problem  # every time is of the one problem SDPA measured there
        ms = {baseline.name: _time(baseline, base, problem)}
        ms.update((c.name, _time(c, found, problem)) for c, found in rivals)
        winner, readings = min(rivals, key=lambda rival: ms[rival[0].name])
        if ms[baseline.name] / ms[winner.name] < 1 + margin:
            return Verdict(key, problem, baseline.name, ms, baseline.name, baseline.resolved,
                           margin)
        resolved = tuple(dataclasses.replace(r, config=found.config, tflops=found.tflops,
                                             neighbour=key)
                         for r, found in zip(winner.resolved, readings, strict=True))
        return Verdict(key, problem, baseline.name, ms, winner.name, resolved, margin)
    return None


def _readings(contender: Contender, key: str) -> tuple[Neighbour, ...] | None:
    """The measurements of every template of ``contender`` on the bucket ``key`` (None: some
    template has none there)."""
    readings = []
    for r in contender.resolved:
        found = _reading(r, key)
        if found is None or found.tflops <= 0:
            return None
        readings.append(found)
    return tuple(readings) or None


def _reading(r: Resolved, key: str) -> Neighbour | None:
    # An answer already chosen on a neighbour (kept for its bucket since) carries that
    # neighbour's config: it reads there alone, so a kept choice is decided again the same way.
    if r.neighbour is not None and r.neighbour != key:
        return None
    return r.neighbours.get(key)


def _time(contender: Contender, readings: tuple[Neighbour, ...], problem: Problem) -> float:
    """ms of ``problem`` at the TFLOP/s measured on the neighbour, summed over the templates."""
    return sum(t.flops(problem) / (found.tflops * 1e9)
               for t, found in zip(contender.templates, readings, strict=True))
