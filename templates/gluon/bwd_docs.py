"""The Gluon backward's view of a mask of causal packed documents (``gluon_bwd``'s
``doc_offsets``): per query row, the first key of its document, so that a partial block's
visibility is computed (key j visible to query i iff first[i] <= j <= i) instead of read
from its uint8 tile, a byte per (key, query) loaded every step.

Only self-attention documents qualify (``BlockMask.documents`` causal, queries and keys at the
same offsets): that rule is then the whole mask. Any other mask keeps its tiles.
"""

from __future__ import annotations

from typing import Any

import torch

from templates.compile.plan_cache import PlanCache

__all__ = ["PAST_EVERY_KEY", "row_first_keys", "takes_offsets"]

# A padded row's "first key": past every key, so it sees none (its gradients add nothing).
PAST_EVERY_KEY = 2**30
_FIRST_KEYS: PlanCache[torch.Tensor] = PlanCache(maxsize=16)


def takes_offsets(block_mask: Any) -> bool:
    """Whether ``block_mask`` is exactly causal self-attention documents (its
    ``documents`` say so)."""
    docs = getattr(block_mask, "documents", None)
    return docs is not None and docs.causal and docs.offsets_q == docs.offsets_k


def row_first_keys(block_mask: Any, rows: int) -> torch.Tensor:
    """int32 (rows,) on the mask's device: each query row's document's first key, rows past
    the mask's queries ``PAST_EVERY_KEY``. Kept per documents, length and device (a training
    step passes one mask to every layer's backward). Made from the offsets on the host and
    copied to the device: a CUDA graph's capture must find it made by an eager call first."""
    if not takes_offsets(block_mask):
        raise ValueError("row_first_keys needs a mask of causal self-attention documents "
                         "(BlockMask.documents with equal query and key offsets)")
    offsets = block_mask.documents.offsets_q
    device = torch.device(block_mask.device)
    key = (offsets, rows, device)
    found = _FIRST_KEYS.get(key)
    if found is not None:
        return found
    bounds = torch.tensor(offsets, dtype=torch.int64)
    lengths = bounds[1:] - bounds[:-1]
    first = torch.full((rows,), PAST_EVERY_KEY, dtype=torch.int32)
    n = int(bounds[-1])
    first[:n] = torch.repeat_interleave(bounds[:-1], lengths).to(torch.int32)
    first = first.to(device)
    _FIRST_KEYS.put(key, first)
    return first
