"""``gluon_train``: calls that need a gradient, by our kernels both ways on Hopper: the Gluon
forward and the Gluon backward (``templates.gluon.bwd``), priced together by the
``gluon_train`` template beside ``torch_sdpa_train`` and ``gluon_cudnn_train``.

Inference calls are the ``gluon`` implementation's (the same forward). Its training op
``tuner::gluon_train_fwd`` (o, lse) has the backward op ``tuner::gluon_attention_bwd``, which
runs gluon_bwd's config measured on the call's problem where a sweep tuned it (the template
prices the pair with the backward's default: the tuned one is at least as fast).
Block masks too (both kernels walk them; the backward's warp-specialized kernel blocks of
128 x 128 only, with the mask's own causality): a masked call runs here only where a sweep
measured ``gluon_train`` fastest on the mask's named pattern (``rule.choose_masked``), or
when forced; the mask travels through both ops as tensors (``mask_args``), as flash's.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from templates.base import KernelConfig
from templates.gluon import bwd as gluon_bwd
from templates.gluon import fwd as gluon_fwd
from templates.gluon.bwd import GluonBwdConfig, block_mask_reason, gluon_attention_bwd
from templates.masks.block_mask import BlockMask
from templates.registry import get_template
from tuner.dispatch.implementations.base import Choice, Implementation
from tuner.dispatch.implementations.call import Call, as_shape, call_of, shapes_4d
from tuner.dispatch.implementations.flash import for_block_mask
from tuner.dispatch.implementations.gluon import GLUON, backward_of, mask_config, training_forward
from tuner.dispatch.implementations.mask_args import Masked
from tuner.dispatch.implementations.ops import (
    TrainingOp,
    grads_fake,
    in_op_layout,
)
from tuner.dispatch.implementations.registry import register_implementation
from tuner.dispatch.plans import Plan, kept_plan
from tuner.lookup.resolver import keep_config, resolve_config

__all__ = ["GluonTrain"]

TRAINING_TEMPLATE = "gluon_train"
# Why a block mask with is_causal=True on top is refused (the Gluon backward walks the mask's
# blocks and nothing else), after "<who>'s backward " or "the Gluon backward ".
MASK_CAUSALITY = ("takes a block mask's own causality: pass is_causal=False with a causal "
                  "mask (e.g. the *_causal patterns)")
# The backward kernel a block mask runs (gluon_bwd's default for a mask is one of these).
MASKED_BACKWARD = GluonBwdConfig(warp_specialize=True)
# The backward under torch.use_deterministic_algorithms: the warp-specialized kernel with dQ
# added in KV-tile order (bitwise repeatable; on the H200 as fast as without it on dense
# calls, about half as fast on causal ones, benchmarks/results/gluon_bwd_h200_ws_det_dqwg.json).
REPEATABLE_BACKWARD = GluonBwdConfig(BLOCK_M=64, BLOCK_N=128, stages=3, consumers=2,
                                     warp_specialize=True, deterministic=True)


class GluonTrain(Implementation):
    name = "gluon_train"
    forward = "gluon_fwd"
    training = (TRAINING_TEMPLATE,)
    description = ("for a gradient on Hopper, our kernels both ways: the Gluon forward and the "
                   "Gluon backward fed its o and logsumexp (gluon_train), block masks "
                   "included; inference is gluon's")
    # Its tuned backwards add dQ in no fixed order; under torch.use_deterministic_algorithms
    # it runs REPEATABLE_BACKWARD instead, where that is priced right (``serves``).
    deterministic_backward = True
    runs_masks = True

    def serves(self, call: Call) -> str | None:
        if not call.needs_grad:
            return "it serves calls that need a gradient (inference is the gluon implementation's)"
        if torch.are_deterministic_algorithms_enabled():
            reason = repeatable_refusal(call)
            if reason:
                return reason
        return mask_causality_refusal(call) or GLUON.serves(call)

    def mask_refusal(self, block_size: tuple[int, int], needs_grad: bool, choice: Choice
                     ) -> str | None:
        return masked_training_refusal(block_size, choice.config)


GLUON_TRAIN = register_implementation(GluonTrain())


def repeatable_refusal(call: Call) -> str | None:
    """Why a call that needs bitwise-repeatable gradients cannot run here (None if it can):
    the deterministic backward walks no block mask, and on a causal call its waits halve its
    speed, which the stored measurements (of the tuned backward) would not price."""
    if call.problem.mask != "none":
        return ("under torch.use_deterministic_algorithms its backward adds dQ in a fixed "
                "order, which it does not do under a block mask")
    if call.problem.causal != "none":
        return ("under torch.use_deterministic_algorithms its backward adds dQ in a fixed "
                "order, about half as fast on causal calls as the backward its measurements "
                "priced: not offered there")
    return get_template("gluon_bwd").constraint(call.problem, REPEATABLE_BACKWARD, call.device)


def masked_training_refusal(block_size: tuple[int, int], config: KernelConfig) -> str | None:
    """Why a block mask of ``block_size`` cannot run both Gluon kernels, the forward with
    ``config`` (None if it can)."""
    reason = block_mask_reason(MASKED_BACKWARD, block_size)
    if reason:
        return f"the Gluon backward: {reason}"
    if mask_config(config, block_size) is None:
        return "blocks the Gluon forward cannot walk (under its 64-row tiles)"
    return None


def masked_training_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            is_causal: bool, scale: float | None, mask: Masked
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, lse) of a masked call by the Gluon forward: gluon_train's config for the mask's
    named problem (measured there, or that problem's default; without a name the dense
    problem's), fitted to the mask's blocks. Refused before anything runs where the backward
    could not follow: an elementwise mask, causal on top of the mask, blocks it cannot walk."""
    block_mask = gluon_backward_mask("gluon_train", mask, is_causal)
    config = _masked_forward_config(q, k, block_mask.pattern, block_mask.block_size)
    q4, kv4 = shapes_4d(q, k)
    # Looked up on the module at each call (tests stand in for it).
    o, lse = gluon_fwd.gluon_attention_fwd(
        as_shape(q, q4), as_shape(k, kv4), as_shape(v, kv4), causal="none", scale=scale,
        config=config, block_mask=block_mask)
    return as_shape(o, q.shape), as_shape(lse, q.shape[:-1])


