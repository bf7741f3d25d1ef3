"""FlashAttention forward: the Triton kernel family and its launcher.

This module imports only torch and triton: ``FlashFwdTemplate.standalone_source`` emits it
verbatim, with a tuned config appended, as a module a user can drop into a project.

One kernel, specialized by ``tl.constexpr``:
  * online softmax (running max ``m_i``, running sum ``l_i``, rescaled fp32 accumulator),
    exp2 with ``scale * log2(e)`` folded into one multiply;
  * KV blocks split per query tile into *full* blocks (every key visible to every row of the
    tile and inside ``N_kv``: no elementwise mask) and *partial* blocks (the causal diagonal and
    the ``N_kv`` tail: masked); blocks above the causal diagonal never run. A block-sparse
    variant can replace the two ranges by per-tile lists of full and partial block indices;
  * loads through pointers (any strides, masked only where needed) or through host-side TMA
    tensor descriptors (rank-4 over (B, H, N, D), so strided views need no copy and rows past
    ``N`` read as zeros and are never written);
  * GQA/MQA by indexing: query head ``h`` reads kv head ``h // (H_q // H_kv)``;
  * head dims up to 256, padded inside the kernel to ``BLOCK_D`` (a power of two >= 16).

Outputs: ``o`` (B, H_q, N_q, D) in the input dtype (contiguous, or laid out as q where q is
a (B, N, H, D) tensor viewed so: ``output_strides``), and ``lse`` (B, H_q, N_q)
float32, the natural-log logsumexp of the scaled (and, with ``softcap``, capped) scores; a row
that sees no key gets o = 0 and lse = -inf.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Any

import torch
import triton
import triton.language as tl

from templates.compile.direct_launch import DirectLaunch, PlannedDescriptor, current_stream
from templates.flash.softcap import softcapped
from templates.kernel_common import (  # noqa: F401  CAUSAL_MODES is re-exported
    CAUSAL_MODES,
    LN_2,
    LOG2_E,
    block_d_for,
    causal_offset,
    normalize_causal,
    output_strides,
)
from templates.masks.listed_blocks import listed_block_step

# log2(e) and ln(2) inside the kernels: a jit function reads a global only as a constexpr.
LOG2_E_JIT = tl.constexpr(LOG2_E)
LN_2_JIT = tl.constexpr(LN_2)

try:  # host-side TMA descriptors (triton >= 3.3 with a Hopper-or-newer GPU, or the interpreter)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older triton
    TensorDescriptor = None

GRID_ORDERS = ("tiles_inner", "heads_inner")
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256

# Tests set this: the launcher then fills ``o`` and ``lse`` with NaN before the kernel runs,
# so an element the kernel forgets to write shows up as NaN instead of stale memory.
DEBUG_POISON = False


# ----------------------------------------------------------------------------- kernels
@triton.jit
def _kv_step(
    acc, l_i, m_i, q,
    K, V, kv_b, kv_h,
    stride_kn, stride_kd, stride_vn, stride_vd,
    start_n, offs_m, N_Q, N_KV, causal_offset, qk_scale, softcap2,
    tile_base, am_base, stride_amm, stride_amn,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, TILE: tl.constexpr, TILE_STRIDE: tl.constexpr,
    ATTN_MASK: tl.constexpr, SOFTCAP: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_TMA: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Fold the KV block [start_n, start_n + BLOCK_N) into the running (acc, l_i, m_i).

    Each mask is a compile-time switch, so a block that needs none runs none of their code:
    ``MASKED`` (keys past N_kv, and the causal diagonal when ``CAUSAL``), ``TILE`` (the block
    mask's elementwise tile of a partial block, uint8 rows ``TILE_STRIDE`` apart from
    ``tile_base``), ``ATTN_MASK`` (0 none, 1 bool, 2 additive: SDPA's attn_mask read tile by
    tile from ``am_base``). Masked blocks may hold rows with no visible key yet.
    ``SOFTCAP``: the scaled scores are capped (``templates.flash.softcap``; ``softcap2`` is
    the cap times log2(e)) before any mask; off, the step is what it was before softcap.
    With pointer loads ``K``/``V`` point at the (batch, kv head) base; with TMA they are
    rank-4 descriptors indexed by (kv_b, kv_h, row, 0).
    """
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    start_n = tl.multiple_of(start_n, BLOCK_N)
    keys = start_n + offs_n
    if USE_TMA:
        k = K.load([kv_b, kv_h, start_n, 0]).reshape(BLOCK_N, BLOCK_D)
    else:
        k_ptrs = K + keys[:, None] * stride_kn + offs_d[None, :] * stride_kd
        if MASKED:
            k = tl.load(k_ptrs, mask=(keys[:, None] < N_KV) & d_ok[None, :], other=0.0)
        elif BLOCK_D != HEAD_DIM:
            k = tl.load(k_ptrs, mask=d_ok[None, :], other=0.0)
        else:
            k = tl.load(k_ptrs)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    if SOFTCAP:
        s = softcapped(s * qk_scale, softcap2)
    elif MASKED or TILE or ATTN_MASK != 0:
        s = s * qk_scale
    if MASKED or TILE or ATTN_MASK != 0:
        visible = (keys[None, :] < N_KV) & (offs_m[:, None] >= 0)  # (BLOCK_M, BLOCK_N)
        if MASKED and CAUSAL:
            visible = visible & (keys[None, :] <= offs_m[:, None] + causal_offset)
        if TILE == 2:
            # (doc_offsets) key j visible to row i iff first[i] <= j <= i: the rows' first
            # visible keys (``tile_base``, int32, one per row) instead of a uint8 tile.
            rows = tl.arange(0, offs_m.shape[0])
            first = tl.load(tile_base + rows)
            visible = visible & (keys[None, :] >= first[:, None]) & (
                keys[None, :] <= offs_m[:, None])
        elif TILE:
            rows = tl.arange(0, offs_m.shape[0])
            tile = tl.load(tile_base + rows[:, None] * TILE_STRIDE + offs_n[None, :])
            visible = visible & (tile != 0)
        if ATTN_MASK != 0:
            am = tl.load(am_base + offs_m[:, None] * stride_amm + keys[None, :] * stride_amn,
                         mask=(offs_m[:, None] < N_Q) & (keys[None, :] < N_KV), other=0)
            if ATTN_MASK == 1:
                visible = visible & (am != 0)
            else:  # additive, in the log2 domain of the scores
                s = s + am.to(tl.float32) * LOG2_E_JIT
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row with no visible key so far keeps m = -inf: shift by 0 instead, so that
        # exp2(-inf - -inf) never makes a NaN; its p and alpha are then exactly 0.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_shift[:, None])
    elif SOFTCAP:  # s is already capped and scaled
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_shift = m_new
        p = tl.math.exp2(s - m_shift[:, None])
    else:
        # max(s) * scale is the scaled scores' max only for scale > 0: the launcher makes it so
        # (LaunchPlan.negate_q), keeping this step one FMA per score.
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        m_shift = m_new
        p = tl.math.exp2(s * qk_scale - m_shift[:, None])
    alpha = tl.math.exp2(m_i - m_shift)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    if USE_TMA:
        v = V.load([kv_b, kv_h, start_n, 0]).reshape(BLOCK_N, BLOCK_D)
    else:
        v_ptrs = V + keys[:, None] * stride_vn + offs_d[None, :] * stride_vd
        if MASKED:
            v = tl.load(v_ptrs, mask=(keys[:, None] < N_KV) & d_ok[None, :], other=0.0)
        elif BLOCK_D != HEAD_DIM:
            v = tl.load(v_ptrs, mask=d_ok[None, :], other=0.0)
        else:
            v = tl.load(v_ptrs)
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
    return acc, l_i, m_new


