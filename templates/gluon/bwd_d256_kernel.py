"""The warp-specialized Gluon backward at head_dim 256 (gluon_bwd at D 256, dense and causal).

At D 256 the split kernel's layout (each MMA warpgroup owning 64 keys of dK and dV over all of
D) needs 2 x 64 x 256 fp32 accumulators per warpgroup: 256 registers a thread before anything
else. Here the two MMA warpgroups (two partitions, as ``bwd_split_kernel``) split the KV tile
of BLOCK_N = 64 keys by *columns* instead (FA3's d256 choice on sm90: dK/dV and dQ split
along the head dim): warpgroup w owns

  * columns [128 w, 128 w + 128) of dK and dV (64 keys x 128: 64 fp32 registers each) and of
    each step's dQ tile (64 queries x 128: 64 registers, held with dK and dV only: S^T and
    dP^T are dead by then, and P^T and dS^T are shared memory's);
  * queries [32 w, 32 w + 32) of each step's S^T and dP^T (64 keys x 32 queries, K = 256: 16
    registers each), so P^T and dS^T of its 32 queries.

A step of BLOCK_M = 64 queries, for warpgroup w:

    S^T_w  = K Q_w^T,  dP^T_w = V dO_w^T      (all of K and V; Q_w, dO_w its 32 rows)
    P^T_w, dS^T_w (softmax, its 32 queries' lse2 and delta) stored into its 32 columns of the
        step's P^T and dS^T tiles (64 keys x 64 queries, bf16/fp16, shared memory); fence;
        arrive on ``pds_full`` (count 2) and wait for it: both halves are there;
    dV[:, cols_w] += P^T dO[:, cols_w],  dK[:, cols_w] += dS^T Q[:, cols_w]
    dQ[:, cols_w]  = dS K[:, cols_w]         (dS^T's tile read transposed, an MN-major A)

every operand of the last three from shared memory. dV's and dK's GEMMs are waited for first
and the ring slot goes back to the load warp (``empty``, count 2) while dQ's GEMM still runs;
then the warpgroup's columns of the dQ tile go into the staging tile (``dq_full``, count 2)
for the dQ warp's TMA reduce.

Shared memory (bf16): K and V 32 KiB each, Q and dO one stage of 32 KiB each (a ring of one:
two do not fit), two P^T + dS^T pairs (16 KiB each, used by turns as the split kernel's dS^T
tiles: a warpgroup stores step t + 1's while the other's GEMMs may still read step t's, never
t - 1's, which it finished before arriving on step t's ``pds_full``), the fp32 dQ staging
tile 64 KiB, lse2/delta rows and barriers: 230,4xx of the 232,448 bytes a Hopper program may
use.

The load and dQ warps are ``bwd_ws_kernel``'s, unchanged (STAGES 1, DQ_BUFFERS 1). The end of
a tile as the split kernel's: both warpgroups arrive on ``kv_free`` (every GEMM of both has
read K and V), store their columns of dK and dV over K's and V's buffers, arrive on
``dkv_ready``; warpgroup 0 issues the two TMA stores.

Dense and causal walks (both alignments; every step takes the masked maths: the N_kv and
causal limits hide nothing where nothing is masked), GQA (the walk's steps over the group's
query heads), any lengths (TMA zero-fills and drops the tails, lse2 = +inf on padded rows).
No block masks, no persistent grid, no deterministic dQ (gluon_bwd's constraint says so).
"""

from __future__ import annotations

from typing import Any

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from templates.gluon.bwd_kernel import (
    check_backward_inputs,
    launch_plan,
    mma_layout,
    probs_t,
    warps_barrier,
)
from templates.gluon.bwd_split_kernel import store_dkv_halves
from templates.gluon.bwd_ws_kernel import (
    MMA_REGS,
    WsLaunchPlan,
    dq_free_phase,
    dq_partition,
    dq_stage,
    load_partition,
    program_tile,
    ring_buffers,
    step_buffers,
    step_rows,
    tile_walk,
)

# Warps of each MMA partition: one warpgroup.
D256_WARPS = gl.constexpr(4)
# The tiles this kernel is written for (gluon_bwd's constraint refuses others at D 256).
D256_BLOCK_M = 64
D256_BLOCK_N = 64
D256_STAGES = 1


