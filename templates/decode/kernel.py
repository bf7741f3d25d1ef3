"""Flash-decoding kernels and their launcher: split-KV partials, then a logsumexp combine.

The combine is either a second kernel ("separate") or done inside the split kernel by the
last split program of each row tile to finish ("fused"): each program stores its partial,
then counts itself in on an arrival counter, and the one that arrives last merges them all.

This module needs only the standard library, torch and triton: ``standalone_source`` of the
``flash_decode`` template copies it whole into an exported module with a config baked in.
The layouts and semantics are documented in ``templates/decode/template.py``.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

from templates.compile.direct_launch import DirectLaunch, alignment_key, current_stream
from templates.compile.plan_cache import PlanCache
from templates.kernel_common import LN_2, LOG2_E

# ln(2) inside the kernels: a jit function reads a global only as a constexpr.
LN_2_JIT = tl.constexpr(LN_2)

MAX_QUERY_TOKENS = 16  # beyond a few tokens a prefill kernel tiles the queries better
MAX_HEAD_DIM = 256
MAX_ROWS_PER_TILE = 64  # GQA heads x tokens per program before the group is split
# Partial-output elements the combine kernel loads per step: 32 per thread of 4 warps. The
# fused combine keeps to the same 32 per thread, whatever its warps.
COMBINE_TILE_ELEMS = 4096
# The fused merge of a row tile may hold more: it runs once, at the end, when registers are
# free (FUSED_MERGE_TILE_ELEMS per 4 warps; measured on the H100 against 4096: see
# benchmarks/decode_loop.py's note in notes/dispatch_measurements.md).
FUSED_MERGE_TILE_ELEMS = 4096
COMBINE_MODES = ("separate", "fused")
# The K/V loads' L2 eviction policy by the kv_load knob's value. (No ".cg" choice: with
# num_stages >= 2 Triton's cp.async of the K/V tiles is .cg already, in Triton 3.9's sm_90
# PTX; there evict_first becomes an L2::cache_hint with an evict_first policy.)
KV_EVICTION = {"default": "", "evict_first": "evict_first"}
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _attend_kv_tile(acc, l_i, m_i, q, K_head, V_head, BT_row, b, start_n, seqlen, row_limit,
                    qk_scale, stride_k0, stride_kn, stride_kd, stride_v0, stride_vn, stride_vd,
                    stride_btp, offs_n, offs_d, d_ok,
                    MASKED: tl.constexpr, PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr,
                    TILE_IN_PAGE: tl.constexpr, EVEN_D: tl.constexpr,
                    DOT_PRECISION: tl.constexpr, KV_EVICT: tl.constexpr):
    """Fold keys [start_n, start_n + BLOCK_N) into the running (acc, l_i, m_i) (log2 domain).

    MASKED tiles may reach past the sequence or into the causal tail of the new tokens;
    unmasked tiles are wholly visible to every row and skip all masking.
    """
    keys = start_n + offs_n
    n_ok = keys < seqlen
    if PAGED:
        if TILE_IN_PAGE:
            # start_n < seqlen here, so the page is one the sequence uses.
            page = tl.load(BT_row + (start_n // PAGE_SIZE) * stride_btp).to(tl.int64)
            slot = (start_n % PAGE_SIZE + offs_n).to(tl.int64)
        else:
            # The block table is only valid for the pages in use: never read past them.
            if MASKED:
                page = tl.load(BT_row + (keys // PAGE_SIZE) * stride_btp, mask=n_ok, other=0)
            else:
                page = tl.load(BT_row + (keys // PAGE_SIZE) * stride_btp)
            page = page.to(tl.int64)
            slot = (keys % PAGE_SIZE).to(tl.int64)
    else:
        page = b.to(tl.int64)
        slot = keys.to(tl.int64)
    kT_ptrs = K_head + (page * stride_k0 + slot * stride_kn)[None, :] + offs_d[:, None] * stride_kd
    v_ptrs = V_head + (page * stride_v0 + slot * stride_vn)[:, None] + offs_d[None, :] * stride_vd
    if MASKED:
        kT = tl.load(kT_ptrs, mask=n_ok[None, :] & d_ok[:, None], other=0.0,
                     eviction_policy=KV_EVICT)
        v = tl.load(v_ptrs, mask=n_ok[:, None] & d_ok[None, :], other=0.0,
                    eviction_policy=KV_EVICT)
    elif EVEN_D:
        kT = tl.load(kT_ptrs, eviction_policy=KV_EVICT)
        v = tl.load(v_ptrs, eviction_policy=KV_EVICT)
    else:
        kT = tl.load(kT_ptrs, mask=d_ok[:, None], other=0.0, eviction_policy=KV_EVICT)
        v = tl.load(v_ptrs, mask=d_ok[None, :], other=0.0, eviction_policy=KV_EVICT)

    qk = tl.dot(q, kT, input_precision=DOT_PRECISION) * qk_scale
    if MASKED:
        # row_limit <= seqlen, so this also drops the keys past the sequence.
        qk = tl.where(keys[None, :] < row_limit[:, None], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        # A row that has seen no key yet keeps m = -inf; exp2(-inf - -inf) would be NaN.
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_ref = m_new
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(qk - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, l_i, m_new


@triton.jit
def _decode_split_kernel(Q, K, V, SEQLENS, BLOCK_TABLE, Out, LSE, O_PART, LSE_PART, ARRIVALS,
                         qk_scale, heads_kv, group, row_tiles, num_splits,
                         stride_qb, stride_qh, stride_qn, stride_qd,
                         stride_k0, stride_kh, stride_kn, stride_kd,
                         stride_v0, stride_vh, stride_vn, stride_vd,
                         stride_btb, stride_btp, stride_len,
                         N_Q: tl.constexpr, HEAD_DIM: tl.constexpr, SINGLE_SPLIT: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                         PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr,
                         TILE_IN_PAGE: tl.constexpr, DOT_PRECISION: tl.constexpr,
                         KV_EVICT: tl.constexpr, FUSED_COMBINE: tl.constexpr,
                         MERGE_ROWS: tl.constexpr, MERGE_BLOCK_S: tl.constexpr,
                         MERGE_SPLIT_TILE: tl.constexpr):
    """One (sequence, KV head, row tile, split): a partial (o, lse) over the split's chunk.

    With FUSED_COMBINE the last split program of the row tile to finish also merges the
    partials into the output (ARRIVALS: one zeroed int32 per row tile, left at zero again).
    """
    pid = tl.program_id(0)
    split = tl.program_id(1)
    row_tile = pid % row_tiles
    b = (pid // row_tiles) // heads_kv
    kvh = (pid // row_tiles) % heads_kv

    seqlen = tl.load(SEQLENS + b * stride_len)
    # Whole tiles are dealt out evenly: split s takes tiles [s*T/S, (s+1)*T/S) of a sequence
    # of T >= S tiles, and tile s alone of a shorter one, so the splits with keys are always
    # the first min(T, S): the fused combine merges just those. num_splits is a run-time
    # value so that tuning it compiles nothing new.
    kv_tiles = tl.cdiv(seqlen, BLOCK_N)
    working_splits = tl.minimum(kv_tiles, num_splits)
    dealt = kv_tiles >= num_splits
    first_tile = tl.where(dealt, split * kv_tiles // num_splits, tl.minimum(split, kv_tiles))
    last_tile = tl.where(dealt, (split + 1) * kv_tiles // num_splits,
                         tl.minimum(split + 1, kv_tiles))
    start = first_tile * BLOCK_N
    end = tl.minimum(last_tile * BLOCK_N, seqlen)
    # Keys below seqlen - N_Q + 1 are visible to every query token: no mask needed there.
    seen_by_all = seqlen - N_Q + 1
    unmasked_end = start + (tl.maximum(tl.minimum(end, seen_by_all) - start, 0) // BLOCK_N) * BLOCK_N

    rows = row_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    tok = rows % N_Q
    head = kvh * group + rows // N_Q
    row_ok = rows < group * N_Q
    row_limit = seen_by_all + tok
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM

    q_ptrs = (Q + b.to(tl.int64) * stride_qb + head[:, None].to(tl.int64) * stride_qh
              + tok[:, None] * stride_qn + offs_d[None, :] * stride_qd)
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    K_head = K + kvh.to(tl.int64) * stride_kh
    V_head = V + kvh.to(tl.int64) * stride_vh
    BT_row = BLOCK_TABLE + b.to(tl.int64) * stride_btb

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start_n in range(start, unmasked_end, BLOCK_N):
        acc, l_i, m_i = _attend_kv_tile(
            acc, l_i, m_i, q, K_head, V_head, BT_row, b, start_n, seqlen, row_limit, qk_scale,
            stride_k0, stride_kn, stride_kd, stride_v0, stride_vn, stride_vd, stride_btp,
            offs_n, offs_d, d_ok, False, PAGED, PAGE_SIZE, TILE_IN_PAGE, HEAD_DIM == BLOCK_D,
            DOT_PRECISION, KV_EVICT)
    for start_n in range(unmasked_end, end, BLOCK_N):
        acc, l_i, m_i = _attend_kv_tile(
            acc, l_i, m_i, q, K_head, V_head, BT_row, b, start_n, seqlen, row_limit, qk_scale,
            stride_k0, stride_kn, stride_kd, stride_v0, stride_vn, stride_vd, stride_btp,
            offs_n, offs_d, d_ok, True, PAGED, PAGE_SIZE, TILE_IN_PAGE, HEAD_DIM == BLOCK_D,
            DOT_PRECISION, KV_EVICT)

    # Rows that saw no key: o = 0, lse = -inf (their acc is 0 and l is 0).
    seen = l_i > 0
    l_safe = tl.where(seen, l_i, 1.0)
    o = acc / l_safe[:, None]
    lse2 = tl.where(seen, m_i + tl.log2(l_safe), float("-inf"))
    out_row = (b.to(tl.int64) * heads_kv * group + head) * N_Q + tok
    out_mask = row_ok[:, None] & d_ok[None, :]
    out_ptrs = Out + out_row[:, None] * HEAD_DIM + offs_d[None, :]
    part_row = out_row * num_splits + split
    part_ptrs = O_PART + part_row[:, None] * HEAD_DIM + offs_d[None, :]
    if SINGLE_SPLIT:
        tl.store(out_ptrs, o.to(Out.dtype.element_ty), mask=out_mask)
        tl.store(LSE + out_row, lse2 * LN_2_JIT, mask=row_ok)
    elif not FUSED_COMBINE:
        # The combine kernel reads every split's partial, an empty one's (o = 0, lse = -inf)
        # included.
        tl.store(part_ptrs, o, mask=out_mask)
        tl.store(LSE_PART + part_row, lse2, mask=row_ok)
    elif working_splits <= 1:
        # One split or none has keys: split 0 holds the whole answer (o = 0, lse = -inf for
        # an empty sequence) and writes it; no partial, no arrival.
        if split == 0:
            tl.store(out_ptrs, o.to(Out.dtype.element_ty), mask=out_mask)
            tl.store(LSE + out_row, lse2 * LN_2_JIT, mask=row_ok)
    elif split < working_splits:  # the empty splits take no part
        tl.store(part_ptrs, o, mask=out_mask)
        tl.store(LSE_PART + part_row, lse2, mask=row_ok)
        # Every thread's partial stores come before the one thread's release (the atomic of
        # a scalar runs on one thread): the barrier orders them within the program, the
        # release (acq_rel at gpu scope) publishes them to whichever program acquires the
        # counter after it. The interpreter runs programs one at a time, so the CPU tests
        # check which program merges and what, not this ordering.
        tl.debug_barrier()
        arrived = tl.atomic_add(ARRIVALS + pid, 1, sem="acq_rel", scope="gpu")
        if arrived == working_splits - 1:
            # Last to arrive: the others are done with the counter, so a plain store leaves
            # it at zero for the next launch on this stream (stream order makes it visible).
            tl.store(ARRIVALS + pid, 0)
            first_row = row_tile * BLOCK_M
            tile_rows = tl.minimum(group * N_Q - first_row, BLOCK_M)
            tile_out_row = (b.to(tl.int64) * heads_kv + kvh) * group * N_Q + first_row
            # .cg: read the other programs' partials from L2, never from a stale L1 line
            # (L1 is not coherent; an earlier launch may have left one on this SM).
            _merge_rows(O_PART, LSE_PART, Out, LSE, tile_out_row, tile_rows, working_splits,
                        num_splits, HEAD_DIM, BLOCK_D, MERGE_ROWS, MERGE_BLOCK_S,
                        MERGE_SPLIT_TILE, ".cg")


@triton.jit
def _decode_combine_kernel(O_PART, LSE_PART, Out, LSE, num_splits,
                           HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                           BLOCK_S: tl.constexpr, SPLIT_TILE: tl.constexpr):
    """One query row: merge its num_splits partials (the separate combine)."""
    _merge_row(O_PART, LSE_PART, Out, LSE, tl.program_id(0).to(tl.int64), num_splits,
               num_splits, HEAD_DIM, BLOCK_D, BLOCK_S, SPLIT_TILE, "")


@triton.jit
def _merge_row(O_PART, LSE_PART, Out, LSE, row, num_parts, num_splits,
               HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
               SPLIT_TILE: tl.constexpr, LOAD_CACHE: tl.constexpr):
    """Merge the first num_parts partials of output row ``row`` (at row * num_splits + s),
    weighting each by exp(lse_s - lse), into Out and LSE.

    Two passes: every lse at once (BLOCK_S >= num_parts) for the max and the sum, then the
    partial outputs SPLIT_TILE at a time. The second pass's loads depend on nothing of the
    step before, so they overlap. (An online merge, the running max carried from tile to
    tile, was in place when the default b1-32k decode row, 64 splits, went from 70 to 99 us on
    the H100, 2026-11-23.)
    """
    offs_s = tl.arange(0, BLOCK_S)
    lse_all = tl.load(LSE_PART + row * num_splits + offs_s, mask=offs_s < num_parts,
                      other=float("-inf"), cache_modifier=LOAD_CACHE)
    m = tl.max(lse_all, 0)
    m_ref = tl.where(m == float("-inf"), 0.0, m)  # every split empty: keep weights at 0
    total = tl.sum(tl.exp2(lse_all - m_ref), 0)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    offs_t = tl.arange(0, SPLIT_TILE)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for first in range(0, num_parts, SPLIT_TILE):
        s = first + offs_t
        s_ok = s < num_parts
        part = row * num_splits + s
        weight = tl.exp2(tl.load(LSE_PART + part, mask=s_ok, other=float("-inf"),
                                 cache_modifier=LOAD_CACHE) - m_ref)
        o_s = tl.load(O_PART + part[:, None] * HEAD_DIM + offs_d[None, :],
                      mask=s_ok[:, None] & d_ok[None, :], other=0.0, cache_modifier=LOAD_CACHE)
        acc += tl.sum(weight[:, None] * o_s, 0)
    seen = total > 0
    total_safe = tl.where(seen, total, 1.0)
    tl.store(Out + row * HEAD_DIM + offs_d, (acc / total_safe).to(Out.dtype.element_ty),
             mask=d_ok)
    lse = tl.where(seen, (m_ref + tl.log2(total_safe)) * LN_2_JIT, float("-inf"))
    tl.store(LSE + row, lse)


@triton.jit
def _merge_rows(O_PART, LSE_PART, Out, LSE, first_row, n_rows, num_parts, num_splits,
                HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr,
                BLOCK_S: tl.constexpr, SPLIT_TILE: tl.constexpr, LOAD_CACHE: tl.constexpr):
    """``_merge_row`` for the n_rows <= ROWS output rows from ``first_row`` at once (the
    fused combine's row tile): one round of loads for the whole tile, where a row at a time
    waits for its loads from L2 once per row, after every split program has finished (the
    one part of the fused combine that nothing overlaps)."""
    offs_r = tl.arange(0, ROWS)
    r_ok = offs_r < n_rows
    rows = first_row + offs_r
    offs_s = tl.arange(0, BLOCK_S)
    lse_all = tl.load(LSE_PART + rows[:, None] * num_splits + offs_s[None, :],
                      mask=r_ok[:, None] & (offs_s[None, :] < num_parts), other=float("-inf"),
                      cache_modifier=LOAD_CACHE)
    m = tl.max(lse_all, 1)
    m_ref = tl.where(m == float("-inf"), 0.0, m)  # every split empty: keep weights at 0
    total = tl.sum(tl.exp2(lse_all - m_ref[:, None]), 1)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    offs_t = tl.arange(0, SPLIT_TILE)
    acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
    for first in range(0, num_parts, SPLIT_TILE):
        s = first + offs_t
        ok = r_ok[:, None] & (s[None, :] < num_parts)
        part = rows[:, None] * num_splits + s[None, :]
        weight = tl.exp2(tl.load(LSE_PART + part, mask=ok, other=float("-inf"),
                                 cache_modifier=LOAD_CACHE) - m_ref[:, None])
        o_s = tl.load(O_PART + part[:, :, None] * HEAD_DIM + offs_d[None, None, :],
                      mask=ok[:, :, None] & d_ok[None, None, :], other=0.0,
                      cache_modifier=LOAD_CACHE)
        acc += tl.sum(weight[:, :, None] * o_s, 1)
    seen = total > 0
    total_safe = tl.where(seen, total, 1.0)
    tl.store(Out + rows[:, None] * HEAD_DIM + offs_d[None, :],
             (acc / total_safe[:, None]).to(Out.dtype.element_ty),
             mask=r_ok[:, None] & d_ok[None, :])
    lse = tl.where(seen, (m_ref + tl.log2(total_safe)) * LN_2_JIT, float("-inf"))
    tl.store(LSE + rows, lse, mask=r_ok)


def pow2_at_least(n: int, floor: int = 1) -> int:
    return max(floor, 1 << max(0, n - 1).bit_length())


def rows_per_tile(group: int, n_q: int) -> int:
    """BLOCK_M: the GQA group x new tokens, padded to tl.dot's 16 and capped at 64."""
    return min(MAX_ROWS_PER_TILE, pow2_at_least(group * n_q, 16))


class DecodeShape(NamedTuple):
    batch: int
    heads_q: int
    heads_kv: int
    n_q: int
    head_dim: int
    capacity: int  # longest length a sequence may have
    page_size: int  # 0 for a contiguous cache
    num_pages: int  # 0 for a contiguous cache


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def check_decode_inputs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        cache_seqlens: torch.Tensor, block_table: torch.Tensor | None = None,
                        *, check_contents: bool = True) -> DecodeShape:
    """Validate shapes, dtypes and devices (and, with ``check_contents``, the lengths and the
    pages in use, which costs one device-to-host copy). Raises ValueError saying what was
    expected and what was got."""
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache),
                    ("cache_seqlens", cache_seqlens)):
        _require(isinstance(t, torch.Tensor), f"{name} must be a torch.Tensor, but got "
                 f"{type(t).__name__}")
    _require(q.dim() == 4, f"q must be (B, H_q, N_q, D), but got shape {tuple(q.shape)}")
    batch, heads_q, n_q, head_dim = q.shape
    _require(min(q.shape) > 0, f"q must have no empty dimension, but got shape {tuple(q.shape)}")
    _require(q.dtype in _DTYPES, f"q must be float16, bfloat16 or float32, but got {q.dtype}")
    _require(n_q <= MAX_QUERY_TOKENS,
             f"flash_decode takes at most {MAX_QUERY_TOKENS} query tokens per sequence, but got "
             f"N_q={n_q}; use flash_attention_fwd for prefill-sized queries")
    _require(head_dim <= MAX_HEAD_DIM, f"head dim must be at most {MAX_HEAD_DIM}, but got {head_dim}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        _require(t.device == q.device, f"{name} must be on q's device {q.device}, but is on {t.device}")
        _require(t.dtype == q.dtype, f"{name} must have q's dtype {q.dtype}, but has {t.dtype}")
        _require(t.dim() == 4, f"{name} must be 4-D, but got shape {tuple(t.shape)}")
    _require(k_cache.shape == v_cache.shape, f"k_cache and v_cache must have one shape, but got "
             f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if block_table is not None:
        _require(isinstance(block_table, torch.Tensor), "block_table must be a torch.Tensor or "
                 f"None, but got {type(block_table).__name__}")
        num_pages, page_size, heads_kv, kv_dim = k_cache.shape
        layout = "paged (num_pages, page_size, H_kv, D)"
        _require(block_table.device == q.device, f"block_table must be on q's device {q.device}, "
                 f"but is on {block_table.device}")
        _require(block_table.dtype == torch.int32, f"block_table must be int32, but got "
                 f"{block_table.dtype}")
        _require(block_table.dim() == 2 and block_table.shape[0] == batch,
                 f"block_table must be (B={batch}, max_pages), but got {tuple(block_table.shape)}")
        _require(num_pages > 0 and page_size > 0, f"the page pool must be non-empty, but "
                 f"k_cache has shape {tuple(k_cache.shape)}")
        capacity = block_table.shape[1] * page_size
    else:
        cache_batch, heads_kv, capacity, kv_dim = k_cache.shape
        num_pages, page_size = 0, 0
        layout = "contiguous (B, H_kv, N_max, D)"
        _require(cache_batch == batch, f"a {layout} cache must have B={batch} like q, but got "
                 f"shape {tuple(k_cache.shape)} (pass block_table for a paged cache)")
    _require(kv_dim == head_dim, f"the {layout} cache must have head dim {head_dim} like q, but "
             f"got shape {tuple(k_cache.shape)}")
    _require(heads_kv > 0 and heads_q % heads_kv == 0, f"H_q ({heads_q}) must be a multiple of "
             f"H_kv ({heads_kv}) of the {layout} cache of shape {tuple(k_cache.shape)}")
    _require(cache_seqlens.device == q.device, f"cache_seqlens must be on q's device {q.device}, "
             f"but is on {cache_seqlens.device}")
    _require(cache_seqlens.dtype == torch.int32, f"cache_seqlens must be int32, but got "
             f"{cache_seqlens.dtype}")
    _require(tuple(cache_seqlens.shape) == (batch,), f"cache_seqlens must have shape ({batch},), "
             f"but got {tuple(cache_seqlens.shape)}")
    shape = DecodeShape(batch, heads_q, heads_kv, n_q, head_dim, capacity, page_size, num_pages)
    if check_contents:
        check_cache_contents(shape, cache_seqlens, block_table)
    return shape


def check_cache_contents(shape: DecodeShape, cache_seqlens: torch.Tensor,
                          block_table: torch.Tensor | None) -> None:
    lens = cache_seqlens.to(torch.int64)
    summary = [lens.min(), lens.max()]
    if block_table is not None:
        pages_used = (lens + shape.page_size - 1) // shape.page_size
        in_use = (torch.arange(block_table.shape[1], device=lens.device)[None, :]
                  < pages_used[:, None])
        pages = block_table.to(torch.int64)
        summary += [torch.where(in_use, pages, shape.num_pages).min(),
                    torch.where(in_use, pages, -1).max()]
    values = torch.stack(summary).tolist()  # the one device-to-host copy
    _require(values[0] >= 0, f"cache_seqlens must be >= 0, but sequence "
             f"{int(torch.argmin(lens))} has length {values[0]}")
    _require(values[1] <= shape.capacity, f"cache_seqlens must be <= the cache capacity "
             f"{shape.capacity}, but sequence {int(torch.argmax(lens))} has length {values[1]}")
    if block_table is not None and values[3] >= 0:  # some page in use
        low, high = values[2], values[3]
        if low < 0 or high >= shape.num_pages:
            bad = (in_use & ((block_table < 0) | (block_table >= shape.num_pages))).nonzero()
            b, p = (int(x) for x in bad[0])
            raise ValueError(f"block_table must map the pages in use into [0, {shape.num_pages}) "
                             f"(the page pool), but block_table[{b}, {p}] = "
                             f"{int(block_table[b, p])} (sequence {b} has length "
                             f"{int(cache_seqlens[b])})")


def smem_bytes(block_n: int, head_dim: int, num_stages: int, elem_bytes: int, rows: int) -> int:
    """Shared memory one split program needs: K and V tiles per pipeline stage plus q."""
    block_d = pow2_at_least(head_dim, 16)
    return (max(1, num_stages) * 2 * block_n + rows) * block_d * elem_bytes


def whole_wave_splits(programs: int, num_splits: int, max_splits: int, sm_count: int) -> int:
    """num_splits raised so that programs x splits is a multiple of the SM count, where that
    takes at most an eighth more splits and no more than max_splits; else num_splits.

    E.g. 8 KV heads at B=1 on 132 SMs: 32 splits -> 33 (264 programs, 2 per SM), 64 -> 66.
    """
    for splits in range(num_splits, min(max_splits, num_splits + num_splits // 8) + 1):
        if programs * splits % sm_count == 0:
            return splits
    return num_splits


def merge_split_tile(num_splits: int, block_d: int, num_warps: int, rows: int = 1,
                     tile_elems: int = COMBINE_TILE_ELEMS) -> int:
    """Partials of each of ``rows`` rows a merge loads per step: all of them where 32
    elements per thread allow (at d=128, 4 warps and one row, 32: so 33 splits take two
    steps; 64 per thread would take 127 registers instead of 100 in the fused split kernel,
    Triton 3.9 sm_90)."""
    return min(pow2_at_least(num_splits),
               max(1, tile_elems * num_warps // 4 // (block_d * rows)))


def merge_rows(group: int, n_q: int) -> int:
    """ROWS of the fused merge: the row tile's real rows (a GQA group x new tokens, at most
    BLOCK_M), rounded up to a power of two; not BLOCK_M, whose padding to tl.dot's 16 rows
    would load and add three times the partials at a group of 4."""
    return pow2_at_least(min(group * n_q, rows_per_tile(group, n_q)))


# Arrival counters of the fused combine, one int32 per (sequence, KV head, row tile), by
# (device, stream). Zeroed once and left at zero by the last program of each row tile: a
# memset per call would be one more launch, the very cost the fused combine removes. One set
# per stream: launches on one stream run one after another and never share counts, two
# launches running at once on two streams would. (A launch that dies mid-way leaves counts
# behind; the device is unusable after that anyway. Under CUDA graph capture the counters
# come from the graph's pool: warm up outside the capture, as for any Triton kernel.)
_ARRIVALS: dict[tuple[str, int], torch.Tensor] = {}


def arrival_counters(device: torch.device, count: int, stream: int | None = None
                     ) -> torch.Tensor:
    if stream is None:
        stream = current_stream(device.index) if device.type == "cuda" else 0
    key = (str(device), stream)
    counters = _ARRIVALS.get(key)
    if counters is None or counters.numel() < count:
        # A larger set replaces a smaller one; the old one is freed in stream order, after
        # the launches already queued on this stream that use it.
        counters = torch.zeros(max(count, 1024), dtype=torch.int32, device=device)
        _ARRIVALS[key] = counters
    return counters


class DecodeLaunchPlan(NamedTuple):
    """What one call's properties decide: the grid, the kernels' constant arguments and
    their compiled launches. Kept per call key (``_plan_key``), so a repeated decode step
    allocates its output and launches, nothing else."""
    out_shape: tuple[int, int, int, int]
    part_shape: tuple[int, int, int, int, int] | None  # None: one split, no partials
    num_splits: int
    fused: bool
    arrivals_needed: int  # arrival counters of the fused combine (0: not fused)
    default_scale: float
    split_constants: tuple[int, ...]  # runtime integers after qk_scale, in kernel order
    split: DirectLaunch
    combine: DirectLaunch | None
    # Scratch (partials, and the lse where the caller does not want it) by CUDA stream, kept
    # where small: launches on one stream run in order, so the next call may overwrite what
    # the last one's combine has read. Each allocation costs several microseconds of host
    # time, as much as a decode step's GPU time saves at small sizes.
    scratch: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


MAX_LAUNCH_PLANS = 1024
# Scratch above this many bytes per plan is allocated per call: a call that big runs long
# enough on the GPU to hide the allocation, and 1024 plans must not pin gigabytes.
MAX_KEPT_SCRATCH_BYTES = 4 << 20
_LAUNCH_PLANS: PlanCache[DecodeLaunchPlan] = PlanCache(MAX_LAUNCH_PLANS)


def _plan_key(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              cache_seqlens: torch.Tensor, block_table: torch.Tensor | None,
              shape: DecodeShape, knobs: tuple[object, ...]) -> tuple[object, ...]:
    """Every property of the arguments that the plan or the kernels' specialization reads:
    shapes and strides (integer arguments), dtypes, devices and pointer alignment."""
    table = None if block_table is None else (block_table.stride(), block_table.dtype)
    tensors = (q, k_cache, v_cache, cache_seqlens) if block_table is None else (
        q, k_cache, v_cache, cache_seqlens, block_table)
    return (shape, knobs, q.stride(), k_cache.stride(), v_cache.stride(),
            cache_seqlens.stride(0), table, q.dtype, k_cache.dtype, v_cache.dtype,
            cache_seqlens.dtype, q.device, alignment_key(*tensors))


def _make_plan(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               cache_seqlens: torch.Tensor, block_table: torch.Tensor | None,
               shape: DecodeShape, *, num_splits: int, block_n: int, num_warps: int,
               num_stages: int, combine: str, kv_load: str,
               whole_waves: bool) -> DecodeLaunchPlan:
    batch, heads_q, heads_kv, n_q, head_dim = shape[:5]
    group = heads_q // heads_kv
    block_m = rows_per_tile(group, n_q)
    row_tiles = triton.cdiv(group * n_q, block_m)
    block_d = pow2_at_least(head_dim, 16)
    if whole_waves and getattr(q, "is_cuda", False):  # (stand-ins: see decode_launches)
        sm_count = torch.cuda.get_device_properties(q.device).multi_processor_count
        num_splits = whole_wave_splits(batch * heads_kv * row_tiles, num_splits,
                                       max(num_splits, triton.cdiv(shape.capacity, block_n)),
                                       sm_count)
    fused = combine == "fused" and num_splits > 1
    if block_table is None:
        # (B, H_kv, N, D): the sequence index plays the page's part, one page per sequence.
        k_strides = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.stride(3))
        v_strides = (v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), v_cache.stride(3))
        table_strides, page_size, tile_in_page = (0, 0), 1, False
    else:
        # (num_pages, page_size, H_kv, D) -> (page, head, slot, dim) strides.
        k_strides = (k_cache.stride(0), k_cache.stride(2), k_cache.stride(1), k_cache.stride(3))
        v_strides = (v_cache.stride(0), v_cache.stride(2), v_cache.stride(1), v_cache.stride(3))
        table_strides = (block_table.stride(0), block_table.stride(1))
        page_size = shape.page_size
        tile_in_page = page_size % block_n == 0
    grid = (batch * heads_kv * row_tiles, num_splits)
    # Unused unless fused; a constant tile then, so that tuning num_splits compiles nothing
    # new (the fused merge's tile follows it: one compile per power of two).
    split = DirectLaunch(_decode_split_kernel, grid, dict(
        N_Q=n_q, HEAD_DIM=head_dim, SINGLE_SPLIT=num_splits == 1, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_D=block_d, PAGED=block_table is not None,
        PAGE_SIZE=page_size, TILE_IN_PAGE=tile_in_page,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        KV_EVICT=KV_EVICTION[kv_load], FUSED_COMBINE=fused,
        MERGE_ROWS=merge_rows(group, n_q) if fused else 1,
        MERGE_BLOCK_S=pow2_at_least(num_splits) if fused else 1,
        MERGE_SPLIT_TILE=merge_split_tile(num_splits, block_d, num_warps, merge_rows(group, n_q),
                                          FUSED_MERGE_TILE_ELEMS) if fused else 1),
        dict(num_warps=num_warps, num_stages=num_stages))
    combine_launch = None
    if num_splits > 1 and not fused:
        combine_launch = DirectLaunch(_decode_combine_kernel, (batch * heads_q * n_q,), dict(
            HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=pow2_at_least(num_splits),
            SPLIT_TILE=merge_split_tile(num_splits, block_d, 4)), dict(num_warps=4))
    return DecodeLaunchPlan(
        out_shape=(batch, heads_q, n_q, head_dim),
        part_shape=(batch, heads_q, n_q, num_splits, head_dim) if num_splits > 1 else None,
        num_splits=num_splits, fused=fused, arrivals_needed=grid[0] if fused else 0,
        default_scale=1.0 / math.sqrt(head_dim),
        split_constants=(heads_kv, group, row_tiles, num_splits, *q.stride(), *k_strides,
                         *v_strides, *table_strides, cache_seqlens.stride(0)),
        split=split, combine=combine_launch, scratch={})


def decode_launches(q: Any, k_cache: Any, v_cache: Any, cache_seqlens: Any,
                    block_table: Any | None, shape: DecodeShape, scratch: Any, *,
                    num_splits: int, block_n: int, num_warps: int, num_stages: int,
                    combine: str = "separate", kv_load: str = "default",
                    whole_waves: bool = False) -> list[tuple[Any, tuple[int, ...], list[Any],
                                                             dict[str, Any]]]:
    """The launches of one call as (kernel, grid, positional arguments, constexprs and
    options), for ``kernel.warmup`` with stand-in tensors (``FlashDecodeTemplate.
    kernel_launches``). ``scratch(dtype, shape)`` makes the outputs' and partials' stand-ins.
    Stand-ins are not CUDA tensors, so ``whole_waves`` keeps num_splits: the fused merge's
    tile (a power of two of the splits) may then differ from a GPU's launch."""
    plan = _make_plan(q, k_cache, v_cache, cache_seqlens, block_table, shape,
                      num_splits=num_splits, block_n=block_n, num_warps=num_warps,
                      num_stages=num_stages, combine=combine, kv_load=kv_load,
                      whole_waves=whole_waves)
    parts = None
    if plan.part_shape is not None:
        parts = (scratch(torch.float32, plan.part_shape),
                 scratch(torch.float32, plan.part_shape[:4]))
    arrivals = scratch(torch.int32, (max(plan.arrivals_needed, 1024),)) if plan.fused else None
    split_args, combine_args = launch_args(
        plan, q, k_cache, v_cache, cache_seqlens, block_table, scratch(q.dtype, plan.out_shape),
        scratch(torch.float32, plan.out_shape[:3]), parts, arrivals, plan.default_scale * LOG2_E)
    launches = [(plan.split.kernel, plan.split.grid, split_args,
                 {**plan.split.constexprs, **plan.split.options})]
    if plan.combine is not None:
        launches.append((plan.combine.kernel, plan.combine.grid, combine_args,
                         {**plan.combine.constexprs, **plan.combine.options}))
    return launches


def launch_args(plan: DecodeLaunchPlan, q: Any, k_cache: Any, v_cache: Any, cache_seqlens: Any,
                block_table: Any | None, o: Any, lse: Any, parts: tuple[Any, Any] | None,
                arrivals: Any | None, qk_scale: float) -> tuple[list[Any], list[Any]]:
    """The split kernel's and the combine kernel's positional arguments, in their order:
    the one place that order is written (real launches and stand-in ones). ``parts`` (o_part,
    lse_part) where the plan has partials; ``arrivals`` where its combine is fused."""
    o_part, lse_part = (o, lse) if parts is None else parts  # unused without partials
    table = cache_seqlens if block_table is None else block_table
    split = [q, k_cache, v_cache, cache_seqlens, table, o, lse, o_part, lse_part,
             lse if arrivals is None else arrivals, qk_scale, *plan.split_constants]
    return split, [o_part, lse_part, o, lse, plan.num_splits]


def launch_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   cache_seqlens: torch.Tensor, block_table: torch.Tensor | None,
                   scale: float | None, shape: DecodeShape, *, num_splits: int, block_n: int,
                   num_warps: int, num_stages: int, combine: str = "separate",
                   kv_load: str = "default", whole_waves: bool = False,
                   want_lse: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the split kernel (and the combine kernel when num_splits > 1 and the combine is
    separate) on checked inputs. The keyword arguments are FlashDecodeConfig's knobs; without
    ``want_lse`` the returned lse is scratch that the next call on the stream overwrites.

    The launch plan is kept per call key: a repeated call launches the compiled kernels
    directly (``DirectLaunch``), without Triton's per-call argument binding."""
    plan = decode_launch_plan(q, k_cache, v_cache, cache_seqlens, block_table, shape,
                              num_splits=num_splits, block_n=block_n, num_warps=num_warps,
                              num_stages=num_stages, combine=combine, kv_load=kv_load,
                              whole_waves=whole_waves)
    return run_decode_plan(plan, q, k_cache, v_cache, cache_seqlens, block_table, scale,
                           want_lse=want_lse)


def decode_launch_plan(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       cache_seqlens: torch.Tensor, block_table: torch.Tensor | None,
                       shape: DecodeShape, *, num_splits: int, block_n: int, num_warps: int,
                       num_stages: int, combine: str = "separate", kv_load: str = "default",
                       whole_waves: bool = False) -> DecodeLaunchPlan:
    """The kept plan for these arguments and knobs (made on first sight). A caller that keys
    its own calls may keep it and ``run_decode_plan`` on arguments with the same properties
    (``_plan_key``: shapes, strides, dtypes, device, 16-byte alignment)."""
    knobs = (num_splits, block_n, num_warps, num_stages, combine, kv_load, whole_waves)
    key = _plan_key(q, k_cache, v_cache, cache_seqlens, block_table, shape, knobs)
    plan = _LAUNCH_PLANS.get(key)
    if plan is None:
        plan = _make_plan(q, k_cache, v_cache, cache_seqlens, block_table, shape,
                          num_splits=num_splits, block_n=block_n, num_warps=num_warps,
                          num_stages=num_stages, combine=combine, kv_load=kv_load,
                          whole_waves=whole_waves)
        _LAUNCH_PLANS.put(key, plan)
    return plan


def run_decode_plan(plan: DecodeLaunchPlan, q: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, cache_seqlens: torch.Tensor,
                    block_table: torch.Tensor | None, scale: float | None, *,
                    want_lse: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, lse) of one call through ``plan``."""
    if not q.is_cuda:
        return _run_plan(plan, q, k_cache, v_cache, cache_seqlens, block_table, scale, 0,
                         want_lse)
    index = q.device.index
    if index == torch.cuda.current_device():
        return _run_plan(plan, q, k_cache, v_cache, cache_seqlens, block_table, scale,
                         current_stream(index), want_lse)
    # Triton launches on the current CUDA device: make it q's.
    with torch.cuda.device(index):
        return _run_plan(plan, q, k_cache, v_cache, cache_seqlens, block_table, scale,
                         current_stream(index), want_lse)


def _scratch(plan: DecodeLaunchPlan, q: torch.Tensor, stream: int
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(o_part, lse_part, lse) scratch of ``plan`` for a call on ``stream``."""
    # A graph being captured gets scratch of its own from the graph's pool: two graphs
    # captured on one stream may replay at once on two.
    capturing = q.is_cuda and torch.cuda.is_current_stream_capturing()
    kept = None if capturing else plan.scratch.get(stream)
    if kept is not None:
        return kept
    o_part = lse_part = torch.empty(0, dtype=torch.float32, device=q.device)
    if plan.part_shape is not None:
        o_part = torch.empty(plan.part_shape, dtype=torch.float32, device=q.device)
        lse_part = torch.empty(plan.part_shape[:4], dtype=torch.float32, device=q.device)
    lse = torch.empty(plan.out_shape[:3], dtype=torch.float32, device=q.device)
    scratch = (o_part, lse_part, lse)
    if not capturing and 4 * (o_part.numel() + lse_part.numel() + lse.numel()) <= \
            MAX_KEPT_SCRATCH_BYTES:
        plan.scratch[stream] = scratch
    return scratch


def _run_plan(plan: DecodeLaunchPlan, q: torch.Tensor, k_cache: torch.Tensor,
              v_cache: torch.Tensor, cache_seqlens: torch.Tensor,
              block_table: torch.Tensor | None, scale: float | None, stream: int,
              want_lse: bool) -> tuple[torch.Tensor, torch.Tensor]:
    o = torch.empty(plan.out_shape, dtype=q.dtype, device=q.device)
    o_part, lse_part, lse = _scratch(plan, q, stream)
    if want_lse:
        lse = torch.empty(plan.out_shape[:3], dtype=torch.float32, device=q.device)
    split_args, combine_args = launch_args(
        plan, q, k_cache, v_cache, cache_seqlens, block_table, o, lse,
        None if plan.part_shape is None else (o_part, lse_part),
        arrival_counters(q.device, plan.arrivals_needed, stream) if plan.fused else None,
        (plan.default_scale if scale is None else float(scale)) * LOG2_E)
    plan.split.launch_on(stream, *split_args)
    if plan.combine is not None:
        plan.combine.launch_on(stream, *combine_args)
    return o, lse
