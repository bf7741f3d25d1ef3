"""``flash``: the project's Triton FlashAttention kernels, forward (``flash_fwd``) and
backward (``flash_bwd``), dense or under a mask (an elementwise ``attn_mask`` or a block mask,
whose tiles they skip). The baseline of block-mask calls: it runs every one that nothing
measured faster.

Its training op ``tuner::attention_fwd`` (o, lse) has the backward op ``tuner::attention_bwd``;
a mask travels through both as tensors (``mask_args``)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from typing import TypeVar, cast

import torch

from templates.base import KernelConfig
from templates.device import interpreter_active
from templates.flash import fwd_kernel as flash_fwd_kernel
from templates.flash.bwd import BwdConfig, flash_attention_bwd
from templates.flash.bwd import fit_to_block_mask as fit_bwd_to_block_mask
from templates.flash.fwd import FwdConfig, fit_to_block_mask, flash_attention_fwd, launch_plan
from templates.kernel_common import normalize_causal
from templates.registry import get_template
from tuner.dispatch.implementations.base import Choice, Implementation, Request, Run
from tuner.dispatch.implementations.call import (
    Call,
    as_shape,
    call_of,
    check_inputs,
    layout_key,
    problem_key,
    shapes_4d,
)
from tuner.dispatch.implementations.mask_args import Masked
from tuner.dispatch.implementations.ops import (
    TrainingOp,
    grads_fake,
    grads_like,
    in_op_layout,
)
from tuner.dispatch.implementations.registry import register_implementation
from tuner.dispatch.plans import Plan, kept_plan
from tuner.lookup.resolver import Resolved, keep_config, resolve_config

__all__ = ["Flash", "for_block_mask", "forward_plan", "mask_fallback_config", "masked_forward",
           "runs_triton"]

C = TypeVar("C", bound=KernelConfig)

Pair = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def runs_triton(call: Call) -> str | None:
    if call.device.is_interpreter and not interpreter_active():
        return "Triton kernels need a CUDA GPU or TRITON_INTERPRET=1"
    return None


def forward_plan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
                 scale: float | None, config: KernelConfig, softcap: float = 0.0) -> Pair:
    """The flash_fwd launch plan for inputs laid out like these: (o, lse) in their shape;
    ``softcap`` > 0 caps the scores."""
    assert isinstance(config, FwdConfig)
    q4, kv4 = shapes_4d(q, k)
    out_shape, lse_shape = tuple(q.shape), tuple(q.shape[:-1])
    reshape = q.dim() != 4
    # Inputs laid out alike reshape to views laid out alike: one launch plan serves them all.
    if reshape:
        q, k, v = q.reshape(q4), k.reshape(kv4), v.reshape(kv4)
    # A tuned TMA config needs 16-byte aligned strides; other layouts use pointer loads.
    if config.use_tma and flash_fwd_kernel.tma_inputs_problem(q, k, v):
        config = replace(config, use_tma=False)
    launch = launch_plan(q, k, v, causal=normalize_causal(is_causal), scale=scale, config=config,
                         softcap=softcap)

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor]:
        if reshape:
            o, lse = launch(q.reshape(q4), k.reshape(kv4), v.reshape(kv4))
            return o.reshape(out_shape), lse.reshape(lse_shape)
        return launch(q, k, v)

    return run


def dense_call(q: torch.Tensor, k: torch.Tensor, is_causal: bool, mask: str = "none",
               softcap: float = 0.0) -> Call:
    """The inference call of these inputs, for looking up one of our templates' configs."""
    if q.device.type != "cuda" and not interpreter_active():
        raise ValueError(f"the flash kernels run on CUDA tensors (or CPU tensors under "
                         f"TRITON_INTERPRET=1), but the inputs are on {q.device}")
    return call_of(q, k, is_causal, needs_grad=False, mask=mask, softcap=softcap)


def resolved_for(template_name: str, q: torch.Tensor, k: torch.Tensor, is_causal: bool,
                 softcap: float = 0.0) -> Resolved:
    """The config of ``template_name`` for the problem of these inputs, which a kernel is about
    to run (so kept: ``tuner.lookup.resolver.ConfigResolver.keep``)."""
    call = dense_call(q, k, is_causal, softcap=softcap)
    return keep_config(resolve_config(get_template(template_name), call.problem, call.device))


