"""``tuner.attention``: a drop-in for ``torch.nn.functional.scaled_dot_product_attention``
that runs, for each call, the fastest implementation measured on this GPU for its problem.

    import tuner
    out = tuner.attention(q, k, v, is_causal=True, enable_gqa=True)

Semantics follow SDPA; ``block_mask`` (a ``tuner.BlockMask``) computes only its blocks (rows
that see no key give zeros); ``softcap`` caps the scaled scores, ``softcap * tanh(s /
softcap)`` (Gemma 2), which SDPA cannot: such calls choose between our kernels and eager
attention (what transformers runs for them), never SDPA. Which implementation runs is
``tuner.dispatch.rule``'s choice (docs/DISPATCH.md); an ``attn_mask`` that is exactly causal, a causal window or documents
runs as that (``tuner.dispatch.dense_mask``); dropout, other masks, float64 or a value head dim
other than the query's run torch SDPA as the user's code did (``use_implementation("flash")``
forces ours on a mask).

This module validates, chooses and runs; how each implementation runs is its own
(``tuner.dispatch.implementations``; its base class is the contract). Eager, dense, without a
gradient (the hot path: keep it tiny), the plan kept in ``tuner.dispatch.plans`` under ("inference",
problem) runs, per layout. Otherwise the chosen implementation's ``run``: its training op (a
``torch.library`` op with its backward) for a gradient, the op ``tuner::attention_inference``
under torch.compile; masks travel through both as tensors, so masked calls stay in compiled
graphs. Under torch.compile the choice is made at trace time (``assume_constant_result``).
"""

from __future__ import annotations

import time

import torch

# Imported first: without CUDA it sets TRITON_INTERPRET before anything imports triton (the
# custom ops' first call imports torch._dynamo, which imports triton).
import templates  # noqa: F401
from templates.kernel_common import check_softcap
from tuner.dispatch.dense_mask import recognize_mask
from tuner.dispatch.implementations import Request, get_implementation
from tuner.dispatch.implementations.call import (
    call_of,
    call_of_shapes,
    check_inputs,
    check_tensors,
    device_info,
    in_kernel_scope,
    layout_key,
    problem_key,
)
from tuner.dispatch.implementations.mask_args import Masked
from tuner.dispatch.implementations.ops import in_op_layout, output_fake
from tuner.dispatch.outside_scope import capped_outside_kernel_scope, outside_kernel_scope
from tuner.dispatch.plans import MAX_PLANS, Plan, clear_plans, keep_plan, kept_plan
from tuner.dispatch.plans import PLANS as _PLANS
from tuner.dispatch.rule import Choice, choose, choose_masked, forced, keep, use_implementation
from tuner.record import recording

__all__ = ["MAX_PLANS", "attention", "clear_plans", "plan_for"]

_now, _compiling = time.monotonic, torch.compiler.is_compiling


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
              is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False,
              *, block_mask: object | None = None, softcap: float | None = None
              ) -> torch.Tensor:
    """Scaled dot-product attention by the fastest measured implementation (module docstring).

    ``softcap``: None or 0 for SDPA's scores; > 0 caps them (a finite number)."""
    try:
        needs_grad = torch.is_grad_enabled() and (
            query.requires_grad or key.requires_grad or value.requires_grad)
        if (attn_mask is None and block_mask is None and dropout_p == 0.0 and not needs_grad
                and not softcap and not torch.compiler.is_compiling()):
            return _forward(query, key, value, is_causal, scale, enable_gqa)
    except AttributeError:  # not tensors (checked only now, to keep the hot path short)
        check_tensors(query=query, key=key, value=value)
        raise
    cap = check_softcap(softcap)
    if attn_mask is not None and block_mask is not None:
        raise ValueError("pass attn_mask or block_mask, not both")
    check_inputs(query, key, value, enable_gqa)
    if cap and block_mask is None and (dropout_p != 0.0 or not in_kernel_scope(query, value)):
        return capped_outside_kernel_scope(query, key, value, attn_mask, dropout_p, is_causal,
                                           scale, enable_gqa, cap, _forced())
    if attn_mask is not None and not (_compiling() or is_causal or dropout_p or forced()) \
            and in_kernel_scope(query, value) and (found := recognize_mask(
                attn_mask, query.shape[-2], key.shape[-2])) is not None:  # run as what it is
        return attention(query, key, value, is_causal=found.is_causal, scale=scale,
                         enable_gqa=enable_gqa, block_mask=found.block_mask, softcap=cap)
    if block_mask is None and not cap and (
            dropout_p != 0.0 or not in_kernel_scope(query, value)
            or (attn_mask is not None and _forced() != "flash")):
        return outside_kernel_scope(query, key, value, attn_mask, dropout_p, is_causal, scale,
                                    enable_gqa, _forced())
    mask = None if attn_mask is None and block_mask is None else Masked.of(
        query, key, attn_mask, block_mask)
    r = Request(query, key, value, is_causal, scale, enable_gqa, needs_grad, mask, cap)
    if torch.compiler.is_compiling():
        name, constant = _traced_choice(
            ",".join(str(n) for n in query.shape), ",".join(str(n) for n in key.shape),
            str(query.dtype).removeprefix("torch."), str(query.device), is_causal, needs_grad,
            mask is not None, None if mask is None else mask.pattern,
            "" if mask is None or mask.block_size is None else ",".join(map(str, mask.block_size)),
            cap, mask is not None and mask.documents is not None).split(":", 1)
        return get_implementation(name).run(r, None, constant)
    choice = _choose(r)
    return choice.implementation.run(r, choice, choice.implementation.constant(choice))


