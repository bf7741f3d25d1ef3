"""A mask whose rows each see one causal range of keys, as the kernels read it: per query row,
its first visible key, so that a partial block's visibility is computed (key j visible to
query i iff first[i] <= j <= i) instead of read from its uint8 tile, a byte per (key, query).

Two kinds of mask are that rule exactly: causal packed documents (``BlockMask.documents``
causal, queries and keys at the same offsets: first[i] is the row's document start) and the
causal sliding window ``sliding_causal:<w>`` over queries and keys alike (``BlockMask.pattern``:
first[i] = max(0, i - w + 1)). Both forwards' ``doc_offsets`` read them (``WithFirstKeys``),
and the Gluon backward's ``doc_offsets`` / ``window_offsets``. Any other mask keeps its tiles.
"""

from __future__ import annotations

from typing import Any

import torch

from templates.compile.plan_cache import PlanCache
from templates.masks.patterns import parse_pattern

__all__ = ["PAST_EVERY_KEY", "WithFirstKeys", "causal_window", "pattern_window",
           "row_first_keys", "rows_take_offsets", "takes_doc_offsets", "takes_offsets",
           "tile_rows"]

# A padded row's "first key": past every key, so it sees none (its gradients add nothing).
PAST_EVERY_KEY = 2**30
_FIRST_KEYS: PlanCache[torch.Tensor] = PlanCache(maxsize=16)


def takes_offsets(block_mask: Any) -> bool:
    """Whether ``block_mask`` is exactly causal self-attention documents (its
    ``documents`` say so)."""
    docs = getattr(block_mask, "documents", None)
    return docs is not None and docs.causal and docs.offsets_q == docs.offsets_k


def causal_window(block_mask: Any) -> int | None:
    """The window w where ``block_mask`` is the named pattern ``sliding_causal:<w>`` over as
    many queries as keys (query i sees keys i - w < j <= i), None otherwise."""
    pattern = getattr(block_mask, "pattern", None)
    if pattern is None:
        return None
    return pattern_window(pattern, block_mask.seqlen_q, block_mask.seqlen_kv)


def pattern_window(pattern: str | None, seqlen_q: int, seqlen_kv: int) -> int | None:
    """``causal_window``'s rule on a pattern's name (a mask's, or a problem's ``mask``)."""
    if pattern is None or seqlen_q != seqlen_kv:
        return None
    name, arg = parse_pattern(pattern)
    return int(arg) if name == "sliding_causal" else None


def row_first_keys(block_mask: Any, rows: int) -> torch.Tensor:
    """int32 (rows,) on the mask's device: each query row's first visible key (its
    document's start, or for a causal window max(0, i - w + 1)), rows past the mask's queries
    ``PAST_EVERY_KEY``. Kept per documents (or window), length and device (a training step
    passes one mask to every layer's backward). Made on the host and copied to the device: a
    CUDA graph's capture must find it made by an eager call first."""
    documents = takes_offsets(block_mask)
    window = None if documents else causal_window(block_mask)
    if not documents and window is None:
        raise ValueError("row_first_keys needs a mask of causal self-attention documents "
                         "(BlockMask.documents with equal query and key offsets) or the "
                         "pattern sliding_causal:<w> over as many queries as keys")
    device = torch.device(block_mask.device)
    key = (("window", window, block_mask.seqlen_q) if window is not None
           else block_mask.documents.offsets_q, rows, device)
    found = _FIRST_KEYS.get(key)
    if found is not None:
        return found
    first = torch.full((rows,), PAST_EVERY_KEY, dtype=torch.int32)
    if window is not None:
        n = block_mask.seqlen_q
        first[:n] = (torch.arange(n) - (window - 1)).clamp_(min=0).to(torch.int32)
    else:
        bounds = torch.tensor(block_mask.documents.offsets_q, dtype=torch.int64)
        lengths = bounds[1:] - bounds[:-1]
        n = int(bounds[-1])
        first[:n] = torch.repeat_interleave(bounds[:-1], lengths).to(torch.int32)
    first = first.to(device)
    _FIRST_KEYS.put(key, first)
    return first


def tile_rows(seqlen_q: int, block_m: int) -> int:
    """How many rows' first keys a forward whose query tiles are ``block_m`` rows reads:
    every row of its tiles, the padding past ``seqlen_q`` included (``PAST_EVERY_KEY``)."""
    return -(-seqlen_q // block_m) * block_m


def takes_doc_offsets(problem: Any) -> bool:
    """Whether ``problem``'s mask pattern has rows that each see one causal range of keys,
    as ``rows_take_offsets`` reads a mask (the forwards' doc_offsets default on for it)."""
    return (parse_pattern(problem.mask)[0] == "documents_causal"
            or pattern_window(problem.mask, problem.seqlen_q, problem.seqlen_kv) is not None)


def rows_take_offsets(block_mask: Any) -> bool:
    """Whether each of ``block_mask``'s rows sees one causal range of keys, first[i] <= j <=
    i: causal self-attention documents (``takes_offsets``) or a causal window."""
    return block_mask is not None and (takes_offsets(block_mask)
                                       or causal_window(block_mask) is not None)


class WithFirstKeys:
    """A block mask as the forwards' doc_offsets kernels read it (``gluon_fwd``,
    ``flash_fwd``): its lists, with its rows' first visible keys (``row_first_keys``,
    ``rows`` of them) where the uint8 tiles go; anything else is the mask's."""

    def __init__(self, block_mask: Any, rows: int) -> None:
        self._mask = block_mask
        self._first = row_first_keys(block_mask, rows)

    def kernel_args(self) -> list[Any]:
        args = list(self._mask.kernel_args())
        args[5] = self._first
        return args

    def __getattr__(self, name: str) -> Any:  # block_size, shape, device: the mask's
        return getattr(self._mask, name)