def mask_fallback_config(template_name: str, q: torch.Tensor, k: torch.Tensor,
                         is_causal: bool, softcap: float = 0.0) -> KernelConfig:
    """The config of ``template_name`` for a masked call that no measurement of its mask
    problem prices: the dense problem's where it is measured (its own bucket), else the
    template's default. A nearest neighbour's config is no proxy here: on the H100 the
    sliding-window training step (8k, 32/8 heads) took 11.8 ms with the flash_bwd config
    tuned for a one-token decode problem (the nearest stored), 5.05 ms with the default."""
    return _mask_fallback(template_name, q, k, is_causal, softcap)[0]


def _mask_fallback(template_name: str, q: torch.Tensor, k: torch.Tensor, is_causal: bool,
                   softcap: float) -> tuple[KernelConfig, float]:
    """``mask_fallback_config`` and when the answer it read expires."""
    call = dense_call(q, k, is_causal, softcap=softcap)
    template = get_template(template_name)
    resolved = resolve_config(template, call.problem, call.device)
    if resolved.match in ("exact", "bucket"):
        return keep_config(resolved).config, resolved.expires_at
    return template.default_config(call.problem, call.device), resolved.expires_at


def for_block_mask(config: C) -> C:
    """A dense problem's forward config (``FwdConfig``, ``GluonFwdConfig``) as a block
    mask's fallback runs it: ``doc_offsets`` on, as the forwards' own default under a block
    mask (the mask's rows decide at launch whether it applies; 1.05-1.46x on packed documents
    and causal windows, H200)."""
    knob: dict[str, bool] = {"doc_offsets": True}  # (both forwards' configs have it)
    return replace(config, **knob)


class Flash(Implementation):
    name = "flash"
    forward = "flash_fwd"
    training = ("flash_fwd", "flash_bwd")
    description = "the project's Triton FlashAttention forward (and backward)"
    runs_masks = True

    def serves(self, call: Call) -> str | None:
        return runs_triton(call)

    def plan(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
             scale: float | None, enable_gqa: bool, choice: Choice) -> Run:
        run = forward_plan(q, k, v, is_causal, scale, choice.config)
        return lambda q, k, v: run(q, k, v)[0]

    def softcap_plan(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     is_causal: bool, scale: float | None, enable_gqa: bool, softcap: float,
                     choice: Choice) -> Run:
        run = forward_plan(q, k, v, is_causal, scale, choice.config, softcap)
        return lambda q, k, v: run(q, k, v)[0]

    def masked(self, r: Request, choice: Choice) -> torch.Tensor:
        assert r.mask is not None
        return masked_forward(r.q, r.k, r.v, r.is_causal, r.scale, r.mask,
                              masked_configs(r.q, r.k, r.is_causal, r.mask, choice, False,
                                             r.softcap), r.softcap)[0]


FLASH = register_implementation(Flash())


def masked_configs(q: torch.Tensor, k: torch.Tensor, is_causal: bool, mask: Masked,
                   choice: Choice | None, needs_grad: bool, softcap: float = 0.0
                   ) -> tuple[FwdConfig, BwdConfig | None]:
    """The forward (and, ``needs_grad``, backward) configs of a masked call: those measured on
    its mask problem (``choice``'s; in a training op, None: this implementation's own on the
    mask's pattern), else the dense problem's, fitted to the mask's blocks. Kept per shape,
    kind of mask and the choice's configs until the answers they came from expire: worked out
    per call, the dense fallback's default (templates' dataclasses) and the resolver cost a
    few hundred microseconds of host time, as long as a masked step's kernels at 4k tokens
    take on the GPU, and most of a 16k packed forward's 0.8 ms."""
    key = ("flash_masked", q.shape, k.shape, q.dtype, q.device, is_causal, mask.pattern,
           mask.block_size, mask.attn_mask is None, softcap, needs_grad,
           None if choice is None else tuple(r.config for r in choice.resolved))
    def make() -> Plan:
        configs, expires_at = _masked_configs(q, k, is_causal, mask, choice, needs_grad,
                                              softcap)
        return Plan(None, configs, expires_at)

    return kept_plan(key, make).choice  # type: ignore[return-value]