@gluon.jit
def _d256_step(dk, dv, k_full, v_full, q_smem, do_smem, p_buf, ds_buf, pds_full, lse_smem,
               delta_smem, dq_bufs, empty_slot, dq_empty, dq_full, DQ, bh, N_Q, t, m0, n0,
               N_KV, causal_offset, qk_scale, sm_scale, WG: gl.constexpr,
               CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
               BLOCK_N: gl.constexpr, DQ_T: gl.constexpr, DQ_BUFFERS: gl.constexpr):
    """Step t of warpgroup WG (query rows from m0 of head row bh; its operands landed): S^T
    and dP^T of its 32 queries, their P^T and dS^T columns stored and both halves waited
    for, then its columns of dV, dK and dQ; the ring slot released once dV's and dK's GEMMs
    are done, the dQ columns handed to the dQ warp (DQ_BUFFERS 1) or added into the fp32
    accumulator ``DQ`` ((B H_q, N_q, D) contiguous) by atomics from registers (DQ_BUFFERS 0).
    Returns (dk, dv)."""
    dtype: gl.constexpr = q_smem.dtype
    HALF_M: gl.constexpr = BLOCK_M // 2
    HALF_D: gl.constexpr = HEAD_DIM // 2
    st_layout: gl.constexpr = mma_layout(D256_WARPS, BLOCK_N, HALF_M)
    dq_layout: gl.constexpr = mma_layout(D256_WARPS, BLOCK_M, HALF_D)
    zeros_st = gl.zeros([BLOCK_N, HALF_M], gl.float32, st_layout)

    # S^T and dP^T of this warpgroup's 32 queries: all 64 keys, K = 256.
    q_rows = q_smem.slice(WG * HALF_M, HALF_M, dim=0)
    do_rows = do_smem.slice(WG * HALF_M, HALF_M, dim=0)
    s_tok = warpgroup_mma(k_full, q_rows.permute((1, 0)), zeros_st, use_acc=False,
                          is_async=True)
    dp_tok = warpgroup_mma(v_full, do_rows.permute((1, 0)), zeros_st, use_acc=False,
                           is_async=True)
    cols: gl.constexpr = gl.SliceLayout(0, st_layout)
    offs_m = m0 + WG * HALF_M + gl.arange(0, HALF_M, layout=cols)
    offs_n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, st_layout))

    s_t = warpgroup_mma_wait(1, deps=(s_tok,))
    lse2 = lse_smem.slice(WG * HALF_M, HALF_M).load(cols)
    # One path: the dense limits (N_kv, causality) on every step, as bwd_ws_kernel's walk.
    p_t = probs_t(s_t, lse2, offs_n, offs_m, N_KV, causal_offset, qk_scale, True, CAUSAL)
    p16 = p_t.to(dtype)
    p_buf.slice(WG * HALF_M, HALF_M, dim=1).store(p16)
    dp_t = warpgroup_mma_wait(0, deps=(dp_tok,))
    delta = delta_smem.slice(WG * HALF_M, HALF_M).load(cols)
    ds_t = (p16.to(gl.float32) * (dp_t - gl.expand_dims(delta, 0)) * sm_scale).to(dtype)
    ds_buf.slice(WG * HALF_M, HALF_M, dim=1).store(ds_t)
    # Both warpgroups' halves of P^T and dS^T in shared memory, visible to the tensor cores.
    fence_async_shared()
    warps_barrier()
    mbarrier.arrive(pds_full.index(t % 2))
    mbarrier.wait(pds_full.index(t % 2), (t // 2) & 1)

    # This warpgroup's columns of dV and dK over all 64 queries (operands in shared memory).
    dv_tok = warpgroup_mma(p_buf, do_smem.slice(WG * HALF_D, HALF_D, dim=1), dv,
                           is_async=True)
    dk_tok = warpgroup_mma(ds_buf, q_smem.slice(WG * HALF_D, HALF_D, dim=1), dk,
                           is_async=True)
    dq_tok = warpgroup_mma(ds_buf.permute((1, 0)), k_full.slice(WG * HALF_D, HALF_D, dim=1),
                           gl.zeros([BLOCK_M, HALF_D], gl.float32, dq_layout),
                           use_acc=False, is_async=True)
    # (In issue order dV's, dK's, dQ's: one outstanding leaves dQ's running.) Q and dO are
    # read by nobody of this warpgroup after dV's and dK's GEMMs: its half of the slot back.
    dv, dk = warpgroup_mma_wait(1, deps=(dv_tok, dk_tok))
    warps_barrier()
    mbarrier.arrive(empty_slot)
    dq = warpgroup_mma_wait(0, deps=(dq_tok,))
    if DQ_BUFFERS == 0:
        # FA3's d256 path: no staging tile, no dQ warp; rows past N_q are not added.
        rows = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, dq_layout))
        dims = WG * HALF_D + gl.arange(0, HALF_D, layout=gl.SliceLayout(0, dq_layout))
        offs = (gl.expand_dims(bh.to(gl.int64) * N_Q + rows, 1) * HEAD_DIM
                + gl.expand_dims(dims, 0))
        gl.atomic_add(DQ + offs, dq, mask=gl.expand_dims(rows < N_Q, 1), sem="relaxed")
    else:
        # Its columns of the staging tile, once the dQ warp's reduce of the last tile has
        # read it (one staging tile: DQ_BUFFERS 1).
        mbarrier.wait(dq_empty.index(0), dq_free_phase(t, 1))
        dq_stage(dq_bufs, 0, BLOCK_M, HEAD_DIM, DQ_T).slice(WG * HALF_D, HALF_D,
                                                            dim=1).store(dq)
        fence_async_shared()
        warps_barrier()
        mbarrier.arrive(dq_full.index(0))
    return dk, dv


