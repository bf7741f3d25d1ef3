"""``flash_gluon``: a block-mask call that needs a gradient, by the Triton block-sparse forward
(``flash_fwd``) and the warp-specialized Gluon backward (``gluon_bwd``) fed its o and
logsumexp, on Hopper.

Why a pair of its own: under some masks the Triton forward is the faster forward and the Gluon
backward the faster backward (H200, 2026-11-29, masked_fwd_bwd_bench.py, d128 16k causal
documents of 1024 tokens: forward 0.38 ms Triton against 0.48 ms Gluon, while the Gluon
backward beat both the Triton one and Flex's; masked_fwd_bwd_h200_gluon_train.json), so
neither ``flash`` (Triton both ways) nor ``gluon_train`` (Gluon both ways) is the fastest
step there. It is priced like ``flash``, by its two templates' measurements on the mask's named
problem (``flash_fwd`` + ``gluon_bwd``), and runs only where a sweep measured it fastest (or
forced). Dense calls are ``gluon_train``'s and ``flash``'s; inference is ``flash``'s.
"""

from __future__ import annotations

import math

import torch

from templates.flash.fwd import FwdConfig, fit_to_block_mask
from templates.gluon.bwd import GluonBwdConfig, block_mask_reason, gluon_attention_bwd
from templates.masks.block_mask import BlockMask
from templates.registry import get_template
from tuner.dispatch.implementations.base import Choice, Implementation
from tuner.dispatch.implementations.call import Call, call_of
from tuner.dispatch.implementations.flash import (
    for_block_mask,
    mask_fallback_config,
    masked_forward,
    runs_triton,
)
from tuner.dispatch.implementations.gluon import GLUON, backward_of
from tuner.dispatch.implementations.gluon_train import (
    MASKED_BACKWARD,
    gluon_backward_mask,
    mask_causality_refusal,
)
from tuner.dispatch.implementations.mask_args import Masked
from tuner.dispatch.implementations.ops import TrainingOp, grads_fake, in_op_layout
from tuner.dispatch.implementations.registry import register_implementation
from tuner.dispatch.plans import Plan, kept_plan
from tuner.lookup.resolver import keep_config, resolve_config

__all__ = ["FlashGluon"]


class FlashGluon(Implementation):
    name = "flash_gluon"
    forward = "flash_fwd"
    training = ("flash_fwd", "gluon_bwd")
    description = ("for a gradient under a block mask on Hopper: the Triton block-sparse "
                   "forward and the warp-specialized Gluon backward fed its o and logsumexp "
                   "(flash_fwd + gluon_bwd); inference is flash's")
    deterministic_backward = False  # the Gluon backward's dQ reduces come in any order
    runs_masks = True

    def serves(self, call: Call) -> str | None:
        if not call.needs_grad:
            return "it serves masked calls that need a gradient (inference is flash's)"
        if call.problem.mask == "none":
            return ("it serves block-mask calls (a dense call's forward is the Gluon one's: "
                    "gluon_train)")
        if call.problem.softcap:
            return "the Gluon backward does not cap scores"
        return mask_causality_refusal(call) or GLUON.serves(call) or runs_triton(call)

    def mask_refusal(self, block_size: tuple[int, int], needs_grad: bool, choice: Choice
                     ) -> str | None:
        reason = block_mask_reason(MASKED_BACKWARD, block_size)
        return f"the Gluon backward: {reason}" if reason else None

    def unnamed_mask_choice(self, call: Call) -> Choice | None:
        # Its op works its configs out itself (``op_configs``): for a mask without a name,
        # the Triton forward's dense fallback and the Gluon backward's default for a mask.
        return Choice(self, (), "forced by use_implementation (a mask without a pattern)")


FLASH_GLUON = register_implementation(FlashGluon())