def _masked_configs(q: torch.Tensor, k: torch.Tensor, is_causal: bool, mask: Masked,
                    choice: Choice | None, needs_grad: bool, softcap: float
                    ) -> tuple[tuple[FwdConfig, BwdConfig | None], float]:
    """``masked_configs`` worked out, and when the earliest answer it came from expires."""
    expires_at = math.inf
    if choice is None and mask.pattern is not None:
        call = call_of(q, k, is_causal, needs_grad, mask=mask.pattern, softcap=softcap)
        choice = Choice(FLASH, tuple(
            resolve_config(get_template(name), call.problem, call.device)
            for name in FLASH.templates_for(call)), "the mask problem's own")
    if choice is not None:
        expires_at = min((r.expires_at for r in choice.resolved), default=math.inf)
    if choice is not None and choice.measured:
        config, bwd = choice.resolved[0].config, (choice.resolved[1].config if needs_grad
                                                  else None)
        keep_config(choice.resolved[0])
    else:
        config, fwd_until = _mask_fallback("flash_fwd", q, k, is_causal, softcap)
        if mask.block_size is not None:
            config = for_block_mask(config)
        bwd, bwd_until = (_mask_fallback("flash_bwd", q, k, is_causal, softcap) if needs_grad
                          else (None, math.inf))
        expires_at = min(expires_at, fwd_until, bwd_until)
    assert isinstance(config, FwdConfig) and (bwd is None or isinstance(bwd, BwdConfig))
    if mask.block_size is not None:
        config = fit_to_block_mask(config, mask.block_size)
        bwd = None if bwd is None else fit_bwd_to_block_mask(bwd, mask.block_size)
    return (config, bwd), expires_at


def masked_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
                   scale: float | None, mask: Masked, configs: tuple[FwdConfig, object],
                   softcap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    q4, kv4 = shapes_4d(q, k)
    q_, k_, v_ = as_shape(q, q4), as_shape(k, kv4), as_shape(v, kv4)
    config = configs[0]
    if config.use_tma and flash_fwd_kernel.tma_inputs_problem(q_, k_, v_):
        config = replace(config, use_tma=False)
    attn_mask = None if mask.attn_mask is None else mask.attn_mask.reshape(
        *q4[:-1], k.shape[-2])
    o, lse = flash_attention_fwd(q_, k_, v_, causal=normalize_causal(is_causal), attn_mask=attn_mask,
                                 block_mask=mask.block_mask, scale=scale, config=config,
                                 softcap=softcap)
    return as_shape(o, q.shape), as_shape(lse, q.shape[:-1])


def repeatable(config: BwdConfig) -> BwdConfig:
    """``config``, with dQ summed in a fixed order (dq_mode "separate": one program per query
    tile, no atomics) when torch.use_deterministic_algorithms is on: "atomic" adds each key
    tile's share in whatever order the programs run, so its dQ differs in the last bits from
    run to run."""
    if config.dq_mode == "atomic" and torch.are_deterministic_algorithms_enabled():
        return replace(config, dq_mode="separate")
    return config


def _training_plan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
                   scale: float | None, enable_gqa: bool, softcap: float = 0.0) -> Plan:
    """The dense forward of a call that needs a gradient, kept per problem and layout."""
    key = ("flash_fwd", *problem_key(q, k, v, is_causal, scale, enable_gqa, None),
           *layout_key(q, k, v), softcap)
    def make() -> Plan:
        check_inputs(q, k, v, enable_gqa)
        resolved = resolved_for("flash_fwd", q, k, is_causal, softcap)
        return Plan(forward_plan(q, k, v, is_causal, scale, resolved.config, softcap),
                    Choice(FLASH, (resolved,), "its training op"), resolved.expires_at)

    return kept_plan(key, make)


