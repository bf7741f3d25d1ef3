"""The one plan cache of ``tuner.attention`` and ``tuner.decode``: what a call worked out once
(the choice, checked shapes, a launch function) kept under (mode, problem, layout).

A mode says which path made the plan ("inference" for ``tuner.attention``'s hot path, an
implementation's training op, "decode" for ``tuner.decode``); the problem and the layout are
the keys of ``tuner.dispatch.implementations.call``. Plans are per exact shape: a decode loop makes
one per step, so past ``MAX_PLANS`` the cache starts over (rebuilding a plan is cheap once its
shape bucket's config is cached by the resolver).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from tuner.lookup.resolver import get_resolver

__all__ = ["MAX_PLANS", "PLANS", "Plan", "clear_plans", "keep_plan", "kept_plan"]

MAX_PLANS = 4096


@dataclass(frozen=True, slots=True)
class Plan:
    """What a call of one key runs until ``expires_at`` (the earliest expiry of its configs):
    ``run``, or for a plan whose launch depends on the layout, one run per layout in
    ``layouts``; ``choice`` is what was chosen (a ``Choice``, or the ``Resolved`` of
    ``tuner.decode``)."""

    run: Callable[..., object] | None
    choice: object
    expires_at: float
    layouts: dict[tuple[object, ...], Callable[..., object]] | None = None


PLANS: dict[tuple[object, ...], Plan] = {}


def keep_plan(key: tuple[object, ...], plan: Plan) -> Plan:
    if len(PLANS) >= MAX_PLANS:
        PLANS.clear()
    PLANS[key] = plan
    return plan


def kept_plan(key: tuple[object, ...], make: Callable[[], Plan], *, refresh: bool = False,
              now: Callable[[], float] = time.monotonic) -> Plan:
    """The plan kept under ``key`` until it expires by ``now``, else ``make()``'s, kept
    (always ``make()``'s with ``refresh``). ``tuner.attention``'s inference hot path looks its
    plans up inline instead: one call fewer per call."""
    plan = PLANS.get(key)
    if plan is None or refresh or plan.expires_at <= now():
        plan = keep_plan(key, make())
    return plan


def clear_plans() -> None:
    """Forget every plan and every resolved config (e.g. after a new sweep)."""
    PLANS.clear()
    get_resolver().clear()
