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
  SDPA and another implementation were both measured (``tuner.dispatch.neighbours``): one that beat
  SDPA there by ``TUNER_NEIGHBOUR_MARGIN`` runs, with its configs from that neighbour.
* Otherwise torch SDPA runs as the user's code would have run it: ours must be measured
  faster to be chosen.
* ``use_implementation(name)`` forces one (tests, experiments); its tuned config or default.
* A softcapped problem (``Problem.softcap``, Gemma 2; torch SDPA cannot cap scores) is
  decided between ours (``flash``) and eager attention as transformers runs it (``eager``) on
  its own bucket: the fastest priced runs where eager is priced; otherwise eager, what the
  user's model ran. SDPA never runs it.
* A block-mask problem (``Problem.mask`` a named pattern) is decided between ours (``flash``),
  compiled FlexAttention (``flex``) and, forward only on Hopper, the Gluon forward (``gluon``)
  on its own bucket: the fastest priced runs where ours is priced; otherwise ours, what ran
  before Flex was a candidate (on Hopper by head dim and mask: ``block_mask_baselines``).
  Packed documents have torch's varlen as their baseline where our untuned kernels were not
  measured faster than it (``DOCUMENTS_OURS_UNMEASURED``).

A choice that runs is kept (``keep``): its configs, and the prices it was chosen among, stay
the process's answers for their buckets (``tuner.lookup.resolver``: stable within a process), so a
problem that ran one implementation and config runs them for the process's life.

An implementation is a subclass of ``tuner.dispatch.implementations.Implementation`` (its docstring
is the contract), registered with ``register_implementation``; the public entry needs no change.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import replace

from templates.base import Problem, Template
from templates.device import DeviceInfo
from templates.masks.row_ranges import takes_doc_offsets
from templates.registry import get_template
from tuner.dispatch.implementations.base import Choice, Estimate, Implementation
from tuner.dispatch.implementations.call import Call
from tuner.dispatch.implementations.registry import (
    get_implementation,
    implementations,
    register_implementation,
)
from tuner.dispatch.neighbours import Contender, decide_on_neighbour
from tuner.lookup.resolver import Resolved, get_resolver, keep_config, resolve_config
from tuner.record import note, recording

__all__ = ["Call", "Choice", "Estimate", "Implementation", "Resolve", "choose",
           "choose_masked", "decide", "get_implementation", "implementations", "keep",
           "register_implementation", "serving_templates", "use_implementation"]

# How a template's config for a problem on a device is found: the process's resolver
# (``tuner.lookup.resolver.resolve_config``) for a call, the stored bests of a database for the
# service's and ``tuner best``'s comparisons (``tuner.dispatch.comparison``).
Resolve = Callable[[Template, Problem, DeviceInfo], Resolved]


log = logging.getLogger("tuner.dispatch.rule")

_FORCED: ContextVar[str | None] = ContextVar("tuner_forced_implementation", default=None)
BASELINE = "sdpa"  # what a user's code ran before tuner.attention: it runs when unmeasured
# What ran a block-mask call before FlexAttention was a candidate (our block-sparse kernels,
# which beat Flex's forward on the H100): it runs a block-mask call when unmeasured.
BLOCK_MASK_BASELINE = "flash"
# The same for a gradient, by head dim, the first of the pair that serves the call (Hopper, the
# mask's own causality, a head dim and dtype its templates take): our two pairs with the Gluon
# backward. Untuned on the H200 both trained 1.10-1.43x faster than compiled Flex on every
# block-mask row measured (d64 and d128, 4k-32k tokens, causal windows, packed documents,
# random blocks), where flash's Triton backward ran 1.25-1.36x slower than Flex (issue 40's
# table). The Gluon forward's pair (gluon_train) read 1-5% faster at d128 on every row but
# documents (tied), the Triton forward's (flash_gluon) 2-8% faster at d64 but on random blocks
# (masked_fwd_bwd_h200_session14.json, varlen_h200_16k_*.json). A sweep still prices all.
BLOCK_MASK_TRAINING_BASELINES = {64: ("flash_gluon", "gluon_train"),
                                 128: ("gluon_train", "flash_gluon")}