def _backward_config(q: torch.Tensor, k: torch.Tensor, is_causal: bool,
                     softcap: float = 0.0) -> KernelConfig:
    """The flash_bwd config for this problem (cache -> database -> service -> default), kept
    per shape until the resolver's answer expires."""
    key = ("flash_bwd", q.shape, k.shape, q.dtype, q.device, is_causal, softcap)
    def make() -> Plan:
        resolved = resolved_for("flash_bwd", q, k, is_causal, softcap)
        return Plan(None, Choice(FLASH, (resolved,), "its backward op"), resolved.expires_at)

    plan = kept_plan(key, make)
    assert isinstance(plan.choice, Choice)
    return plan.choice.config


def _attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
                   scale: float | None, enable_gqa: bool,
                   full_counts: torch.Tensor | None = None, full_indices: torch.Tensor | None = None,
                   partial_counts: torch.Tensor | None = None,
                   partial_indices: torch.Tensor | None = None,
                   partial_tile_ids: torch.Tensor | None = None,
                   partial_tiles: torch.Tensor | None = None, mask_geometry: list[int] | None = None,
                   mask_pattern: str | None = None, attn_mask: torch.Tensor | None = None,
                   softcap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, lse): o like q (value's head dim; ``ops.op_output_strides``), lse (..., H_q, L)
    float32 natural log; under the mask given as ``mask_args.Masked.op_args``, the scores
    capped at ``softcap`` (0: none)."""
    mask = Masked.from_op_args(full_counts, full_indices, partial_counts, partial_indices,
                               partial_tile_ids, partial_tiles, mask_geometry, mask_pattern, attn_mask)
    if mask is None:
        run = _training_plan(q, k, v, is_causal, scale, enable_gqa, softcap).run
        assert run is not None
        o, lse = cast(tuple[torch.Tensor, torch.Tensor], run(q, k, v))
    else:
        configs = masked_configs(q, k, is_causal, mask, None, True, softcap)
        o, lse = masked_forward(q, k, v, is_causal, scale, mask, configs, softcap)
    return in_op_layout(o, q), lse


def _attention_bwd(grad_o: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   o: torch.Tensor, lse: torch.Tensor, is_causal: bool, scale: float | None,
                   enable_gqa: bool,
                   full_counts: torch.Tensor | None = None, full_indices: torch.Tensor | None = None,
                   partial_counts: torch.Tensor | None = None,
                   partial_indices: torch.Tensor | None = None,
                   partial_tile_ids: torch.Tensor | None = None,
                   partial_tiles: torch.Tensor | None = None, mask_geometry: list[int] | None = None,
                   mask_pattern: str | None = None, attn_mask: torch.Tensor | None = None,
                   softcap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) by the flash_bwd kernel from the forward's o and lse."""
    mask = Masked.from_op_args(full_counts, full_indices, partial_counts, partial_indices,
                               partial_tile_ids, partial_tiles, mask_geometry, mask_pattern, attn_mask)
    q4, kv4 = shapes_4d(q, k)
    if mask is None:
        config, block_mask, mask4 = _backward_config(q, k, is_causal, softcap), None, None
    else:
        config = masked_configs(q, k, is_causal, mask, None, True,  # type: ignore[assignment]
                                softcap)[1]
        block_mask = mask.block_mask
        mask4 = None if mask.attn_mask is None else mask.attn_mask.reshape(*q4[:-1], k.shape[-2])
    dq, dk, dv = flash_attention_bwd(
        as_shape(grad_o, q4), as_shape(q, q4), as_shape(k, kv4), as_shape(v, kv4), as_shape(o, q4),
        as_shape(lse, q4[:-1]), causal=normalize_causal(is_causal), scale=scale,
        config=repeatable(config),  # type: ignore[arg-type]
        attn_mask=mask4, block_mask=block_mask, softcap=softcap)
    # Laid out as the fake says (``torch.empty_like`` of q, k, v): flash_attention_bwd's own
    # layouts already are, but for dk and dv when k and v are laid out differently.
    return grads_like((dq, dk, dv), q, k, v)


def _attention_bwd_fake(grad_o: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                        v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor, is_causal: bool,
                        scale: float | None, enable_gqa: bool, *mask: object
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return grads_fake(q, k, v)


FLASH.training_op = TrainingOp.define("attention_fwd", _attention_fwd, "attention_bwd",
                                      _attention_bwd, _attention_bwd_fake)
