"""Hugging Face transformers integration: ``attn_implementation="tuner"``.

    import tuner.hf
    tuner.hf.register_transformers()
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="tuner")

Registers ``tuner.attention`` in transformers' ``AttentionInterface`` under ``name``, and a
mask function of its own in ``AttentionMaskInterface``: for a prefill or a training step
without padding, it reads transformers' mask rule (causal, sliding window, chunked, packed
documents from ``position_ids``) and builds its ``BlockMask`` directly (``tuner.dispatch.hf_mask``),
once per forward (transformers asks once per mask type and shares the answer among the
layers), kept per segment layout and shape; no L x L mask is made. Plain causal attention gets
no mask (the dispatcher's causal path). The masks carry their named problem
(``sliding_causal:<w>``, ``documents_causal:<L>``), so the dispatcher runs ours or Flex for
them as measured. Packed rows that come with the collator's ``cu_seq_lens_q/k`` kwargs
(``DataCollatorWithFlattening``) run ``tuner.varlen_attention`` on those offsets.

Softcapped scores (Gemma 2's ``attn_logit_softcapping``, passed as ``softcap``) go to
``tuner.attention(..., softcap=...)`` on every path: ours or eager attention, as measured
(transformers itself runs eager attention for them: SDPA cannot cap scores).

Everything else (padded batches, prefills continuing a KV cache, decoding, custom
``or_mask_function`` / ``and_mask_function`` rules) gets transformers' "sdpa" mask as before: no
mask, or a boolean (B, 1, L, S) mask, causality included, which the kernel reads tile by tile
as SDPA's ``attn_mask``. Query rows that see no key (left padding) give zeros. A dense mask
that is exactly the causal sliding window (``is_sliding_causal``), causal, or block-diagonal
documents (``tuner.dispatch.dense_mask``) runs as is_causal or a block mask (checked once per mask
tensor).
"""

from __future__ import annotations

import weakref
from functools import lru_cache
from typing import Any

import torch

from templates.masks.block_mask import BlockMask
from templates.masks.mods import pattern_block_mask
from tuner.attention import attention
from tuner.dispatch.dense_mask import recognize_mask
from tuner.dispatch.hf_mask import CAUSAL, rule_block_mask
from tuner.varlen import varlen_attention

DEFAULT_NAME = "tuner"


