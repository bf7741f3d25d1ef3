"""FlashAttention backward: the Triton kernel family and its launcher.

This module imports only torch and triton: ``FlashBwdTemplate.standalone_source`` emits it
verbatim, with a tuned config appended, as a module a user can drop into a project.

Given the forward's ``o`` and ``lse`` (natural-log logsumexp of the scaled, possibly capped,
scores) and the incoming gradient ``do``, three kernels produce ``dq``, ``dk`` and ``dv``
without ever storing an N_q x N_kv matrix:

  * preprocess, one program per (query tile, query head, batch): ``delta = rowsum(dO * O)``
    in fp32, and the lse turned into the base-2 shift the main kernels subtract,
    ``lse * log2(e)``, with +inf for rows that saw no key so that their P is exactly 0;
  * dK/dV, one program per (KV tile, kv head, batch): it walks the query tiles that can see
    its keys, for every query head of its GQA group (dK/dV of the group summed in registers:
    no repeated K/V, no atomics), recomputing ``P^T = exp2(K Q^T * scale * log2 e - lse2)``,
    and accumulates ``dV += P^T dO``, ``dK += dS^T Q`` with ``dS = P * (dO V^T - delta)``.
    With ``dq_mode="atomic"`` it also adds ``dS K`` into an fp32 dQ buffer with atomics;
  * dQ (``dq_mode="separate"``), one program per (query tile, query head, batch): it walks
    the KV tiles its rows can see and accumulates ``dQ += dS K``; deterministic and free of
    atomics, at the price of recomputing ``Q K^T`` and ``dO V^T``.

Both walks split their range into *full* tiles (inside both lengths and visible to every
(query, key) pair: no elementwise mask) and *partial* tiles (the causal diagonal and the
sequence tails: masked); tiles nothing can see are never visited. A walk is a helper over a
``[start, stop)`` range of tiles, so a block-sparse variant can drive the same helpers from
per-tile index lists of full and partial tiles.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping
from typing import Any

import torch
import triton
import triton.language as tl

from templates.flash.softcap import softcapped_with_slope
from templates.kernel_common import (  # noqa: F401  CAUSAL_MODES is re-exported
    CAUSAL_MODES,
    LOG2_E,
    block_d_for,
    causal_offset,
    normalize_causal,
)
from templates.masks.listed_blocks import listed_block_step

# log2(e) inside the kernels: a jit function reads a global only as a constexpr.
LOG2_E_JIT = tl.constexpr(LOG2_E)

DQ_MODES = ("atomic", "separate")
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256
# Rows per preprocess program times the padded head dim: 8192 fp32 elements per operand
# keeps the two loaded tiles of one program in registers at 4 warps.
PREPROCESS_TILE_ELEMENTS = 8192
PREPROCESS_WARPS = 4

# Tests set this: the launcher then fills dq/dk/dv and the internal row buffers with NaN
# before the kernels run, so an element a kernel forgets to write shows up as NaN.
DEBUG_POISON = False


# ----------------------------------------------------------------------------- kernels
@triton.jit
def _load_rows(ptrs, rows, n_rows, offs_d,
               MASK_ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """A (rows, BLOCK_D) tile; rows >= n_rows (if MASK_ROWS) and columns >= HEAD_DIM read 0."""
    if MASK_ROWS:
        tile = tl.load(ptrs, mask=(rows[:, None] < n_rows) & (offs_d[None, :] < HEAD_DIM),
                       other=0.0)
    elif BLOCK_D != HEAD_DIM:
        tile = tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
    else:
        tile = tl.load(ptrs)
    return tile


@triton.jit
def _dkdv_step(
    dk, dv, k, v,
    Q, DO, DQ, LSE2, DELTA,
    stride_qm, stride_qd, stride_dom, stride_dod, stride_dqm,
    m0, offs_n, offs_d, N_Q, N_KV, causal_offset, qk_scale, sm_scale, softcap2,
    tile_base, am_base, stride_amm, stride_amn,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, TILE: tl.constexpr, TILE_STRIDE: tl.constexpr,
    ATTN_MASK: tl.constexpr, SOFTCAP: tl.constexpr, ATOMIC_DQ: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Fold the query tile [m0, m0 + BLOCK_M) of one query head into the (dk, dv)
    accumulators of one KV tile (keys ``offs_n``).

    ``Q``, ``DO``, ``DQ`` point at the (batch, query head) base, ``LSE2``/``DELTA`` at its
    first row. Each mask is a compile-time switch, as in the forward: ``MASKED`` (rows past
    N_q, keys past N_kv, and the causal diagonal when ``CAUSAL``), ``TILE`` (a block mask's
    elementwise tile, transposed: uint8 rows per key ``TILE_STRIDE`` apart from ``tile_base``),
    ``ATTN_MASK`` (0 none, 1 bool, 2 additive, read from ``am_base`` by (query, key)).
    ``SOFTCAP``: the scores are capped as in the forward (``softcap2``: the cap times
    log2(e)) and dS takes the cap's slope ``1 - tanh^2``.
    """
    offs_m = m0 + tl.arange(0, BLOCK_M)
    q = _load_rows(Q + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd,
                   offs_m, N_Q, offs_d, MASKED, HEAD_DIM, BLOCK_D)
    do = _load_rows(DO + offs_m[:, None] * stride_dom + offs_d[None, :] * stride_dod,
                    offs_m, N_Q, offs_d, MASKED, HEAD_DIM, BLOCK_D)
    if MASKED:
        # Rows past N_q get lse2 = +inf, hence P = 0: they add nothing.
        lse2 = tl.load(LSE2 + offs_m, mask=offs_m < N_Q, other=float("inf"))
        delta = tl.load(DELTA + offs_m, mask=offs_m < N_Q, other=0.0)
    else:
        lse2 = tl.load(LSE2 + offs_m)
        delta = tl.load(DELTA + offs_m)
    # Scores transposed (keys along rows): P^T feeds dV = P^T dO without a transpose.
    s_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION) * qk_scale
    if SOFTCAP:  # the forward's capped scores, and their slope for dS
        s_t, slope_t = softcapped_with_slope(s_t, softcap2)
    if ATTN_MASK != 0:
        am = tl.load(am_base + offs_m[None, :] * stride_amm + offs_n[:, None] * stride_amn,
                     mask=(offs_m[None, :] < N_Q) & (offs_n[:, None] < N_KV), other=0)
        if ATTN_MASK == 2:  # additive, in the log2 domain of the scores
            s_t = s_t + am.to(tl.float32) * LOG2_E_JIT
    s_t = s_t - lse2[None, :]
    if MASKED or TILE or ATTN_MASK == 1:
        # Masked before exp2: a hidden score may exceed the row's lse and overflow.
        visible = (offs_n[:, None] < N_KV) & (offs_m[None, :] >= 0)  # (BLOCK_N, BLOCK_M)
        if MASKED and CAUSAL:
            visible = visible & (offs_n[:, None] <= offs_m[None, :] + causal_offset)
        if TILE:
            tile = tl.load(tile_base + tl.arange(0, BLOCK_N)[:, None] * TILE_STRIDE
                           + tl.arange(0, BLOCK_M)[None, :])
            visible = visible & (tile != 0)
        if ATTN_MASK == 1:
            visible = visible & (am != 0)
        s_t = tl.where(visible, s_t, float("-inf"))
    p_t = tl.math.exp2(s_t)
    dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
    dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
    ds_t = p_t * (dp_t - delta[None, :])
    if SOFTCAP:  # dS = dC * (1 - tanh^2); the scale is applied as without a cap
        ds_t = ds_t * slope_t
    ds_t = ds_t.to(q.dtype)
    dk = tl.dot(ds_t, q, dk, input_precision=DOT_PRECISION)
    if ATOMIC_DQ:
        dq = tl.dot(tl.trans(ds_t), k, input_precision=DOT_PRECISION) * sm_scale
        dq_ptrs = DQ + offs_m[:, None] * stride_dqm + offs_d[None, :]
        tl.atomic_add(dq_ptrs, dq, mask=(offs_m[:, None] < N_Q) & (offs_d[None, :] < HEAD_DIM),
                      sem="relaxed")
    return dk, dv


