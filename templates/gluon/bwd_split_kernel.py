"""The warp-specialized Gluon backward with its two MMA warpgroups as two partitions
(gluon_bwd's ``split_warpgroups``; FlashAttention-3's consumers).

``bwd_ws_kernel`` runs both MMA warpgroups in one partition of 8 warps: every mbarrier
arrival there is one thread's after a barrier of all 8 warps (Triton inserts it), so the
warpgroups meet twice a step, before the dQ GEMM and at the dQ tile's hand-over, and each
waits for the slower one (the H200 profile: 14% of the compute warps' stalls at those
barriers; notes/gluon_notes.md). Here each warpgroup is a partition of its own (the kernel's
4 warps, and a worker of 4 at the same 240 registers) and owns half of everything a program
holds: keys [64 w, 64 w + 64) of the KV tile (its S^T, dP^T, dK and dV rows) and columns
[D/2 w, D/2 w + D/2) of each step's dQ tile. They meet only where the maths needs both:

  * dS^T: each stores its 64 key rows into the step's dS^T tile and arrives on ``ds_full``
    (count 2); both wait for it, then each runs its half of dQ = dS K (all 128 keys, its
    D/2 columns of K). Two dS^T tiles, used by turns: a warpgroup may store step t + 1's
    while the other's dQ GEMM still reads step t's (it passed step t + 1's ``ds_full`` only
    after the other finished step t).
  * the hand-overs count both: the ring slot's ``empty`` and the dQ tile's ``dq_full`` are
    initialized with count 2, each warpgroup arriving after its own GEMMs and its half of
    the tile; the load and dQ warps (``bwd_ws_kernel``'s, unchanged) see one completion.
  * the end: dK and dV leave through K's and V's buffers, which the other warpgroup's dQ
    GEMMs read until its last step: both arrive on ``kv_free`` first, then store their
    rows and arrive on ``dkv_ready``; the first warpgroup issues the TMA stores.

Dense, causal and block-masked walks (the mask's KV-major lists, partial blocks by their
tiles or, with DOCS, by the rows' document starts: each warpgroup reads its 64 key rows),
no ordered dQ and no dq_early (gluon_bwd's constraint says so). A dense step takes the masked
maths on every step (limits that hide nothing where nothing is masked), as
``bwd_ws_kernel``'s dense walk; a masked walk branches between full and partial blocks.

PERSISTENT (gluon_bwd's ``persistent``): one program per SM, every partition walking the
program's tiles in turn with the steps (ring slots, dQ tiles, dS^T tiles and their phases)
counted on across them. Without a block mask the host gives each program its tiles
(``SplitLaunchPlan._host_schedule``: longest first to the least loaded program), with one
they go in rounds (``bwd_ws_kernel.persistent_tile``). Between two tiles K and V go back to
the load warp as soon as both warpgroups' last GEMMs have read them (``kv_empty``), and the
next tile's first Q/dO loads and its K and V run under this tile's end: dK and dV leave
through the dS^T tiles and the first dQ staging tile (``_persistent_tile_end``).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from templates.gluon.bwd_kernel import (  # noqa: F401  validate_inputs: the standalone entry's
    launch_plan,
    mma_layout,
    tma_store,
    validate_inputs,
    warps_barrier,
)
from templates.gluon.bwd_tile_order import persistent_head_group
from templates.gluon.bwd_ws_kernel import (
    MMA_REGS,
    WsLaunchPlan,
    dq_free_phase,
    dq_partition,
    dq_stage,
    load_partition,
    mask_head,
    mask_step,
    persistent_tile,
    program_tile,
    step_buffers,
    step_front,
    step_rows,
    tile_walk,
    tiles_of_program,
)
from templates.gluon.schedule import MAX_SCHEDULED_TILES, lpt_schedule

# Warps of each MMA partition: one warpgroup (a constexpr: the kernels read it).
HALF_WARPS = gl.constexpr(4)


@builtin
def smem_reinterpret(desc, dtype, shape, layout, _semantic=None):  # noqa: ANN001, ANN201
    """Shared memory ``desc``'s bytes seen as ``dtype``, ``shape`` and ``layout``: the method
    is ``_reinterpret`` in triton 3.6's Gluon and ``reinterpret`` later; both call this."""
    def value(x):  # noqa: ANN001, ANN202
        return x.value if isinstance(x, gl.constexpr) else x

    return _semantic.memdesc_reinterpret(desc, value(dtype), [value(n) for n in value(shape)],
                                         value(layout))


