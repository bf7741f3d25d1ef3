"""Document block masks: the BlockMask of packed variable-length sequences (FlashAttention's
``cu_seqlens`` offsets), causal per document bottom-right as FlashAttention aligns it, built in
O(blocks) and kept for the few offsets a training step uses. ``tuner.varlen_attention`` runs
packed calls with them; ``tuner.dispatch.dense_mask`` turns a recognized block-diagonal mask into
one. Imports nothing of ``tuner`` (so both can use it without a cycle through ``tuner.attention``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch

from templates.masks.block_mask import DEFAULT_BLOCK_SIZE, EMPTY, EVALUATE, FULL, BlockMask, MaskMod
from templates.masks.document_offsets import DocumentOffsets
from templates.masks.patterns import documents_pattern

__all__ = ["MAX_CACHED_MASKS", "clear_document_masks", "document_block_mask"]

# Masks kept per (cu_seqlens_q, cu_seqlens_k, causal, block size, device). A model's layers
# share one per step; padding-free training changes the documents every step, so only the
# last few are worth keeping (each holds O(total x block) bytes of partial tiles).
MAX_CACHED_MASKS = 8
_MASKS: OrderedDict[tuple[object, ...], BlockMask] = OrderedDict()


def document_block_mask(offsets_q: Sequence[int], offsets_k: Sequence[int], *, causal: bool,
                        device: torch.device | str,
                        block_size: int | tuple[int, int] = DEFAULT_BLOCK_SIZE) -> BlockMask:
    """The (1, 1, total_q, total_k) block mask of packed documents with these offsets (the
    contents of cu_seqlens), causal per document bottom-right; from the LRU when the same
    documents were asked for lately. Carries ``documents[_causal]:<L>``
    (``documents_pattern``) when queries and keys share their offsets (self-attention; the
    sweeps' masks are square) and the block size is the sweeps'; else no pattern (ours run).
    It carries its offsets (``BlockMask.documents``) for implementations that run documents
    by them."""
    device = torch.device(device)
    key = (tuple(offsets_q), tuple(offsets_k), causal, block_size, device)
    mask = _MASKS.get(key)
    if mask is not None:
        _MASKS.move_to_end(key)
        return mask
    mask = _build_document_mask(key[0], key[1], causal, block_size, device)
    _MASKS[key] = mask
    if len(_MASKS) > MAX_CACHED_MASKS:
        _MASKS.popitem(last=False)
    return mask


def clear_document_masks() -> None:
    """Forget the kept document masks."""
    _MASKS.clear()


# ----------------------------------------------------------------------------- the mask
def _build_document_mask(offsets_q: tuple[int, ...], offsets_k: tuple[int, ...], causal: bool,
                         block_size: int | tuple[int, int], device: torch.device) -> BlockMask:
    """Blocks classified from the offsets alone (O(blocks)); only blocks that a document's
    edge or a causal diagonal crosses are evaluated element by element."""
    qb, kb = (block_size, block_size) if isinstance(block_size, int) else block_size
    total_q, total_k = offsets_q[-1], offsets_k[-1]
    cu_q = torch.tensor(offsets_q, device=device)
    cu_k = torch.tensor(offsets_k, device=device)
    mask_mod = _document_mask_mod(cu_q, cu_k, causal)
    # Per block: the documents of its first and last real row (query) and column (key).
    first_q = torch.arange(0, total_q, qb, device=device)
    last_q = (first_q + qb - 1).clamp(max=total_q - 1)
    first_k = torch.arange(0, total_k, kb, device=device)
    last_k = (first_k + kb - 1).clamp(max=total_k - 1)
    doc_q_lo, doc_q_hi = _document_of(cu_q, first_q), _document_of(cu_q, last_q)
    doc_k_lo, doc_k_hi = _document_of(cu_k, first_k), _document_of(cu_k, last_k)
    # Documents are in order, so ranges of them that do not overlap share no document.
    apart = (doc_q_hi[:, None] < doc_k_lo[None, :]) | (doc_k_hi[None, :] < doc_q_lo[:, None])
    one_doc = ((doc_q_lo == doc_q_hi)[:, None] & (doc_k_lo == doc_k_hi)[None, :]
               & (doc_q_lo[:, None] == doc_k_lo[None, :]))
    kinds = torch.full(apart.shape, EVALUATE, dtype=torch.int8, device=device)
    kinds[apart] = EMPTY
    if causal:
        # Inside document d, key j is visible to query i iff j - end_k(d) <= i - end_q(d).
        doc = doc_q_lo[:, None].expand_as(one_doc)
        shift = (cu_k[1:][doc] - cu_q[1:][doc])  # end_k(d) - end_q(d)
        below = last_k[None, :] <= first_q[:, None] + shift
        above = first_k[None, :] > last_q[:, None] + shift
        kinds[one_doc & below] = FULL
        kinds[one_doc & above] = EMPTY
    else:
        kinds[one_doc] = FULL
    lengths = [b - a for a, b in zip(offsets_q[:-1], offsets_q[1:], strict=True)]
    pattern = (documents_pattern(lengths, causal=causal)
               if offsets_q == offsets_k and (qb, kb) == (DEFAULT_BLOCK_SIZE,) * 2 else None)
    return BlockMask.from_block_kinds(kinds[None, None], mask_mod, total_q, total_k,
                                      (qb, kb), pattern=pattern,
                                      documents=DocumentOffsets(offsets_q, offsets_k, causal))


def _document_of(cu: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The document of each token position (an empty document holds none: with equal
    offsets, the last of them starts the document the position is in)."""
    return torch.searchsorted(cu, positions, right=True) - 1


def _document_mask_mod(cu_q: torch.Tensor, cu_k: torch.Tensor, causal: bool) -> MaskMod:
    def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
                 ) -> torch.Tensor:
        doc_q, doc_k = _document_of(cu_q, q_idx), _document_of(cu_k, kv_idx)
        same = doc_q == doc_k
        if not causal:
            return same
        return same & (kv_idx - cu_k[1:][doc_k] <= q_idx - cu_q[1:][doc_q])

    return mask_mod


# ----------------------------------------------------------------------------- checks
