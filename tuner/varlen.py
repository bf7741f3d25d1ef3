"""``tuner.varlen_attention``: packed variable-length sequences, as FlashAttention's
``flash_attn_varlen_func`` takes them.

    out = tuner.varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                 max_seqlen_k, causal=True)

q (total_q, H_q, D), k and v (total_k, H_kv, D) hold the documents one after another;
``cu_seqlens_*`` (n_docs + 1,) int32/int64 are their offsets (0 first, the total last; a
document may be empty). Query tokens of document d see only the keys of document d, and with
``causal`` only those at or before them, aligned bottom-right as FlashAttention aligns them
when a document's query and key lengths differ: query i of a document of L_q queries and L_k
keys sees key j iff j <= i + L_k - L_q (so with L_q > L_k the first L_q - L_k queries see
nothing). A query that sees no key gets zeros, as in FlashAttention.

How it runs: the documents become one block mask over the (total_q, total_k) scores (full
blocks inside a document, partial ones where a document starts or ends or the causal diagonal
runs, nothing between documents), built once per cu_seqlens and kept in a small LRU, so a
model's layers share one. The call is then ``tuner.attention`` on a (1, H, total, D) view with
that mask: the dispatcher runs our block-sparse kernels or compiled FlexAttention, as measured
on the mask's named problem (``documents[_causal]:<L>``, ``templates.mask_patterns``). Forward
and backward (the view and the mask are differentiable through ``tuner.attention``).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence

import torch

from templates.block_mask import DEFAULT_BLOCK_SIZE, EMPTY, EVALUATE, FULL, BlockMask, MaskMod
from templates.mask_patterns import documents_pattern
from tuner.attention import attention

__all__ = ["clear_document_masks", "document_block_mask", "varlen_attention",
           "varlen_attention_reference"]

# Masks kept per (cu_seqlens_q, cu_seqlens_k, causal, block size, device). A model's layers
# share one per step; padding-free training changes the documents every step, so only the
# last few are worth keeping (each holds O(total x block) bytes of partial tiles).
MAX_CACHED_MASKS = 8
_MASKS: OrderedDict[tuple[object, ...], BlockMask] = OrderedDict()


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int,
                     max_seqlen_k: int, causal: bool = False, scale: float | None = None
                     ) -> torch.Tensor:
    """Attention within each packed document (module docstring): (total_q, H_q, D_v) out."""
    _check_tensors(q, k, v)
    offsets_q = _offsets("cu_seqlens_q", cu_seqlens_q, q.shape[0], q.device)
    offsets_k = _offsets("cu_seqlens_k", cu_seqlens_k, k.shape[0], q.device)
    if len(offsets_q) != len(offsets_k):
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must describe the same documents, but "
                         f"have {len(offsets_q)} and {len(offsets_k)} entries")
    _check_max_seqlen("max_seqlen_q", max_seqlen_q, offsets_q)
    _check_max_seqlen("max_seqlen_k", max_seqlen_k, offsets_k)
    mask = document_block_mask(offsets_q, offsets_k, causal=bool(causal), device=q.device)
    # (total, H, D) -> (1, H, total, D): a view; the kernels read this layout as it is.
    out = attention(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
                    v.transpose(0, 1).unsqueeze(0), scale=scale,
                    enable_gqa=q.shape[1] != k.shape[1], block_mask=mask)
    # Contiguous, as FlashAttention returns it (callers .view() it): free for our kernels,
    # whose output already has q's packed layout; a copy where Flex answered (1, H, T, D).
    return out[0].transpose(0, 1).contiguous()


def document_block_mask(offsets_q: Sequence[int], offsets_k: Sequence[int], *, causal: bool,
                        device: torch.device | str,
                        block_size: int | tuple[int, int] = DEFAULT_BLOCK_SIZE) -> BlockMask:
    """The (1, 1, total_q, total_k) block mask of packed documents with these offsets (the
    contents of cu_seqlens), causal per document bottom-right; from the LRU when the same
    documents were asked for lately. Carries ``documents[_causal]:<L>``
    (``documents_pattern``) when queries and keys share their offsets (self-attention; the
    sweeps' masks are square) and the block size is the sweeps'; else no pattern (ours run)."""
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
                                      (qb, kb), pattern=pattern)


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
def _check_tensors(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, but got {type(t).__name__}")
        if t.dim() != 3:
            raise ValueError(f"{name} must be (total_tokens, heads, head_dim), packed as "
                             f"flash_attn_varlen_func takes it, but has shape {tuple(t.shape)}")
    if k.shape[:2] != v.shape[:2]:
        raise ValueError(f"k and v must have the same tokens and heads, but got shapes "
                         f"{tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"the query heads ({q.shape[1]}) must be a multiple of the key/value "
                         f"heads ({k.shape[1]})")
    if q.shape[0] == 0 or k.shape[0] == 0:
        raise ValueError(f"q and k must hold at least one token, but got shapes "
                         f"{tuple(q.shape)} and {tuple(k.shape)}")


def _offsets(name: str, cu: torch.Tensor, total: int, device: torch.device) -> tuple[int, ...]:
    """The offsets in ``cu`` (one device-to-host copy), checked against FlashAttention's
    rules; the error names the argument, the index and the rule."""
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, but got {type(cu).__name__}")
    if cu.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be int32 or int64, but got {cu.dtype}")
    if cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(f"{name} must be 1-D with n_docs + 1 >= 2 entries, but has shape "
                         f"{tuple(cu.shape)}")
    if cu.device != device:
        raise ValueError(f"{name} must be on the inputs' device {device}, but is on "
                         f"{cu.device}")
    offsets = tuple(int(x) for x in cu.tolist())
    if offsets[0] != 0:
        raise ValueError(f"{name}[0] must be 0, but is {offsets[0]}")
    for i in range(1, len(offsets)):
        if offsets[i] < offsets[i - 1]:
            raise ValueError(f"{name} must not decrease, but {name}[{i}] = {offsets[i]} < "
                             f"{name}[{i - 1}] = {offsets[i - 1]}")
    if offsets[-1] != total:
        raise ValueError(f"{name}[-1] must be the total number of tokens {total}, but is "
                         f"{offsets[-1]} (nothing is truncated: pass the offsets of every "
                         f"packed token)")
    return offsets


def _check_max_seqlen(name: str, max_seqlen: int, offsets: tuple[int, ...]) -> None:
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int):
        raise TypeError(f"{name} must be an int, but got {type(max_seqlen).__name__}")
    lengths = [b - a for a, b in zip(offsets[:-1], offsets[1:], strict=True)]
    longest = max(lengths)
    if max_seqlen < longest:
        doc = lengths.index(longest)
        raise ValueError(f"{name} ({max_seqlen}) must be at least every document's length, but "
                         f"document {doc} has {longest} tokens")


# ----------------------------------------------------------------------------- reference
def varlen_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                               causal: bool = False, scale: float | None = None,
                               upcast: bool = True) -> torch.Tensor:
    """The same attention as a loop of torch SDPA calls, one per document (for tests and
    benchmarks; differentiable). ``upcast``: computed in float32, returned in q's dtype.
    Queries that see no key get zeros (SDPA itself would give NaN for them)."""
    offsets_q = [int(x) for x in cu_seqlens_q.tolist()]
    offsets_k = [int(x) for x in cu_seqlens_k.tolist()]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    work = torch.float32 if upcast else q.dtype
    gqa = q.shape[1] != k.shape[1]
    pieces = []
    for (a_q, b_q), (a_k, b_k) in zip(zip(offsets_q[:-1], offsets_q[1:], strict=True),
                                      zip(offsets_k[:-1], offsets_k[1:], strict=True),
                                      strict=True):
        n_q, n_k = b_q - a_q, b_k - a_k
        if n_q == 0:
            continue
        qd, kd, vd = (t.transpose(0, 1).to(work) for t in (q[a_q:b_q], k[a_k:b_k], v[a_k:b_k]))
        blind = n_q - n_k if causal else 0  # leading queries that see no key
        if n_k == 0 or blind >= n_q:
            pieces.append(q.new_zeros(n_q, q.shape[1], v.shape[2]))
            continue
        blind = max(blind, 0)
        rows = torch.arange(n_q - blind, device=q.device)[:, None] + blind
        cols = torch.arange(n_k, device=q.device)[None, :]
        mask = cols <= rows + n_k - n_q if causal else None
        out = torch.nn.functional.scaled_dot_product_attention(
            qd[:, blind:], kd, vd, attn_mask=mask, scale=scale, enable_gqa=gqa)
        out = out.transpose(0, 1).to(q.dtype)
        if blind:
            out = torch.cat([out.new_zeros(blind, *out.shape[1:]), out])
        pieces.append(out)
    return torch.cat(pieces)
