"""A template's config space as Optuna sees it: one categorical distribution per knob.

Every knob is a finite list of choices (tile sizes, warps, stages, flags), so categorical
distributions describe the space exactly and every sampler (TPE, GP, random, exhaustive)
works on the same parameters, whose names are the config's field names.

A search runs over a :class:`SearchSpace`: every knob's choices, or the subset a sweep spec's
``[space]`` table allows (e.g. to make a grid small enough to run exhaustively). The table
maps knob names to lists of allowed values; the word ``"default"`` instead of a list pins the
knob to the value of the problem's default config. Knobs it does not name keep every choice.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import random
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from optuna.distributions import BaseDistribution, CategoricalDistribution

from templates.base import KernelConfig, Problem, Scalar, Template
from templates.device import DeviceInfo

__all__ = [
    "PROBLEM_DEFAULT",
    "SearchSpace",
    "SpaceRestriction",
    "check_restriction",
    "distributions",
    "neighbours",
    "params_of",
    "problem_space",
    "valid_configs",
]

# Enumerating a space to find its valid configs is cheap per config (a constraint is a few
# comparisons); this bound only guards against a template whose grid explodes.
MAX_ENUMERATED = 200_000
# In a [space] table: the knob keeps the value of the problem's default config.
PROBLEM_DEFAULT = "default"
# Knob name -> allowed values, or PROBLEM_DEFAULT (as a sweep spec's [space] table holds it).
SpaceRestriction = Mapping[str, tuple[Scalar, ...] | str]


@dataclass(frozen=True)
class SearchSpace:
    """The configs a search may suggest: for each knob (in the config's order), the allowed
    values, in the order of the knob's choices."""

    config_cls: type[KernelConfig]
    choices: Mapping[str, tuple[Scalar, ...]]

    @classmethod
    def full(cls, config_cls: type[KernelConfig]) -> SearchSpace:
        return cls(config_cls, {k.name: tuple(k.choices) for k in config_cls.knobs()})

    @classmethod
    def of(cls, space: SpaceLike) -> SearchSpace:
        """``space`` itself, or a config class's full space."""
        return space if isinstance(space, SearchSpace) else cls.full(space)

    @property
    def is_full(self) -> bool:
        return all(self.choices[k.name] == tuple(k.choices) for k in self.config_cls.knobs())

    def size(self) -> int:
        return math.prod(len(values) for values in self.choices.values())

    def configs(self) -> Iterator[KernelConfig]:
        """Every config of the space (its grid), in the order of ``KernelConfig.grid``. Made
        without the per-knob check of ``from_dict``: every value is one of its knob's choices
        by construction, and spaces of 50k-75k configs (gluon_fwd, gluon_bwd) took 1.5-2 s a
        search to check them, on every problem of a sweep."""
        names = list(self.choices)
        if set(names) != {k.name for k in self.config_cls.knobs()}:  # (a space names them all)
            raise ValueError(f"a space of {self.config_cls.__name__} must give every knob's "
                             f"choices, but got {sorted(names)}")
        for values in itertools.product(*self.choices.values()):
            config = object.__new__(self.config_cls)
            for name, value in zip(names, values, strict=True):
                object.__setattr__(config, name, value)  # (a frozen dataclass's fields)
            yield config

    def contains(self, params: Mapping[str, Any]) -> bool:
        """Whether a config (as a dict of its knobs, e.g. ``config.to_dict()``) lies in the
        space; a knob the dict lacks counts with its default, as ``from_dict`` fills it."""
        defaults = {k.name: k.default for k in self.config_cls.knobs()}
        return all(_is_choice(params.get(name, defaults[name]), values)
                   for name, values in self.choices.items())

    def tag(self) -> str:
        """"" for the full space, else a short stable name of the subset: searches of
        different spaces must not share an Optuna study (a categorical distribution cannot
        change its choices within one)."""
        if self.is_full:
            return ""
        text = json.dumps({k: list(v) for k, v in self.choices.items()}, sort_keys=True)
        return "space-" + hashlib.sha256(text.encode()).hexdigest()[:12]

    def to_dict(self) -> dict[str, list[Scalar]]:
        return {name: list(values) for name, values in self.choices.items()}


SpaceLike = SearchSpace | type[KernelConfig]


def _is_choice(value: object, choices: Sequence[Scalar]) -> bool:
    # bool is an int subclass: True must not pass for a tile size, nor 1 for a flag.
    return any(type(value) is type(c) and value == c for c in choices)


def check_restriction(config_cls: type[KernelConfig], restriction: SpaceRestriction,
                      template_name: str) -> None:
    """Raise ValueError, naming the knob and what it allows, unless every entry of
    ``restriction`` is a knob of ``config_cls`` with values among its choices."""
    knobs = {k.name: k for k in config_cls.knobs()}
    for name, allowed in restriction.items():
        knob = knobs.get(name)
        if knob is None:
            raise ValueError(f"space: {template_name} has no knob {name!r}; its knobs are "
                             f"{', '.join(knobs)}")
        if allowed == PROBLEM_DEFAULT:
            continue
        bad = [v for v in allowed if not _is_choice(v, knob.choices)]
        if bad:
            raise ValueError(f"space.{name}: {bad} not among the choices of {template_name}'s "
                             f"{name} ({list(knob.choices)})")


def problem_space(template: Template, problem: Problem, device: DeviceInfo,
                  restriction: SpaceRestriction | None = None) -> SearchSpace:
    """The space a search of ``problem`` runs over: the template's whole space, or the subset
    ``restriction`` allows (checked with :func:`check_restriction` first), its ``"default"``
    knobs pinned to the problem's default config on ``device``."""
    space = SearchSpace.full(template.config_cls)
    if not restriction:
        return space
    check_restriction(template.config_cls, restriction, template.name)
    default = (template.default_config(problem, device).to_dict()
               if PROBLEM_DEFAULT in restriction.values() else {})
    choices = dict(space.choices)
    for name, allowed in restriction.items():
        if allowed == PROBLEM_DEFAULT:
            choices[name] = (default[name],)
        else:  # the knob's order, whatever the spec's
            choices[name] = tuple(c for c in choices[name] if _is_choice(c, allowed))
    return SearchSpace(template.config_cls, choices)


def distributions(space: SpaceLike) -> dict[str, BaseDistribution]:
    return {name: CategoricalDistribution(list(values))
            for name, values in SearchSpace.of(space).choices.items()}


def params_of(config: KernelConfig) -> dict[str, Any]:
    return dict(config.to_dict())


def valid_configs(space: SpaceLike,
                  reason: Callable[[KernelConfig], str | None]) -> list[KernelConfig] | None:
    """Every config of the space that passes ``reason`` (None = valid), in grid order;
    None if the space is too large to enumerate."""
    space = SearchSpace.of(space)
    if space.size() > MAX_ENUMERATED:
        return None
    return [c for c in space.configs() if reason(c) is None]


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