@triton.jit
def _attend_kv_range(
    acc, l_i, m_i, q,
    K, V, kv_b, kv_h,
    stride_kn, stride_kd, stride_vn, stride_vd,
    offs_m, kv_lo, kv_hi, N_Q, N_KV, causal_offset, qk_scale, softcap2,
    am_base, stride_amm, stride_amn,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, ATTN_MASK: tl.constexpr, SOFTCAP: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_TMA: tl.constexpr, LOOP_STAGES: tl.constexpr, LOOP_UNROLL: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Fold the contiguous KV blocks [kv_lo, kv_hi) (dense and causal attention)."""
    for start_n in tl.range(kv_lo, kv_hi, BLOCK_N, num_stages=LOOP_STAGES,
                            loop_unroll_factor=LOOP_UNROLL, warp_specialize=WARP_SPECIALIZE):
        acc, l_i, m_i = _kv_step(
            acc, l_i, m_i, q, K, V, kv_b, kv_h, stride_kn, stride_kd, stride_vn, stride_vd,
            start_n, offs_m, N_Q, N_KV, causal_offset, qk_scale, softcap2,
            am_base, am_base, stride_amm, stride_amn,
            MASKED, CAUSAL, False, 1, ATTN_MASK, SOFTCAP, HEAD_DIM, BLOCK_D, BLOCK_N, USE_TMA,
            DOT_PRECISION)
    return acc, l_i, m_i


@triton.jit
def _attend_listed_blocks(
    acc, l_i, m_i, q,
    K, V, kv_b, kv_h,
    stride_kn, stride_kd, stride_vn, stride_vd,
    offs_m, tile_row, N_Q, N_KV, causal_offset, qk_scale, softcap2,
    Count, Indices, TileIds, Tiles,
    am_base, stride_amm, stride_amn,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, TILE: tl.constexpr, ATTN_MASK: tl.constexpr,
    SOFTCAP: tl.constexpr, MASK_BLOCK_Q: tl.constexpr, MASK_BLOCK_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_TMA: tl.constexpr, LOOP_STAGES: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Fold the KV blocks a BlockMask lists for this query block (``Count`` of them, indices
    at ``Indices``), each as MASK_BLOCK_KV / BLOCK_N kernel steps; one flat loop, so the
    pipeliner overlaps loads across listed blocks. ``TILE``: partial blocks, whose uint8 tile
    (row ``tile_row`` of it first) is at ``Tiles`` + its id * MASK_BLOCK_Q * MASK_BLOCK_KV;
    ``TILE`` 2 (doc_offsets): ``Tiles`` is the tile's rows' first visible keys instead."""
    n = tl.load(Count)
    for t in tl.range(0, n * (MASK_BLOCK_KV // BLOCK_N), num_stages=LOOP_STAGES):
        start_n, tile_base = listed_block_step(Indices, TileIds, Tiles, t, tile_row,
                                               MASK_BLOCK_KV, BLOCK_N,
                                               MASK_BLOCK_Q * MASK_BLOCK_KV, TILE == 1)
        acc, l_i, m_i = _kv_step(
            acc, l_i, m_i, q, K, V, kv_b, kv_h, stride_kn, stride_kd, stride_vn, stride_vd,
            start_n, offs_m, N_Q, N_KV, causal_offset, qk_scale, softcap2,
            tile_base, am_base, stride_amm, stride_amn,
            MASKED, CAUSAL, TILE, MASK_BLOCK_KV, ATTN_MASK, SOFTCAP, HEAD_DIM, BLOCK_D,
            BLOCK_N, USE_TMA, DOT_PRECISION)
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["N_Q", "N_KV", "causal_offset", "H_Q", "GROUP", "BH",
                               "n_q_tiles"])
def _flash_fwd_kernel(
    Q, K, V, Out, LSE,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_om, stride_od,
    N_Q, N_KV, causal_offset, H_Q, GROUP, BH, n_q_tiles, qk_scale, softcap2,
    FullCount, FullIndices, PartialCount, PartialIndices, PartialTileIds, PartialTiles,
    stride_cb, stride_ch, stride_ib, stride_ih, stride_iq,
    AttnMask, stride_amb, stride_amh, stride_amm, stride_amn,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, USE_TMA: tl.constexpr,
    GRID_ORDER: tl.constexpr, LONGEST_FIRST: tl.constexpr,
    NUM_STAGES: tl.constexpr, MASKED_LOOP_STAGES: tl.constexpr, LOOP_UNROLL: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    SPARSE: tl.constexpr, MASK_BLOCK_Q: tl.constexpr, MASK_BLOCK_KV: tl.constexpr,
    ATTN_MASK: tl.constexpr, SOFTCAP: tl.constexpr,
):
    # -- which (batch, head, query tile) this program owns: a 1-D grid decoded here, so the
    # launch order is a knob and no grid axis can exceed its hardware limit.
    pid = tl.program_id(0)
    if GRID_ORDER == 0:  # tiles_inner: the tiles of one head run together (its K/V stay in L2)
        tile = pid % n_q_tiles
        bh = pid // n_q_tiles
    else:  # heads_inner: the heads of one tile run together
        bh = pid % BH
        tile = pid // BH
    if LONGEST_FIRST:  # causal: later tiles see more keys; start them first
        tile = n_q_tiles - 1 - tile
    b = bh // H_Q
    h = bh % H_Q
    kv_h = h // GROUP
    m0 = tile * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < N_Q
    d_ok = offs_d < HEAD_DIM

    if USE_TMA:
        q = Q.load([b, h, m0, 0]).reshape(BLOCK_M, BLOCK_D)
        K_base = K
        V_base = V
    else:
        q_ptrs = (Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
                  + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd)
        q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        K_base = K + b.to(tl.int64) * stride_kb + kv_h.to(tl.int64) * stride_kh
        V_base = V + b.to(tl.int64) * stride_vb + kv_h.to(tl.int64) * stride_vh

    # SDPA's attn_mask (B|1, H|1, N_q, N_kv): broadcast dims have stride 0.
    am_base = AttnMask + b.to(tl.int64) * stride_amb + h.to(tl.int64) * stride_amh

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if SPARSE:
        # The BlockMask's lists for the mask block holding this tile (BLOCK_M divides
        # MASK_BLOCK_Q): full blocks unmasked (but for causal, applied on top elementwise),
        # then partial blocks through their tiles; unlisted blocks are never touched.
        q_block = m0 // MASK_BLOCK_Q
        lists = b.to(tl.int64) * stride_ib + h.to(tl.int64) * stride_ih + q_block * stride_iq
        counts = b.to(tl.int64) * stride_cb + h.to(tl.int64) * stride_ch + q_block
        acc, l_i, m_i = _attend_listed_blocks(
            acc, l_i, m_i, q, K_base, V_base, b, kv_h,
            stride_kn, stride_kd, stride_vn, stride_vd,
            offs_m, m0 % MASK_BLOCK_Q, N_Q, N_KV, causal_offset, qk_scale, softcap2,
            FullCount + counts, FullIndices + lists, PartialTileIds + lists, PartialTiles,
            am_base, stride_amm, stride_amn,
            CAUSAL, CAUSAL, False, ATTN_MASK, SOFTCAP, MASK_BLOCK_Q, MASK_BLOCK_KV,
            HEAD_DIM, BLOCK_D, BLOCK_N, USE_TMA, NUM_STAGES, DOT_PRECISION)
        # TILE = SPARSE: 1 the uint8 tiles, 2 (doc_offsets) PartialTiles is the rows' first
        # visible keys, read from this tile's first row on.
        acc, l_i, m_i = _attend_listed_blocks(
            acc, l_i, m_i, q, K_base, V_base, b, kv_h,
            stride_kn, stride_kd, stride_vn, stride_vd,
            offs_m, m0 % MASK_BLOCK_Q, N_Q, N_KV, causal_offset, qk_scale, softcap2,
            PartialCount + counts, PartialIndices + lists, PartialTileIds + lists,
            PartialTiles + m0 * (SPARSE - 1), am_base, stride_amm, stride_amn,
            True, CAUSAL, SPARSE, ATTN_MASK, SOFTCAP, MASK_BLOCK_Q, MASK_BLOCK_KV,
            HEAD_DIM, BLOCK_D, BLOCK_N, USE_TMA, MASKED_LOOP_STAGES, DOT_PRECISION)
    else:
        # The KV range of this tile: [0, full_end) needs no mask, [full_end, kv_end) does.
        if CAUSAL:
            # Row i sees keys j <= i + causal_offset (0 top-left, N_kv - N_q bottom-right).
            kv_end = tl.maximum(tl.minimum(N_KV, m0 + BLOCK_M + causal_offset), 0)
            first_row_sees = tl.maximum(m0 + causal_offset + 1, 0)
            full_end = tl.minimum(first_row_sees // BLOCK_N, N_KV // BLOCK_N) * BLOCK_N
        else:
            kv_end = N_KV
            full_end = (N_KV // BLOCK_N) * BLOCK_N
        acc, l_i, m_i = _attend_kv_range(
            acc, l_i, m_i, q, K_base, V_base, b, kv_h,
            stride_kn, stride_kd, stride_vn, stride_vd,
            offs_m, 0, full_end, N_Q, N_KV, causal_offset, qk_scale, softcap2,
            am_base, stride_amm, stride_amn,
            False, CAUSAL, ATTN_MASK, SOFTCAP, HEAD_DIM, BLOCK_D, BLOCK_N,
            USE_TMA, NUM_STAGES, LOOP_UNROLL, WARP_SPECIALIZE, DOT_PRECISION)
        acc, l_i, m_i = _attend_kv_range(
            acc, l_i, m_i, q, K_base, V_base, b, kv_h,
            stride_kn, stride_kd, stride_vn, stride_vd,
            offs_m, full_end, kv_end, N_Q, N_KV, causal_offset, qk_scale, softcap2,
            am_base, stride_amm, stride_amn,
            True, CAUSAL, ATTN_MASK, SOFTCAP, HEAD_DIM, BLOCK_D, BLOCK_N,
            USE_TMA, MASKED_LOOP_STAGES, 1, False, DOT_PRECISION)

    # -- epilogue: normalize; rows that saw no key get o = 0 and lse = -inf (never NaN).
    seen = l_i > 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    o = acc / l_safe[:, None]
    lse = tl.where(seen, (m_i + tl.math.log2(l_safe)) * LN_2_JIT, float("-inf"))
    tl.store(LSE + bh.to(tl.int64) * N_Q + offs_m, lse, mask=row_ok)
    if USE_TMA:
        Out.store([b, h, m0, 0], o.to(q.dtype).reshape(1, 1, BLOCK_M, BLOCK_D))
    else:
        o_ptrs = (Out + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
                  + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od)
        tl.store(o_ptrs, o.to(q.dtype), mask=row_ok[:, None] & d_ok[None, :])


# ----------------------------------------------------------------------------- host side
def validate_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    causal: bool | str, scale: float | None) -> tuple[str, float]:
    """Check shapes, dtypes and devices; return (causal mode, softmax scale)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, but got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D (batch, heads, seqlen, head_dim), "
                             f"but got shape {tuple(t.shape)}")
        if not t.is_floating_point() or t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name} must be float16, bfloat16 or float32, but got {t.dtype}")
        if t.numel() == 0:
            raise ValueError(f"{name} must not be empty, but got shape {tuple(t.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must share one dtype, but got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must be on one device, but got {q.device}, {k.device}, "
                         f"{v.device}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape (batch, heads_kv, seqlen_kv, "
                         f"head_dim), but got {tuple(k.shape)} and {tuple(v.shape)}")
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
    mode = normalize_causal(causal)
    if scale is None:
        return mode, 1.0 / math.sqrt(q.shape[3])
    if isinstance(scale, bool) or not isinstance(scale, int | float) or not math.isfinite(scale):
        raise ValueError(f"scale must be a finite number or None, but got {scale!r}")
    return mode, float(scale)


def tma_layout_problem(shape: tuple[int, ...], strides: tuple[int, ...], data_ptr: int,
                       element_size: int, name: str) -> str | None:
    """Why a rank-4 TMA descriptor cannot cover a tensor laid out so (None if it can)."""
    if strides[-1] != 1:
        return f"TMA needs {name}'s last dimension contiguous, but its strides are {strides}"
    for dim, (size, stride) in enumerate(zip(shape[:-1], strides[:-1], strict=True)):
        if size > 1 and (stride <= 0 or (stride * element_size) % 16):
            return (f"TMA needs every stride of {name} to be a positive multiple of 16 bytes, "
                    f"but dim {dim} has stride {stride} ({stride * element_size} bytes)")
    if data_ptr % 16:
        return f"TMA needs {name} to start at a 16-byte aligned address"
    return None


def tma_inputs_problem(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
    """Why q, k, v (and the output, laid out by ``output_strides``) cannot be read through TMA
    (None if they can).

    Callers check once per launch plan (``templates.flash.fwd``, ``tuner.attention``)."""
    batch, heads, seqlen, head_dim = q.shape
    o_strides = output_strides(tuple(q.shape), tuple(q.stride()))
    for name, shape, strides, ptr in (("q", q.shape, q.stride(), q.data_ptr()),
                                      ("k", k.shape, k.stride(), k.data_ptr()),
                                      ("v", v.shape, v.stride(), v.data_ptr()),
                                      ("o", q.shape, o_strides, 0)):
        reason = tma_layout_problem(tuple(shape), tuple(strides), ptr, q.element_size(), name)
        if reason:
            return reason
    return None


def attn_mask_view(attn_mask: Any, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """SDPA's ``attn_mask`` checked and viewed as (B, H_q, N_q, N_kv) without a copy (stride 0
    on broadcast dims); bool masks as uint8 (1 = attend), float masks added to the scores."""
    if not isinstance(attn_mask, torch.Tensor):
        raise TypeError(f"attn_mask must be a torch.Tensor or None, but got "
                        f"{type(attn_mask).__name__}")
    if attn_mask.dtype != torch.bool and attn_mask.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"attn_mask must be bool (True = attend) or float16/bfloat16/float32 "
                        f"(added to the scores), but got {attn_mask.dtype}")
    if attn_mask.device != q.device:
        raise ValueError(f"attn_mask must be on q's device {q.device}, but is on "
                         f"{attn_mask.device}")
    full = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    try:
        if attn_mask.dim() > 4 or torch.broadcast_shapes(attn_mask.shape, full) != full:
            raise RuntimeError
    except RuntimeError:
        raise ValueError(f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to "
                         f"(B, H_q, N_q, N_kv) = {full}") from None
    view = attn_mask.expand(full)
    return view.view(torch.uint8) if view.dtype == torch.bool else view


def broadcast_attn_mask(attn_mask: torch.Tensor, q: Any, k: Any) -> torch.Tensor:
    """The (B, H_q, N_q, N_kv) view of an ``attn_mask`` that ``attn_mask_view`` accepted, as
    the kernel reads it: broadcast dims with stride 0, bool as uint8."""
    view = attn_mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    return view.view(torch.uint8) if view.dtype == torch.bool else view


def launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal_mode: str,
           scale: float, config: Mapping[str, Any], block_mask: Any = None,
           attn_mask: torch.Tensor | None = None, softcap: float = 0.0
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the kernel on validated inputs with a config given as a plain mapping.

    ``block_mask``: a ``templates.masks.block_mask.BlockMask`` (already checked against q and k);
    ``attn_mask``: as returned by ``attn_mask_view``; ``softcap``: the cap (0: none), as
    ``check_softcap`` returns it."""
    if config["use_tma"]:
        reason = tma_inputs_problem(q, k, v)
        if reason:
            raise ValueError(f"{reason}; use a config with use_tma=False")
    plan = LaunchPlan(q, k, v, causal_mode=causal_mode, scale=scale, config=config,
                      block_mask=block_mask, attn_mask=attn_mask, softcap=softcap)
    return plan(q, k, v, block_mask, attn_mask)


def kernel_call(q: Any, k: Any, v: Any, o: Any, lse: Any, *, causal_mode: str, scale: float,
                config: Mapping[str, Any], block_mask: Any = None, attn_mask: Any = None,
                softcap: float = 0.0) -> tuple[tuple[int], list[Any], dict[str, Any]]:
    """Grid, positional arguments and options of one launch (``o`` and ``lse`` contiguous).

    The tensors may be triton's ``MockTensor`` stand-ins (dtype and shape, contiguous), so that
    ``_flash_fwd_kernel.warmup`` can compile exactly what a launch would without any memory.
    """
    plan = LaunchPlan(q, k, v, causal_mode=causal_mode, scale=scale, config=config,
                      block_mask=block_mask, attn_mask=attn_mask, softcap=softcap)
    return plan.grid, plan.args(q, k, v, o, lse, block_mask, attn_mask), plan.options


def _tma_descriptor(tensor: Any, block: list[int]) -> Any:
    return TensorDescriptor.from_tensor(tensor, block)


# Keyword arguments of a launch that are Triton's options, not the kernel's constexprs.
LAUNCH_OPTIONS = ("num_warps", "num_stages")
# The mask arguments of a dense launch (SPARSE and ATTN_MASK off compile their code out): the
# block mask's six lists and five strides, SDPA's mask and its four strides. Null pointers on
# a direct launch; the JIT's path passes lse for them (it must type them as pointers).
_NO_MASK_ARGS: tuple[Any, ...] = (None,) * 6 + (0,) * 5 + (None,) + (0,) * 4


class LaunchPlan:
    """One launch of ``_flash_fwd_kernel`` less its tensors: the grid, the compile-time options
    and every scalar argument, worked out once from the inputs' shapes, strides and dtype, the
    causal mode, the scale, the softcap (0: none), the config and the kinds of mask.

    Calling it launches on tensors laid out like the ones it was made from (same shapes,
    strides, dtype and device; for TMA, 16-byte aligned): then the only host work left is two
    allocations, the argument list and the launch. A caller that checks inputs once per layout
    and keeps the plan (``templates.flash.fwd`` does) pays for the checks once.

    Dense calls (no mask) launch through a ``DirectLaunch`` once the first has compiled: every
    integer argument is fixed by the plan, so what Triton specializes on beyond the plan is the
    16-byte alignment of the pointers; calls whose five pointers (q, k, v, o, lse) are all
    aligned (always so for the outputs) take the direct launch, others the JIT's.
    """

    def __init__(self, q: Any, k: Any, v: Any, *, causal_mode: str, scale: float,
                 config: Mapping[str, Any], block_mask: Any = None,
                 attn_mask: Any = None, softcap: float = 0.0) -> None:
        batch, heads_q, seqlen_q, head_dim = q.shape
        heads_kv, seqlen_kv = k.shape[1], k.shape[2]
        block_m, block_n = int(config["BLOCK_M"]), int(config["BLOCK_N"])
        block_d = block_d_for(head_dim)
        num_stages = int(config["num_stages"])
        causal = causal_mode != "none"
        n_q_tiles = -(-seqlen_q // block_m)
        self.use_tma = bool(config["use_tma"])
        if self.use_tma and TensorDescriptor is None:
            raise RuntimeError("use_tma=True needs triton.tools.tensor_descriptor (triton >= 3.3)")
        self.grid = (n_q_tiles * batch * heads_q,)
        self.out_shape = (batch, heads_q, seqlen_q, head_dim)
        self.lse_shape = (batch, heads_q, seqlen_q)
        self.out_strides = output_strides(self.out_shape, tuple(q.stride()))
        self.scalars = [*q.stride(), *k.stride(), *v.stride(), *self.out_strides,
                        seqlen_q, seqlen_kv, causal_offset(causal_mode, seqlen_q, seqlen_kv),
                        heads_q, heads_q // heads_kv, batch * heads_q, n_q_tiles,
                        abs(scale) * LOG2_E, softcap * LOG2_E]
        # A negative scale runs as -q with |scale| (the same scores, exactly): the unmasked
        # step takes the row max before scaling, right only for a positive scale.
        self.negate_q = scale < 0
        self.block_shapes = ([1, 1, block_m, block_d], [1, 1, block_n, block_d])
        if block_mask is not None:
            mask_block_q, mask_block_kv = block_mask.block_size
        else:
            mask_block_q = mask_block_kv = block_m
        self.options = dict(
            HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=block_n,
            CAUSAL=causal, USE_TMA=self.use_tma,
            GRID_ORDER=GRID_ORDERS.index(str(config["grid_order"])),
            LONGEST_FIRST=bool(config["longest_first"]) and causal,
            NUM_STAGES=num_stages,
            MASKED_LOOP_STAGES=num_stages if config["pipeline_masked_loop"] else 1,
            LOOP_UNROLL=int(config["loop_unroll"]),
            WARP_SPECIALIZE=bool(config["warp_specialize"]),
            # fp32 inputs (tests) get exact fp32 dots; 16-bit inputs ignore the option.
            DOT_PRECISION="ieee" if q.dtype == torch.float32 else None,
            # SPARSE: 0 dense, 1 the mask's uint8 tiles, 2 its rows' first keys instead
            # (``doc_offsets``: causal documents or a causal window; ``if SPARSE`` holds).
            SPARSE=(2 if config.get("doc_offsets") else True) if block_mask is not None
            else False, MASK_BLOCK_Q=mask_block_q,
            MASK_BLOCK_KV=mask_block_kv,
            ATTN_MASK=0 if attn_mask is None else (1 if attn_mask.dtype == torch.uint8 else 2),
            SOFTCAP=softcap > 0,
            num_warps=int(config["num_warps"]), num_stages=num_stages,
        )
        m_block, n_block = self.block_shapes
        self._descriptors = [PlannedDescriptor(functools.partial(_tma_descriptor, block=block))
                             for block in (m_block, n_block, n_block, m_block)]
        self._dense = DirectLaunch(
            _flash_fwd_kernel, self.grid,
            {k: v for k, v in self.options.items() if k not in LAUNCH_OPTIONS},
            {k: v for k, v in self.options.items() if k in LAUNCH_OPTIONS},
            dict(enumerate(self._descriptors)) if self.use_tma else None)
        self._direct_tail = (*self.scalars, *_NO_MASK_ARGS)
        self._device_guard: bool | None = None

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: Any = None,
                 attn_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(o, lse) of the kernel on q, k, v; ``attn_mask`` as ``broadcast_attn_mask`` gives it."""
        if self.negate_q:
            q = -q  # strides kept: the plan's output layout still holds
        o = torch.empty_strided(self.out_shape, self.out_strides, device=q.device, dtype=q.dtype)
        if DEBUG_POISON:
            o.fill_(float("nan"))
            lse = torch.full(self.lse_shape, float("nan"), device=q.device, dtype=torch.float32)
        else:
            lse = q.new_empty(self.lse_shape, dtype=torch.float32)
        if self._device_guard is None:
            # Triton launches on the current device: make it q's, unless there is only one.
            self._device_guard = q.is_cuda and torch.cuda.device_count() > 1
        if self._device_guard and q.device.index != torch.cuda.current_device():
            with torch.cuda.device(q.device):
                self._launch(q, k, v, o, lse, block_mask, attn_mask)
        else:
            self._launch(q, k, v, o, lse, block_mask, attn_mask)
        return o, lse

    def _launch(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                lse: torch.Tensor, block_mask: Any, attn_mask: torch.Tensor | None) -> None:
        if block_mask is None and attn_mask is None:
            q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr = (q.data_ptr(), k.data_ptr(), v.data_ptr(),
                                                   o.data_ptr(), lse.data_ptr())
            if (q_ptr | k_ptr | v_ptr | o_ptr | lse_ptr) % 16 == 0:
                stream = current_stream(q.device.index) if q.is_cuda else 0
                # Pointers as addresses: the launcher then makes no driver call for them.
                if self._dense.try_direct(stream, *((q, k, v, o) if self.use_tma else
                                                    (q_ptr, k_ptr, v_ptr, o_ptr)),
                                          lse_ptr, *self._direct_tail):
                    return
                self._dense.launch_on(stream, q, k, v, o, *self._jit_tail(lse))
                return
        _flash_fwd_kernel[self.grid](*self.args(q, k, v, o, lse, block_mask, attn_mask),
                                     **self.options)

    def _jit_tail(self, lse: Any) -> list[Any]:
        """The arguments after o of a dense launch through the JIT."""
        return [lse, *self.scalars, lse, lse, lse, lse, lse, lse, 0, 0, 0, 0, 0, lse, 0, 0, 0, 0]

    def args(self, q: Any, k: Any, v: Any, o: Any, lse: Any, block_mask: Any = None,
             attn_mask: Any = None) -> list[Any]:
        """The kernel's positional arguments for these tensors."""
        tensors = [q, k, v, o]
        if self.use_tma:
            tensors = [make(t) for make, t in zip(self._descriptors, tensors, strict=True)]
        if block_mask is None and attn_mask is None:
            return [*tensors, *self._jit_tail(lse)]
        # Unused mask arguments point at lse: their code is compiled out (SPARSE, ATTN_MASK).
        args = [*tensors, lse, *self.scalars]
        if block_mask is not None:
            args += block_mask.kernel_args()
        else:
            args += [lse, lse, lse, lse, lse, lse, 0, 0, 0, 0, 0]
        if attn_mask is not None:
            args += [attn_mask, *attn_mask.stride()]
        else:
            args += [lse, 0, 0, 0, 0]
        return args