@gluon.jit
def _d256_mma(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, lse_desc, delta_desc,
              dq_desc, k_buf, v_buf, q_bufs, do_bufs, lse_bufs, delta_bufs, dq_bufs, p_bufs,
              ds_bufs, kv_ready, ready, empty, dq_full, dq_empty, pds_full, kv_free,
              dkv_ready, N_Q, N_KV, causal_offset, H_Q, H_KV, GROUP, n_kv_tiles, n_q_tiles,
              qk_scale, sm_scale, Schedule, WG: gl.constexpr, HEAD_DIM: gl.constexpr,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
              CAUSAL: gl.constexpr, DQ_T: gl.constexpr, DQ_BUFFERS: gl.constexpr):
    """Warpgroup WG's walk of the program's KV tile (``tile_walk``: the load and dQ warps walk
    the same steps): its columns of dK and dV summed over every step, stored at the end.
    ``dq_desc``: the accumulator's TMA descriptor, or with DQ_BUFFERS 0 its pointer."""
    HALF_D: gl.constexpr = HEAD_DIM // 2
    b, kv_h, n0, first_row, full_row, n_q_steps, n_steps, h0 = tile_walk(
        program_tile(Schedule, False), N_KV, causal_offset, H_KV, GROUP, n_kv_tiles,
        n_q_tiles, BLOCK_M, BLOCK_N, CAUSAL)
    kv_layout: gl.constexpr = mma_layout(D256_WARPS, BLOCK_N, HALF_D)
    dk = gl.zeros([BLOCK_N, HALF_D], gl.float32, kv_layout)
    dv = gl.zeros([BLOCK_N, HALF_D], gl.float32, kv_layout)
    # K and V have landed before anything reads them or (no step at all) dK/dV overwrite them.
    mbarrier.wait(kv_ready, 0)
    for t in range(n_steps):
        h, m0 = step_rows(t, n_q_steps, h0, first_row, BLOCK_M)
        slot = t % STAGES
        mbarrier.wait(ready.index(slot), (t // STAGES) & 1)
        # As bwd_ws_kernel: K's and V's descriptors rebuilt each step from an index LLVM
        # cannot see (hoisted, they held registers across the step).
        zero = gl.inline_asm_elementwise("mov.b32 $0, 0;", "=r,r", [t], dtype=gl.int32,
                                         is_pure=False, pack=1)
        dk, dv = _d256_step(
            dk, dv, k_buf.index(zero).reshape([BLOCK_N, HEAD_DIM]),
            v_buf.index(zero).reshape([BLOCK_N, HEAD_DIM]),
            q_bufs.index(slot).reshape([BLOCK_M, HEAD_DIM]),
            do_bufs.index(slot).reshape([BLOCK_M, HEAD_DIM]), p_bufs.index(t % 2),
            ds_bufs.index(t % 2), pds_full, lse_bufs.index(slot), delta_bufs.index(slot),
            dq_bufs, empty.index(slot), dq_empty, dq_full, dq_desc, b * H_Q + h, N_Q, t, m0,
            n0, N_KV, causal_offset, qk_scale, sm_scale, WG, CAUSAL, HEAD_DIM, BLOCK_M,
            BLOCK_N, DQ_T, DQ_BUFFERS)
    # Both warpgroups' GEMMs read all of K and V (S^T and dP^T) until their last step.
    store_dkv_halves(dk, dv, k_buf, v_buf, dk_desc, dv_desc, kv_free, dkv_ready, b, kv_h, n0,
                     WG, 1, BLOCK_N, HEAD_DIM)


@gluon.jit(do_not_specialize=["N_Q", "N_KV", "causal_offset", "H_Q", "H_KV", "GROUP",
                              "n_kv_tiles", "n_q_tiles", "stride_cb", "stride_ch",
                              "stride_ib", "stride_ih", "stride_iq"])
def _gluon_bwd_d256_kernel(
    q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, lse_desc, delta_desc, dq_desc,
    N_Q, N_KV, causal_offset, H_Q, H_KV, GROUP, n_kv_tiles, n_q_tiles, qk_scale, sm_scale,
    # bwd_ws_kernel's parameters, so that its launch plan's arguments fit: the mask lists
    # and the counters are stand-ins here (dense and causal walks only).
    FullCounts, FullIndices, PartialCounts, PartialIndices, PartialTileIds, PartialTiles,
    stride_cb, stride_ch, stride_ib, stride_ih, stride_iq, DqCounters, Schedule,
    HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr, CAUSAL: gl.constexpr, DQ_BUFFERS: gl.constexpr,
    LOAD_REGS: gl.constexpr, num_warps: gl.constexpr, MMA_REGS: gl.constexpr = 240,
    DQ_T: gl.constexpr = False,
):
    gl.static_assert(HEAD_DIM == 256 and BLOCK_M == 64 and BLOCK_N == 64,
                     "the d256 kernel: 64 x 64 tiles at head_dim 256")
    gl.static_assert(DQ_BUFFERS <= 1, "one dQ staging tile (64 KiB at D 256) or none")
    dtype: gl.constexpr = q_desc.dtype
    if DQ_BUFFERS == 0:
        # (dq_buffers 0) No staging tile and no dQ warp: the MMA warps add dQ by atomics
        # (``dq_desc`` is the accumulator's pointer), which leaves room for a ring of two.
        k_buf, v_buf, q_bufs, do_bufs, lse_bufs, delta_bufs = ring_buffers(
            q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, STAGES)
    else:
        k_buf, v_buf, q_bufs, do_bufs, lse_bufs, delta_bufs, dq_bufs = step_buffers(
            q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, dq_desc, STAGES,
            DQ_BUFFERS)
        dq_full = gl.allocate_shared_memory(gl.int64, [DQ_BUFFERS, 1],
                                            mbarrier.MBarrierLayout())
        dq_empty = gl.allocate_shared_memory(gl.int64, [DQ_BUFFERS, 1],
                                             mbarrier.MBarrierLayout())
        for i in gl.static_range(DQ_BUFFERS):
            mbarrier.init(dq_full.index(i), count=2)
            mbarrier.init(dq_empty.index(i), count=1)
    pds_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128,
                                                    element_bitwidth=16, rank=2)
    p_bufs = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_M], pds_layout)
    ds_bufs = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_M], pds_layout)
    kv_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    pds_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    kv_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    dkv_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_ready, count=1)
    # Arrived on by both MMA warpgroups (one thread each): the slot, the dQ tile, P^T/dS^T
    # and the end. ready and dq_empty have one producer (the load warp, the dQ warp).
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)
    for i in gl.static_range(2):
        mbarrier.init(pds_full.index(i), count=2)
    mbarrier.init(kv_free, count=2)
    mbarrier.init(dkv_ready, count=2)
    fence_async_shared()

    if DQ_BUFFERS == 0:
        # (warp_specialize takes no None: stand-ins, never used, for the staging tile and its
        # barriers)
        dq_bufs = ds_bufs
        dq_full = empty
        dq_empty = empty
        gl.warp_specialize([
            (_d256_mma, (q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, lse_desc,
              delta_desc, dq_desc, k_buf, v_buf, q_bufs, do_bufs, lse_bufs, delta_bufs,
              dq_bufs, p_bufs, ds_bufs, kv_ready, ready, empty, dq_full, dq_empty, pds_full,
              kv_free, dkv_ready, N_Q, N_KV, causal_offset, H_Q, H_KV, GROUP, n_kv_tiles,
              n_q_tiles, qk_scale, sm_scale, Schedule, 0, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES,
              CAUSAL, DQ_T, DQ_BUFFERS)),
            (_d256_mma, (q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, lse_desc,
              delta_desc, dq_desc, k_buf, v_buf, q_bufs, do_bufs, lse_bufs, delta_bufs,
              dq_bufs, p_bufs, ds_bufs, kv_ready, ready, empty, dq_full, dq_empty, pds_full,
              kv_free, dkv_ready, N_Q, N_KV, causal_offset, H_Q, H_KV, GROUP, n_kv_tiles,
              n_q_tiles, qk_scale, sm_scale, Schedule, 1, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES,
              CAUSAL, DQ_T, DQ_BUFFERS)),
            (load_partition, (q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, lse_desc,
              delta_desc, dq_desc, k_buf, v_buf, q_bufs, do_bufs, lse_bufs, delta_bufs,
              dq_bufs, ds_bufs, kv_ready, ready, empty, dq_full, dq_empty, N_Q, N_KV,
              causal_offset, H_Q, H_KV, GROUP, n_kv_tiles, n_q_tiles, qk_scale, sm_scale,
              FullCounts, FullIndices, PartialCounts, PartialIndices, PartialTileIds,
              PartialTiles, stride_cb, stride_ch, stride_ib, stride_ih, stride_iq, HEAD_DIM,
              BLOCK_M, BLOCK_N, STAGES, CAUSAL, DQ_BUFFERS, False, 128, 128, 0, kv_ready,
              Schedule, 0, False, False, False)),
        ], [D256_WARPS, 1], [MMA_REGS, LOAD_REGS])
    else:
        gl.warp_specialize([
            (_d256_mma, (q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, lse_desc,
              delta_desc, dq_desc, k_buf, v_buf, q_bufs, do_bufs, lse_bufs, delta_bufs,
              dq_bufs, p_bufs, ds_bufs, kv_ready, ready, empty, dq_full, dq_empty, pds_full,
              kv_free, dkv_ready, N_Q, N_KV, causal_offset, H_Q, H_KV, GROUP, n_kv_tiles,
              n_q_tiles, qk_scale, sm_scale, Schedule, 0, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES,
              CAUSAL, DQ_T, DQ_BUFFERS)),
            (_d256_mma, (q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, lse_desc,
              delta_desc, dq_desc, k_buf, v_buf, q_bufs, do_bufs, lse_bufs, delta_bufs,
              dq_bufs, p_bufs, ds_bufs, kv_ready, ready, empty, dq_full, dq_empty, pds_full,
              kv_free, dkv_ready, N_Q, N_KV, causal_offset, H_Q, H_KV, GROUP, n_kv_tiles,
              n_q_tiles, qk_scale, sm_scale, Schedule, 1, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES,
              CAUSAL, DQ_T, DQ_BUFFERS)),
            (load_partition, (q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, lse_desc,
              delta_desc, dq_desc, k_buf, v_buf, q_bufs, do_bufs, lse_bufs, delta_bufs,
              dq_bufs, ds_bufs, kv_ready, ready, empty, dq_full, dq_empty, N_Q, N_KV,
              causal_offset, H_Q, H_KV, GROUP, n_kv_tiles, n_q_tiles, qk_scale, sm_scale,
              FullCounts, FullIndices, PartialCounts, PartialIndices, PartialTileIds,
              PartialTiles, stride_cb, stride_ch, stride_ib, stride_ih, stride_iq, HEAD_DIM,
              BLOCK_M, BLOCK_N, STAGES, CAUSAL, DQ_BUFFERS, False, 128, 128, 0, kv_ready,
              Schedule, 0, False, False, False)),
            (dq_partition, (q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, lse_desc,
              delta_desc, dq_desc, k_buf, v_buf, q_bufs, do_bufs, lse_bufs, delta_bufs,
              dq_bufs, ds_bufs, kv_ready, ready, empty, dq_full, dq_empty, N_Q, N_KV,
              causal_offset, H_Q, H_KV, GROUP, n_kv_tiles, n_q_tiles, qk_scale, sm_scale,
              FullCounts, FullIndices, PartialCounts, PartialIndices, PartialTileIds,
              PartialTiles, stride_cb, stride_ch, stride_ib, stride_ih, stride_iq,
              DqCounters, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, CAUSAL, DQ_BUFFERS, False, 128,
              128, 0, False, DQ_T, Schedule, 0, False, False, False)),
        ], [D256_WARPS, 1, 1], [MMA_REGS, LOAD_REGS, LOAD_REGS])


