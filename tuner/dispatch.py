"""Which implementation runs a call: chosen by measurement, never by assumption.

An *implementation* is a way to compute a call of ``tuner.attention``: torch's own SDPA
(``sdpa``), our Triton FlashAttention kernels (``flash``), the split-KV decode kernel
(``decode``). Each names the templates whose stored measurements price it: the forward
template for inference, the templates whose times add up to a training step when a gradient
is needed. An implementation that cannot take the call says why (``serves``).

The rule (docs/DISPATCH.md):

* Each implementation that serves the call is priced from its templates' stored bests for
  this device and the call's problem (exact or same shape bucket; a nearest shape or a default
  is no measurement). Estimated time = the problem's FLOPs over the stored TFLOP/s, summed.
* If torch SDPA is priced, the fastest priced implementation runs, with its tuned config.
* If torch SDPA is not priced, the choice is decided on the nearest neighbouring bucket where
  SDPA and another implementation were both measured (``tuner.neighbours``): one that beat
  SDPA there by ``TUNER_NEIGHBOUR_MARGIN`` runs, with its configs from that neighbour.
* Otherwise torch SDPA runs as the user's code would have run it: ours must be measured
  faster to be chosen.
* ``use_implementation(name)`` forces one (tests, experiments); its tuned config or default.
* A block-mask problem (``Problem.mask`` a named pattern) is decided between ours (``flash``),
  compiled FlexAttention (``flex``) and, forward only on Hopper, the Gluon forward (``gluon``)
  on its own bucket: the fastest priced runs where ours is priced; otherwise ours, what ran
  before Flex was a candidate.

A choice that runs is kept (``keep``): its configs, and the prices it was chosen among, stay
the process's answers for their buckets (``tuner.lookup``: stable within a process), so a
problem that ran one implementation and config runs them for the process's life.

New implementations (the Gluon kernels, FlexAttention, another backend) register here with
``register_implementation`` and need no change to the public entry.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field, replace
from typing import Any

from templates.base import KernelConfig, Problem, Template
from templates.device import DeviceInfo
from templates.registry import get_template
from tuner.lookup import Resolved, get_resolver, keep_config, resolve_config
from tuner.neighbours import Contender, Verdict, decide_on_neighbour
from tuner.record import note, recording

__all__ = ["Call", "Choice", "Implementation", "Resolve", "choose", "decide", "implementations",
           "keep", "register_implementation", "use_implementation"]

# How a template's config for a problem on a device is found: the process's resolver
# (``tuner.lookup.resolve_config``) for a call, the stored bests of a database for the service's
# and ``tuner best``'s comparisons (``tuner.comparison``).
Resolve = Callable[[Template, Problem, DeviceInfo], Resolved]


@dataclass(frozen=True)
class Call:
    """What the choice depends on: the problem, whether a gradient is needed, the device."""

    problem: Problem
    needs_grad: bool
    device: DeviceInfo


@dataclass(frozen=True)
class Implementation:
    """One way to run a call, priced by the stored bests of its templates.

    ``forward``: the template priced for inference (its config is the one that runs);
    ``training``: the templates whose times add up to forward + backward (empty: no backward,
    so calls that need a gradient are not served); ``serves``: why a call cannot run here
    (None: it can); ``build``: the inference plan for inputs of one layout (or of any, with
    ``layout_free``), (q, k, v, is_causal, scale, enable_gqa, choice) -> a function of
    (q, k, v) returning the output.
    """

    name: str
    forward: str
    training: tuple[str, ...]
    serves: Callable[[Call], str | None]
    build: Callable[..., Callable[..., Any]]
    description: str = ""
    layout_free: bool = False  # one built plan serves inputs of any strides and alignment

    def templates_for(self, call: Call) -> tuple[str, ...]:
        return self.training if call.needs_grad else (self.forward,)

    def why_not(self, call: Call) -> str | None:
        if call.needs_grad and not self.training:
            return f"{self.name} has no backward"
        for name in self.templates_for(call):
            reason = get_template(name).unsupported(call.problem)
            if reason:
                return reason
        return self.serves(call)


@dataclass(frozen=True)
class Estimate:
    """One implementation's price for a call: resolved configs and the time they add up to."""

    implementation: str
    resolved: tuple[Resolved, ...]  # one per template of ``templates_for``
    ms: float | None  # None: some template has no measurement for this problem

    def to_dict(self) -> dict[str, object]:
        return {"implementation": self.implementation, "ms": self.ms,
                "matches": [r.match for r in self.resolved]}


