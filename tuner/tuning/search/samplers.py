"""Samplers by name: ``tpe`` (default), ``gp``, ``random`` and ``grid`` (exhaustive).

``grid`` is the baseline the others are measured against: every config of the search's
space once, in a seeded random order (so a grid cut short is still an unbiased sample).
Optuna's own GridSampler is not used: it re-suggests a config that was enqueued (the
template's default) and calls ``Study.stop`` when the grid runs out, which ask/tell forbids.
"""

from __future__ import annotations

import importlib.util
import random
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import optuna
from optuna.distributions import BaseDistribution, CategoricalDistribution
from optuna.samplers import BaseSampler, GPSampler, RandomSampler, TPESampler
from optuna.trial import FrozenTrial, TrialState

from tuner.errors import TunerError
from tuner.tuning.search.space import SearchSpace, SpaceLike

__all__ = ["SAMPLERS", "ExhaustiveSampler", "make_sampler", "startup_trials"]

SAMPLERS = ("tpe", "gp", "random", "grid")
# States whose params count as taken for the exhaustive order: measured, being measured by
# some worker, or queued. FAIL is not: a trial failed by a dead worker's heartbeat is free.
_TAKEN = (TrialState.COMPLETE, TrialState.RUNNING, TrialState.WAITING, TrialState.PRUNED)


class ExhaustiveSampler(BaseSampler):
    """Every point of a categorical space once, shared by all workers of one study."""

    def __init__(self, space: Mapping[str, Sequence[Any]], seed: int | None = None) -> None:
        self._space = {name: list(choices) for name, choices in space.items()}
        self._rng = random.Random(seed)
        grid: list[dict[str, Any]] = [{}]
        for name, choices in self._space.items():
            grid = [dict(point, **{name: c}) for point in grid for c in choices]
        random.Random(seed).shuffle(grid)
        self._grid = grid
        self._grid_keys = [_point_key(point) for point in grid]
        self._trial_keys: dict[tuple[int, int], tuple[tuple[str, str], ...]] = {}

    def infer_relative_search_space(self, study: optuna.Study,
                                    trial: FrozenTrial) -> dict[str, BaseDistribution]:
        return {name: CategoricalDistribution(choices) for name, choices in self._space.items()}

    def sample_relative(self, study: optuna.Study, trial: FrozenTrial,
                        search_space: dict[str, BaseDistribution]) -> dict[str, Any]:
        if not search_space:
            return {}
        taken = {self._key_of(study, t) for t in study.get_trials(deepcopy=False, states=_TAKEN)
                 if t.number != trial.number}
        for point, key in zip(self._grid, self._grid_keys, strict=True):
            if key not in taken:
                return dict(point)
        # Exhausted: any point; the search loop sees it is measured and stops.
        return dict(self._rng.choice(self._grid))

    def _key_of(self, study: optuna.Study, trial: FrozenTrial) -> tuple[tuple[str, str], ...]:
        # A trial's params never change once set: remember each trial's key.
        ident = (study._study_id, trial.number)
        key = self._trial_keys.get(ident)
        if key is None or trial.state == TrialState.WAITING:  # a WAITING trial may lack params
            key = _point_key(trial.params)
            if trial.state != TrialState.WAITING:
                self._trial_keys[ident] = key
        return key

    def sample_independent(self, study: optuna.Study, trial: FrozenTrial, param_name: str,
                           param_distribution: BaseDistribution) -> Any:
        assert isinstance(param_distribution, CategoricalDistribution)
        return self._rng.choice(list(param_distribution.choices))


def _point_key(params: Mapping[str, Any]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((k, repr(v)) for k, v in params.items()))


def startup_trials(budget: int) -> int:
    """Random trials before TPE/GP model the space: a quarter of the budget, 4 to 10.

    Optuna's default (10) would spend most of a small budget at random; the template's
    default and known good configs, enqueued first, already seed the model.
    """
    return max(4, min(10, budget // 4))


def make_sampler(name: str, space: SpaceLike, *, budget: int,
                 seed: int | None = None) -> BaseSampler:
    """The sampler ``name`` over ``space`` (a config class: its whole space)."""
    if name == "tpe":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            # multivariate: knobs interact (tile sizes x warps x stages); constant_liar: the
            # trials other workers (or the compile-ahead queue) hold are not re-suggested.
            return TPESampler(seed=seed, n_startup_trials=startup_trials(budget),
                              multivariate=True, constant_liar=True)
    if name == "gp":
        if importlib.util.find_spec("scipy") is None:
            raise TunerError("sampler 'gp' needs scipy, which is not installed",
                             "pip install scipy, or use --sampler tpe")
        return GPSampler(seed=seed, n_startup_trials=startup_trials(budget),
                         deterministic_objective=False)
    if name == "random":
        return RandomSampler(seed=seed)
    if name == "grid":
        return ExhaustiveSampler(SearchSpace.of(space).choices, seed=seed)
    raise TunerError(f"unknown sampler {name!r}", f"use one of {', '.join(SAMPLERS)}")