# Without a gradient at d128 under causal documents or a causal window (each row sees one range
# of keys: ``row_ranges.takes_doc_offsets``; the mask's own causality, as measured), the Gluon
# forward where it serves: untuned on the H200 it read 1.10-1.21x faster than the Triton
# forward there (16k-64k tokens, 32/16 and 32/8 heads; docs_fwd_doc_offsets_h200_*.json,
# varlen_h200_*.json); at d64 the Triton forward read 1.27x faster (packed documents, 16k),
# and under other masks the two were not compared.
BLOCK_MASK_INFERENCE_BASELINE_D128 = "gluon"
# What packed documents ran without us (FlashAttention's varlen kernels, as torch's varlen_attn
# runs them), where it can serve the call: it runs a documents mask problem when unmeasured,
# except on the architectures and head dims in DOCUMENTS_OURS_UNMEASURED, where our untuned
# kernels were measured faster than it. On the H200 (documents of 200-4000 tokens packed 13 in
# 16k and 52 in 64k; d128 32/16 and 32/8 heads, d64 32/16; varlen_h200_*.json) what runs
# untuned here (the forward by block_mask_baselines, Gluon at d128 and Triton at d64) read
# 1.66-1.79x its speed, the training pair 1.37-1.57x; elsewhere it stays the baseline until
# measured (ours must be measured faster to run there).
DOCUMENTS_BASELINE = "torch_varlen"
DOCUMENTS_OURS_UNMEASURED = {"hopper": frozenset({64, 128})}
# What transformers runs for softcapped scores, which SDPA cannot compute: eager attention.
SOFTCAP_BASELINE = "eager"


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
        note(call.problem, serving_templates(call))
    if log.isEnabledFor(logging.DEBUG):
        log.debug("%s%s: %s %s (%s, from %s): %s", call.problem.key(),
                  " with grad" if call.needs_grad else "", choice.implementation.name,
                  choice.config.key(), choice.match, choice.source, choice.why)
    return choice


def serving_templates(call: Call) -> list[str]:
    """The templates of every implementation that could run ``call``, in the registry's
    order: what ``tuner.record`` notes for it, and what a sweep of its problem prices."""
    return [name for impl in implementations() if impl.why_not(call) is None
            for name in impl.templates_for(call)]


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
    and ``tuner best`` show for a problem (``tuner.dispatch.comparison``), one computation."""
    if call.problem.mask != "none":
        return _decide_block_mask(call, resolve)
    if call.problem.softcap:
        return _decide_softcap(call, resolve)
    estimates = tuple(price(impl, call, resolve) for impl in implementations()
                      if impl.why_not(call) is None)
    by_name = {e.implementation: e for e in estimates}
    baseline = by_name.get(BASELINE)
    if baseline is None:  # torch SDPA cannot take it (cannot happen for SDPA's own calls)
        raise ValueError(f"torch SDPA cannot run {call.problem.key()}: "
                         f"{get_implementation(BASELINE).why_not(call)}")
    if baseline.ms is None:
        return _on_neighbour(call, baseline, estimates, margin)
    return _fastest_measured(estimates)


def _fastest_measured(estimates: tuple[Estimate, ...]) -> Choice:
    """The fastest of the priced estimates (the caller made sure its baseline is priced)."""
    priced = [e for e in estimates if e.ms is not None]
    best = min(priced, key=lambda e: e.ms)  # type: ignore[arg-type, return-value]
    others = ", ".join(f"{e.implementation} {e.ms:.4g} ms" for e in priced if e is not best)
    return Choice(get_implementation(best.implementation), best.resolved,
                  f"fastest measured ({best.ms:.4g} ms; {others or 'no other measured'})",
                  estimates)


def _on_neighbour(call: Call, baseline: Estimate, estimates: tuple[Estimate, ...],
                  margin: float) -> Choice:
    """SDPA not measured for this problem: decided on a neighbour (``tuner.dispatch.neighbours``),
    or SDPA as the user's code would have run it."""
    contenders = {e.implementation: Contender(e.implementation, tuple(
        get_template(name) for name in get_implementation(e.implementation).templates_for(
            call)), e.resolved) for e in estimates}
    verdict = decide_on_neighbour(contenders.pop(BASELINE), list(contenders.values()), margin)
    if verdict is None:
        return Choice(get_implementation(BASELINE), baseline.resolved,
                      "torch SDPA not measured for this problem on this device: running what "
                      "SDPA would run", estimates)
    # The winner's answers, configs from the neighbour, are what ``keep`` keeps for its buckets.
    estimates = tuple(replace(e, resolved=verdict.resolved)
                      if e.implementation == verdict.winner else e for e in estimates)
    return Choice(get_implementation(verdict.winner), verdict.resolved, verdict.why, estimates,
                  neighbour=verdict.neighbour, verdict=verdict)


