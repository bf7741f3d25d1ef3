"""A template's config space as Optuna sees it: one categorical distribution per knob.

Every knob is a finite list of choices (tile sizes, warps, stages, flags), so categorical
distributions describe the space exactly and every sampler (TPE, GP, random, exhaustive)
works on the same parameters, whose names are the config's field names.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from optuna.distributions import BaseDistribution, CategoricalDistribution

from templates.base import KernelConfig

__all__ = ["distributions", "neighbours", "params_of", "valid_configs"]

# Enumerating a space to find its valid configs is cheap per config (a constraint is a few
# comparisons); this bound only guards against a template whose grid explodes.
MAX_ENUMERATED = 200_000


def distributions(config_cls: type[KernelConfig]) -> dict[str, BaseDistribution]:
    return {k.name: CategoricalDistribution(list(k.choices)) for k in config_cls.knobs()}


def params_of(config: KernelConfig) -> dict[str, Any]:
    return dict(config.to_dict())


def valid_configs(config_cls: type[KernelConfig],
                  reason: Callable[[KernelConfig], str | None]) -> list[KernelConfig] | None:
    """Every config of the grid that passes ``reason`` (None = valid), in grid order;
    None if the grid is too large to enumerate."""
    if config_cls.grid_size() > MAX_ENUMERATED:
        return None
    return [c for c in config_cls.grid() if reason(c) is None]


def neighbours(config: KernelConfig, candidates: Iterable[KernelConfig],
               rng: random.Random) -> list[KernelConfig]:
    """``candidates`` ordered by closeness to ``config``: fewest knobs changed first, then the
    smallest step along each knob's ordered choices; ties broken at random."""
    knobs = config.knobs()
    here = config.to_dict()

    def distance(other: KernelConfig) -> tuple[int, int, float]:
        there = other.to_dict()
        changed = [k for k in knobs if there[k.name] != here[k.name]]
        steps = sum(abs(k.choices.index(there[k.name]) - k.choices.index(here[k.name]))
                    for k in changed)
        return (len(changed), steps, rng.random())

    return sorted((c for c in candidates if c != config), key=distance)


def config_from_params(config_cls: type[KernelConfig], params: Mapping[str, Any]) -> KernelConfig:
    return config_cls.from_dict(dict(params))