def op_configs(q: torch.Tensor, k: torch.Tensor, mask: Masked
               ) -> tuple[FwdConfig, GluonBwdConfig | None]:
    """(forward, backward) configs of a masked training call: each as measured on the mask's
    named problem, else the Triton forward's dense fallback and the Gluon backward's default
    for the mask (None); the forward fitted to the mask's blocks. Kept per shape and kind of
    mask until the answers expire (worked out per call they cost host time every step)."""
    assert mask.block_mask is not None
    block_size = mask.block_mask.block_size
    key = ("flash_gluon", q.shape, k.shape, q.dtype, q.device, mask.pattern, block_size)

    def make() -> Plan:
        expires_at = math.inf
        fwd: object = None
        bwd: object = None
        if mask.pattern is not None:
            call = call_of(q, k, False, True, mask=mask.pattern)
            resolved = [resolve_config(get_template(name), call.problem, call.device)
                        for name in FLASH_GLUON.training]
            expires_at = min(r.expires_at for r in resolved)
            # Each measured on the mask's problem is taken on its own (a sweep that reached
            # one template of the pair still tuned it).
            fwd, bwd = (keep_config(r).config if r.measured else None for r in resolved)
        if fwd is None:
            fwd = for_block_mask(mask_fallback_config("flash_fwd", q, k, False))
        assert isinstance(fwd, FwdConfig)
        if not isinstance(bwd, GluonBwdConfig) or block_mask_reason(bwd, block_size):
            bwd = None  # gluon_attention_bwd's default for a mask
        return Plan(None, (fit_to_block_mask(fwd, block_size), bwd), expires_at)

    return kept_plan(key, make).choice  # type: ignore[return-value]


def _masked(full_counts: torch.Tensor | None, full_indices: torch.Tensor | None,
            partial_counts: torch.Tensor | None, partial_indices: torch.Tensor | None,
            partial_tile_ids: torch.Tensor | None, partial_tiles: torch.Tensor | None,
            mask_geometry: list[int] | None, mask_pattern: str | None,
            attn_mask: torch.Tensor | None, is_causal: bool) -> tuple[Masked, BlockMask]:
    mask = Masked.from_op_args(full_counts, full_indices, partial_counts, partial_indices,
                               partial_tile_ids, partial_tiles, mask_geometry, mask_pattern,
                               attn_mask)
    if mask is None:
        raise ValueError("flash_gluon runs block masks only, not a dense call: use flash or "
                         "gluon_train")
    return mask, gluon_backward_mask("flash_gluon", mask, is_causal)


def _flash_gluon_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
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
    """(o, lse) by the Triton block-sparse forward under the block mask given as
    ``mask_args.Masked.op_args``; its backward is the Gluon one (``tuner::flash_gluon_bwd``)."""
    mask, _ = _masked(full_counts, full_indices, partial_counts, partial_indices,
                      partial_tile_ids, partial_tiles, mask_geometry, mask_pattern, attn_mask,
                      is_causal)
    fwd, _bwd = op_configs(q, k, mask)
    o, lse = masked_forward(q, k, v, False, scale, mask, (fwd, None))
    return in_op_layout(o, q), lse


def _flash_gluon_bwd(grad_o: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     o: torch.Tensor, lse: torch.Tensor, is_causal: bool, scale: float | None,
                     enable_gqa: bool,
                     full_counts: torch.Tensor | None = None,
                     full_indices: torch.Tensor | None = None,
                     partial_counts: torch.Tensor | None = None,
                     partial_indices: torch.Tensor | None = None,
                     partial_tile_ids: torch.Tensor | None = None,
                     partial_tiles: torch.Tensor | None = None,
                     mask_geometry: list[int] | None = None, mask_pattern: str | None = None,
                     attn_mask: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) by the warp-specialized Gluon backward under the forward's block mask,
    from the Triton forward's o and lse (both kernels' lse is the natural-log logsumexp),
    laid out as ``torch.empty_like`` of q, k, v."""
    mask, block_mask = _masked(full_counts, full_indices, partial_counts, partial_indices,
                               partial_tile_ids, partial_tiles, mask_geometry, mask_pattern,
                               attn_mask, is_causal)
    _fwd, bwd = op_configs(q, k, mask)
    # Looked up on the module at each call (tests stand in for it). Not causal: _masked
    # refused causality on top of the mask.
    return backward_of(gluon_attention_bwd, grad_o, q, k, v, o, lse, "none", scale,
                       config=bwd, block_mask=block_mask)


def _flash_gluon_bwd_fake(grad_o: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                          v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor, is_causal: bool,
                          scale: float | None, enable_gqa: bool, *mask: object
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return grads_fake(q, k, v)


FLASH_GLUON.training_op = TrainingOp.define("flash_gluon_fwd", _flash_gluon_fwd,
                                            "flash_gluon_bwd", _flash_gluon_bwd,
                                            _flash_gluon_bwd_fake)
