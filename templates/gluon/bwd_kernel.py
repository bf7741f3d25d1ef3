"""FlashAttention-3-style backward for Hopper (sm_90), written in Gluon.

This module imports only torch and triton (``GluonBwdTemplate.standalone_source`` emits it
verbatim with a config appended). Written for triton 3.6's Gluon API (the GPU machines'
wheel); the names that moved in later versions are picked in ``gluon_common``, which
it shares with ``gluon_fwd_kernel``.

Given the forward's ``o`` and ``lse`` (natural-log logsumexp of the scaled scores) and the
incoming gradient ``do``, three launches produce ``dq``, ``dk`` and ``dv``:

  * preprocess (plain Triton), one program per (query tile, query head, batch):
    ``delta = rowsum(dO * O)`` and ``lse2 = lse * log2(e)``, +inf for rows that saw no key
    (their P is then exactly 0);
  * the main kernel (Gluon), one program per (KV tile of BLOCK_N keys, kv head, batch): K_j and
    V_j arrive once by TMA; the program walks every query tile that can see its keys, for
    every query head of its GQA group (dK/dV of the group summed in registers: no atomics for
    them), Q_i and dO_i arriving by TMA through a ring of ``STAGES`` buffers with one mbarrier
    each, loaded ``STAGES`` steps ahead. Per step, on asynchronous wgmma, in the transposed
    orientation (keys along the accumulator rows, as FA3's swapped SdP, so that P^T and dS^T
    are already the A operands of the dV and dK GEMMs and stay in registers):
        S^T  = K Q^T                 (A = K, B = Q^T: both shared)
        dP^T = V dO^T                (issued with S^T; runs under the exponentials)
        P^T  = exp2(S^T * scale * log2 e - lse2)
        dV  += P^T dO                (A = P^T from registers)
        dS^T = scale * P^T (dP^T - delta)
        dK  += dS^T Q                (A = dS^T from registers)
        dQ_i = dS K                  (A = dS: dS^T staged in shared memory, read transposed)
    and dQ_i is added into an fp32 buffer with atomics (staged in a swizzled shared tile, as
    16-byte vector atomics; with ``defer_dq`` under the next step's S^T/dP^T GEMMs), so dq is
    not bitwise deterministic: the order of the additions varies between runs. ``scale`` is
    folded into dS, so dK and dQ come out scaled;
  * dq = dq_accum cast to the input dtype, in q's layout (``_dq_cast_kernel``); dq_accum is
    zeroed by the preprocess.

Masking only where needed: query tiles wholly above the causal diagonal are never visited,
tiles crossing it and every tile of a KV tile reaching past N_kv take the masked step (a
run-time branch per step), the rest the unmasked one. Rows past N_q read as zeros (TMA) with
lse2 = +inf, so their P is 0 without a mask; keys past N_kv are masked (their scores are 0,
and exp2(0 - lse2) need not be small).

Outputs: dq, dk, dv in the inputs' dtype and shapes, laid out as ``torch.empty_like`` of them.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from typing import Any

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from templates.gluon.common import (  # noqa: F401  re-exported for the templates
    CAUSAL_MODES,
    LOG2_E,
    SUPPORTED_DTYPES,
    host_smem_layout,
    tma_descriptor,
    tma_layout_problem,
    tma_load,
    tma_ready,
    tma_store,
    warps_barrier,
)
from templates.kernel_common import normalize_causal

# log2(e) inside the kernels: a jit function reads a global only as a constexpr.
LOG2_E_JIT = tl.constexpr(LOG2_E)

HEAD_DIMS = (64, 128)
# Preprocess rows per program (times D <= 128: 8192 elements per operand, in registers).
PREPROCESS_ROWS = 64

# Tests set this: dk and dv are then filled with NaN before the kernel runs, so an element
# the kernel forgets to write shows up as NaN instead of stale memory.
DEBUG_POISON = False
# Bisecting switches for GPU diagnosis (a constexpr of the main kernel; 0 in production):
#   2: every GEMM is waited for at once (warpgroup_mma_wait(0)) and the refill is preceded by
#      fence_async_shared + a barrier of its own (conservative ordering);
#   4: the dQ GEMM is skipped (dq stays 0: tells the dQ path from the rest; with defer_dq
#      the staged tile's atomics still run);
#   8: no exponentials, P^T = S^T (wrong gradients: prices the softmax, as the forward's
#      DIAG switches; benchmarks/gluon_bwd_price.py times these);
#  16: the dQ atomics are skipped (the GEMM and the staging still run: with 4 it tells the
#      GEMM's cost from the atomics').
# The environment variable GLUON_BWD_DEBUG overrides it (read when a launch is planned).
DEBUG = 0


# ----------------------------------------------------------------------------- preprocess
@triton.jit(do_not_specialize=["N_Q", "H_Q", "n_q_tiles"])
def _gluon_bwd_preprocess_kernel(
    O, DO, LSE, DELTA, LSE2, DQ,  # noqa: E741 - kernel pointers are UPPER_CASE
    stride_ob, stride_oh, stride_om, stride_dob, stride_doh, stride_dom,
    stride_lb, stride_lh, stride_lm, N_Q, N_Q_PAD, H_Q, n_q_tiles,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, ZERO_DQ: tl.constexpr = False,
):
    """delta = rowsum(dO * O) and lse2 = lse * log2(e) (+inf where lse = -inf), both
    (B, H_q, N_q_pad) contiguous fp32, rows padded to a whole number of the main kernel's
    query tiles with lse2 = +inf, delta = 0 (their P is then 0); o and do have a unit last
    stride. With ZERO_DQ also the fp32 dQ accumulator's rows (DQ: (B, H_q, N_q, HEAD_DIM)
    contiguous: q's head dim is o's) set to 0, which the main kernel then adds into: one pass over the rows
    instead of a fill kernel of its own (a fixed cost that short masked walks feel)."""
    pid = tl.program_id(0)
    tile = pid % n_q_tiles
    bh = pid // n_q_tiles
    b = (bh // H_Q).to(tl.int64)
    h = (bh % H_Q).to(tl.int64)
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, HEAD_DIM)
    row_ok = rows < N_Q
    o = tl.load(O + b * stride_ob + h * stride_oh + rows[:, None] * stride_om + cols[None, :],
                mask=row_ok[:, None], other=0.0)
    do = tl.load(DO + b * stride_dob + h * stride_doh + rows[:, None] * stride_dom
                 + cols[None, :], mask=row_ok[:, None], other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    lse = tl.load(LSE + b * stride_lb + h * stride_lh + rows * stride_lm, mask=row_ok,
                  other=0.0)
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * LOG2_E_JIT)
    lse2 = tl.where(row_ok, lse2, float("inf"))
    out = bh.to(tl.int64) * N_Q_PAD + rows
    tl.store(DELTA + out, delta, mask=rows < N_Q_PAD)
    tl.store(LSE2 + out, lse2, mask=rows < N_Q_PAD)
    if ZERO_DQ:
        dq = DQ + (bh.to(tl.int64) * N_Q + rows[:, None]) * HEAD_DIM + cols[None, :]
        tl.store(dq, tl.zeros((BLOCK_M, HEAD_DIM), dtype=tl.float32), mask=row_ok[:, None])


# dq from the row-major fp32 accumulator, one tile of rows a program, written in the layout
# of the tensor it is handed: q's own (``torch.empty_like(q)``), so a packed (B, L, H, D) q
# viewed as (B, H, L, D), as transformers and tuner.varlen_attention pass it, gets its
# gradient without another copy (H200 varlen, 16k tokens: a contiguous cast, then autograd's
# strided copy into q's layout, 0.09 + 0.13 ms).
DQ_CAST_ROWS = 64


@triton.jit(do_not_specialize=["N_Q", "N_COLS", "H_Q"])
def _dq_cast_kernel(ACC, DQ, N_Q, N_COLS, H_Q, stride_b, stride_h, stride_m,
                    HEAD_DIM: tl.constexpr, ROWS: tl.constexpr):
    """DQ[b, h, rows, :] (its strides; unit last) = ACC's rows, (B H_q, N_q, D) contiguous
    fp32, in DQ's dtype. N_COLS: unused (the D-major cast's signature)."""
    bh = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
    dims = tl.arange(0, HEAD_DIM)
    ok = rows[:, None] < N_Q
    acc = tl.load(ACC + (bh * N_Q + rows[:, None]) * HEAD_DIM + dims[None, :], mask=ok)
    out = DQ + (bh // H_Q) * stride_b + (bh % H_Q) * stride_h
    tl.store(out + rows[:, None].to(tl.int64) * stride_m + dims[None, :],
             acc.to(DQ.dtype.element_ty), mask=ok)


def dq_cast_launch(seqlen_q: int, batch_heads: int, head_dim: int
                   ) -> tuple[tuple[int, int], dict[str, int]]:
    """(grid, options) of a dq cast (``_dq_cast_kernel``, bwd_ws_kernel's D-major one) for
    ``batch_heads`` heads of ``seqlen_q`` rows: heads along the grid's first dimension (up to
    2^31 - 1 programs; the second takes 65535, 4M rows here)."""
    return ((batch_heads, triton.cdiv(seqlen_q, DQ_CAST_ROWS)),
            dict(HEAD_DIM=head_dim, ROWS=DQ_CAST_ROWS, num_warps=4))


def dq_cast_args(dq_accum: Any, dq: Any, seqlen_q: int, columns: int) -> list[Any]:
    """A dq cast's arguments: the accumulator, dq (any layout, unit last stride), lengths."""
    return [dq_accum, dq, seqlen_q, columns, dq.shape[1], *dq.stride()[:3]]


