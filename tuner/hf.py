"""Hugging Face transformers integration: ``attn_implementation="tuner"``.

    import tuner.hf
    tuner.hf.register_transformers()
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="tuner")

Registers ``tuner.attention`` in transformers' ``AttentionInterface`` under ``name``, and, for
the masks transformers builds, the same mask function as its "sdpa" implementation: that one
returns no mask at all for plain causal or bidirectional attention without padding (the kernel
then runs its causal or dense path), and a boolean (B, 1, L, S) mask, causality included, for
padded batches, sliding-window layers and prefills that continue a KV cache: the kernel reads
it tile by tile as SDPA's ``attn_mask``. Query rows that see no key (left padding) give zeros.
"""

from __future__ import annotations

from typing import Any

import torch

from tuner.attention import attention

DEFAULT_NAME = "tuner"


def tuner_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                            value: torch.Tensor, attention_mask: torch.Tensor | None,
                            dropout: float = 0.0, scaling: float | None = None,
                            is_causal: bool | None = None, **kwargs: Any
                            ) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: (B, H, L, D) in, (B, L, H, D) out."""
    if attention_mask is not None:
        # The mask already holds causality (as with transformers' own "sdpa" path).
        causal = False
    else:
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        # One query token (decoding) sees every cached key: causal masking would hide them
        # all but the first under SDPA's top-left alignment.
        causal = bool(causal) and query.shape[2] > 1
    out = attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                    is_causal=causal, scale=scaling, enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None


def register_transformers(name: str = DEFAULT_NAME) -> str:
    """Make ``attn_implementation=name`` run ``tuner.attention``; returns ``name``.

    Raises ImportError with the fix when transformers is not installed.
    """
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    except ImportError as exc:
        raise ImportError(f"register_transformers needs transformers >= 4.54 with "
                          f"AttentionInterface and AttentionMaskInterface ({exc}); "
                          "pip install -U transformers") from exc
    AttentionInterface.register(name, tuner_attention_forward)
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    return name