@dataclass(frozen=True)
class Choice:
    """The implementation that runs, its configs, why, and the prices it was chosen among."""

    implementation: Implementation
    resolved: tuple[Resolved, ...]
    why: str
    estimates: tuple[Estimate, ...] = field(default=())
    # The neighbouring bucket (problem key) the choice was decided on (None: this problem's
    # own measurements, or none).
    neighbour: str | None = None
    # What the measurements on that neighbour decided, every implementation's time there.
    verdict: Verdict | None = field(default=None, compare=False, repr=False)

    @property
    def config(self) -> KernelConfig:
        """The forward template's config (the first resolved)."""
        return self.resolved[0].config

    @property
    def match(self) -> str:
        return self.resolved[0].match

    @property
    def source(self) -> str:
        """Where the config comes from; a config taken from a neighbour names it."""
        r = self.resolved[0]
        return r.source if r.neighbour is None else f"{r.source}, neighbour {r.neighbour}"

    @property
    def expires_at(self) -> float:
        """Ask again once any resolved config may change (an untuned answer expires)."""
        return min((r.expires_at for r in self.resolved), default=math.inf)


log = logging.getLogger("tuner.dispatch")

_IMPLEMENTATIONS: dict[str, Implementation] = {}
_FORCED: ContextVar[str | None] = ContextVar("tuner_forced_implementation", default=None)
BASELINE = "sdpa"  # what a user's code ran before tuner.attention: it runs when unmeasured
# What ran a block-mask call before FlexAttention was a candidate (our block-sparse kernels,
# which beat Flex's forward on the H100): it runs a block-mask call when unmeasured.
BLOCK_MASK_BASELINE = "flash"


def register_implementation(impl: Implementation) -> Implementation:
    if impl.name in _IMPLEMENTATIONS:
        raise ValueError(f"an implementation named {impl.name!r} is already registered")
    _IMPLEMENTATIONS[impl.name] = impl
    return impl


def implementations() -> list[Implementation]:
    return list(_IMPLEMENTATIONS.values())


def get_implementation(name: str) -> Implementation:
    try:
        return _IMPLEMENTATIONS[name]
    except KeyError:
        raise ValueError(f"unknown implementation {name!r}; known: "
                         f"{sorted(_IMPLEMENTATIONS)}") from None


@contextlib.contextmanager
def use_implementation(name: str | None) -> Iterator[None]:
    """Run every ``tuner.attention`` call in this context with implementation ``name`` (its
    tuned config, or its default), whatever was measured; None restores the choice by
    measurement. A call the implementation cannot take raises ValueError saying why."""
    if name is not None:
        get_implementation(name)  # unknown names fail here, not at the first call
    token = _FORCED.set(name)
    try:
        yield
    finally:
        _FORCED.reset(token)


def forced() -> str | None:
    return _FORCED.get()


def price(impl: Implementation, call: Call, resolve: Resolve = resolve_config) -> Estimate:
    resolved = tuple(resolve(get_template(name), call.problem, call.device)
                     for name in impl.templates_for(call))
    total = 0.0
    for name, r in zip(impl.templates_for(call), resolved, strict=True):
        if not r.measured:
            return Estimate(impl.name, resolved, None)
        assert r.tflops is not None
        total += get_template(name).flops(call.problem) / (r.tflops * 1e9)  # ms
    return Estimate(impl.name, resolved, total)


def choose(call: Call) -> Choice:
    """The implementation and configs for ``call`` (see the module docstring); logged at
    DEBUG (``TUNER_LOG_LEVEL=DEBUG``): once per problem and plan, not per call."""
    choice = _choose(call)
    if recording():  # tuner.record: the templates of every implementation that could run it
        note(call.problem, [name for impl in _IMPLEMENTATIONS.values()
                            if impl.why_not(call) is None for name in impl.templates_for(call)])
    if log.isEnabledFor(logging.DEBUG):
        log.debug("%s%s: %s %s (%s, from %s): %s", call.problem.key(),
                  " with grad" if call.needs_grad else "", choice.implementation.name,
                  choice.config.key(), choice.match, choice.source, choice.why)
    return choice


def keep(choice: Choice) -> Choice:
    """``choice`` is about to run: the choice to run, its answers and those it was priced
    among kept for their buckets (``ConfigResolver.keep``). Kept, the prices cannot change,
    so neither can the choice, when its plan is rebuilt or another shape of its buckets
    comes."""
    estimates = tuple(replace(e, resolved=tuple(keep_config(r) for r in e.resolved))
                      for e in choice.estimates)
    return replace(choice, resolved=tuple(keep_config(r) for r in choice.resolved),
                   estimates=estimates)