@triton.jit
def _dkdv_walk_q_range(
    dk, dv, k, v,
    Q, DO, DQ, LSE2, DELTA,
    stride_qm, stride_qd, stride_dom, stride_dod, stride_dqm,
    offs_n, offs_d, m_start, m_stop, N_Q, N_KV, causal_offset, qk_scale, sm_scale, softcap2,
    am_base, stride_amm, stride_amn,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, ATTN_MASK: tl.constexpr,
    SOFTCAP: tl.constexpr, ATOMIC_DQ: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Fold the query tiles m_start, m_start + BLOCK_M, ... < m_stop (dense and causal)."""
    for m0 in range(m_start, m_stop, BLOCK_M):
        dk, dv = _dkdv_step(
            dk, dv, k, v, Q, DO, DQ, LSE2, DELTA,
            stride_qm, stride_qd, stride_dom, stride_dod, stride_dqm,
            m0, offs_n, offs_d, N_Q, N_KV, causal_offset, qk_scale, sm_scale, softcap2,
            am_base, am_base, stride_amm, stride_amn,
            MASKED, CAUSAL, False, 1, ATTN_MASK, SOFTCAP, ATOMIC_DQ,
            HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, DOT_PRECISION)
    return dk, dv


@triton.jit
def _dkdv_walk_listed_blocks(
    dk, dv, k, v,
    Q, DO, DQ, LSE2, DELTA,
    stride_qm, stride_qd, stride_dom, stride_dod, stride_dqm,
    offs_n, offs_d, tile_row, N_Q, N_KV, causal_offset, qk_scale, sm_scale, softcap2,
    Count, Indices, TileIds, Tiles,
    am_base, stride_amm, stride_amn,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, TILE: tl.constexpr, ATTN_MASK: tl.constexpr,
    SOFTCAP: tl.constexpr, ATOMIC_DQ: tl.constexpr,
    MASK_BLOCK_Q: tl.constexpr, MASK_BLOCK_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Fold the query blocks the transposed BlockMask lists for this KV block (``Count`` of
    them, indices at ``Indices``), each as MASK_BLOCK_Q / BLOCK_M steps in one flat loop.
    ``TILE``: partial blocks, whose transposed (MASK_BLOCK_KV, MASK_BLOCK_Q) uint8 tile (row
    ``tile_row`` first) is at ``Tiles`` + its id * MASK_BLOCK_Q * MASK_BLOCK_KV."""
    n = tl.load(Count)
    for t in tl.range(0, n * (MASK_BLOCK_Q // BLOCK_M)):
        m0, tile_base = listed_block_step(Indices, TileIds, Tiles, t, tile_row, MASK_BLOCK_Q,
                                          BLOCK_M, MASK_BLOCK_Q * MASK_BLOCK_KV, TILE)
        dk, dv = _dkdv_step(
            dk, dv, k, v, Q, DO, DQ, LSE2, DELTA,
            stride_qm, stride_qd, stride_dom, stride_dod, stride_dqm,
            m0, offs_n, offs_d, N_Q, N_KV, causal_offset, qk_scale, sm_scale, softcap2,
            tile_base, am_base, stride_amm, stride_amn,
            MASKED, CAUSAL, TILE, MASK_BLOCK_Q, ATTN_MASK, SOFTCAP, ATOMIC_DQ,
            HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, DOT_PRECISION)
    return dk, dv


@triton.jit(do_not_specialize=["N_Q", "N_KV", "causal_offset", "H_Q", "H_KV", "GROUP",
                               "n_kv_tiles"])
def _flash_bwd_dkdv_kernel(
    Q, K, V, DO, DK, DV, DQ, LSE2, DELTA,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_dkb, stride_dkh, stride_dkn,
    stride_dqb, stride_dqh, stride_dqm,
    N_Q, N_KV, causal_offset, H_Q, H_KV, GROUP, n_kv_tiles, qk_scale, sm_scale, softcap2,
    FullCount, FullIndices, PartialCount, PartialIndices, PartialTileIds, PartialTiles,
    stride_cb, stride_ch, stride_ib, stride_ih, stride_il,
    AttnMask, stride_amb, stride_amh, stride_amm, stride_amn,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, EVEN_M: tl.constexpr, ATOMIC_DQ: tl.constexpr,
    SPARSE: tl.constexpr, SPARSE_FULL_MASKED: tl.constexpr,
    MASK_BLOCK_Q: tl.constexpr, MASK_BLOCK_KV: tl.constexpr, ATTN_MASK: tl.constexpr,
    SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    # -- which (batch, kv head, KV tile): a 1-D grid, tiles of one kv head next to each other
    # so the Q/dO of its group stay in L2. Tile 0 first: under causal masking the first KV
    # tiles are seen by the most queries, so the longest programs start first.
    pid = tl.program_id(0)
    tile = pid % n_kv_tiles
    bh = pid // n_kv_tiles
    b = (bh // H_KV).to(tl.int64)
    kv_h = (bh % H_KV).to(tl.int64)
    n0 = tile * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    k = _load_rows(K + b * stride_kb + kv_h * stride_kh
                   + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd,
                   offs_n, N_KV, offs_d, True, HEAD_DIM, BLOCK_D)
    v = _load_rows(V + b * stride_vb + kv_h * stride_vh
                   + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd,
                   offs_n, N_KV, offs_d, True, HEAD_DIM, BLOCK_D)

    # -- the query range: [m_begin, m_full) partial, [m_full, m_whole) full, then the tail
    # tile [m_whole, N_q) partial when N_q is not a multiple of BLOCK_M.
    m_whole = (N_Q // BLOCK_M) * BLOCK_M
    m_all = tl.cdiv(N_Q, BLOCK_M) * BLOCK_M
    if CAUSAL:
        # Query i sees key j iff j <= i + causal_offset: the first query seeing key n0, and
        # the first seeing the tile's last key (from there on every pair is visible).
        m_begin = (tl.maximum(n0 - causal_offset, 0) // BLOCK_M) * BLOCK_M
        m_full = tl.cdiv(tl.maximum(n0 + BLOCK_N - 1 - causal_offset, 0), BLOCK_M) * BLOCK_M
    else:
        m_begin = 0
        m_full = n0 * 0
    # A KV tile reaching past N_kv masks its tail keys against every query tile.
    m_full = tl.where(n0 + BLOCK_N > N_KV, m_all, m_full)

    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    for g in range(GROUP):
        h = kv_h * GROUP + g
        Q_bh = Q + b * stride_qb + h * stride_qh
        DO_bh = DO + b * stride_dob + h * stride_doh
        DQ_bh = DQ + b * stride_dqb + h * stride_dqh
        row0 = (b * H_Q + h) * N_Q
        # SDPA's attn_mask (B|1, H|1, N_q, N_kv): broadcast dims have stride 0.
        am_base = AttnMask + b * stride_amb + h * stride_amh
        if SPARSE:
            # The transposed BlockMask's lists for the mask KV block holding this tile
            # (BLOCK_N divides MASK_BLOCK_KV): full query blocks, then partial ones.
            kv_block = n0 // MASK_BLOCK_KV
            lists = b * stride_ib + h * stride_ih + kv_block * stride_il
            counts = b * stride_cb + h * stride_ch + kv_block
            dk, dv = _dkdv_walk_listed_blocks(
                dk, dv, k, v, Q_bh, DO_bh, DQ_bh, LSE2 + row0, DELTA + row0,
                stride_qm, stride_qd, stride_dom, stride_dod, stride_dqm,
                offs_n, offs_d, n0 % MASK_BLOCK_KV, N_Q, N_KV, causal_offset, qk_scale,
                sm_scale, softcap2, FullCount + counts, FullIndices + lists, PartialTileIds + lists,
                PartialTiles, am_base, stride_amm, stride_amn,
                SPARSE_FULL_MASKED, CAUSAL, False, ATTN_MASK, SOFTCAP, ATOMIC_DQ,
                MASK_BLOCK_Q, MASK_BLOCK_KV, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N,
                DOT_PRECISION)
            dk, dv = _dkdv_walk_listed_blocks(
                dk, dv, k, v, Q_bh, DO_bh, DQ_bh, LSE2 + row0, DELTA + row0,
                stride_qm, stride_qd, stride_dom, stride_dod, stride_dqm,
                offs_n, offs_d, n0 % MASK_BLOCK_KV, N_Q, N_KV, causal_offset, qk_scale,
                sm_scale, softcap2, PartialCount + counts, PartialIndices + lists,
                PartialTileIds + lists, PartialTiles, am_base, stride_amm, stride_amn,
                True, CAUSAL, True, ATTN_MASK, SOFTCAP, ATOMIC_DQ,
                MASK_BLOCK_Q, MASK_BLOCK_KV, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N,
                DOT_PRECISION)
        else:
            dk, dv = _dkdv_walk_q_range(
                dk, dv, k, v, Q_bh, DO_bh, DQ_bh, LSE2 + row0, DELTA + row0,
                stride_qm, stride_qd, stride_dom, stride_dod, stride_dqm,
                offs_n, offs_d, m_begin, tl.minimum(m_full, N_Q), N_Q, N_KV, causal_offset,
                qk_scale, sm_scale, softcap2, am_base, stride_amm, stride_amn,
                True, CAUSAL, ATTN_MASK, SOFTCAP, ATOMIC_DQ, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N,
                DOT_PRECISION)
            dk, dv = _dkdv_walk_q_range(
                dk, dv, k, v, Q_bh, DO_bh, DQ_bh, LSE2 + row0, DELTA + row0,
                stride_qm, stride_qd, stride_dom, stride_dod, stride_dqm,
                offs_n, offs_d, m_full, m_whole, N_Q, N_KV, causal_offset, qk_scale,
                sm_scale, softcap2, am_base, stride_amm, stride_amn,
                False, CAUSAL, ATTN_MASK, SOFTCAP, ATOMIC_DQ, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N,
                DOT_PRECISION)
            if not EVEN_M:
                dk, dv = _dkdv_walk_q_range(
                    dk, dv, k, v, Q_bh, DO_bh, DQ_bh, LSE2 + row0, DELTA + row0,
                    stride_qm, stride_qd, stride_dom, stride_dod, stride_dqm,
                    offs_n, offs_d, tl.maximum(m_full, m_whole), N_Q, N_Q, N_KV,
                    causal_offset, qk_scale, sm_scale, softcap2, am_base, stride_amm, stride_amn,
                    True, CAUSAL, ATTN_MASK, SOFTCAP, ATOMIC_DQ, HEAD_DIM, BLOCK_D, BLOCK_M,
                    BLOCK_N,
                    DOT_PRECISION)

    out_mask = (offs_n[:, None] < N_KV) & (offs_d[None, :] < HEAD_DIM)
    out_offs = b * stride_dkb + kv_h * stride_dkh + offs_n[:, None] * stride_dkn + offs_d[None, :]
    tl.store(DK + out_offs, (dk * sm_scale).to(DK.dtype.element_ty), mask=out_mask)
    tl.store(DV + out_offs, dv.to(DV.dtype.element_ty), mask=out_mask)


@triton.jit
def _dq_step(
    dq, q, do, lse2, delta,
    K, V, stride_kn, stride_kd, stride_vn, stride_vd,
    n0, offs_m, offs_d, N_Q, N_KV, causal_offset, qk_scale, softcap2,
    tile_base, am_base, stride_amm, stride_amn,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, TILE: tl.constexpr, TILE_STRIDE: tl.constexpr,
    ATTN_MASK: tl.constexpr, SOFTCAP: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Fold the KV tile [n0, n0 + BLOCK_N) into the dq accumulator of one query tile
    (``K``/``V`` point at the (batch, kv head) base). The masks are the dK/dV step's, in the
    forward's orientation: ``MASKED`` (keys past N_kv, the causal diagonal), ``TILE`` (a block
    mask's tile, uint8 rows per query ``TILE_STRIDE`` apart), ``ATTN_MASK``."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    k = _load_rows(K + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd,
                   offs_n, N_KV, offs_d, MASKED, HEAD_DIM, BLOCK_D)
    v = _load_rows(V + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd,
                   offs_n, N_KV, offs_d, MASKED, HEAD_DIM, BLOCK_D)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    if SOFTCAP:
        s, slope = softcapped_with_slope(s, softcap2)
    if ATTN_MASK != 0:
        am = tl.load(am_base + offs_m[:, None] * stride_amm + offs_n[None, :] * stride_amn,
                     mask=(offs_m[:, None] < N_Q) & (offs_n[None, :] < N_KV), other=0)
        if ATTN_MASK == 2:
            s = s + am.to(tl.float32) * LOG2_E_JIT
    s = s - lse2[:, None]
    if MASKED or TILE or ATTN_MASK == 1:
        visible = (offs_n[None, :] < N_KV) & (offs_m[:, None] >= 0)  # (BLOCK_M, BLOCK_N)
        if MASKED and CAUSAL:
            visible = visible & (offs_n[None, :] <= offs_m[:, None] + causal_offset)
        if TILE:
            tile = tl.load(tile_base + tl.arange(0, offs_m.shape[0])[:, None] * TILE_STRIDE
                           + tl.arange(0, BLOCK_N)[None, :])
            visible = visible & (tile != 0)
        if ATTN_MASK == 1:
            visible = visible & (am != 0)
        s = tl.where(visible, s, float("-inf"))
    p = tl.math.exp2(s)
    dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
    ds = p * (dp - delta[:, None])
    if SOFTCAP:  # dS = dC * (1 - tanh^2); the scale is applied as without a cap
        ds = ds * slope
    return tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION)


@triton.jit
def _dq_walk_kv_range(
    dq, q, do, lse2, delta,
    K, V, stride_kn, stride_kd, stride_vn, stride_vd,
    offs_m, offs_d, n_start, n_stop, N_Q, N_KV, causal_offset, qk_scale, softcap2,
    am_base, stride_amm, stride_amn,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, ATTN_MASK: tl.constexpr, SOFTCAP: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Fold the KV tiles n_start, n_start + BLOCK_N, ... < n_stop (dense and causal)."""
    for n0 in range(n_start, n_stop, BLOCK_N):
        dq = _dq_step(dq, q, do, lse2, delta, K, V, stride_kn, stride_kd, stride_vn, stride_vd,
                      n0, offs_m, offs_d, N_Q, N_KV, causal_offset, qk_scale, softcap2,
                      am_base, am_base, stride_amm, stride_amn,
                      MASKED, CAUSAL, False, 1, ATTN_MASK, SOFTCAP, HEAD_DIM, BLOCK_D, BLOCK_N,
                      DOT_PRECISION)
    return dq


@triton.jit
def _dq_walk_listed_blocks(
    dq, q, do, lse2, delta,
    K, V, stride_kn, stride_kd, stride_vn, stride_vd,
    offs_m, offs_d, tile_row, N_Q, N_KV, causal_offset, qk_scale, softcap2,
    Count, Indices, TileIds, Tiles,
    am_base, stride_amm, stride_amn,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, TILE: tl.constexpr, ATTN_MASK: tl.constexpr,
    SOFTCAP: tl.constexpr,
    MASK_BLOCK_Q: tl.constexpr, MASK_BLOCK_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Fold the KV blocks the BlockMask lists for this query block, as the forward does."""
    n = tl.load(Count)
    for t in tl.range(0, n * (MASK_BLOCK_KV // BLOCK_N)):
        n0, tile_base = listed_block_step(Indices, TileIds, Tiles, t, tile_row, MASK_BLOCK_KV,
                                          BLOCK_N, MASK_BLOCK_Q * MASK_BLOCK_KV, TILE)
        dq = _dq_step(dq, q, do, lse2, delta, K, V, stride_kn, stride_kd, stride_vn, stride_vd,
                      n0, offs_m, offs_d, N_Q, N_KV, causal_offset, qk_scale, softcap2,
                      tile_base, am_base, stride_amm, stride_amn,
                      MASKED, CAUSAL, TILE, MASK_BLOCK_KV, ATTN_MASK, SOFTCAP, HEAD_DIM, BLOCK_D,
                      BLOCK_N, DOT_PRECISION)
    return dq


@triton.jit(do_not_specialize=["N_Q", "N_KV", "causal_offset", "H_Q", "GROUP", "n_q_tiles"])
def _flash_bwd_dq_kernel(
    Q, K, V, DO, DQ, LSE2, DELTA,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_dqb, stride_dqh, stride_dqm,
    N_Q, N_KV, causal_offset, H_Q, GROUP, n_q_tiles, qk_scale, sm_scale, softcap2,
    FullCount, FullIndices, PartialCount, PartialIndices, PartialTileIds, PartialTiles,
    stride_cb, stride_ch, stride_ib, stride_ih, stride_il,
    AttnMask, stride_amb, stride_amh, stride_amm, stride_amn,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, SPARSE: tl.constexpr,
    MASK_BLOCK_Q: tl.constexpr, MASK_BLOCK_KV: tl.constexpr, ATTN_MASK: tl.constexpr,
    SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    tile = pid % n_q_tiles
    bh = pid // n_q_tiles
    if CAUSAL:  # later query tiles see more keys: start them first
        tile = n_q_tiles - 1 - tile
    b = (bh // H_Q).to(tl.int64)
    h = (bh % H_Q).to(tl.int64)
    kv_h = h // GROUP
    m0 = tile * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < N_Q
    q = _load_rows(Q + b * stride_qb + h * stride_qh
                   + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd,
                   offs_m, N_Q, offs_d, True, HEAD_DIM, BLOCK_D)
    do = _load_rows(DO + b * stride_dob + h * stride_doh
                    + offs_m[:, None] * stride_dom + offs_d[None, :] * stride_dod,
                    offs_m, N_Q, offs_d, True, HEAD_DIM, BLOCK_D)
    row0 = bh.to(tl.int64) * N_Q
    lse2 = tl.load(LSE2 + row0 + offs_m, mask=row_ok, other=float("inf"))
    delta = tl.load(DELTA + row0 + offs_m, mask=row_ok, other=0.0)

    K_bh = K + b * stride_kb + kv_h * stride_kh
    V_bh = V + b * stride_vb + kv_h * stride_vh
    am_base = AttnMask + b * stride_amb + h * stride_amh
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if SPARSE:
        # The BlockMask's lists for the mask block holding this tile, as in the forward:
        # full blocks (causal still applied elementwise), then partial ones through tiles.
        q_block = m0 // MASK_BLOCK_Q
        lists = b * stride_ib + h * stride_ih + q_block * stride_il
        counts = b * stride_cb + h * stride_ch + q_block
        dq = _dq_walk_listed_blocks(
            dq, q, do, lse2, delta, K_bh, V_bh, stride_kn, stride_kd, stride_vn, stride_vd,
            offs_m, offs_d, m0 % MASK_BLOCK_Q, N_Q, N_KV, causal_offset, qk_scale, softcap2,
            FullCount + counts, FullIndices + lists, PartialTileIds + lists, PartialTiles,
            am_base, stride_amm, stride_amn,
            CAUSAL, CAUSAL, False, ATTN_MASK, SOFTCAP, MASK_BLOCK_Q, MASK_BLOCK_KV,
            HEAD_DIM, BLOCK_D, BLOCK_N, DOT_PRECISION)
        dq = _dq_walk_listed_blocks(
            dq, q, do, lse2, delta, K_bh, V_bh, stride_kn, stride_kd, stride_vn, stride_vd,
            offs_m, offs_d, m0 % MASK_BLOCK_Q, N_Q, N_KV, causal_offset, qk_scale, softcap2,
            PartialCount + counts, PartialIndices + lists, PartialTileIds + lists,
            PartialTiles, am_base, stride_amm, stride_amn,
            True, CAUSAL, True, ATTN_MASK, SOFTCAP, MASK_BLOCK_Q, MASK_BLOCK_KV,
            HEAD_DIM, BLOCK_D, BLOCK_N, DOT_PRECISION)
    else:
        # -- the KV range: [0, n_full) full, [n_full, n_stop) partial.
        if CAUSAL:
            # The tile's last row sees keys < n_stop; its first row sees every key < n_full.
            n_stop = tl.maximum(tl.minimum(N_KV, tl.minimum(m0 + BLOCK_M, N_Q) + causal_offset),
                                0)
            n_full = tl.minimum(tl.maximum(m0 + causal_offset + 1, 0) // BLOCK_N,
                                N_KV // BLOCK_N) * BLOCK_N
        else:
            n_stop = N_KV
            n_full = (N_KV // BLOCK_N) * BLOCK_N
        dq = _dq_walk_kv_range(dq, q, do, lse2, delta, K_bh, V_bh,
                               stride_kn, stride_kd, stride_vn, stride_vd,
                               offs_m, offs_d, 0, n_full, N_Q, N_KV, causal_offset, qk_scale,
                               softcap2,
                               am_base, stride_amm, stride_amn,
                               False, CAUSAL, ATTN_MASK, SOFTCAP, HEAD_DIM, BLOCK_D, BLOCK_N,
                               DOT_PRECISION)
        dq = _dq_walk_kv_range(dq, q, do, lse2, delta, K_bh, V_bh,
                               stride_kn, stride_kd, stride_vn, stride_vd,
                               offs_m, offs_d, n_full, n_stop, N_Q, N_KV, causal_offset,
                               qk_scale, softcap2, am_base, stride_amm, stride_amn,
                               True, CAUSAL, ATTN_MASK, SOFTCAP, HEAD_DIM, BLOCK_D, BLOCK_N,
                               DOT_PRECISION)

    dq_ptrs = (DQ + b * stride_dqb + h * stride_dqh
               + offs_m[:, None] * stride_dqm + offs_d[None, :])
    tl.store(dq_ptrs, (dq * sm_scale).to(DQ.dtype.element_ty),
             mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM))


@triton.jit(do_not_specialize=["N_Q", "H_Q", "n_q_tiles"])
def _flash_bwd_preprocess_kernel(
    O, DO, LSE, DELTA, LSE2,  # noqa: E741 - kernel pointers are UPPER_CASE
    stride_ob, stride_oh, stride_om, stride_od,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_lb, stride_lh, stride_lm,
    N_Q, H_Q, n_q_tiles,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
):
    pid = tl.program_id(0)
    tile = pid % n_q_tiles
    bh = pid // n_q_tiles
    b = (bh // H_Q).to(tl.int64)
    h = (bh % H_Q).to(tl.int64)
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < N_Q
    o = _load_rows(O + b * stride_ob + h * stride_oh
                   + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od,
                   offs_m, N_Q, offs_d, True, HEAD_DIM, BLOCK_D)
    do = _load_rows(DO + b * stride_dob + h * stride_doh
                    + offs_m[:, None] * stride_dom + offs_d[None, :] * stride_dod,
                    offs_m, N_Q, offs_d, True, HEAD_DIM, BLOCK_D)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    lse = tl.load(LSE + b * stride_lb + h * stride_lh + offs_m * stride_lm, mask=row_ok,
                  other=0.0)
    # A row that saw no key has lse = -inf; +inf makes its P = exp2(s - inf) = 0, not NaN.
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * LOG2_E_JIT)
    row0 = bh.to(tl.int64) * N_Q
    tl.store(DELTA + row0 + offs_m, delta, mask=row_ok)
    tl.store(LSE2 + row0 + offs_m, lse2, mask=row_ok)


# ----------------------------------------------------------------------------- host side
def _check_tensor(name: str, t: object, dims: int, what: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, but got {type(t).__name__}")
    if t.dim() != dims:
        raise ValueError(f"{name} must be {dims}-D {what}, but got shape {tuple(t.shape)}")
    return t


def validate_inputs(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    o: torch.Tensor, lse: torch.Tensor, causal: bool | str,
                    scale: float | None) -> tuple[str, float]:
    """Check shapes, dtypes and devices of the backward's inputs; return (causal mode, scale)."""
    layout = "(batch, heads, seqlen, head_dim)"
    for name, t in (("q", q), ("k", k), ("v", v), ("o", o), ("do", do)):
        _check_tensor(name, t, 4, layout)
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name} must be float16, bfloat16 or float32, but got {t.dtype}")
        if t.numel() == 0:
            raise ValueError(f"{name} must not be empty, but got shape {tuple(t.shape)}")
    _check_tensor("lse", lse, 3, "(batch, heads_q, seqlen_q)")
    if not (q.dtype == k.dtype == v.dtype == o.dtype == do.dtype):
        raise TypeError(f"q, k, v, o and do must share one dtype, but got {q.dtype}, {k.dtype}, "
                        f"{v.dtype}, {o.dtype}, {do.dtype}")
    if lse.dtype != torch.float32:
        raise TypeError(f"lse must be float32 (the forward's logsumexp), but got {lse.dtype}")
    devices = {t.device for t in (q, k, v, o, do, lse)}
    if len(devices) != 1:
        raise ValueError(f"q, k, v, o, do and lse must be on one device, but got "
                         f"{sorted(str(d) for d in devices)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape (batch, heads_kv, seqlen_kv, "
                         f"head_dim), but got {tuple(k.shape)} and {tuple(v.shape)}")
    if o.shape != q.shape or do.shape != q.shape:
        raise ValueError(f"o and do must have q's shape {tuple(q.shape)}, but got "
                         f"{tuple(o.shape)} and {tuple(do.shape)}")
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"q and k must have the same batch size, but got {q.shape[0]} and "
                         f"{k.shape[0]}")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"q and k must have the same head_dim, but got {q.shape[3]} and "
                         f"{k.shape[3]}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"heads of q ({q.shape[1]}) must be a multiple of heads of k/v "
                         f"({k.shape[1]})")
    if q.shape[3] > MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be at most {MAX_HEAD_DIM}, but got {q.shape[3]}")
    if lse.shape != q.shape[:3]:
        raise ValueError(f"lse must have shape (batch, heads_q, seqlen_q) = {tuple(q.shape[:3])}, "
                         f"but got {tuple(lse.shape)}")
    mode = normalize_causal(causal)
    if scale is None:
        return mode, 1.0 / math.sqrt(q.shape[3])
    if isinstance(scale, bool) or not isinstance(scale, int | float) or not math.isfinite(scale):
        raise ValueError(f"scale must be a finite number or None, but got {scale!r}")
    return mode, float(scale)


def _int_field(config: Mapping[str, object], name: str) -> int:
    value = config[name]
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"config field {name} must be an integer, but got {value!r}")
    return value


def _empty(shape: tuple[int, ...], like: torch.Tensor, dtype: torch.dtype,
           strides: tuple[int, ...] | None = None) -> torch.Tensor:
    """An output of ``shape`` on ``like``'s device, contiguous or laid out by ``strides``
    (NaN-filled under DEBUG_POISON)."""
    out = (torch.empty(shape, device=like.device, dtype=dtype) if strides is None
           else torch.empty_strided(shape, strides, device=like.device, dtype=dtype))
    return out.fill_(float("nan")) if DEBUG_POISON else out


def launch(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           o: torch.Tensor, lse: torch.Tensor, *, causal_mode: str, scale: float,
           config: Mapping[str, object], block_mask: Any = None,
           attn_mask: torch.Tensor | None = None, softcap: float = 0.0
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run the backward on validated inputs with a config given as a plain mapping.

    ``block_mask``: the forward's ``templates.masks.block_mask.BlockMask`` (already checked against
    q and k; the dK/dV pass walks its ``transposed`` lists); ``attn_mask``: the forward's,
    as ``flash_fwd_kernel.attn_mask_view`` returns it; ``softcap``: the forward's cap (0:
    none). Returns (dq, dk, dv), contiguous, in
    the inputs' dtype and shapes.
    """
    rows = tuple(q.shape[:3])
    delta = _empty(rows, q, torch.float32)
    lse2 = _empty(rows, q, torch.float32)
    dk = _empty(tuple(k.shape), k, k.dtype)
    dv = _empty(tuple(v.shape), v, v.dtype)
    atomic = str(config["dq_mode"]) == "atomic"
    # Atomic mode accumulates dQ in fp32 (zeroed: every visited tile adds into it).
    dq = (torch.zeros(q.shape, device=q.device, dtype=torch.float32) if atomic
          else _empty(tuple(q.shape), q, q.dtype))
    calls = kernel_calls(do, q, k, v, o, lse, delta, lse2, dq, dk, dv,
                         causal_mode=causal_mode, scale=scale, config=config,
                         block_mask=block_mask, attn_mask=attn_mask, softcap=softcap)
    with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
        for kernel, grid, args, options in calls:
            kernel[grid](*args, **options)
    return (dq.to(q.dtype) if atomic else dq), dk, dv


def kernel_calls(do: Any, q: Any, k: Any, v: Any, o: Any, lse: Any, delta: Any, lse2: Any,
                 dq: Any, dk: Any, dv: Any, *, causal_mode: str, scale: float,
                 config: Mapping[str, object], block_mask: Any = None, attn_mask: Any = None,
                 softcap: float = 0.0
                 ) -> list[tuple[Any, tuple[int, ...], list[Any], dict[str, Any]]]:
    """(kernel, grid, positional arguments, options) of each launch, in launch order.

    ``delta``/``lse2`` are (B, H_q, N_q) float32 row buffers, ``dq`` the fp32 accumulator
    (atomic mode) or the output; all contiguous. The tensors may be stand-ins with dtype,
    shape, stride() and data_ptr(), so that ``kernel.warmup`` can compile exactly what a
    launch would without any memory.
    """
    batch, heads_q, seqlen_q, head_dim = q.shape
    heads_kv, seqlen_kv = k.shape[1], k.shape[2]
    block_d = block_d_for(head_dim)
    block_m1, block_n1 = _int_field(config, "BLOCK_M1"), _int_field(config, "BLOCK_N1")
    block_m2, block_n2 = _int_field(config, "BLOCK_M2"), _int_field(config, "BLOCK_N2")
    warps_stages = dict(num_warps=_int_field(config, "num_warps"),
                        num_stages=_int_field(config, "num_stages"))
    dq_mode = str(config["dq_mode"])
    if dq_mode not in DQ_MODES:
        raise ValueError(f"dq_mode must be one of {list(DQ_MODES)}, but got {dq_mode!r}")
    atomic = dq_mode == "atomic"
    causal = causal_mode != "none"
    offset = causal_offset(causal_mode, seqlen_q, seqlen_kv)
    group = heads_q // heads_kv
    qk_scale = scale * LOG2_E
    # fp32 inputs (tests) get exact fp32 dots; 16-bit inputs ignore the option.
    precision = "ieee" if q.dtype == torch.float32 else None

    pre_m = max(16, PREPROCESS_TILE_ELEMENTS // block_d)
    pre_tiles = triton.cdiv(seqlen_q, pre_m)
    calls: list[tuple[Any, tuple[int, ...], list[Any], dict[str, Any]]] = [(
        _flash_bwd_preprocess_kernel, (pre_tiles * batch * heads_q,),
        [o, do, lse, delta, lse2, *o.stride(), *do.stride(), *lse.stride(),
         seqlen_q, heads_q, pre_tiles],
        dict(HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=pre_m, num_warps=PREPROCESS_WARPS))]

    # Unused mask arguments point at lse: their code is compiled out (SPARSE, ATTN_MASK).
    if attn_mask is not None:
        mask_args = [attn_mask, *attn_mask.stride()]
        mask_kind = 1 if attn_mask.dtype == torch.uint8 else 2
    else:
        mask_args, mask_kind = [lse, 0, 0, 0, 0], 0
    sparse = block_mask is not None
    mask_block_q, mask_block_kv = block_mask.block_size if sparse else (block_m1, block_n1)
    masks = dict(SPARSE=sparse, MASK_BLOCK_Q=mask_block_q, MASK_BLOCK_KV=mask_block_kv,
                 ATTN_MASK=mask_kind, SOFTCAP=softcap > 0)

    kv_tiles = triton.cdiv(seqlen_kv, block_n1)
    calls.append((
        _flash_bwd_dkdv_kernel, (kv_tiles * batch * heads_kv,),
        [q, k, v, do, dk, dv, dq, lse2, delta,
         *q.stride(), *k.stride(), *v.stride(), *do.stride(),
         *dk.stride()[:3], *dq.stride()[:3],
         seqlen_q, seqlen_kv, offset, heads_q, heads_kv, group, kv_tiles, qk_scale, scale,
         softcap * LOG2_E,
         *(block_mask.transposed.kernel_args() if sparse else [lse] * 6 + [0] * 5),
         *mask_args],
        dict(HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=block_m1, BLOCK_N=block_n1,
             CAUSAL=causal, EVEN_M=seqlen_q % block_m1 == 0, ATOMIC_DQ=atomic,
             # Full blocks of the last query block may hold rows past N_q: mask their loads.
             SPARSE_FULL_MASKED=causal or seqlen_q % mask_block_q != 0,
             DOT_PRECISION=precision, **masks, **warps_stages)))
    if not atomic:
        q_tiles = triton.cdiv(seqlen_q, block_m2)
        calls.append((
            _flash_bwd_dq_kernel, (q_tiles * batch * heads_q,),
            [q, k, v, do, dq, lse2, delta,
             *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dq.stride()[:3],
             seqlen_q, seqlen_kv, offset, heads_q, group, q_tiles, qk_scale, scale,
             softcap * LOG2_E,
             *(block_mask.kernel_args() if sparse else [lse] * 6 + [0] * 5),
             *mask_args],
            dict(HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=block_m2, BLOCK_N=block_n2,
                 CAUSAL=causal, DOT_PRECISION=precision, **masks, **warps_stages)))
    return calls