class D256LaunchPlan(WsLaunchPlan):
    """``WsLaunchPlan`` (grids, preprocess, descriptors, arguments) for the d256 kernel: one
    MMA warpgroup in the kernel's own partition (the other is a worker), 64 x 64 tiles; a
    ring of one with one dQ staging tile, or (dq_buffers 0) a ring of two with dQ added by
    the MMA warps' atomics."""

    def __init__(self, q: Any, k: Any, *, causal_mode: str, scale: float,
                 config: Any, kv_major_mask: Any = None, docs: bool = False,
                 sm_count: int | None = None) -> None:
        if kv_major_mask is not None:
            raise ValueError("the d256 backward walks dense and causal problems only "
                             "(no block mask)")
        super().__init__(q, k, causal_mode=causal_mode, scale=scale, config=config,
                         sm_count=sm_count)
        self.options.update(num_warps=D256_WARPS, MMA_REGS=MMA_REGS)
        self.options.pop("DEBUG", None)
        for name in ("DETERMINISTIC", "DQ_EARLY"):
            if self.options.pop(name, False):
                raise ValueError(f"the d256 backward does not take {name.lower()}")
        # dq_buffers 0: the MMA warps add dQ by atomics into the row-major accumulator (zeroed
        # by the preprocess), passed as its pointer instead of a TMA descriptor.
        self.dq_by_descriptor = self.options["DQ_BUFFERS"] > 0
        if not self.dq_by_descriptor and self.dq_transposed:
            raise ValueError("dq_transposed lays out the dQ staging tile: the d256 kernel "
                             "without one (dq_buffers 0) adds dQ row-major")

    def _dq_descriptor(self, dq_accum: Any) -> Any:
        """The accumulator's TMA descriptor (``WsLaunchPlan``'s), or with dq_buffers 0 the
        accumulator itself (its pointer)."""
        return super()._dq_descriptor(dq_accum) if self.dq_by_descriptor else dq_accum

    def main_kernel(self) -> Any:
        return _gluon_bwd_d256_kernel


def validate_inputs(do: Any, q: Any, k: Any, v: Any, o: Any, lse: Any, causal: bool | str,
                    scale: float | None) -> tuple[str, float]:
    """``bwd_kernel.validate_inputs`` for this kernel's head dim (the standalone entry's)."""
    return check_backward_inputs(do, q, k, v, o, lse, causal, scale, head_dims=(256,))


def launch(do: Any, q: Any, k: Any, v: Any, o: Any, lse: Any, *, causal_mode: str,
           scale: float, config: Any, block_mask: Any = None) -> tuple[Any, Any, Any]:
    """Run the d256 kernel on validated CUDA inputs (``bwd_ws_kernel.launch``'s contract)."""
    if block_mask is not None:
        raise ValueError("the d256 backward takes no block mask")
    return launch_plan(D256LaunchPlan, do, q, k, v, o, lse, causal_mode=causal_mode,
                       scale=scale, config=config)