# ----------------------------------------------------------------------------- layouts
@gluon.constexpr_function
def mma_layout(num_warps, m, n):
    """wgmma accumulator layout of an (m, n) fp32 tile over ``num_warps`` warps: warpgroups
    stacked along M while each still gets 64 rows (a wgmma's M), the others side by side
    along N."""
    groups = num_warps // 4
    along_m = max(1, min(groups, m // 64))
    along_n = groups // along_m
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4 * along_m, along_n],
                                     instr_shape=[16, n // along_n, 16])


# ----------------------------------------------------------------------------- one step
@gluon.jit
def probs_t(s_t, lse2, offs_n, offs_m, N_KV, causal_offset, qk_scale,
             MASKED: gl.constexpr, CAUSAL: gl.constexpr):
    """P^T = exp2(S^T * qk_scale - lse2) of one (keys x queries) tile. MASKED hides keys
    past N_kv and, for causal, keys past each query's diagonal (masked before nothing: the
    where picks 0 over whatever a hidden score's exp2 gave, inf included)."""
    p_t = gl.exp2(s_t * qk_scale - gl.expand_dims(lse2, 0))
    if MASKED:
        keys = gl.expand_dims(offs_n, 1)
        visible = keys < N_KV
        if CAUSAL:
            visible = visible & (keys <= gl.expand_dims(offs_m + causal_offset, 0))
        p_t = gl.where(visible, p_t, 0.0)
    return p_t


@gluon.jit
def _refill(q_desc, do_desc, lse_desc, delta_desc, q_bufs, do_bufs, lse_bufs, delta_bufs, ready,
            slot, t, n_steps, n_q_steps, b, h0, H_Q, N_Q_PAD, first_row, BLOCK_M: gl.constexpr):
    """Load step t's Q, dO, lse2 and delta tiles (if there is a step t) into ring ``slot``.
    Step t is query tile ``first_row / BLOCK_M + t % n_q_steps`` of query head
    ``h0 + t // n_q_steps``. The row vectors come by TMA too (one flat descriptor over the
    padded (B, H_q, N_q_pad) buffers): read from shared memory where they are used, they
    hold no registers across the GEMM waits (in registers they cost 32 per thread: each
    thread holds 16 of a 64-query tile's columns; seen as spills in the offline build)."""
    pred = t < n_steps
    per_head = gl.maximum(n_q_steps, 1)  # no division by zero when there is no step at all
    h = h0 + t // per_head
    m0 = first_row + (t % per_head) * BLOCK_M
    row0 = (b * H_Q + h) * N_Q_PAD + m0
    mbarrier.expect(ready.index(slot), q_desc.block_type.nbytes + do_desc.block_type.nbytes
                    + 2 * lse_desc.block_type.nbytes, pred=pred)
    tma_load(q_desc, [b, h, m0, 0], ready.index(slot), q_bufs.index(slot), pred=pred)
    tma_load(do_desc, [b, h, m0, 0], ready.index(slot), do_bufs.index(slot), pred=pred)
    tma_load(lse_desc, [row0], ready.index(slot), lse_bufs.index(slot), pred=pred)
    tma_load(delta_desc, [row0], ready.index(slot), delta_bufs.index(slot), pred=pred)


@gluon.jit
def dq_gemm(ds_t, ds_smem, k_smem, dq_layout: gl.constexpr, BLOCK_M: gl.constexpr,
            HEAD_DIM: gl.constexpr):
    """dQ = dS K issued (async; the caller waits for it). dQ needs dS with queries along
    rows: dS^T goes through shared memory, each warpgroup storing its keys' rows, and the
    GEMM reads the whole tile transposed (an MN-major A), as Triton's own compiler stages a
    transposed dot operand. (A transpose in registers, the compiler's round trip through its
    scratch, measured 1-5% slower on the H200.)"""
    ds_smem.store(ds_t)
    fence_async_shared()
    warps_barrier()
    return warpgroup_mma(ds_smem.permute((1, 0)), k_smem,
                         gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, dq_layout),
                         use_acc=False, is_async=True)


@gluon.jit
def _bwd_step(dk, dv, q_smem, do_smem, k_smem, v_smem, dq_smem, ds_smem, lse_smem, delta_smem,
              DQ, bh, m0, n0, N_Q, N_KV, causal_offset, qk_scale, sm_scale,
              prev_bh, prev_m0, has_prev,
              MASKED: gl.constexpr, CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_WARPS: gl.constexpr,
              DEFER_DQ: gl.constexpr, DEBUG: gl.constexpr = 0):
    """Fold query tile [m0, m0 + BLOCK_M) of query head ``bh`` (its row index b * H_q + h)
    into the dk, dv accumulators of the KV tile [n0, n0 + BLOCK_N); add its dQ into DQ.

    With DEFER_DQ the dQ tile is left staged in ``dq_smem`` and added by the next step (or
    the kernel's tail: ``_dq_atomics``) while that step's S^T and dP^T GEMMs run; this step
    adds the previous one's (``prev_bh``, ``prev_m0``) if ``has_prev``."""
    dtype: gl.constexpr = q_smem.dtype
    st_layout: gl.constexpr = mma_layout(NUM_WARPS, BLOCK_N, BLOCK_M)
    kv_layout: gl.constexpr = mma_layout(NUM_WARPS, BLOCK_N, HEAD_DIM)
    dq_layout: gl.constexpr = mma_layout(NUM_WARPS, BLOCK_M, HEAD_DIM)
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kv_layout, k_width=2)
    zeros_st = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, st_layout)

    # S^T and dP^T, back to back on the tensor cores.
    s_tok = warpgroup_mma(k_smem, q_smem.permute((1, 0)), zeros_st, use_acc=False,
                          is_async=True)
    dp_tok = warpgroup_mma(v_smem, do_smem.permute((1, 0)), zeros_st, use_acc=False,
                           is_async=True)
    # (Two ifs: the constexpr one is resolved at compile time, the other runs.)
    if DEFER_DQ:  # noqa: SIM102
        # The previous step's dQ tile, added while the tensor cores compute S^T and dP^T.
        if has_prev:
            _dq_atomics(DQ, dq_smem, prev_bh, prev_m0, N_Q, HEAD_DIM, BLOCK_M, NUM_WARPS,
                        DEBUG)
    cols: gl.constexpr = gl.SliceLayout(0, st_layout)
    offs_m = m0 + gl.arange(0, BLOCK_M, layout=cols)
    offs_n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, st_layout))

    if DEBUG & 2:
        s_t, dp_t = warpgroup_mma_wait(0, deps=(s_tok, dp_tok))
    else:
        s_t = warpgroup_mma_wait(1, deps=(s_tok,))
    # The queries' lse2 along the columns (padded rows: +inf, so P = 0 there).
    lse2 = lse_smem.load(cols)
    if DEBUG & 8:
        p_t = s_t
    else:
        p_t = probs_t(s_t, lse2, offs_n, offs_m, N_KV, causal_offset, qk_scale, MASKED,
                       CAUSAL)
    p16 = p_t.to(dtype)
    p_op = gl.convert_layout(p16, a_layout)
    dv_tok = warpgroup_mma(p_op, do_smem, dv, is_async=True)

    if DEBUG & 2:
        dv, p_op = warpgroup_mma_wait(0, deps=(dv_tok, p_op))
    else:
        dp_t = warpgroup_mma_wait(1, deps=(dp_tok,))
    delta = delta_smem.load(cols)
    ds_t = (p16.to(gl.float32) * (dp_t - gl.expand_dims(delta, 0)) * sm_scale).to(dtype)
    ds_op = gl.convert_layout(ds_t, a_layout)
    dk_tok = warpgroup_mma(ds_op, q_smem, dk, is_async=True)
    if DEBUG & 2:
        dk, ds_op = warpgroup_mma_wait(0, deps=(dk_tok, ds_op))
    if DEBUG & 4:
        if (DEBUG & 2) == 0:
            dv, dk, p_op, ds_op = warpgroup_mma_wait(0, deps=(dv_tok, dk_tok, p_op, ds_op))
        return dk, dv
    dq_tok = dq_gemm(ds_t, ds_smem, k_smem, dq_layout, BLOCK_M, HEAD_DIM)
    dv, dk, dq, p_op, ds_op = warpgroup_mma_wait(0, deps=(dv_tok, dk_tok, dq_tok, p_op, ds_op))
    if DEFER_DQ:
        # Every warp has read the previous tile out of dq_smem before it is overwritten;
        # the barrier before the ring's refill then publishes this one to the next step.
        warps_barrier()
        dq_smem.store(dq)
    else:
        dq_smem.store(dq)
        warps_barrier()
        _dq_atomics(DQ, dq_smem, bh, m0, N_Q, HEAD_DIM, BLOCK_M, NUM_WARPS, DEBUG)
    return dk, dv


