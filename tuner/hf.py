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

Sliding-window layers (Mistral, Gemma, ...): transformers hands every layer a dense boolean
(B, 1, L, S) mask, so SDPA computes all L x S scores and masks most of them away. When that
mask is exactly the causal sliding window (no padding, a prefill from an empty cache), the
layer runs as a block mask instead, and only the tiles inside the window are computed. That
mask is the named pattern ``sliding_causal:<window>``: a sweep of the layer's problem (e.g.
``benchmarks/specs/dispatch_sliding_hf.toml``) decides whether our block-sparse kernels or
FlexAttention run it; unswept, ours run. The check reads the mask once per mask tensor
(transformers passes one tensor to every layer of a forward): one device-to-host sync per
forward, not per layer.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import torch

from templates.block_mask import BlockMask
from templates.mask_mods import pattern_block_mask
from tuner.attention import attention

DEFAULT_NAME = "tuner"


def tuner_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                            value: torch.Tensor, attention_mask: torch.Tensor | None,
                            dropout: float = 0.0, scaling: float | None = None,
                            is_causal: bool | None = None, **kwargs: Any
                            ) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: (B, H, L, D) in, (B, L, H, D) out."""
    window = kwargs.get("sliding_window")
    # A window of 0 or less hides every key: no pattern names it, so it stays a dense mask.
    if (window and int(window) > 0 and isinstance(attention_mask, torch.Tensor)
            and is_sliding_causal(attention_mask, int(window))):
        # A window as long as the sequence is plain causal attention: the dispatcher's
        # (measured) choice, e.g. cuDNN's causal kernel, without any mask.
        if window >= query.shape[2]:
            out = attention(query, key, value, dropout_p=dropout, is_causal=True,
                            scale=scaling, enable_gqa=query.shape[1] != key.shape[1])
        else:
            # The block mask holds causality too (is_causal=False): its blocks below the
            # diagonal and inside the window are then full and run unmasked. With causality
            # left to the kernel, every listed block ran the elementwise causal mask (the
            # kernel applies is_causal on top of full blocks): 2.14 ms per layer on the H100
            # for a Mistral-shaped 8k prefill, against 3.23 for cuDNN with the dense mask.
            out = attention(query, key, value, dropout_p=dropout, is_causal=False,
                            scale=scaling, enable_gqa=query.shape[1] != key.shape[1],
                            block_mask=sliding_block_mask(query.shape[2], int(window),
                                                          query.device))
        return out.transpose(1, 2).contiguous(), None
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


_CHECKED: dict[tuple[object, ...], bool] = {}


def is_sliding_causal(mask: torch.Tensor, window: int) -> bool:
    """Whether ``mask`` (B, 1, L, S) is the causal sliding window itself: L == S (no cached
    prefix), every batch row alike (no padding), key j visible to query i iff
    i - window < j <= i (transformers' rule). Remembered per tensor and version."""
    if mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[-1] != mask.shape[-2]:
        return False
    key = (mask.data_ptr(), mask._version, tuple(mask.shape), tuple(mask.stride()), window,
           mask.device)
    hit = _CHECKED.get(key)
    if hit is None:
        n = mask.shape[-1]
        rows = torch.arange(n, device=mask.device)[:, None]
        cols = torch.arange(n, device=mask.device)[None, :]
        expected = (cols <= rows) & (cols > rows - window)
        hit = bool(torch.equal(mask, expected.expand_as(mask)))
        if len(_CHECKED) > 64:  # a few masks per forward; the tensors of old ones are gone
            _CHECKED.clear()
        _CHECKED[key] = hit
    return hit


@lru_cache(maxsize=16)
def sliding_block_mask(seqlen: int, window: int, device: torch.device) -> BlockMask:
    """The causal sliding window of ``window`` keys (transformers' rule: query i sees key j
    iff i - window < j <= i) as a block mask: the diagonal and window-edge blocks partial,
    the blocks between them full.

    Built as the named pattern ``sliding_causal:<window>`` with the sweeps' block size, so it
    carries ``BlockMask.pattern`` and is the very mask a sweep of that problem timed: the
    dispatcher then prices the call (ours against FlexAttention) by those measurements, and
    runs ours where none are stored."""
    return pattern_block_mask(f"sliding_causal:{window}", seqlen, seqlen, device=device)


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