@gluon.jit
def _half_step(dk, dv, k_full, v_full, q_smem, do_smem, ds_buf, ds_full, lse_smem,
               delta_smem, t, m0, n0, N_KV, causal_offset, qk_scale, sm_scale, tile_base,
               WG: gl.constexpr, MASKED: gl.constexpr, CAUSAL: gl.constexpr,
               TILE: gl.constexpr, DOCS: gl.constexpr, HEAD_DIM: gl.constexpr,
               BLOCK_M: gl.constexpr, HALF_N: gl.constexpr, MASK_BLOCK_Q: gl.constexpr,
               DK_LATE: gl.constexpr):
    """Step t of warpgroup WG: its keys' S^T, dP^T, dV and dK GEMMs and softmax, its dS^T
    rows into ``ds_buf``, then (both halves there) its columns of dQ. Returns (dk, dv, dq,
    dS^T's operand), every GEMM completed; with DK_LATE dK's GEMM is issued after dQ's and
    ``dk`` is its token, still in flight (the caller writes dQ out under it, then waits for
    it with the operand). MASKED: the dense walk's limits (N_kv, causality); TILE: a block
    mask's partial block, whose rows of its keys x queries uint8 tile (from ``tile_base``)
    hide P^T's zeros, or with DOCS the rows' document starts there (``bwd_ws_kernel``'s)."""
    HALF_D: gl.constexpr = HEAD_DIM // 2
    dq_layout: gl.constexpr = mma_layout(HALF_WARPS, BLOCK_M, HALF_D)
    dv_tok, p_op, ds_t, ds_op = step_front(
        dv, k_full.slice(WG * HALF_N, HALF_N, dim=0), v_full.slice(WG * HALF_N, HALF_N, dim=0),
        q_smem, do_smem, lse_smem, delta_smem, m0, n0, n0 + WG * HALF_N, N_KV, causal_offset,
        qk_scale, sm_scale, tile_base, MASKED, CAUSAL, TILE, DOCS, HALF_WARPS, HALF_N,
        HEAD_DIM, BLOCK_M, MASK_BLOCK_Q)
    if not DK_LATE:  # dK's GEMM runs across the dS^T exchange
        dk_tok = warpgroup_mma(ds_op, q_smem, dk, is_async=True)

    # This warpgroup's dS^T rows, then both halves before either dQ GEMM reads the tile.
    ds_buf.slice(WG * HALF_N, HALF_N, dim=0).store(ds_t)
    fence_async_shared()
    warps_barrier()
    mbarrier.arrive(ds_full.index(t % 2))
    mbarrier.wait(ds_full.index(t % 2), (t // 2) & 1)
    dq_tok = warpgroup_mma(ds_buf.permute((1, 0)), k_full.slice(WG * HALF_D, HALF_D, dim=1),
                           gl.zeros([BLOCK_M, HALF_D], gl.float32, dq_layout),
                           use_acc=False, is_async=True)
    if DK_LATE:  # FA3's order: dK's GEMM runs while the caller writes dQ out
        dk = warpgroup_mma(ds_op, q_smem, dk, is_async=True)
        dv, dq, p_op = warpgroup_mma_wait(1, deps=(dv_tok, dq_tok, p_op))
    else:
        dv, dk, dq, p_op, ds_op = warpgroup_mma_wait(0, deps=(dv_tok, dk_tok, dq_tok, p_op,
                                                              ds_op))
    return dk, dv, dq, ds_op


@gluon.jit
def _half_walk_step(dk, dv, k_buf, v_buf, q_bufs, do_bufs, lse_bufs, delta_bufs, dq_bufs,
                    ds_bufs, ready, empty, dq_full, dq_empty, ds_full, t, m0, n0, N_KV,
                    causal_offset, qk_scale, sm_scale, tile_base, WG: gl.constexpr,
                    MASKED: gl.constexpr, CAUSAL: gl.constexpr, TILE: gl.constexpr,
                    DOCS: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                    BLOCK_N: gl.constexpr, STAGES: gl.constexpr, DQ_BUFFERS: gl.constexpr,
                    MASK_BLOCK_Q: gl.constexpr, DQ_T: gl.constexpr, DK_LATE: gl.constexpr):
    """Step t (query rows from m0, ring slot t % STAGES) of warpgroup WG: its half of the
    step (``_half_step``), then its columns of the dQ tile into a free staging buffer and its
    two arrivals (each barrier completes on both warpgroups'; with DK_LATE the slot's once
    dK's GEMM, which reads Q, is done). Returns (dk, dv)."""
    HALF_N: gl.constexpr = BLOCK_N // 2
    HALF_D: gl.constexpr = HEAD_DIM // 2
    slot = t % STAGES
    mbarrier.wait(ready.index(slot), (t // STAGES) & 1)
    # As bwd_ws_kernel: descriptors rebuilt each step from an index LLVM cannot see.
    zero = gl.inline_asm_elementwise("mov.b32 $0, 0;", "=r,r", [t], dtype=gl.int32,
                                     is_pure=False, pack=1)
    k_full = k_buf.index(zero).reshape([BLOCK_N, HEAD_DIM])
    v_full = v_buf.index(zero).reshape([BLOCK_N, HEAD_DIM])
    dk, dv, dq, ds_op = _half_step(dk, dv, k_full, v_full,
                                   q_bufs.index(slot).reshape([BLOCK_M, HEAD_DIM]),
                                   do_bufs.index(slot).reshape([BLOCK_M, HEAD_DIM]),
                                   ds_bufs.index(t % 2), ds_full, lse_bufs.index(slot),
                                   delta_bufs.index(slot), t, m0, n0, N_KV, causal_offset,
                                   qk_scale, sm_scale, tile_base, WG, MASKED, CAUSAL, TILE, DOCS,
                                   HEAD_DIM, BLOCK_M, HALF_N, MASK_BLOCK_Q, DK_LATE)
    buf = t % DQ_BUFFERS
    mbarrier.wait(dq_empty.index(buf), dq_free_phase(t, DQ_BUFFERS))
    dq_stage(dq_bufs, buf, BLOCK_M, HEAD_DIM, DQ_T).slice(WG * HALF_D, HALF_D,
                                                          dim=1).store(dq)
    fence_async_shared()
    warps_barrier()
    if DK_LATE:
        mbarrier.arrive(dq_full.index(buf))
        dk, ds_op = warpgroup_mma_wait(0, deps=(dk, ds_op))
        warps_barrier()
        mbarrier.arrive(empty.index(slot))
    else:
        mbarrier.arrive(empty.index(slot))
        mbarrier.arrive(dq_full.index(buf))
    return dk, dv


@gluon.jit
def _mma_half(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, lse_desc, delta_desc,
              dq_desc, k_buf, v_buf, q_bufs, do_bufs, lse_bufs, delta_bufs, dq_bufs, ds_bufs,
              kv_ready, ready, empty, dq_full, dq_empty, ds_full, kv_free, dkv_ready,
              N_Q, N_KV, causal_offset, H_Q, H_KV, GROUP, n_kv_tiles, n_q_tiles,
              qk_scale, sm_scale, FullCounts, FullIndices, PartialCounts, PartialIndices,
              PartialTileIds, PartialTiles, stride_cb, stride_ch, stride_ib, stride_ih,
              stride_iq, kv_empty, dkv_stored, Schedule, N_TILES, WG: gl.constexpr,
              HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              STAGES: gl.constexpr, CAUSAL: gl.constexpr, DQ_BUFFERS: gl.constexpr,
              SPARSE: gl.constexpr, MASK_BLOCK_Q: gl.constexpr, MASK_BLOCK_KV: gl.constexpr,
              DOCS: gl.constexpr, DQ_T: gl.constexpr, PERSISTENT: gl.constexpr,
              HOST_SCHEDULE: gl.constexpr, TILE_ORDER: gl.constexpr, DK_LATE: gl.constexpr):
    """Warpgroup WG's walk (the same walk as every partition's, ``tile_walk``): its
    half of each step, its half of the dQ tile handed over, its dK/dV rows stored at the
    end. PERSISTENT: the program's tiles in turn (``persistent_tile``), steps counted on
    across them (``_persistent_tile_end`` says how a tile ends)."""
    if PERSISTENT:
        step0 = N_Q * 0
        for i in range(tiles_of_program(N_TILES, Schedule, HOST_SCHEDULE)):
            b, kv_h, n0, first_row, full_row, n_q_steps, n_steps, h0 = tile_walk(
                persistent_tile(i, Schedule, HOST_SCHEDULE, TILE_ORDER), N_KV, causal_offset,
                H_KV, GROUP, n_kv_tiles, n_q_tiles, BLOCK_M, BLOCK_N, CAUSAL)
            mbarrier.wait(kv_ready, i & 1)
            # The staging tiles hold the last tile's dK and dV until their stores have read
            # them (a fresh barrier passes the first tile).
            mbarrier.wait(dkv_stored, (i & 1) ^ 1)
            dk, dv, step0 = _half_walk(
                step0, b, n0, first_row, n_q_steps, n_steps, h0, k_buf, v_buf, q_bufs, do_bufs,
                lse_bufs, delta_bufs, dq_bufs, ds_bufs, ready, empty, dq_full, dq_empty, ds_full,
                N_KV, causal_offset, GROUP, qk_scale, sm_scale, FullCounts, FullIndices,
                PartialCounts, PartialIndices, PartialTileIds, PartialTiles, stride_cb,
                stride_ch, stride_ib, stride_ih, stride_iq, WG, HEAD_DIM, BLOCK_M, BLOCK_N,
                STAGES, CAUSAL, DQ_BUFFERS, SPARSE, MASK_BLOCK_Q, MASK_BLOCK_KV, DOCS, DQ_T,
                DK_LATE)
            _persistent_tile_end(dk, dv, dk_desc, dv_desc, dq_bufs, ds_bufs, dq_empty,
                                 kv_empty, dkv_ready, dkv_stored, i, step0, b, kv_h, n0, WG,
                                 HEAD_DIM, BLOCK_M, BLOCK_N, DQ_BUFFERS)
    else:
        b, kv_h, n0, first_row, full_row, n_q_steps, n_steps, h0 = tile_walk(
            program_tile(Schedule, TILE_ORDER), N_KV, causal_offset, H_KV, GROUP, n_kv_tiles,
            n_q_tiles, BLOCK_M, BLOCK_N, CAUSAL)
        mbarrier.wait(kv_ready, 0)
        dk, dv, steps = _half_walk(
            N_Q * 0, b, n0, first_row, n_q_steps, n_steps, h0, k_buf, v_buf, q_bufs, do_bufs,
            lse_bufs, delta_bufs, dq_bufs, ds_bufs, ready, empty, dq_full, dq_empty, ds_full,
            N_KV, causal_offset, GROUP, qk_scale, sm_scale, FullCounts, FullIndices,
            PartialCounts, PartialIndices, PartialTileIds, PartialTiles, stride_cb, stride_ch,
            stride_ib, stride_ih, stride_iq, WG, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, CAUSAL,
            DQ_BUFFERS, SPARSE, MASK_BLOCK_Q, MASK_BLOCK_KV, DOCS, DQ_T, DK_LATE)
        # The other warpgroup's dQ GEMMs read all of K until its last step.
        store_dkv_halves(dk, dv, k_buf, v_buf, dk_desc, dv_desc, kv_free, dkv_ready, b, kv_h,
                         n0, WG, 0, BLOCK_N, HEAD_DIM)


@gluon.jit
def store_dkv_halves(dk, dv, k_buf, v_buf, dk_desc, dv_desc, kv_free, dkv_ready, b, kv_h, n0,
                     WG: gl.constexpr, DIM: gl.constexpr, BLOCK_N: gl.constexpr,
                     HEAD_DIM: gl.constexpr):
    """The end of a KV tile whose dK and dV two MMA warpgroups hold in halves (DIM 0: each
    its keys, this kernel; DIM 1: each its columns, the d256 kernel): once both have done
    every GEMM that reads K and V (``kv_free``), each stores its halves over K's and V's
    buffers, and warpgroup 0 issues the two TMA stores once both are in (``dkv_ready``)."""
    HALF: gl.constexpr = (BLOCK_N if DIM == 0 else HEAD_DIM) // 2
    dtype: gl.constexpr = dk_desc.dtype
    mbarrier.arrive(kv_free)
    mbarrier.wait(kv_free, 0)
    k_buf.index(0).reshape([BLOCK_N, HEAD_DIM]).slice(WG * HALF, HALF,
                                                      dim=DIM).store(dk.to(dtype))
    v_buf.index(0).reshape([BLOCK_N, HEAD_DIM]).slice(WG * HALF, HALF,
                                                      dim=DIM).store(dv.to(dtype))
    fence_async_shared()
    warps_barrier()
    mbarrier.arrive(dkv_ready)
    if WG == 0:  # one issuer for the tile's TMA stores, once both halves are in
        mbarrier.wait(dkv_ready, 0)
        tma_store(dk_desc, [b, kv_h, n0, 0], k_buf.index(0))
        tma_store(dv_desc, [b, kv_h, n0, 0], v_buf.index(0))
        tma.store_wait(0)


@gluon.jit
def _persistent_tile_end(dk, dv, dk_desc, dv_desc, dq_bufs, ds_bufs, dq_empty, kv_empty,
                         dkv_ready, dkv_stored, i, step, b, kv_h, n0, WG: gl.constexpr,
                         HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                         BLOCK_N: gl.constexpr, DQ_BUFFERS: gl.constexpr):
    """The end of the program's i-th tile (``step``: the next tile's first step) on a
    persistent grid. K and V go back to the load warp at once (``kv_empty``, both
    warpgroups), so that the next tile's load under this one's stores; dK and dV leave
    through the tiles the walk has finished with instead: dK through the two dS^T tiles
    (once the other warpgroup's dQ GEMMs have read them: ``kv_empty`` complete), dV through
    the first dQ staging tile (once the dQ warp's last reduce has read it), both exactly a
    tile's bytes with 64-query steps (BLOCK_N x D bf16: 2 x BLOCK_N x 64 x 2 and 64 x D x 4).
    Warpgroup 0 issues the TMA stores and, once they have read the tiles, arrives on
    ``dkv_stored``, which both wait for before the next tile's walk writes into them."""
    gl.static_assert(BLOCK_M == 64 and (HEAD_DIM == 64 or HEAD_DIM == 128),
                     "dK and dV staged in the dS^T and dQ tiles: 64-query steps, D 64 or 128")
    HALF_N: gl.constexpr = BLOCK_N // 2
    dtype: gl.constexpr = ds_bufs.dtype
    mbarrier.arrive(kv_empty)
    mbarrier.wait(kv_empty, i & 1)
    # The first buffer's next user waits for its last reduce: so does dV.
    first = step + (DQ_BUFFERS - step % DQ_BUFFERS) % DQ_BUFFERS
    mbarrier.wait(dq_empty.index(0), dq_free_phase(first, DQ_BUFFERS))
    if HEAD_DIM == 2 * BLOCK_M:
        dk_stage = smem_reinterpret(ds_bufs, dtype, [1, 1, BLOCK_N, HEAD_DIM], dk_desc.layout)
    else:
        dk_stage = smem_reinterpret(ds_bufs.index(0), dtype, [1, 1, BLOCK_N, HEAD_DIM],
                                    dk_desc.layout)
    dv_stage = smem_reinterpret(dq_bufs.index(0), dtype, [1, 1, BLOCK_N, HEAD_DIM],
                                dv_desc.layout)
    dk_stage.reshape([BLOCK_N, HEAD_DIM]).slice(WG * HALF_N, HALF_N, dim=0).store(dk.to(dtype))
    dv_stage.reshape([BLOCK_N, HEAD_DIM]).slice(WG * HALF_N, HALF_N, dim=0).store(dv.to(dtype))
    fence_async_shared()
    warps_barrier()
    mbarrier.arrive(dkv_ready)
    if WG == 0:
        mbarrier.wait(dkv_ready, i & 1)
        tma_store(dk_desc, [b, kv_h, n0, 0], dk_stage)
        tma_store(dv_desc, [b, kv_h, n0, 0], dv_stage)
        tma.store_wait(0)
        mbarrier.arrive(dkv_stored)


@gluon.jit
def _half_walk(step0, b, n0, first_row, n_q_steps, n_steps, h0, k_buf, v_buf, q_bufs, do_bufs,
               lse_bufs, delta_bufs, dq_bufs, ds_bufs, ready, empty, dq_full, dq_empty,
               ds_full, N_KV, causal_offset, GROUP, qk_scale, sm_scale, FullCounts,
               FullIndices, PartialCounts, PartialIndices, PartialTileIds, PartialTiles,
               stride_cb, stride_ch, stride_ib, stride_ih, stride_iq, WG: gl.constexpr,
               HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
               STAGES: gl.constexpr, CAUSAL: gl.constexpr, DQ_BUFFERS: gl.constexpr,
               SPARSE: gl.constexpr, MASK_BLOCK_Q: gl.constexpr, MASK_BLOCK_KV: gl.constexpr,
               DOCS: gl.constexpr, DQ_T: gl.constexpr, DK_LATE: gl.constexpr):
    """Warpgroup WG's steps of one tile (K and V landed), numbered from ``step0``: (dk, dv,
    the step after its last), every GEMM completed."""
    HALF_N: gl.constexpr = BLOCK_N // 2
    kv_layout: gl.constexpr = mma_layout(HALF_WARPS, HALF_N, HEAD_DIM)
    dk = gl.zeros([HALF_N, HEAD_DIM], gl.float32, kv_layout)
    dv = gl.zeros([HALF_N, HEAD_DIM], gl.float32, kv_layout)
    if SPARSE:
        step = step0
        for g in range(GROUP):
            lrow, n_full, n_head = mask_head(FullCounts, PartialCounts, b, h0 + g, n0,
                                             stride_cb, stride_ch, stride_ib, stride_ih,
                                             stride_iq, BLOCK_M, MASK_BLOCK_Q, MASK_BLOCK_KV)
            for j in range(n_head):
                m0, partial, tile_base = mask_step(FullIndices, PartialIndices,
                                                   PartialTileIds, PartialTiles, lrow, n_full,
                                                   j, n0, BLOCK_M, MASK_BLOCK_Q, MASK_BLOCK_KV)
                if DOCS:
                    tile_base = PartialTiles
                # Causality is the mask's: a full block sees every pair, a partial one what
                # its tile keeps.
                if partial:
                    dk, dv = _half_walk_step(
                        dk, dv, k_buf, v_buf, q_bufs, do_bufs, lse_bufs, delta_bufs, dq_bufs,
                        ds_bufs, ready, empty, dq_full, dq_empty, ds_full, step, m0, n0, N_KV,
                        causal_offset, qk_scale, sm_scale, tile_base, WG, False, False, True,
                        DOCS, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, DQ_BUFFERS, MASK_BLOCK_Q, DQ_T,
                        DK_LATE)
                else:
                    dk, dv = _half_walk_step(
                        dk, dv, k_buf, v_buf, q_bufs, do_bufs, lse_bufs, delta_bufs, dq_bufs,
                        ds_bufs, ready, empty, dq_full, dq_empty, ds_full, step, m0, n0, N_KV,
                        causal_offset, qk_scale, sm_scale, tile_base, WG, False, False, False,
                        False, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, DQ_BUFFERS, MASK_BLOCK_Q, DQ_T,
                        DK_LATE)
                step += 1
        end = step
    else:
        for t in range(n_steps):
            h, m0 = step_rows(t, n_q_steps, h0, first_row, BLOCK_M)
            # One path: the masked maths on every step, as bwd_ws_kernel's dense walk.
            dk, dv = _half_walk_step(
                dk, dv, k_buf, v_buf, q_bufs, do_bufs, lse_bufs, delta_bufs, dq_bufs, ds_bufs,
                ready, empty, dq_full, dq_empty, ds_full, step0 + t, m0, n0, N_KV,
                causal_offset, qk_scale, sm_scale, None, WG, True, CAUSAL, False, False,
                HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, DQ_BUFFERS, MASK_BLOCK_Q, DQ_T, DK_LATE)
        end = step0 + n_steps
    return dk, dv, end


@gluon.jit(do_not_specialize=["N_Q", "N_KV", "causal_offset", "H_Q", "H_KV", "GROUP",
                              "n_kv_tiles", "n_q_tiles", "stride_cb", "stride_ch",
                              "stride_ib", "stride_ih", "stride_iq", "N_TILES"])
def _gluon_bwd_split_kernel(
    q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, lse_desc, delta_desc, dq_desc,
    N_Q, N_KV, causal_offset, H_Q, H_KV, GROUP, n_kv_tiles, n_q_tiles, qk_scale, sm_scale,
    # bwd_ws_kernel's parameters, so that its launch plan's arguments fit: the mask lists
    # and the counters are stand-ins here (dense and causal walks only).
    FullCounts, FullIndices, PartialCounts, PartialIndices, PartialTileIds, PartialTiles,
    stride_cb, stride_ch, stride_ib, stride_ih, stride_iq, DqCounters,
    # (persistent) the host's schedule (HOST_SCHEDULE) and the tiles (``persistent_tile``);
    # with TILE_ORDER (longest_first) the tiles' order instead of a schedule.
    Schedule, N_TILES,
    HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr, CAUSAL: gl.constexpr, DQ_BUFFERS: gl.constexpr,
    LOAD_REGS: gl.constexpr, num_warps: gl.constexpr, MMA_REGS: gl.constexpr = 240,
    SPARSE: gl.constexpr = False, MASK_BLOCK_Q: gl.constexpr = 128,
    MASK_BLOCK_KV: gl.constexpr = 128, DOCS: gl.constexpr = False, DQ_T: gl.constexpr = False,
    PERSISTENT: gl.constexpr = False, HOST_SCHEDULE: gl.constexpr = False,
    TILE_ORDER: gl.constexpr = False, DK_LATE: gl.constexpr = False,
):
    gl.static_assert(BLOCK_N == 128, "two warpgroups of 64 keys each")
    dtype: gl.constexpr = q_desc.dtype
    k_buf, v_buf, q_bufs, do_bufs, lse_bufs, delta_bufs, dq_bufs = step_buffers(
        q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, dq_desc, STAGES, DQ_BUFFERS)
    ds_bufs = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_M],
                                        gl.NVMMASharedLayout(swizzle_byte_width=128,
                                                             element_bitwidth=16, rank=2))
    kv_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    dq_full = gl.allocate_shared_memory(gl.int64, [DQ_BUFFERS, 1], mbarrier.MBarrierLayout())
    dq_empty = gl.allocate_shared_memory(gl.int64, [DQ_BUFFERS, 1], mbarrier.MBarrierLayout())
    ds_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    kv_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    dkv_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    dkv_stored = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_ready, count=1)
    # Arrived on by both MMA warpgroups (one thread each): the slot, the dQ tile, dS^T and
    # the end. ready and dq_empty have one producer (the load warp, the dQ warp).
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)
    for i in gl.static_range(DQ_BUFFERS):
        mbarrier.init(dq_full.index(i), count=2)
        mbarrier.init(dq_empty.index(i), count=1)
    for i in gl.static_range(2):
        mbarrier.init(ds_full.index(i), count=2)
    mbarrier.init(kv_free, count=2)
    mbarrier.init(dkv_ready, count=2)
    mbarrier.init(kv_empty, count=2)
    mbarrier.init(dkv_stored, count=1)
    fence_async_shared()

    gl.warp_specialize([
        (_mma_half, (q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, lse_desc, delta_desc,
          dq_desc, k_buf, v_buf, q_bufs, do_bufs, lse_bufs, delta_bufs, dq_bufs, ds_bufs,
          kv_ready, ready, empty, dq_full, dq_empty, ds_full, kv_free, dkv_ready, N_Q, N_KV,
          causal_offset, H_Q, H_KV, GROUP, n_kv_tiles, n_q_tiles, qk_scale, sm_scale,
          FullCounts, FullIndices, PartialCounts, PartialIndices, PartialTileIds, PartialTiles,
          stride_cb, stride_ch, stride_ib, stride_ih, stride_iq, kv_empty, dkv_stored,
          Schedule, N_TILES, 0, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, CAUSAL, DQ_BUFFERS,
          SPARSE, MASK_BLOCK_Q, MASK_BLOCK_KV, DOCS, DQ_T, PERSISTENT, HOST_SCHEDULE,
          TILE_ORDER, DK_LATE)),
        (_mma_half, (q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, lse_desc, delta_desc,
          dq_desc, k_buf, v_buf, q_bufs, do_bufs, lse_bufs, delta_bufs, dq_bufs, ds_bufs,
          kv_ready, ready, empty, dq_full, dq_empty, ds_full, kv_free, dkv_ready, N_Q, N_KV,
          causal_offset, H_Q, H_KV, GROUP, n_kv_tiles, n_q_tiles, qk_scale, sm_scale,
          FullCounts, FullIndices, PartialCounts, PartialIndices, PartialTileIds, PartialTiles,
          stride_cb, stride_ch, stride_ib, stride_ih, stride_iq, kv_empty, dkv_stored,
          Schedule, N_TILES, 1, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, CAUSAL, DQ_BUFFERS,
          SPARSE, MASK_BLOCK_Q, MASK_BLOCK_KV, DOCS, DQ_T, PERSISTENT, HOST_SCHEDULE,
          TILE_ORDER, DK_LATE)),
        (load_partition, (q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, lse_desc,
          delta_desc, dq_desc, k_buf, v_buf, q_bufs, do_bufs, lse_bufs, delta_bufs, dq_bufs,
          ds_bufs, kv_ready, ready, empty, dq_full, dq_empty, N_Q, N_KV, causal_offset, H_Q,
          H_KV, GROUP, n_kv_tiles, n_q_tiles, qk_scale, sm_scale, FullCounts, FullIndices,
          PartialCounts, PartialIndices, PartialTileIds, PartialTiles, stride_cb, stride_ch,
          stride_ib, stride_ih, stride_iq, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, CAUSAL,
          DQ_BUFFERS, SPARSE, MASK_BLOCK_Q, MASK_BLOCK_KV, 0, kv_empty, Schedule, N_TILES,
          PERSISTENT, HOST_SCHEDULE, TILE_ORDER)),
        (dq_partition, (q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, lse_desc,
          delta_desc, dq_desc, k_buf, v_buf, q_bufs, do_bufs, lse_bufs, delta_bufs, dq_bufs,
          ds_bufs, kv_ready, ready, empty, dq_full, dq_empty, N_Q, N_KV, causal_offset, H_Q,
          H_KV, GROUP, n_kv_tiles, n_q_tiles, qk_scale, sm_scale, FullCounts, FullIndices,
          PartialCounts, PartialIndices, PartialTileIds, PartialTiles, stride_cb, stride_ch,
          stride_ib, stride_ih, stride_iq, DqCounters, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES,
          CAUSAL, DQ_BUFFERS, SPARSE, MASK_BLOCK_Q, MASK_BLOCK_KV, 0, False, DQ_T, Schedule,
          N_TILES, PERSISTENT, HOST_SCHEDULE, TILE_ORDER)),
    ], [HALF_WARPS, 1, 1], [MMA_REGS, LOAD_REGS, LOAD_REGS])