def mask_causality_refusal(call: Call) -> str | None:
    """Why the Gluon backward cannot take ``call``: a block mask with causality on top (the
    serves check of both implementations that train masks through it); None otherwise."""
    if call.problem.mask != "none" and call.problem.causal != "none":
        return f"the Gluon backward {MASK_CAUSALITY}"
    return None


def gluon_backward_mask(name: str, mask: Masked, is_causal: bool) -> BlockMask:
    """The block mask the Gluon backward will walk in implementation ``name``'s masked
    training call, refused before anything runs where it could not: an elementwise mask, or
    causal on top of the mask (the backward takes the mask's own causality)."""
    if mask.block_mask is None:
        raise ValueError(f"{name} runs block masks, not an elementwise attn_mask")
    if is_causal:
        raise ValueError(f"{name}'s backward {MASK_CAUSALITY}")
    return mask.block_mask


def _masked_forward_config(q: torch.Tensor, k: torch.Tensor, pattern: str | None,
                           blocks: tuple[int, int]) -> gluon_fwd.GluonFwdConfig:
    """The Gluon forward's config for a masked training call (``masked_training_forward``),
    kept per shape and kind of mask until the answer it came from expires (working it out
    costs host time on every step otherwise: templates' dataclasses, the resolver)."""
    key = ("gluon_train_masked", q.shape, k.shape, q.dtype, q.device, pattern, blocks)

    def make() -> Plan:
        call = call_of(q, k, False, needs_grad=True, mask=pattern or "none")
        resolved = keep_config(resolve_config(get_template(TRAINING_TEMPLATE), call.problem,
                                              call.device))
        reason = masked_training_refusal(blocks, resolved.config)
        if reason:
            raise ValueError(f"gluon_train cannot run a block mask of blocks {blocks}: "
                             f"{reason}")
        config = mask_config(resolved.config, blocks)
        if config is not None and pattern is None:  # the dense problem's config
            config = for_block_mask(config)
        dense = dataclasses.replace(call.problem, mask="none")
        if config is None or gluon_fwd.TEMPLATE.run_constraint(dense, config, call.device,
                                                               blocks):
            # A config the fitting leaves unable to walk the mask (split pieces): the
            # forward's default for these blocks (ValueError where none fits).
            config = gluon_fwd.TEMPLATE.run_default(dense, call.device, blocks)
        assert isinstance(config, gluon_fwd.GluonFwdConfig)
        return Plan(None, config, resolved.expires_at)

    return kept_plan(key, make).choice  # type: ignore[return-value]


