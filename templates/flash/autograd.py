"""Differentiable FlashAttention: the forward and backward templates joined by autograd,
with configs given explicitly (the templates' own entry, for their tests and benchmarks;
``tuner.attention`` runs the same kernels through its op ``tuner::attention_fwd``, which
finds the tuned configs and stays in compiled graphs).

The forward saves q, k, v, its output o and its logsumexp (one float per query row); the
backward recomputes the attention probabilities tile by tile from them, so no N_q x N_kv
matrix is ever stored.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.autograd.function import once_differentiable

from templates.flash.bwd import BwdConfig, flash_attention_bwd
from templates.flash.fwd import FwdConfig, flash_attention_fwd
from templates.masks.block_mask import BlockMask

FwdConfigLike = FwdConfig | Mapping[str, object] | None
BwdConfigLike = BwdConfig | Mapping[str, object] | None


class FlashAttentionFunction(torch.autograd.Function):
    """o = softmax(scale * q k^T [masked]) v with FlashAttention kernels both ways.

    ``apply(q, k, v, causal, scale, fwd_config, bwd_config, attn_mask, block_mask, softcap)``;
    see ``flash_attention``.
    """

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                causal: bool | str, scale: float | None, fwd_config: FwdConfigLike,
                bwd_config: BwdConfigLike, attn_mask: torch.Tensor | None = None,
                block_mask: BlockMask | None = None, softcap: float | None = None
                ) -> torch.Tensor:
        o, lse = flash_attention_fwd(q, k, v, causal=causal, scale=scale, config=fwd_config,
                                     attn_mask=attn_mask, block_mask=block_mask,
                                     softcap=softcap)
        ctx.save_for_backward(q, k, v, o, lse, attn_mask)
        ctx.causal = causal
        ctx.scale = scale
        ctx.bwd_config = bwd_config
        ctx.block_mask = block_mask
        ctx.softcap = softcap
        return o

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, do: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, o, lse, attn_mask = ctx.saved_tensors
        dq, dk, dv = flash_attention_bwd(do, q, k, v, o, lse, causal=ctx.causal,
                                         scale=ctx.scale, config=ctx.bwd_config,
                                         attn_mask=attn_mask, block_mask=ctx.block_mask,
                                         softcap=ctx.softcap)
        return dq, dk, dv, None, None, None, None, None, None, None


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                    causal: bool | str = False, scale: float | None = None,
                    fwd_config: FwdConfigLike = None, bwd_config: BwdConfigLike = None,
                    attn_mask: torch.Tensor | None = None, block_mask: BlockMask | None = None,
                    softcap: float | None = None) -> torch.Tensor:
    """Attention output o (B, H_q, N_q, D) in q's dtype, differentiable w.r.t. q, k and v.

    Args:
        q: (B, H_q, N_q, D) float16, bfloat16 or float32, any strides.
        k, v: (B, H_kv, N_kv, D), same dtype and device; H_q a multiple of H_kv (GQA/MQA).
        causal: False / "none"; True / "top_left" (query i sees keys j <= i, as torch SDPA);
            "bottom_right" (j <= i + N_kv - N_q).
        scale: softmax scale, default 1/sqrt(D).
        attn_mask, block_mask: as ``flash_attention_fwd``'s; both passes apply them. A float
            attn_mask is a constant here: asking for its gradient raises.
        fwd_config / bwd_config: configs of the flash_fwd / flash_bwd templates (or mappings
            of their fields); None takes each template's default for the problem and device.
        softcap: cap the scaled scores, ``softcap * tanh(s / softcap)`` (Gemma 2), in both
            passes; None or 0: no cap.

    Raises:
        TypeError / ValueError from either template's validation (shapes, dtypes, configs).
    """
    if isinstance(attn_mask, torch.Tensor) and attn_mask.requires_grad:
        raise NotImplementedError("attn_mask requires grad, but the kernels compute no "
                                  "gradient for it (that would be an N_q x N_kv matrix); pass "
                                  "attn_mask.detach() or use torch SDPA's math backend")
    o = FlashAttentionFunction.apply(q, k, v, causal, scale, fwd_config, bwd_config,
                                     attn_mask, block_mask, softcap)
    assert isinstance(o, torch.Tensor)
    return o