def block_mask_baselines(call: Call) -> tuple[str, ...]:
    """Ours for a block-mask call: any of them priced, the fastest priced runs; none, the
    first. For a gradient, those of ``BLOCK_MASK_TRAINING_BASELINES`` (by head dim: the d64
    order below 128) that serve the call, not ``flash``: its Triton backward, priced, says
    nothing of the Gluon backward's pairs, which untuned beat both it and Flex. Without one,
    ``BLOCK_MASK_INFERENCE_BASELINE_D128`` where it applies and serves, then
    ``BLOCK_MASK_BASELINE`` (the Triton forward priced, the fastest priced runs, as before
    the Gluon forward was a candidate)."""
    wide = call.problem.head_dim >= 128
    if call.needs_grad:
        order: tuple[str, ...] = BLOCK_MASK_TRAINING_BASELINES[128 if wide else 64]
    elif wide and takes_doc_offsets(call.problem) and call.problem.causal == "none":
        order = (BLOCK_MASK_INFERENCE_BASELINE_D128, BLOCK_MASK_BASELINE)
    else:
        order = ()
    serving = tuple(name for name in order if get_implementation(name).why_not(call) is None)
    return serving or (BLOCK_MASK_BASELINE,)


def _decide_block_mask(call: Call, resolve: Resolve) -> Choice:
    """A block-mask problem (``Problem.mask`` a named pattern): the implementations serving it
    (ours, ``flash``, compiled FlexAttention, ``flex``, and without a gradient on Hopper the
    Gluon forward, ``gluon``; torch SDPA cannot skip tiles) priced on the problem's own
    bucket. Ours priced (one of those ``block_mask_baselines`` names for the call): the
    fastest priced runs. Ours not priced: ours, as before Flex was a candidate (no neighbour
    is consulted: a mask's ratio on another shape is no measurement of this one). Packed
    documents (``document:<n>``, ``documents:<L>``, ``documents_causal:<L>``) that torch's
    varlen kernels can run have those as the baseline instead (``DOCUMENTS_BASELINE``), what
    such calls ran without us, except where our untuned kernels were measured faster than
    them (``DOCUMENTS_OURS_UNMEASURED``)."""
    # Its why_not refuses every mask but packed documents (its templates' ``unsupported``),
    # the CPU, a torch without varlen_attn, capped scores.
    ours_measured_faster = call.problem.head_dim in DOCUMENTS_OURS_UNMEASURED.get(
        call.device.family, ())
    if (not ours_measured_faster
            and get_implementation(DOCUMENTS_BASELINE).why_not(call) is None):
        return _decide_on_own_bucket(
            call, resolve, (DOCUMENTS_BASELINE,), "torch's varlen_attn",
            "torch's varlen_attn not measured for these packed documents on this device: "
            "running it (FlashAttention's varlen kernels, what packed documents ran without "
            "us)")
    # Ours priced means one of those that would run untuned: a sweep that priced flash and
    # Flex but none of them (killed, or narrowed to a few templates) would otherwise move the
    # call to the fastest of those, slower than the untuned choice (block_mask_baselines).
    ours = block_mask_baselines(call)
    return _decide_on_own_bucket(
        call, resolve, ours, "our block-sparse kernels",
        f"our block-sparse kernels not measured for this mask problem on this device: running "
        f"them ({ours[0]}; what ran before FlexAttention was a candidate)")