def _gluon_train_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
                     scale: float | None, enable_gqa: bool,
                     full_counts: torch.Tensor | None = None,
                     full_indices: torch.Tensor | None = None,
                     partial_counts: torch.Tensor | None = None,
                     partial_indices: torch.Tensor | None = None,
                     partial_tile_ids: torch.Tensor | None = None,
                     partial_tiles: torch.Tensor | None = None,
                     mask_geometry: list[int] | None = None, mask_pattern: str | None = None,
                     attn_mask: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, lse) by the Gluon forward with gluon_train's config, under the block mask given
    as ``mask_args.Masked.op_args`` (if any); its backward is the Gluon backward
    (``tuner::gluon_attention_bwd``)."""
    mask = Masked.from_op_args(full_counts, full_indices, partial_counts, partial_indices,
                               partial_tile_ids, partial_tiles, mask_geometry, mask_pattern,
                               attn_mask)
    if mask is None:
        return training_forward(GLUON_TRAIN, TRAINING_TEMPLATE, q, k, v, is_causal, scale,
                                enable_gqa)
    o, lse = masked_training_forward(q, k, v, is_causal, scale, mask)
    return in_op_layout(o, q), lse


def _gluon_attention_bwd(grad_o: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                         v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor, is_causal: bool,
                         scale: float | None, enable_gqa: bool,
                         full_counts: torch.Tensor | None = None,
                         full_indices: torch.Tensor | None = None,
                         partial_counts: torch.Tensor | None = None,
                         partial_indices: torch.Tensor | None = None,
                         partial_tile_ids: torch.Tensor | None = None,
                         partial_tiles: torch.Tensor | None = None,
                         mask_geometry: list[int] | None = None,
                         mask_pattern: str | None = None, attn_mask: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) by the Gluon backward (gluon_bwd's config measured on the call's problem,
    else its default: ``tuned_backward``; under torch.use_deterministic_algorithms
    ``REPEATABLE_BACKWARD``) from the forward's o and lse, under the forward's block mask (if
    any), laid out as ``torch.empty_like`` of q, k, v."""
    mask = Masked.from_op_args(full_counts, full_indices, partial_counts, partial_indices,
                               partial_tile_ids, partial_tiles, mask_geometry, mask_pattern,
                               attn_mask)
    # Looked up on the module at each call (tests stand in for it).
    if mask is None:
        config = (REPEATABLE_BACKWARD if torch.are_deterministic_algorithms_enabled()
                  else tuned_backward(q, k, is_causal, None, None))
        return backward_of(gluon_attention_bwd, grad_o, q, k, v, o, lse, is_causal, scale,
                           config=config)
    assert mask.block_mask is not None  # (the forward refused an elementwise mask)
    config = tuned_backward(q, k, False, mask.pattern, mask.block_mask.block_size)
    return backward_of(gluon_attention_bwd, grad_o, q, k, v, o, lse, is_causal, scale,
                       config=config, block_mask=mask.block_mask)


def tuned_backward(q: torch.Tensor, k: torch.Tensor, is_causal: bool, pattern: str | None,
                   blocks: tuple[int, int] | None) -> GluonBwdConfig | None:
    """The Gluon backward's config for a training call: gluon_bwd's as a sweep measured it on
    the call's problem (a masked call's: its mask's named problem; ``blocks``: the mask's
    block size, None without one), or None (the backward's own default) where nothing was
    measured there, the mask has no name, or the measured config cannot take the call. A
    sweep prices ``gluon_train`` with the backward's default and tunes ``gluon_bwd`` on its
    own: its best is at least as fast as that default on the problem. Kept per shape and
    kind of call until the answer expires (working it out costs host time every step)."""
    key = ("gluon_train_bwd", q.shape, k.shape, q.dtype, q.device, is_causal, pattern, blocks)

    def make() -> Plan:
        if blocks is not None and pattern is None:
            return Plan(None, None, math.inf)
        call = call_of(q, k, is_causal, True, mask=pattern or "none")
        template = gluon_bwd.TEMPLATE
        resolved = resolve_config(template, call.problem, call.device)
        config = keep_config(resolved).config if resolved.measured else None
        dense = dataclasses.replace(call.problem, mask="none")
        if not isinstance(config, GluonBwdConfig) or template.run_constraint(
                dense, config, call.device, blocks):
            config = None
        return Plan(None, config, resolved.expires_at)

    return kept_plan(key, make).choice  # type: ignore[return-value]


def _gluon_attention_bwd_fake(grad_o: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                              v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
                              is_causal: bool, scale: float | None, enable_gqa: bool,
                              *mask: object) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return grads_fake(q, k, v)


GLUON_TRAIN.training_op = TrainingOp.define("gluon_train_fwd", _gluon_train_fwd,
                                            "gluon_attention_bwd", _gluon_attention_bwd,
                                            _gluon_attention_bwd_fake)