def tuner_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                            value: torch.Tensor, attention_mask: torch.Tensor | None,
                            dropout: float = 0.0, scaling: float | None = None,
                            is_causal: bool | None = None, **kwargs: Any
                            ) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: (B, H, L, D) in, (B, L, H, D) out."""
    gqa = query.shape[1] != key.shape[1]
    # Gemma 2's attn_logit_softcapping (None elsewhere): every call below caps its scores;
    # packed offsets then take the block-mask path (varlen attention takes no cap).
    softcap = kwargs.get("softcap")
    if _packed_offsets(query, key, kwargs) and dropout == 0.0 and not softcap:
        # squeeze, not [0]: the gradient of a select is a zeroed input-sized tensor and a
        # copy into it, of a squeeze a view.
        out = varlen_attention(query.squeeze(0).transpose(0, 1), key.squeeze(0).transpose(0, 1),
                               value.squeeze(0).transpose(0, 1), kwargs["cu_seq_lens_q"],
                               kwargs["cu_seq_lens_k"], int(kwargs["max_length_q"]),
                               int(kwargs["max_length_k"]),
                               causal=bool(getattr(module, "is_causal", True)
                                           if is_causal is None else is_causal),
                               scale=scaling)
        return out.unsqueeze(0).contiguous(), None
    if isinstance(attention_mask, BlockMask) and dropout:
        # The block-mask kernels have no dropout: SDPA with the mask made dense, as before.
        attention_mask = attention_mask.to_dense()
    if isinstance(attention_mask, BlockMask):  # from tuner_mask: causality included
        out = attention(query, key, value, dropout_p=dropout, is_causal=False, scale=scaling,
                        enable_gqa=gqa, block_mask=attention_mask, softcap=softcap)
        return out.transpose(1, 2).contiguous(), None
    window = kwargs.get("sliding_window")
    # A window of 0 or less hides every key: no pattern names it, so it stays a dense mask.
    if (window and int(window) > 0 and isinstance(attention_mask, torch.Tensor)
            and is_sliding_causal(attention_mask, int(window))):
        # A window as long as the sequence is plain causal attention: the dispatcher's
        # (measured) choice, e.g. cuDNN's causal kernel, without any mask.
        if window >= query.shape[2]:
            out = attention(query, key, value, dropout_p=dropout, is_causal=True,
                            scale=scaling, enable_gqa=gqa, softcap=softcap)
        else:
            # The block mask holds causality too (is_causal=False): its blocks below the
            # diagonal and inside the window are then full and run unmasked. With causality
            # left to the kernel, every listed block ran the elementwise causal mask (the
            # kernel applies is_causal on top of full blocks): 2.14 ms per layer on the H100
            # for a Mistral-shaped 8k prefill, against 3.23 for cuDNN with the dense mask.
            out = attention(query, key, value, dropout_p=dropout, is_causal=False,
                            scale=scaling, enable_gqa=gqa,
                            block_mask=sliding_block_mask(query.shape[2], int(window),
                                                          query.device), softcap=softcap)
        return out.transpose(1, 2).contiguous(), None
    if isinstance(attention_mask, torch.Tensor) and not dropout:
        # A dense mask from transformers' fallback (e.g. a custom mask rule) that is exactly
        # causal, a window or documents: its block mask (tuner.dispatch.dense_mask; read once per
        # mask tensor, refused after 8 sampled rows for left padding).
        found = recognize_mask(attention_mask, query.shape[2], key.shape[2])
        if found is not None:
            out = attention(query, key, value, is_causal=found.is_causal, scale=scaling,
                            enable_gqa=gqa, block_mask=found.block_mask, softcap=softcap)
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
                    is_causal=causal, scale=scaling, enable_gqa=gqa, softcap=softcap)
    return out.transpose(1, 2).contiguous(), None


def _packed_offsets(query: torch.Tensor, key: torch.Tensor, kwargs: dict[str, Any]) -> bool:
    """Whether the call comes with the collator's packed-sequence offsets for its one row
    (``cu_seq_lens_q/k``, ``max_length_q/k``) and a self-attention layer without a window."""
    names = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
    return (all(kwargs.get(n) is not None for n in names) and query.shape[0] == 1
            and query.shape[2] == key.shape[2] and not kwargs.get("sliding_window"))


def tuner_mask(batch_size: int, q_length: int, kv_length: int, q_offset: Any = 0,
               kv_offset: Any = 0, mask_function: Any = None,
               attention_mask: torch.Tensor | None = None, local_size: int | None = None,
               allow_is_causal_skip: bool = True, use_vmap: bool = False,
               device: torch.device | str = "cpu", **kwargs: Any) -> object:
    """transformers' mask-function signature (``sdpa_mask``'s): a ``BlockMask`` built from
    ``mask_function`` for a prefill or training step without padding, None for plain causal
    attention, else transformers' own "sdpa" mask (module docstring)."""
    from transformers.masking_utils import sdpa_mask  # transformers is an optional dependency

    eligible = (mask_function is not None and not use_vmap and q_length == kv_length > 1
                and isinstance(q_offset, int) and isinstance(kv_offset, int)
                and q_offset == 0 and kv_offset == 0
                and (attention_mask is None or (attention_mask.shape[-1] == kv_length
                                                and bool(attention_mask.all()))))
    if eligible:
        found = rule_block_mask(mask_function, batch_size, q_length, local_size, device)
        if found is CAUSAL and allow_is_causal_skip:
            return None
        if isinstance(found, BlockMask):
            return found
    return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length,
                     q_offset=q_offset, kv_offset=kv_offset, mask_function=mask_function,
                     attention_mask=attention_mask, local_size=local_size,
                     allow_is_causal_skip=allow_is_causal_skip, use_vmap=use_vmap,
                     device=device, **kwargs)


_CHECKED: dict[tuple[int, int], tuple[weakref.ref[torch.Tensor], int, bool]] = {}


def is_sliding_causal(mask: torch.Tensor, window: int) -> bool:
    """Whether ``mask`` (B, 1, L, S) is the causal sliding window itself: L == S (no cached
    prefix), every batch row alike (no padding), key j visible to query i iff
    i - window < j <= i (transformers' rule). Remembered per tensor and version."""
    if mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[-1] != mask.shape[-2]:
        return False
    # Per tensor object (weakly: the next forward's mask may be allocated at the same
    # address, with the same shape and version, and be another mask) and version.
    seen = _CHECKED.get((id(mask), window))
    if seen is not None and seen[0]() is mask and seen[1] == mask._version:
        return seen[2]
    n = mask.shape[-1]
    rows = torch.arange(n, device=mask.device)[:, None]
    cols = torch.arange(n, device=mask.device)[None, :]
    expected = (cols <= rows) & (cols > rows - window)
    hit = bool(torch.equal(mask, expected.expand_as(mask)))
    if len(_CHECKED) > 64:  # a few masks per forward; the tensors of old ones are gone
        _CHECKED.clear()
    _CHECKED[(id(mask), window)] = (weakref.ref(mask), mask._version, hit)
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
    try:  # transformers is an optional dependency
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask  # noqa: F401
    except ImportError as exc:
        raise ImportError(f"register_transformers needs transformers >= 4.54 with "
                          f"AttentionInterface and AttentionMaskInterface ({exc}); "
                          "pip install -U transformers") from exc
    AttentionInterface.register(name, tuner_attention_forward)
    AttentionMaskInterface.register(name, tuner_mask)
    return name