class SplitLaunchPlan(WsLaunchPlan):
    """``WsLaunchPlan`` (grids, preprocess, descriptors, arguments) for the split kernel:
    one warpgroup in the kernel's own partition (the other is a worker). With the config's
    ``persistent``, a grid of min(tiles, ``sm_count``) programs (q's GPU's multiprocessors
    by default) walking the tiles ``persistent_tile`` gives them: without a block mask by
    the host's schedule (``_host_schedule``), with one in rounds. With ``longest_first``
    (block masks only) the tiles go in the order ``bwd_tile_order.TileOrder`` gives each
    call's mask: the grid's launch order, or the persistent grid's rounds."""

    def __init__(self, q: Any, k: Any, *, causal_mode: str, scale: float,
                 config: Any, kv_major_mask: Any = None, docs: bool = False,
                 sm_count: int | None = None) -> None:
        super().__init__(q, k, causal_mode=causal_mode, scale=scale, config=config,
                         kv_major_mask=kv_major_mask, docs=docs, sm_count=sm_count)
        self.options.update(num_warps=HALF_WARPS, MMA_REGS=MMA_REGS)
        # (GLUON_BWD_DEBUG's switches are the other kernel's.)
        self.options.pop("DEBUG", None)
        for name in ("DETERMINISTIC", "DQ_EARLY"):
            if self.options.pop(name, False):
                raise ValueError(f"split_warpgroups does not take {name.lower()}")
        if config.get("dk_after_dq"):  # only where set: the default kernel's options unchanged
            self.options.update(DK_LATE=True)
        self.n_tiles = self.grid[0]
        self.schedule: Any = None
        if config.get("persistent"):
            self.grid = (min(self.n_tiles, self.sm_count),)
            self.options.update(PERSISTENT=True)
            if kv_major_mask is None and self.n_tiles <= MAX_SCHEDULED_TILES:
                table = self._host_schedule(q, k, causal_mode)
                # (A stand-in q, the offline build's, makes a stand-in of its type.)
                self.schedule = (torch.tensor(table, dtype=torch.int32, device=q.device)
                                 if isinstance(q, torch.Tensor)
                                 else type(q)(torch.int32, [len(table)]))
                self.options.update(HOST_SCHEDULE=True)

    def _host_schedule(self, q: Any, k: Any, causal_mode: str) -> list[int]:
        """The persistent grid's tiles, per program (``tiles_of_program``' table): each KV
        tile costs its walk's steps (its query tiles times the GQA group) plus
        ``TILE_OVERHEAD_STEPS``; longest first to the least loaded program
        (``schedule.lpt_schedule``), in head groups (``persistent_head_group``)."""
        batch, heads_q, seqlen_q, head_dim = q.shape
        heads_kv = k.shape[1]
        offset, n_kv_tiles, n_q_tiles = self.scalars[2], self.scalars[6], self.scalars[7]
        block_m, block_n = self.options["BLOCK_M"], self.options["BLOCK_N"]
        group = heads_q // heads_kv
        costs = []
        for m in range(n_kv_tiles):
            first = (max(m * block_n - offset, 0) // block_m) if causal_mode != "none" else 0
            costs.append(group * max(n_q_tiles - first, 0) + TILE_OVERHEAD_STEPS)
        rows = batch * heads_kv
        # Equal walks (no causality) need no pool to even out: one row at a time, every KV
        # tile of a head in turn, as the grid without persistence runs them (with head
        # groups of 8, 4 x 4k dense read 0.90x cuDNN's speed against the non-persistent
        # grid's 0.96x; one row at a time 0.92x against 0.95x: the order is not what that
        # row loses, notes/gluon_notes.md).
        head_group = 1 if causal_mode == "none" else persistent_head_group(
            rows, n_kv_tiles, self.grid[0], 2 * seqlen_q * head_dim * q.dtype.itemsize * group)
        owned = lpt_schedule(n_kv_tiles, rows, head_group, costs, self.grid[0])
        offsets = [0]
        for tiles in owned:
            offsets.append(offsets[-1] + len(tiles))
        return offsets + [tile for tiles in owned for tile in tiles]

    def tail_args(self, dk: Any, mask: list[Any], kv_major: Any = None) -> list[Any]:
        # (The host's schedule where there is one, else the tiles' order or dk's stand-in.)
        if self.schedule is not None:
            return [self.schedule, self.n_tiles]
        return [*super().tail_args(dk, mask, kv_major), self.n_tiles]

    def main_kernel(self) -> Any:
        return _gluon_bwd_split_kernel


# What a tile of a persistent grid costs beyond its steps, in steps, for the host's schedule:
# its K/V load and dK/dV stores, about one 128-key step's time each.
TILE_OVERHEAD_STEPS = 2


def launch(do: Any, q: Any, k: Any, v: Any, o: Any, lse: Any, *, causal_mode: str,
           scale: float, config: Any, block_mask: Any = None) -> tuple[Any, Any, Any]:
    """Run the split kernel on validated CUDA inputs (``bwd_ws_kernel.launch``'s contract)."""
    kv_major = None if block_mask is None else block_mask.transposed
    return launch_plan(functools.partial(SplitLaunchPlan, kv_major_mask=kv_major), do, q, k,
                       v, o, lse, causal_mode=causal_mode, scale=scale, config=config)
