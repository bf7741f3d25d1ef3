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
nothing). A query that sees no key gets zeros, as in FlashAttention. ``softcap`` caps the
scaled scores (``softcap * tanh(s / softcap)``, Gemma 2; as flash_attn_varlen_func's).

How it runs: the documents become one block mask over the (total_q, total_k) scores (full
blocks inside a document, partial ones where a document starts or ends or the causal diagonal
runs, nothing between documents), built once per cu_seqlens and kept in a small LRU, so a
model's layers share one. The call is then ``tuner.attention`` on a (1, H, total, D) view with
that mask: the dispatcher runs our block-sparse kernels or compiled FlexAttention, as measured
on the mask's named problem (``documents[_causal]:<L>``, ``templates.masks.patterns``). Forward
and backward (the view and the mask are differentiable through ``tuner.attention``).
"""

from __future__ import annotations

import functools
import math
import weakref

import torch

from templates.kernel_common import check_softcap
from templates.masks.documents import clear_document_masks, document_block_mask
from templates.pytorch.eager import eager_attention
from templates.pytorch.sdpa import TORCH_SDPA_FUNCTION
from tuner.attention import attention

__all__ = ["clear_document_masks", "document_block_mask", "varlen_attention",
           "varlen_attention_reference"]


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int,
                     max_seqlen_k: int, causal: bool = False, scale: float | None = None,
                     softcap: float | None = None) -> torch.Tensor:
    """Attention within each packed document (module docstring): (total_q, H_q, D_v) out."""
    _check_tensors(q, k, v)
    check_softcap(softcap)
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
                    enable_gqa=q.shape[1] != k.shape[1], block_mask=mask, softcap=softcap)
    # Contiguous, as FlashAttention returns it (callers .view() it): free for our kernels,
    # whose output already has q's packed layout; a copy where Flex answered (1, H, T, D).
    # squeeze, not out[0]: the gradient of a select is a zeroed (1, H, T, D) tensor and a
    # strided copy into it, which also left the gradient reaching the kernels in (H, T, D)
    # order (torch's varlen backward then copied it again); of a squeeze, a view (H200, 16k
    # tokens, 32 heads: 0.21 ms a training step, 0.38 ms through torch's varlen).
    return out.squeeze(0).transpose(0, 1).contiguous()


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


# The checked offsets of the cu_seqlens tensors seen lately, by identity: a model's layers
# (and every step of a loop over one batch) pass the same tensor, and reading it is a
# device-to-host copy that waits for the GPU, which leaves the GPU idle while Python dispatches
# the call. An entry holds its tensor weakly and its version counter, so a tensor changed in
# place or freed (its address reused by another) is read again, never answered from here.
_OFFSETS_KEPT = 64
_offsets_seen: dict[int, tuple[weakref.ref[torch.Tensor], int, tuple[int, ...]]] = {}


def _offsets(name: str, cu: torch.Tensor, total: int, device: torch.device) -> tuple[int, ...]:
    """The offsets in ``cu`` (one device-to-host copy the first time this tensor is seen),
    checked against FlashAttention's rules; the error names the argument, the index and the
    rule."""
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
    seen = _offsets_seen.get(id(cu))
    if seen is not None and seen[0]() is cu and seen[1] == cu._version:
        offsets = seen[2]
    else:
        offsets = tuple(int(x) for x in cu.tolist())
        _check_offsets(name, offsets)
        _remember_offsets(cu, offsets)
    if offsets[-1] != total:
        raise ValueError(f"{name}[-1] must be the total number of tokens {total}, but is "
                         f"{offsets[-1]} (nothing is truncated: pass the offsets of every "
                         f"packed token)")
    return offsets


def _check_offsets(name: str, offsets: tuple[int, ...]) -> None:
    if offsets[0] != 0:
        raise ValueError(f"{name}[0] must be 0, but is {offsets[0]}")
    for i in range(1, len(offsets)):
        if offsets[i] < offsets[i - 1]:
            raise ValueError(f"{name} must not decrease, but {name}[{i}] = {offsets[i]} < "
                             f"{name}[{i - 1}] = {offsets[i - 1]}")


def _remember_offsets(cu: torch.Tensor, offsets: tuple[int, ...]) -> None:
    if cu.requires_grad or torch.compiler.is_compiling():
        return  # (no integer tensor needs a gradient; a traced call reads a fake tensor)
    key = id(cu)
    while len(_offsets_seen) >= _OFFSETS_KEPT:
        _offsets_seen.pop(next(iter(_offsets_seen)))
    _offsets_seen[key] = (weakref.ref(cu, functools.partial(_forget, key)), cu._version,
                          offsets)


def _forget(key: int, _: object) -> None:
    _offsets_seen.pop(key, None)


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
                               upcast: bool = True, softcap: float | None = None
                               ) -> torch.Tensor:
    """The same attention as a loop of torch SDPA calls, one per document (eager attention
    where ``softcap`` caps the scores: SDPA cannot), for tests and benchmarks; differentiable.
    ``upcast``: computed in float32, returned in q's dtype. Queries that see no key get zeros
    (SDPA itself would give NaN for them)."""
    cap = check_softcap(softcap)
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
        if cap:
            out = eager_attention(qd[:, blind:], kd, vd, attn_mask=mask, scale=scale,
                                  softcap=cap)
        else:
            out = TORCH_SDPA_FUNCTION(
                qd[:, blind:], kd, vd, attn_mask=mask, scale=scale, enable_gqa=gqa)
        out = out.transpose(0, 1).to(q.dtype)
        if blind:
            out = torch.cat([out.new_zeros(blind, *out.shape[1:]), out])
        pieces.append(out)
    return torch.cat(pieces)