def _choose(call: Call) -> Choice:
    name = forced()
    if name is not None:
        impl = get_implementation(name)
        reason = impl.why_not(call)
        if reason:
            raise ValueError(f"implementation {name!r} was forced but cannot run "
                             f"{call.problem.key()}: {reason}")
        estimate = price(impl, call)
        return Choice(impl, estimate.resolved, "forced by use_implementation", (estimate,))
    return decide(call, resolve=resolve_config, margin=get_resolver().settings.neighbour_margin)


def decide(call: Call, *, resolve: Resolve, margin: float) -> Choice:
    """The rule (module docstring), with each template's config found by ``resolve`` and a
    neighbour's win needing ``margin``: what ``choose`` runs for a call, and what the service
    and ``tuner best`` show for a problem (``tuner.comparison``), one computation."""
    if call.problem.mask != "none":
        return _decide_block_mask(call, resolve)
    estimates = tuple(price(impl, call, resolve) for impl in _IMPLEMENTATIONS.values()
                      if impl.why_not(call) is None)
    by_name = {e.implementation: e for e in estimates}
    baseline = by_name.get(BASELINE)
    if baseline is None:  # torch SDPA cannot take it (cannot happen for SDPA's own calls)
        raise ValueError(f"torch SDPA cannot run {call.problem.key()}: "
                         f"{_IMPLEMENTATIONS[BASELINE].why_not(call)}")
    if baseline.ms is None:
        return _on_neighbour(call, baseline, estimates, margin)
    return _fastest_measured(estimates)


def _fastest_measured(estimates: tuple[Estimate, ...]) -> Choice:
    """The fastest of the priced estimates (the caller made sure its baseline is priced)."""
    priced = [e for e in estimates if e.ms is not None]
    best = min(priced, key=lambda e: e.ms)  # type: ignore[arg-type, return-value]
    others = ", ".join(f"{e.implementation} {e.ms:.4g} ms" for e in priced if e is not best)
    return Choice(_IMPLEMENTATIONS[best.implementation], best.resolved,
                  f"fastest measured ({best.ms:.4g} ms; {others or 'no other measured'})",
                  estimates)


def _on_neighbour(call: Call, baseline: Estimate, estimates: tuple[Estimate, ...],
                  margin: float) -> Choice:
    """SDPA not measured for this problem: decided on a neighbour (``tuner.neighbours``), or
    SDPA as the user's code would have run it."""
    contenders = {e.implementation: Contender(e.implementation, tuple(
        get_template(name) for name in _IMPLEMENTATIONS[e.implementation].templates_for(call)),
        e.resolved) for e in estimates}
    verdict = decide_on_neighbour(contenders.pop(BASELINE), list(contenders.values()), margin)
    if verdict is None:
        return Choice(_IMPLEMENTATIONS[BASELINE], baseline.resolved,
                      "torch SDPA not measured for this problem on this device: running what "
                      "SDPA would run", estimates)
    # The winner's answers, configs from the neighbour, are what ``keep`` keeps for its buckets.
    estimates = tuple(replace(e, resolved=verdict.resolved)
                      if e.implementation == verdict.winner else e for e in estimates)
    return Choice(_IMPLEMENTATIONS[verdict.winner], verdict.resolved, verdict.why, estimates,
                  neighbour=verdict.neighbour, verdict=verdict)


def _decide_block_mask(call: Call, resolve: Resolve) -> Choice:
    """A block-mask problem (``Problem.mask`` a named pattern): the implementations serving it
    (ours, ``flash``, compiled FlexAttention, ``flex``, and without a gradient on Hopper the
    Gluon forward, ``gluon``; torch SDPA cannot skip tiles) priced on the problem's own
    bucket. Ours priced: the fastest priced runs. Ours not priced: ours, as before Flex was a
    candidate (no neighbour is consulted: a mask's ratio on another shape
    is no measurement of this one)."""
    estimates = tuple(price(impl, call, resolve) for impl in _IMPLEMENTATIONS.values()
                      if impl.why_not(call) is None)
    by_name = {e.implementation: e for e in estimates}
    baseline = by_name.get(BLOCK_MASK_BASELINE)
    if baseline is None:
        raise ValueError(f"our block-sparse kernels cannot run {call.problem.key()}: "
                         f"{_IMPLEMENTATIONS[BLOCK_MASK_BASELINE].why_not(call)}")
    if baseline.ms is None:
        return Choice(_IMPLEMENTATIONS[BLOCK_MASK_BASELINE], baseline.resolved,
                      "our block-sparse kernels not measured for this mask problem on this "
                      "device: running them (what ran before FlexAttention was a candidate)",
                      estimates)
    return _fastest_measured(estimates)
