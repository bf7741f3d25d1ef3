"""Calls no kernel of ours takes, and what runs them: what the user's code ran without us.

``tuner.attention`` hands a call here when it has dropout, an elementwise mask it does not
recognize, float64 inputs or a value head dim other than the query's: torch SDPA runs it (as
the user's code did), or, for softcapped scores, which SDPA cannot compute, eager attention
(as transformers runs them). With ``flash`` forced (``use_implementation``), an error says
what our kernels lack instead.
"""

from __future__ import annotations

import torch

from templates.pytorch.eager import eager_attention
from templates.pytorch.sdpa import sdpa

__all__ = ["capped_outside_kernel_scope", "outside_kernel_scope"]


def capped_outside_kernel_scope(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                attn_mask: torch.Tensor | None, dropout_p: float,
                                is_causal: bool, scale: float | None, enable_gqa: bool,
                                softcap: float, forced: str | None) -> torch.Tensor:
    """A softcapped call with dropout, or inputs no kernel of ours takes: eager attention, as
    transformers runs it (SDPA cannot cap scores); forced to ``flash``, an error saying why
    ours cannot."""
    if forced == "flash":
        return outside_kernel_scope(q, k, v, attn_mask, dropout_p, is_causal, scale,
                                    enable_gqa, forced)  # raises, naming what ours lacks
    return eager_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p,
                           causal=is_causal, scale=scale, softcap=softcap)


def outside_kernel_scope(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         attn_mask: torch.Tensor | None, dropout_p: float, is_causal: bool,
                         scale: float | None, enable_gqa: bool, forced: str | None
                         ) -> torch.Tensor:
    """Dropout, an elementwise mask, or inputs no kernel of ours takes: torch SDPA, as the
    user's code ran it; forced to ``flash``, an error saying why ours cannot."""
    if forced != "flash":
        return sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                    scale=scale, enable_gqa=enable_gqa)
    if dropout_p != 0.0:
        raise NotImplementedError(f"the flash kernels have no dropout: dropout_p must be 0.0, "
                                  f"but got {dropout_p}")
    raise NotImplementedError(f"the flash kernels take float16, bfloat16 or float32 with the "
                              f"value head dim equal to the query's, but got {q.dtype}, "
                              f"query head dim {q.shape[-1]}, value head dim {v.shape[-1]}")