@gluon.jit
def _dq_atomics(DQ, dq_smem, bh, m0, N_Q, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                NUM_WARPS: gl.constexpr, DEBUG: gl.constexpr = 0):
    """Add the dQ tile staged in ``dq_smem`` into DQ's rows [m0, m0 + BLOCK_M) of ``bh``.
    Read back with 4 consecutive columns per thread, its atomics become 16-byte
    red.global.add.v4.f32, a quarter of the scalar ones the wgmma layout gives (offline
    build: 8 per thread and step instead of 32)."""
    dq_head = DQ + bh.to(gl.int64) * N_Q * HEAD_DIM
    add_layout: gl.constexpr = gl.BlockedLayout([1, 4], [32 * 4 // HEAD_DIM, HEAD_DIM // 4],
                                                [NUM_WARPS, 1], [1, 0])
    # In chunks of rows: a chunk's fp32 values are the only registers this holds, so it can
    # run beside GEMMs in flight (DEFER_DQ) without pushing the dK/dV accumulators to spill.
    CHUNK: gl.constexpr = NUM_WARPS * (32 * 4 // HEAD_DIM)
    dims = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, add_layout))
    if (DEBUG & 16) == 0:
        for c in gl.static_range(BLOCK_M // CHUNK):
            dq = dq_smem.slice(c * CHUNK, CHUNK, dim=0).load(add_layout)
            q_rows = m0 + c * CHUNK + gl.arange(0, CHUNK, layout=gl.SliceLayout(1, add_layout))
            offs = gl.expand_dims(q_rows, 1) * HEAD_DIM + gl.expand_dims(dims, 0)
            gl.atomic_add(dq_head + offs, dq, mask=gl.expand_dims(q_rows < N_Q, 1),
                          sem="relaxed")


# ----------------------------------------------------------------------------- kernel
@gluon.jit(do_not_specialize=["N_Q", "N_KV", "causal_offset", "H_Q", "H_KV", "GROUP",
                              "n_kv_tiles", "n_q_tiles"])
def _gluon_bwd_kernel(
    q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, lse_desc, delta_desc, DQ,
    N_Q, N_KV, causal_offset, H_Q, H_KV, GROUP, n_kv_tiles, n_q_tiles, qk_scale, sm_scale,
    HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr, CAUSAL: gl.constexpr, num_warps: gl.constexpr,
    DEFER_DQ: gl.constexpr = True, DEBUG: gl.constexpr = 0,
):
    # Program -> (KV tile, batch, kv head); the tiles of one kv head are consecutive (its
    # group's Q and dO stay in L2), tile 0 first (under causal masking it sees the most
    # queries, so the longest programs start first).
    pid = gl.program_id(0)
    tile = pid % n_kv_tiles
    bkv = pid // n_kv_tiles
    b = bkv // H_KV
    kv_h = bkv % H_KV
    n0 = tile * BLOCK_N

    dtype: gl.constexpr = q_desc.dtype
    q_block: gl.constexpr = q_desc.block_type.shape
    kv_block: gl.constexpr = k_desc.block_type.shape
    k_buf = gl.allocate_shared_memory(dtype, [1] + kv_block, k_desc.layout)
    v_buf = gl.allocate_shared_memory(dtype, [1] + kv_block, v_desc.layout)
    q_bufs = gl.allocate_shared_memory(dtype, [STAGES] + q_block, q_desc.layout)
    do_bufs = gl.allocate_shared_memory(dtype, [STAGES] + q_block, do_desc.layout)
    # Swizzled: the accumulator's stores of 8 rows 512 bytes apart then fall on different
    # banks (unswizzled they hit the same ones: 10-15% of the kernel's time at d128 on the
    # H200 together with dS staged below, notes/gluon_notes.md).
    dq_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_M, HEAD_DIM],
                                        gl.NVMMASharedLayout(swizzle_byte_width=128,
                                                             element_bitwidth=32, rank=2))
    ds_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, BLOCK_M],
                                        gl.NVMMASharedLayout(swizzle_byte_width=128,
                                                             element_bitwidth=16, rank=2))
    lse_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], lse_desc.layout)
    delta_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], delta_desc.layout)
    kv_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_ready, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
    fence_async_shared()

    # The query tiles this KV tile's keys are visible to: [first_row, N_q) in BLOCK_M steps;
    # from full_row on every (query, key) pair is visible (unmasked steps). Query i sees key
    # j iff j <= i + causal_offset (0 top-left, N_kv - N_q bottom-right).
    if CAUSAL:
        first_row = (gl.maximum(n0 - causal_offset, 0) // BLOCK_M) * BLOCK_M
        full_row = gl.cdiv(gl.maximum(n0 + BLOCK_N - 1 - causal_offset, 0), BLOCK_M) * BLOCK_M
    else:
        first_row = n0 * 0
        full_row = n0 * 0
    # A KV tile reaching past N_kv masks its tail keys in every step.
    full_row = gl.where(n0 + BLOCK_N > N_KV, n_q_tiles * BLOCK_M, full_row)
    n_q_steps = gl.maximum(n_q_tiles - first_row // BLOCK_M, 0)
    n_steps = n_q_steps * GROUP
    h0 = kv_h * GROUP
    N_Q_PAD = n_q_tiles * BLOCK_M

    mbarrier.expect(kv_ready, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma_load(k_desc, [b, kv_h, n0, 0], kv_ready, k_buf.index(0))
    tma_load(v_desc, [b, kv_h, n0, 0], kv_ready, v_buf.index(0))
    for i in gl.static_range(STAGES):
        _refill(q_desc, do_desc, lse_desc, delta_desc, q_bufs, do_bufs, lse_bufs, delta_bufs,
                ready, i, i, n_steps, n_q_steps, b, h0, H_Q, N_Q_PAD, first_row, BLOCK_M)

    kv_layout: gl.constexpr = mma_layout(num_warps, BLOCK_N, HEAD_DIM)
    dk = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, kv_layout)
    dv = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, kv_layout)
    mbarrier.wait(kv_ready, 0)
    prev_bh = b * H_Q + h0
    prev_m0 = first_row
    for t in range(n_steps):
        slot = t % STAGES
        h = h0 + t // n_q_steps
        m0 = first_row + (t % n_q_steps) * BLOCK_M
        bh = b * H_Q + h
        mbarrier.wait(ready.index(slot), (t // STAGES) & 1)
        # An index LLVM cannot see is 0: the shared-memory descriptors of K and V are then
        # rebuilt each step instead of hoisted out of the loop (hoisted, their 64-bit copies
        # for every k-step of 3 GEMMs held ~48 registers and spilled).
        zero = gl.inline_asm_elementwise("mov.b32 $0, 0;", "=r,r", [t], dtype=gl.int32,
                                         is_pure=False, pack=1)
        k_smem = k_buf.index(zero).reshape([BLOCK_N, HEAD_DIM])
        v_smem = v_buf.index(zero).reshape([BLOCK_N, HEAD_DIM])
        q_smem = q_bufs.index(slot).reshape([BLOCK_M, HEAD_DIM])
        do_smem = do_bufs.index(slot).reshape([BLOCK_M, HEAD_DIM])
        lse_smem = lse_bufs.index(slot)
        delta_smem = delta_bufs.index(slot)
        if m0 < full_row:
            dk, dv = _bwd_step(dk, dv, q_smem, do_smem, k_smem, v_smem, dq_smem, ds_smem,
                               lse_smem, delta_smem, DQ, bh, m0, n0, N_Q, N_KV, causal_offset,
                               qk_scale, sm_scale, prev_bh, prev_m0, t > 0, True, CAUSAL,
                               HEAD_DIM, BLOCK_M, BLOCK_N, num_warps, DEFER_DQ, DEBUG)
        else:
            dk, dv = _bwd_step(dk, dv, q_smem, do_smem, k_smem, v_smem, dq_smem, ds_smem,
                               lse_smem, delta_smem, DQ, bh, m0, n0, N_Q, N_KV, causal_offset,
                               qk_scale, sm_scale, prev_bh, prev_m0, t > 0, False, CAUSAL,
                               HEAD_DIM, BLOCK_M, BLOCK_N, num_warps, DEFER_DQ, DEBUG)
        prev_bh = bh
        prev_m0 = m0
        # Every warp's GEMMs that read this slot (and dS) have completed: refill it.
        if DEBUG & 2:
            fence_async_shared()
            warps_barrier()
        warps_barrier()
        _refill(q_desc, do_desc, lse_desc, delta_desc, q_bufs, do_bufs, lse_bufs, delta_bufs,
                ready, slot, t + STAGES, n_steps, n_q_steps, b, h0, H_Q, N_Q_PAD, first_row,
                BLOCK_M)

    if DEFER_DQ:  # noqa: SIM102  (constexpr, then run time)
        if n_steps > 0:  # the last step's dQ tile (published by the loop's last barrier)
            _dq_atomics(DQ, dq_smem, prev_bh, prev_m0, N_Q, HEAD_DIM, BLOCK_M, num_warps,
                        DEBUG)
    # dK and dV leave through K's and V's buffers (every GEMM reading them has completed) and
    # TMA stores, which drop the rows past N_kv. A tile no query sees stores zeros.
    k_buf.index(0).reshape([BLOCK_N, HEAD_DIM]).store(dk.to(dtype))
    v_buf.index(0).reshape([BLOCK_N, HEAD_DIM]).store(dv.to(dtype))
    fence_async_shared()
    warps_barrier()
    tma_store(dk_desc, [b, kv_h, n0, 0], k_buf.index(0))
    tma_store(dv_desc, [b, kv_h, n0, 0], v_buf.index(0))
    tma.store_wait(0)
    mbarrier.invalidate(kv_ready)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))


# ----------------------------------------------------------------------------- host side
def num_warps_of(config: Mapping[str, Any]) -> int:
    """One warpgroup per consumer; every warp of the program computes (no producer warp)."""
    return 4 * int(config["consumers"])


class LaunchPlan:
    """The launches of one backward less their tensors: grids, constexprs and scalars,
    worked out once from the inputs' shapes, causal mode, scale and config."""

    def __init__(self, q: Any, k: Any, *, causal_mode: str, scale: float,
                 config: Mapping[str, Any]) -> None:
        batch, heads_q, seqlen_q, head_dim = q.shape
        heads_kv, seqlen_kv = k.shape[1], k.shape[2]
        block_m, block_n = int(config["BLOCK_M"]), int(config["BLOCK_N"])
        n_q_tiles = -(-seqlen_q // block_m)
        n_kv_tiles = -(-seqlen_kv // block_n)
        offset = seqlen_kv - seqlen_q if causal_mode == "bottom_right" else 0
        self.grid = (n_kv_tiles * batch * heads_kv,)
        # The row vectors are padded to whole query tiles (PREPROCESS_ROWS divides BLOCK_M).
        self.rows_pad = n_q_tiles * block_m
        self.pre_tiles = self.rows_pad // PREPROCESS_ROWS
        self.pre_grid = (self.pre_tiles * batch * heads_q,)
        self.rows_shape = (batch, heads_q, self.rows_pad)
        self.seqlen_q = seqlen_q
        # The dq cast (``dq_cast_kernel``): the accumulator's row length (N_q here; padded
        # where it is D-major), grid and options.
        self.dq_columns = seqlen_q
        self.dq_cast_grid, self.dq_cast_options = dq_cast_launch(seqlen_q, batch * heads_q,
                                                                 head_dim)
        self.scalars = [seqlen_q, seqlen_kv, offset, heads_q, heads_kv, heads_q // heads_kv,
                        n_kv_tiles, n_q_tiles, scale * LOG2_E, scale]
        self.q_block = [1, 1, block_m, head_dim]
        self.kv_block = [1, 1, block_n, head_dim]
        self.rows_block = [block_m]
        self.rows_layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32,
                                                rank=1)
        self.q_layout = host_smem_layout(self.q_block, 16)
        self.kv_layout = host_smem_layout(self.kv_block, 16)
        self.options: dict[str, Any] = dict(
            HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n, STAGES=int(config["stages"]),
            CAUSAL=causal_mode != "none", num_warps=num_warps_of(config),
            DEFER_DQ=bool(config.get("defer_dq", True)))
        debug = int(os.environ.get("GLUON_BWD_DEBUG", DEBUG))
        if debug:
            self.options["DEBUG"] = debug
        self.head_dim = head_dim

    # Whether the preprocess zeroes dq_accum (then made empty, not zeros): the row-major
    # accumulator's rows are the preprocess's own; a plan whose accumulator is laid out
    # otherwise (``WsLaunchPlan`` with dq_transposed) says False.
    zero_dq_in_preprocess = True

    def preprocess_args(self, o: Any, do: Any, lse: Any, delta: Any, lse2: Any,
                        dq_accum: Any) -> list[Any]:
        return [o, do, lse, delta, lse2, dq_accum, *o.stride()[:3], *do.stride()[:3],
                *lse.stride(), self.seqlen_q, self.rows_pad, self.rows_shape[1],
                self.pre_tiles]

    def preprocess_options(self) -> dict[str, Any]:
        options = dict(HEAD_DIM=self.head_dim, BLOCK_M=PREPROCESS_ROWS, num_warps=4)
        if self.zero_dq_in_preprocess:
            options.update(ZERO_DQ=True)
        return options

    def main_args(self, q: Any, k: Any, v: Any, do: Any, dk: Any, dv: Any, dq_accum: Any,
                  lse2: Any, delta: Any) -> list[Any]:
        return [tma_descriptor(q, self.q_block, self.q_layout),
                tma_descriptor(k, self.kv_block, self.kv_layout),
                tma_descriptor(v, self.kv_block, self.kv_layout),
                tma_descriptor(do, self.q_block, self.q_layout),
                tma_descriptor(dk, self.kv_block, self.kv_layout),
                tma_descriptor(dv, self.kv_block, self.kv_layout),
                self._rows_descriptor(lse2), self._rows_descriptor(delta),
                dq_accum, *self.scalars]

    def _rows_descriptor(self, rows: Any) -> Any:
        """A flat view of a padded (B, H_q, N_q_pad) fp32 row buffer for 1-D TMA loads."""
        size = rows.shape[0] * rows.shape[1] * rows.shape[2]
        return TensorDescriptor(rows, [size], [1], self.rows_block, self.rows_layout)

    def buffers(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                ) -> tuple[torch.Tensor, ...]:
        """(delta, lse2, dq_accum, dk, dv): what the launches write (the warp-specialized
        kernel's plan shares them)."""
        delta = q.new_empty(self.rows_shape, dtype=torch.float32)
        lse2 = q.new_empty(self.rows_shape, dtype=torch.float32)
        dq_accum = self.dq_accumulator(q)
        # dK and dV in k's and v's layouts (TMA stores take any 16-byte strides): a packed
        # (B, L, H, D) caller's gradients need no copy after.
        if DEBUG_POISON:
            dk, dv = torch.full_like(k, float("nan")), torch.full_like(v, float("nan"))
        else:
            dk, dv = torch.empty_like(k), torch.empty_like(v)
        return delta, lse2, dq_accum, dk, dv

    def dq_accumulator(self, q: torch.Tensor) -> torch.Tensor:
        """The fp32 dQ accumulator (B, H_q, N_q, D), which every visited step adds into: zeroed
        by the preprocess (``zero_dq_in_preprocess``; NaN under DEBUG_POISON, so a row it
        missed shows), else here."""
        if not self.zero_dq_in_preprocess:
            return torch.zeros(q.shape, device=q.device, dtype=torch.float32)
        if DEBUG_POISON:
            return torch.full(q.shape, float("nan"), device=q.device, dtype=torch.float32)
        return torch.empty(q.shape, device=q.device, dtype=torch.float32)

    def __call__(self, do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 o: torch.Tensor, lse: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        delta, lse2, dq_accum, dk, dv = self.buffers(q, k, v)
        with torch.cuda.device(q.device):
            _gluon_bwd_preprocess_kernel[self.pre_grid](
                *self.preprocess_args(o, do, lse, delta, lse2, dq_accum),
                **self.preprocess_options())
            self.main_kernel()[self.grid](
                *self.main_args(q, k, v, do, dk, dv, dq_accum, lse2, delta), **self.options)
        return self.dq_result(dq_accum, q), dk, dv

    def dq_cast_kernel(self) -> Any:
        """The kernel that makes dq from the accumulator."""
        return _dq_cast_kernel

    def dq_cast_scalars(self, dq: Any) -> list[Any]:
        """The dq cast's arguments after its two pointers, for ``dq`` (q's layout)."""
        return dq_cast_args(None, dq, self.seqlen_q, self.dq_columns)[2:]

    def dq_result(self, dq_accum: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """dq in q's dtype and layout (``torch.empty_like(q)``) from the fp32 accumulator the
        kernels added into."""
        dq = torch.empty_like(q)
        self.dq_cast_kernel()[self.dq_cast_grid](
            *dq_cast_args(dq_accum, dq, self.seqlen_q, self.dq_columns),
            **self.dq_cast_options)
        return dq

    def main_kernel(self) -> Any:
        """The main kernel this plan launches (the warp-specialized plan names its own)."""
        return _gluon_bwd_kernel


def validate_inputs(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    o: torch.Tensor, lse: torch.Tensor, causal: bool | str,
                    scale: float | None, head_dims: tuple[int, ...] = HEAD_DIMS
                    ) -> tuple[str, float]:
    """Check shapes, dtypes and devices of the backward's inputs; return (causal mode, scale).
    ``head_dims``: those the caller's kernel takes (the d256 kernel's: 256)."""
    for name, t in (("q", q), ("k", k), ("v", v), ("o", o), ("do", do), ("lse", lse)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, but got {type(t).__name__}")
    for name, t in (("q", q), ("k", k), ("v", v), ("o", o), ("do", do)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D (batch, heads, seqlen, head_dim), but got "
                             f"shape {tuple(t.shape)}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name} must be float16 or bfloat16, but got {t.dtype}")
        if t.numel() == 0:
            raise ValueError(f"{name} must not be empty, but got shape {tuple(t.shape)}")
    if not (q.dtype == k.dtype == v.dtype == o.dtype == do.dtype):
        raise TypeError(f"q, k, v, o and do must share one dtype, but got {q.dtype}, {k.dtype}, "
                        f"{v.dtype}, {o.dtype}, {do.dtype}")
    if lse.dtype != torch.float32 or lse.dim() != 3:
        raise TypeError(f"lse must be 3-D float32 (the forward's logsumexp), but got "
                        f"{lse.dtype} of shape {tuple(lse.shape)}")
    devices = {t.device for t in (q, k, v, o, do, lse)}
    if len(devices) != 1:
        raise ValueError(f"q, k, v, o, do and lse must be on one device, but got "
                         f"{sorted(str(d) for d in devices)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, but got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")
    if o.shape != q.shape or do.shape != q.shape:
        raise ValueError(f"o and do must have q's shape {tuple(q.shape)}, but got "
                         f"{tuple(o.shape)} and {tuple(do.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q and k must share batch and head_dim, but got {tuple(q.shape)} "
                         f"and {tuple(k.shape)}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"heads of q ({q.shape[1]}) must be a multiple of heads of k/v "
                         f"({k.shape[1]})")
    if q.shape[3] not in head_dims:
        raise ValueError(f"head_dim must be one of {list(head_dims)}, but got {q.shape[3]}")
    if lse.shape != q.shape[:3]:
        raise ValueError(f"lse must have shape (batch, heads_q, seqlen_q) = "
                         f"{tuple(q.shape[:3])}, but got {tuple(lse.shape)}")
    mode = normalize_causal(causal)
    if scale is None:
        return mode, 1.0 / math.sqrt(q.shape[3])
    if isinstance(scale, bool) or not isinstance(scale, int | float) or not math.isfinite(scale):
        raise ValueError(f"scale must be a finite number or None, but got {scale!r}")
    return mode, float(scale)


# The checks under a second name, for a kernel module that defines a validate_inputs of its
# own (bwd_d256_kernel's: in its standalone source this module is pasted in above it).
check_backward_inputs = validate_inputs


def launch(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           o: torch.Tensor, lse: torch.Tensor, *, causal_mode: str, scale: float,
           config: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run the backward on validated CUDA inputs with a config given as a plain mapping."""
    return launch_plan(LaunchPlan, do, q, k, v, o, lse, causal_mode=causal_mode, scale=scale,
                       config=config)


def launch_plan(plan_cls: Callable[..., LaunchPlan], do: torch.Tensor, q: torch.Tensor,
                k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor, *,
                causal_mode: str, scale: float, config: Mapping[str, Any]
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``launch`` through a plan of class ``plan_cls`` (this module's or the
    warp-specialized kernel's): layouts TMA cannot read copied first."""
    q, k, v, do = tma_ready(q), tma_ready(k), tma_ready(v), tma_ready(do)
    if o.stride(-1) != 1:
        o = o.contiguous()
    plan = plan_cls(q, k, causal_mode=causal_mode, scale=scale, config=config)
    return plan(do, q, k, v, o, lse)
