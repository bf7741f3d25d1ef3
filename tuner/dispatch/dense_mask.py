"""What a dense ``attn_mask`` is, when it is exactly one of the structures our block masks
serve: causal (top-left, N_q == N_kv), a causal sliding window, or block-diagonal documents
(causal within each, or not). Then the call can run as ``is_causal=True`` or with the named
block mask (``sliding_causal:<w>``, ``documents[_causal]:<L>``), priced like any problem;
anything else is None and runs as given.

Cost, and why it is safe: a mask that is none of these is usually refused after reading 8
sampled rows (O(8 x N_kv)); otherwise one vectorized pass over the mask (three row reductions:
first and last visible key and the count, so that every row is an interval) and a
comparison of those O(N_q) numbers with the structure: exact, with one device-to-host read.
The pass reads the mask once, as SDPA itself would (at 16k, 256 MB of bools: ~0.1 ms of an
H200's bandwidth against SDPA's 14 ms with that mask, issue 43), and its answer is kept per
mask tensor (the object and its version), so a mask shared by a model's layers is read
once per forward. Additive masks count as masks only when every entry is 0 or -inf (or the
dtype's lowest value, as transformers writes them); any other bias (ALiBi, ...) is None.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from templates.masks.block_mask import BlockMask
from templates.masks.documents import document_block_mask
from templates.masks.mods import pattern_block_mask

__all__ = ["Recognized", "recognize_mask"]

SAMPLED_ROWS = 8
_SEEN: dict[int, tuple[weakref.ref[torch.Tensor], int, Recognized | None]] = {}
_MAX_SEEN = 64  # a few masks per forward; the tensors of old ones are gone


@dataclass(frozen=True)
class Recognized:
    """How to run a recognized mask: ``is_causal`` (or, with neither, unmasked) with no mask,
    or ``block_mask``."""

    is_causal: bool
    block_mask: BlockMask | None
    name: str  # "causal", "dense", or the block mask's pattern


def recognize_mask(mask: torch.Tensor, seqlen_q: int, seqlen_kv: int) -> Recognized | None:
    """``mask`` (broadcastable to (B, H, N_q, N_kv), bool True = attend, or additive) as one
    of the structures above, else None (module docstring)."""
    if not isinstance(mask, torch.Tensor) or mask.dim() < 2 or tuple(mask.shape[-2:]) != (
            seqlen_q, seqlen_kv) or seqlen_q != seqlen_kv or seqlen_q < 2:
        return None
    # Kept per tensor object (a weak reference: a pointer can be reused by the next mask
    # allocated, with the same shape and version) and its version (an in-place change).
    seen = _SEEN.get(id(mask))
    if seen is not None and seen[0]() is mask and seen[1] == mask._version:
        return seen[2]
    # Leading dims broadcast (size 1 or stride 0, as ``expand`` makes them) are one mask:
    # read one of them, never a materialized (B, H, N, N) copy.
    one = mask
    while one.dim() > 2 and (one.shape[0] == 1 or one.stride(0) == 0):
        one = one[0]
    found = _recognize(one)
    if len(_SEEN) >= _MAX_SEEN:
        _SEEN.clear()
    _SEEN[id(mask)] = (weakref.ref(mask), mask._version, found)
    return found


def _visible(mask: torch.Tensor) -> torch.Tensor | None:
    """The bool mask of a bool or additive mask (None: an additive mask with a bias)."""
    if mask.dtype == torch.bool:
        return mask
    if not mask.dtype.is_floating_point:
        return None
    hidden = (mask == float("-inf")) | (mask <= torch.finfo(mask.dtype).min / 2)
    if not bool(((mask == 0) | hidden).all()):
        return None
    return mask == 0


def _row_intervals(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(first visible key, last visible key, whether the visible keys are that interval and
    not empty) per row of ``rows`` (..., N_kv)."""
    n = rows.shape[-1]
    count = rows.sum(-1)
    first = rows.int().argmax(-1)
    last = n - 1 - rows.flip(-1).int().argmax(-1)
    return first, last, (count > 0) & (count == last - first + 1)


def _recognize(mask: torch.Tensor) -> Recognized | None:
    n = mask.shape[-1]
    flat = mask.reshape(-1, n, n)
    picks = torch.linspace(0, n - 1, SAMPLED_ROWS, device=mask.device).long()
    sample = _visible(flat[0, picks])
    if sample is None or not bool(_row_intervals(sample)[2].all()):
        return None
    visible = _visible(flat)
    if visible is None:
        return None
    first, last, interval = _row_intervals(visible)
    if not bool(interval.all()) or not bool(((first == first[:1]) & (last == last[:1])).all()):
        return None  # not intervals, or rows differ between batches or heads
    lo, hi = first[0], last[0]
    i = torch.arange(n, device=mask.device)
    causal = bool((hi == i).all())
    if causal:
        if bool((lo == 0).all()):
            return Recognized(True, None, "causal")
        width = n - int(lo[-1])  # the last row's window: i - w < j <= i
        if bool((lo == (i - width + 1).clamp(min=0)).all()):
            pattern = f"sliding_causal:{width}"
            return Recognized(False, pattern_block_mask(pattern, n, n, device=mask.device),
                              pattern)
    offsets = _documents(lo, hi, causal)
    if offsets is None:
        return None
    if offsets == [0, n] and not causal:
        return Recognized(False, None, "dense")  # every key visible: no mask at all
    block_mask = document_block_mask(offsets, offsets, causal=causal, device=mask.device)
    return Recognized(False, block_mask, block_mask.pattern or "documents")


def _documents(lo: torch.Tensor, hi: torch.Tensor, causal: bool) -> list[int] | None:
    """The offsets of the documents whose block-diagonal mask (causal or not) has these row
    intervals, or None: each row starts at its document's start (the last row at or before
    it that starts itself) and ends at its own position (causal) or at its document's end
    (the row before the next start)."""
    n = lo.numel()
    i = torch.arange(n, device=lo.device)
    starts = lo == i
    doc_start = torch.cummax(torch.where(starts, i, 0), 0).values
    at_or_after = torch.where(starts, i, n).flip(0).cummin(0).values.flip(0)
    next_start = torch.cat([at_or_after[1:], at_or_after.new_tensor([n])])
    end = i if causal else next_start - 1
    if not bool(((lo == doc_start) & (hi == end)).all()):
        return None
    return [*starts.nonzero().flatten().tolist(), n]