def plan_for(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *,
             is_causal: bool = False, enable_gqa: bool = False,
             needs_grad: bool = False, softcap: float | None = None) -> Choice:
    """Which implementation and config ``attention`` runs for these inputs, and why."""
    cap = check_softcap(softcap)
    check_inputs(query, key, value, enable_gqa)
    return choose(call_of(query, key, is_causal, needs_grad, softcap=cap))


@torch.compiler.assume_constant_result
def _forced() -> str | None:
    """``forced()`` read at trace time, as the choice is (Dynamo cannot read a ContextVar)."""
    return forced()


def _choose(r: Request) -> Choice:
    """The kept choice for a checked call (a masked one by ``choose_masked``), itself kept
    per problem, kind of mask, forced implementation and deterministic mode until its
    answers expire: a training or masked call works it out once, not on every step (pricing
    takes a few hundred microseconds of host time, as long as a small step's kernels)."""
    mask = r.mask
    key = ("choice", r.q.shape, r.k.shape, r.q.dtype, r.q.device, r.is_causal, r.needs_grad,
           r.softcap, forced(), torch.are_deterministic_algorithms_enabled(),
           None if mask is None else (mask.pattern, mask.block_size,
                                      mask.documents is not None, mask.attn_mask is None))
    def make() -> Plan:
        call = call_of(r.q, r.k, r.is_causal, r.needs_grad, softcap=r.softcap)
        choice = keep(choose(call)) if mask is None else choose_masked(
            call, mask.pattern, mask.block_size, mask.documents is not None)
        return Plan(None, choice, choice.expires_at)

    # (while tuner.record listens, every call is priced: the recording counts the calls)
    plan = kept_plan(key, make, refresh=recording(), now=_now)
    assert isinstance(plan.choice, Choice)
    return plan.choice


@torch.compiler.assume_constant_result
def _traced_choice(shape_q: str, shape_k: str, dtype: str, device: str, is_causal: bool,
                   needs_grad: bool, masked: bool, pattern: str | None, block_size: str,
                   softcap: float = 0.0, documents: bool = False) -> str:
    """Under torch.compile: "<implementation>:<its constant>", fixed at trace time as a
    constant; arguments are scalars and strings, as Dynamo requires."""
    call = call_of_shapes(tuple(int(n) for n in shape_q.split(",")),
                          tuple(int(n) for n in shape_k.split(",")), getattr(torch, dtype),
                          is_causal, needs_grad, device_info(torch.device(device)),
                          softcap=softcap)
    blocks = tuple(int(n) for n in block_size.split(",")) if block_size else None
    choice = (choose_masked(call, pattern, blocks, documents) if masked  # type: ignore[arg-type]
              else keep(choose(call)))
    return f"{choice.implementation.name}:{choice.implementation.constant(choice)}"


def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
             scale: float | None, enable_gqa: bool) -> torch.Tensor:
    # The hot path: one tuple, one dict lookup, one clock read, then the plan's launch (a
    # layout-free plan takes any layout; others have a launch plan per layout).
    key = ("inference", *problem_key(q, k, v, is_causal, scale, enable_gqa, forced()))
    plan = _PLANS.get(key)
    if plan is None or plan.expires_at <= _now():
        check_inputs(q, k, v, enable_gqa)
        if not in_kernel_scope(q, v):  # float64, another value head dim: never kept
            return outside_kernel_scope(q, k, v, None, 0.0, is_causal, scale, enable_gqa,
                                        _forced())
        choice = keep(choose(call_of(q, k, is_causal, needs_grad=False)))
        impl = choice.implementation
        plan = keep_plan(key, Plan(
            impl.plan(q, k, v, is_causal, scale, enable_gqa, choice) if impl.layout_free
            else None, choice, choice.expires_at, None if impl.layout_free else {}))
    if plan.run is not None:
        return plan.run(q, k, v)  # type: ignore[return-value]
    assert plan.layouts is not None and isinstance(plan.choice, Choice)
    layout = layout_key(q, k, v)
    run = plan.layouts.get(layout)
    if run is None:
        run = plan.layouts[layout] = plan.choice.implementation.plan(
            q, k, v, is_causal, scale, enable_gqa, plan.choice)
    return run(q, k, v)  # type: ignore[return-value]


@torch.library.custom_op("tuner::attention_inference", mutates_args=())
def _attention_inference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
                         scale: float | None, enable_gqa: bool, implementation: str,
                         full_counts: torch.Tensor | None = None, full_indices: torch.Tensor | None = None,
                         partial_counts: torch.Tensor | None = None,
                         partial_indices: torch.Tensor | None = None,
                         partial_tile_ids: torch.Tensor | None = None,
                         partial_tiles: torch.Tensor | None = None, mask_geometry: list[int] | None = None,
                         mask_pattern: str | None = None, attn_mask: torch.Tensor | None = None,
                         softcap: float = 0.0) -> torch.Tensor:
    """o by ``implementation`` as the trace chose it, under the mask given as
    ``Masked.op_args`` and capped at ``softcap``: the eager path, with that implementation
    forced."""
    mask = Masked.from_op_args(full_counts, full_indices, partial_counts, partial_indices,
                               partial_tile_ids, partial_tiles, mask_geometry, mask_pattern, attn_mask)
    with torch.no_grad(), use_implementation(implementation):
        return in_op_layout(attention(
            q, k, v, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa,
            attn_mask=None if mask is None else mask.attn_mask,
            block_mask=None if mask is None else mask.block_mask, softcap=softcap), q)


@_attention_inference.register_fake
def _attention_inference_fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              is_causal: bool, scale: float | None, enable_gqa: bool,
                              implementation: str, *mask: object) -> torch.Tensor:
    return output_fake(q, v)