def _decide_softcap(call: Call, resolve: Resolve) -> Choice:
    """A dense softcapped problem: the implementations serving it (ours, ``flash``, and eager
    attention, ``eager``; SDPA's templates refuse it) priced on the problem's own bucket.
    Eager priced: the fastest priced runs. Eager not priced: eager, as the user's model ran
    it (ours must be measured faster to be chosen; no neighbour is consulted)."""
    return _decide_on_own_bucket(
        call, resolve, (SOFTCAP_BASELINE,), "eager attention",
        "eager attention not measured for this softcapped problem on this device: running it "
        "(what transformers runs where SDPA cannot cap scores)")


def _decide_on_own_bucket(call: Call, resolve: Resolve, baselines: tuple[str, ...],
                          baseline_what: str, unpriced_why: str) -> Choice:
    """The implementations serving ``call`` priced on its own bucket: the fastest priced where
    one of ``baselines`` is priced, else the first of them (``unpriced_why``)."""
    estimates = tuple(price(impl, call, resolve) for impl in implementations()
                      if impl.why_not(call) is None)
    by_name = {e.implementation: e for e in estimates}
    first = by_name.get(baselines[0])
    if first is None:
        raise ValueError(f"{baseline_what} cannot run {call.problem.key()}: "
                         f"{get_implementation(baselines[0]).why_not(call)}")
    if all(name not in by_name or by_name[name].ms is None for name in baselines):
        return Choice(get_implementation(first.implementation), first.resolved, unpriced_why,
                      estimates)
    return _fastest_measured(estimates)


def choose_masked(call: Call, pattern: str | None, block_size: tuple[int, int] | None,
                  documents: bool = False) -> Choice:
    """Who runs a masked call (``call.problem.mask`` "none"; a block mask's ``pattern`` and
    ``block_size``, or None for an elementwise mask): for a named pattern, the choice on that
    mask problem's own measurements (``_decide_block_mask``); for a mask without a name, ours
    (``BLOCK_MASK_BASELINE``, the dense problem's configs fitted to the mask), or the forced
    implementation's ``unnamed_mask_choice`` (by default its forced dense choice). Whatever
    the chosen one's ``mask_refusal`` refuses (blocks it cannot walk), and a forced
    implementation that runs no masks, runs ours too; so does a choice that runs only masks
    carrying their packed documents (``Implementation.needs_documents``: torch's varlen) for
    a mask that carries none (``documents`` False)."""
    baseline = get_implementation(BLOCK_MASK_BASELINE)
    fallback = Choice(baseline, (), "the dense problem's configs, fitted to the mask's blocks")
    name = forced()
    if block_size is None or (name is not None and not get_implementation(name).runs_masks):
        return fallback
    if pattern is not None:
        choice = keep(choose(replace(call, problem=replace(call.problem, mask=pattern))))
    elif name is None or name == BLOCK_MASK_BASELINE:
        return fallback
    else:
        choice = (get_implementation(name).unnamed_mask_choice(call)
                  or keep(choose(call)))  # raises if it cannot run the call
    if choice.implementation.mask_refusal(block_size, call.needs_grad, choice) is not None:
        return fallback
    if choice.implementation.needs_documents and not documents:
        return fallback
    return choice
