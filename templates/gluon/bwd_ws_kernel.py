"""The Gluon backward for Hopper, warp-specialized (FlashAttention-3's structure).

The same backward as ``templates.gluon.bwd_kernel`` (whose preprocess, per-step maths, input
checks and launch plan it reuses: same inputs, same delta/lse2 preprocess, same fp32 dQ
accumulator cast at the end), with the work of a program split over three partitions of
``gl.warp_specialize``:

  * the MMA partition (the kernel's own 8 warps: two warpgroups, ``setmaxnreg`` raised to
    MMA_REGS) runs every step's five GEMMs and the softmax, keeps dK/dV in registers, and
    hands each step's dQ tile over in shared memory: it never issues a load nor a global
    atomic;
  * a load warp (LOAD_REGS registers) brings K and V once, then each step's Q, dO, lse2 and
    delta by TMA into a ring of ``STAGES`` slots, each with a full and an empty mbarrier (the
    MMA partition releases a slot when the step's GEMMs that read it have completed);
  * a dQ warp (LOAD_REGS registers) adds each staged dQ tile into the fp32 accumulator with
    one TMA bulk reduce (``cp.reduce.async.bulk.tensor ... add.f32``) and releases the
    staging buffer once the reduce has read it; with ``DQ_BUFFERS`` 2 the MMA partition fills
    one buffer while the other is being added, so it waits on the reduce only when the
    reduce takes longer than a whole step.

With a block mask (``SPARSE``) a program walks, for each query head of its group, only the
query blocks the mask's *transposed* lists give for its KV block (``BlockMask.transposed``:
per KV block, its full then its partial query blocks, ascending), each mask block of
MASK_BLOCK_Q rows as MASK_BLOCK_Q / BLOCK_M steps; full blocks take the unmasked maths,
partial ones hide what their (transposed, keys x queries) uint8 tile hides in P^T, so dS^T
too. Causality is the mask's own (CAUSAL False). The three partitions run the same walk
(``mask_head`` and ``mask_step``): the load warp issues the step's loads, the MMA warps
compute it, the dQ warp adds its dQ tile where the walk says.

dq is not bitwise deterministic (the reduces of the programs of one query tile land in any
order); dk and dv are. With ``DETERMINISTIC`` (gluon_bwd's ``deterministic``; dense and causal
only; bitwise repeatable in the GPU tests) the dQ warp adds each query tile's dQ in increasing
KV-tile order, through an int32 counter per (batch, query head, query tile) in global memory
(FA3's semaphore; ``_dq_step_in_order`` says why it is ordered and when it cannot deadlock),
so dq is bitwise repeatable too.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from typing import Any

import torch
import triton
import triton.language as tl
from triton._C.libtriton import ir
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
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from templates.gluon.bwd_kernel import (  # noqa: F401  validate_inputs: the standalone entry's
    DEBUG,
    PREPROCESS_ROWS,
    LaunchPlan,
    dq_cast_args,
    dq_cast_launch,
    dq_gemm,
    host_smem_layout,
    launch_plan,
    mma_layout,
    probs_t,
    tma_load,
    tma_store,
    validate_inputs,
    warps_barrier,
)
from templates.gluon.bwd_tile_order import TileOrder, persistent_head_group

# Registers per thread of the load and dQ warps' warpgroup (setmaxnreg: a multiple of 8, at
# least 24): they compute coordinates and issue TMA operations only.
LOAD_REGS = 24
# Registers per thread of the MMA warpgroups: the register file (65536) over three
# warpgroups is 168 each at launch (maxnreg); Triton gives the two MMA warpgroups what the
# worker warpgroup gives up, (3 x 168 - 24) / 2 = 240 (FA3's split for two MMA warpgroups;
# the PTX's setmaxnreg.inc 240).
MAX_REGS = 168
MMA_REGS = (3 * MAX_REGS - LOAD_REGS) // 2
# Warps of the MMA partition (two warpgroups; ``_mma_partition`` says 8 itself); the two
# worker partitions have one warp each, in the warpgroup Triton pads them to.
MMA_WARPS = 8


@builtin
def _tma_reduce_add_36(tensor_desc, coord, src, _semantic=None):  # noqa: ANN001, ANN202
    """global[the box at ``coord``] += shared ``src``: one TMA bulk reduce, completed like a
    TMA store (``tma.store_wait``). triton 3.6's Gluon has the op in its builder but no Python
    name for it (measured right on the H200 in session #22); later versions call it
    ``tma.async_atomic_add`` (picked below)."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle,
                                              coord, src.handle)


tma_reduce_add = getattr(tma, "async_atomic_add", None) or _tma_reduce_add_36


# ----------------------------------------------------------------------------- the walk
@gluon.jit
def program_tile(Schedule, TILE_ORDER: gl.constexpr = False):
    """The tile of this program of a grid of one program per tile: the program id, or with
    TILE_ORDER the tile ``Schedule`` lists at it (the host's order of the tiles: longest
    walk first, ``bwd_tile_order.TileOrder``; programs start in about their id's order)."""
    if TILE_ORDER:
        return gl.load(Schedule + gl.program_id(0))
    else:
        return gl.program_id(0)


@gluon.jit
def tile_walk(pid, N_KV, causal_offset, H_KV, GROUP, n_kv_tiles, n_q_tiles,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
    """Tile ``pid`` (KV tile ``pid % n_kv_tiles`` of (batch, kv head) row
    ``pid // n_kv_tiles``) and the query tiles it walks: (b, kv head, n0, first_row,
    full_row, n_q_steps, n_steps, h0). Step t is query tile ``first_row / BLOCK_M + t %
    n_q_steps`` of query head ``h0 + t // n_q_steps``; steps on rows below ``full_row`` take
    the masked maths (as ``bwd_kernel``'s walk)."""
    tile = pid % n_kv_tiles
    bkv = pid // n_kv_tiles
    b = bkv // H_KV
    kv_h = bkv % H_KV
    n0 = tile * BLOCK_N
    if CAUSAL:
        first_row = (gl.maximum(n0 - causal_offset, 0) // BLOCK_M) * BLOCK_M
        full_row = gl.cdiv(gl.maximum(n0 + BLOCK_N - 1 - causal_offset, 0), BLOCK_M) * BLOCK_M
    else:
        first_row = n0 * 0
        full_row = n0 * 0
    full_row = gl.where(n0 + BLOCK_N > N_KV, n_q_tiles * BLOCK_M, full_row)
    n_q_steps = gl.maximum(n_q_tiles - first_row // BLOCK_M, 0)
    n_steps = n_q_steps * GROUP
    h0 = kv_h * GROUP
    return b, kv_h, n0, first_row, full_row, n_q_steps, n_steps, h0


@gluon.jit
def step_rows(t, n_q_steps, h0, first_row, BLOCK_M: gl.constexpr):
    """(query head, first query row) of step t."""
    per_head = gl.maximum(n_q_steps, 1)  # no division by zero when there is no step at all
    return h0 + t // per_head, first_row + (t % per_head) * BLOCK_M


# ----------------------------------------------------------------------------- the mask walk
@gluon.jit
def mask_head(FullCounts, PartialCounts, b, h, n0, stride_cb, stride_ch, stride_ib, stride_ih,
              stride_iq, BLOCK_M: gl.constexpr, MASK_BLOCK_Q: gl.constexpr,
              MASK_BLOCK_KV: gl.constexpr):
    """(SPARSE) The walk of query head h for the KV tile from key n0, from the transposed
    mask's lists (rows = KV blocks): (offset of the tile's list row, its full blocks, its
    steps). A step is BLOCK_M rows of a listed query block: full blocks' steps first."""
    SUB: gl.constexpr = MASK_BLOCK_Q // BLOCK_M
    kv_row = n0 // MASK_BLOCK_KV
    counts = b * stride_cb + h * stride_ch + kv_row
    lrow = b * stride_ib + h * stride_ih + kv_row * stride_iq
    n_full = gl.load(FullCounts + counts)
    n_partial = gl.load(PartialCounts + counts)
    return lrow, n_full, (n_full + n_partial) * SUB


@gluon.jit
def mask_step(FullIndices, PartialIndices, PartialTileIds, PartialTiles, lrow, n_full, j, n0,
              BLOCK_M: gl.constexpr, MASK_BLOCK_Q: gl.constexpr,
              MASK_BLOCK_KV: gl.constexpr):
    """(SPARSE) Step j of a head's walk (``mask_head``): (first query row, whether its block
    is partial, where the step's keys x queries uint8 tile starts: row ``n0 % MASK_BLOCK_KV``
    of the block's transposed tile, its columns of this step's queries; unused for a full
    block). Slot 0 of a list row is readable even where the row lists nothing."""
    SUB: gl.constexpr = MASK_BLOCK_Q // BLOCK_M
    slot = j // SUB
    sub = j % SUB
    partial = slot >= n_full
    p_slot = gl.maximum(slot - n_full, 0)
    if partial:
        block = gl.load(PartialIndices + lrow + p_slot)
    else:
        block = gl.load(FullIndices + lrow + slot)
    tile_id = gl.load(PartialTileIds + lrow + p_slot)
    tile_base = (PartialTiles + tile_id.to(gl.int64) * (MASK_BLOCK_Q * MASK_BLOCK_KV)
                 + (n0 % MASK_BLOCK_KV) * MASK_BLOCK_Q + sub * BLOCK_M)
    return block * MASK_BLOCK_Q + sub * BLOCK_M, partial, tile_base


# ----------------------------------------------------------------------------- the load warp
@gluon.jit
def load_partition(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, lse_desc, delta_desc,
                    dq_desc, k_buf, v_buf, q_bufs, do_bufs, lse_bufs, delta_bufs, dq_bufs,
                    ds_smem, kv_ready, ready, empty, dq_full, dq_empty,
                    N_Q, N_KV, causal_offset, H_Q, H_KV, GROUP, n_kv_tiles, n_q_tiles,
                    qk_scale, sm_scale, FullCounts, FullIndices, PartialCounts,
                    PartialIndices, PartialTileIds, PartialTiles, stride_cb, stride_ch,
                    stride_ib, stride_ih, stride_iq,
                    HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                    STAGES: gl.constexpr, CAUSAL: gl.constexpr, DQ_BUFFERS: gl.constexpr,
                    SPARSE: gl.constexpr, MASK_BLOCK_Q: gl.constexpr,
                    MASK_BLOCK_KV: gl.constexpr, DEBUG: gl.constexpr, kv_empty=None,
                    Schedule=None, N_TILES=0, PERSISTENT: gl.constexpr = False,
                    HOST_SCHEDULE: gl.constexpr = False, TILE_ORDER: gl.constexpr = False):
    """K and V once, then step t's Q, dO, lse2 and delta into slot t % STAGES once the MMA
    partition has released it (the empty barrier's previous phase; a fresh barrier passes).
    PERSISTENT (``persistent_tile``): the program's tiles in turn, steps counted on across
    them; each tile's K and V once the MMA warps have released the last one's
    (``kv_empty``), after the tile's first STAGES steps' loads, which the ring takes while
    the last tile's steps finish."""
    if PERSISTENT:
        step0 = N_Q * 0
        for i in range(tiles_of_program(N_TILES, Schedule, HOST_SCHEDULE)):
            step0 = _load_walk(persistent_tile(i, Schedule, HOST_SCHEDULE, TILE_ORDER), step0, i,
                q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, k_buf, v_buf, q_bufs,
                do_bufs, lse_bufs, delta_bufs, kv_ready, kv_empty, ready, empty, N_KV,
                causal_offset, H_Q, H_KV, GROUP, n_kv_tiles, n_q_tiles, FullCounts, FullIndices,
                PartialCounts, PartialIndices, PartialTileIds, PartialTiles, stride_cb, stride_ch,
                stride_ib, stride_ih, stride_iq, BLOCK_M, BLOCK_N, STAGES, CAUSAL, SPARSE,
                MASK_BLOCK_Q, MASK_BLOCK_KV, True)
    else:
        _load_walk(program_tile(Schedule, TILE_ORDER), N_Q * 0, 0, q_desc, k_desc, v_desc, do_desc,
                   lse_desc, delta_desc, k_buf, v_buf, q_bufs, do_bufs, lse_bufs, delta_bufs,
                   kv_ready, kv_empty, ready, empty, N_KV, causal_offset, H_Q, H_KV, GROUP,
                   n_kv_tiles, n_q_tiles, FullCounts, FullIndices, PartialCounts, PartialIndices,
                   PartialTileIds, PartialTiles, stride_cb, stride_ch, stride_ib, stride_ih,
                   stride_iq, BLOCK_M, BLOCK_N, STAGES, CAUSAL, SPARSE, MASK_BLOCK_Q, MASK_BLOCK_KV,
                   False)


@gluon.jit
def _load_walk(pid, step0, i, q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, k_buf,
               v_buf, q_bufs, do_bufs, lse_bufs, delta_bufs, kv_ready, kv_empty, ready, empty,
               N_KV, causal_offset, H_Q, H_KV, GROUP, n_kv_tiles, n_q_tiles, FullCounts,
               FullIndices, PartialCounts, PartialIndices, PartialTileIds, PartialTiles,
               stride_cb, stride_ch, stride_ib, stride_ih, stride_iq, BLOCK_M: gl.constexpr,
               BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
               SPARSE: gl.constexpr, MASK_BLOCK_Q: gl.constexpr, MASK_BLOCK_KV: gl.constexpr,
               PERSISTENT: gl.constexpr):
    """Tile ``pid``'s loads, its steps numbered from ``step0`` (the program's i-th tile);
    returns the step after its last."""
    b, kv_h, n0, first_row, full_row, n_q_steps, n_steps, h0 = tile_walk(
        pid, N_KV, causal_offset, H_KV, GROUP, n_kv_tiles, n_q_tiles, BLOCK_M, BLOCK_N, CAUSAL)
    N_Q_PAD = n_q_tiles * BLOCK_M
    if not PERSISTENT:
        _load_kv(k_desc, v_desc, k_buf, v_buf, kv_ready, kv_empty, i, b, kv_h, n0, False)
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
                if PERSISTENT:  # noqa: SIM102  (a constexpr, then a run-time condition)
                    if step - step0 == STAGES:
                        _load_kv(k_desc, v_desc, k_buf, v_buf, kv_ready, kv_empty, i, b, kv_h,
                                 n0, True)
                _load_step(q_desc, do_desc, lse_desc, delta_desc, q_bufs, do_bufs, lse_bufs,
                           delta_bufs, ready, empty, step, b, h0 + g, m0, H_Q, N_Q_PAD, STAGES)
                step += 1
        end = step
    else:
        for t in range(n_steps):
            h, m0 = step_rows(t, n_q_steps, h0, first_row, BLOCK_M)
            if PERSISTENT:  # noqa: SIM102  (a constexpr, then a run-time condition)
                if t == STAGES:
                    _load_kv(k_desc, v_desc, k_buf, v_buf, kv_ready, kv_empty, i, b, kv_h, n0,
                             True)
            _load_step(q_desc, do_desc, lse_desc, delta_desc, q_bufs, do_bufs, lse_bufs,
                       delta_bufs, ready, empty, step0 + t, b, h, m0, H_Q, N_Q_PAD, STAGES)
        end = step0 + n_steps
    if PERSISTENT:  # noqa: SIM102  (a constexpr, then a run-time condition)
        if end - step0 <= STAGES:  # a walk of STAGES steps or fewer: its K and V now
            _load_kv(k_desc, v_desc, k_buf, v_buf, kv_ready, kv_empty, i, b, kv_h, n0, True)
    return end


@gluon.jit
def _load_kv(k_desc, v_desc, k_buf, v_buf, kv_ready, kv_empty, i, b, kv_h, n0,
             PERSISTENT: gl.constexpr):
    """The tile's K and V (the program's i-th tile); PERSISTENT: once both MMA warpgroups
    have released the (i-1)-th's (``kv_empty``'s previous phase; the first passes)."""
    if PERSISTENT:
        mbarrier.wait(kv_empty, (i & 1) ^ 1)
    mbarrier.expect(kv_ready, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma_load(k_desc, [b, kv_h, n0, 0], kv_ready, k_buf.index(0))
    tma_load(v_desc, [b, kv_h, n0, 0], kv_ready, v_buf.index(0))


@gluon.jit
def _load_step(q_desc, do_desc, lse_desc, delta_desc, q_bufs, do_bufs, lse_bufs, delta_bufs,
               ready, empty, t, b, h, m0, H_Q, N_Q_PAD, STAGES: gl.constexpr):
    """Step t's Q, dO, lse2 and delta (query head h, rows from m0) into slot t % STAGES once
    the MMA partition has released it."""
    step_bytes: gl.constexpr = (q_desc.block_type.nbytes + do_desc.block_type.nbytes
                                + 2 * lse_desc.block_type.nbytes)
    slot = t % STAGES
    mbarrier.wait(empty.index(slot), ((t // STAGES) & 1) ^ 1)
    row0 = (b * H_Q + h) * N_Q_PAD + m0
    mbarrier.expect(ready.index(slot), step_bytes)
    tma_load(q_desc, [b, h, m0, 0], ready.index(slot), q_bufs.index(slot))
    tma_load(do_desc, [b, h, m0, 0], ready.index(slot), do_bufs.index(slot))
    tma_load(lse_desc, [row0], ready.index(slot), lse_bufs.index(slot))
    tma_load(delta_desc, [row0], ready.index(slot), delta_bufs.index(slot))


# ----------------------------------------------------------------------------- persistent grids
# (gluon_bwd's ``persistent``, the split kernel) A grid of min(tiles, SMs) programs, each
# walking its tiles one after another. Without a block mask the host gives each program its
# tiles (HOST_SCHEDULE: ``Schedule`` holds programs + 1 offsets, then every program's tiles;
# the split kernel's plan makes it, longest first to the least loaded program). With one
# (the walks' lengths are the mask's, on the GPU) round r of the grid takes tiles r G ..
# r G + G - 1 in ``tile_walk``'s order, program p the p-th of an even round and the
# (G-1-p)-th of an odd one, so that a program given a long tile in one round gets a short
# one in the next.
@gluon.jit
def tiles_of_program(N_TILES, Schedule, HOST_SCHEDULE: gl.constexpr):
    """How many tiles this program of a persistent grid walks."""
    p = gl.program_id(0)
    if HOST_SCHEDULE:
        return gl.load(Schedule + p + 1) - gl.load(Schedule + p)
    else:
        G = gl.num_programs(0)
        rounds = N_TILES // G
        last = gl.where(rounds % 2 == 0, p, G - 1 - p)  # its place in the partial last round
        return rounds + (last < N_TILES % G).to(gl.int32)


@gluon.jit
def persistent_tile(i, Schedule, HOST_SCHEDULE: gl.constexpr,
                    TILE_ORDER: gl.constexpr = False):
    """This program's i-th tile, as ``tile_walk`` numbers them. Without a host schedule the
    grid takes the tiles in rounds, snaking; with TILE_ORDER it takes them in the order
    ``Schedule`` lists them (``program_tile``)."""
    G = gl.num_programs(0)
    p = gl.program_id(0)
    if HOST_SCHEDULE:
        return gl.load(Schedule + G + 1 + gl.load(Schedule + p) + i)
    else:
        turn = i * G + gl.where(i % 2 == 0, p, G - 1 - p)
        if TILE_ORDER:
            return gl.load(Schedule + turn)
        else:
            return turn


# ----------------------------------------------------------------------------- the dQ warp
@gluon.jit
def dq_partition(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, lse_desc, delta_desc,
                  dq_desc, k_buf, v_buf, q_bufs, do_bufs, lse_bufs, delta_bufs, dq_bufs,
                  ds_smem, kv_ready, ready, empty, dq_full, dq_empty,
                  N_Q, N_KV, causal_offset, H_Q, H_KV, GROUP, n_kv_tiles, n_q_tiles,
                  qk_scale, sm_scale, FullCounts, FullIndices, PartialCounts,
                  PartialIndices, PartialTileIds, PartialTiles, stride_cb, stride_ch,
                  stride_ib, stride_ih, stride_iq, DqCounters,
                  HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                  STAGES: gl.constexpr, CAUSAL: gl.constexpr, DQ_BUFFERS: gl.constexpr,
                  SPARSE: gl.constexpr, MASK_BLOCK_Q: gl.constexpr,
                  MASK_BLOCK_KV: gl.constexpr, DEBUG: gl.constexpr,
                  DETERMINISTIC: gl.constexpr, DQ_T: gl.constexpr = False, Schedule=None,
                  N_TILES=0, PERSISTENT: gl.constexpr = False,
                  HOST_SCHEDULE: gl.constexpr = False, TILE_ORDER: gl.constexpr = False):
    """Step t's dQ tile, staged in buffer t % DQ_BUFFERS, added into the accumulator's rows
    of its query head by one TMA bulk reduce (rows past N_q are dropped by the TMA unit);
    the buffer goes back to the MMA partition once the reduce is done with it. With
    DETERMINISTIC (dense or causal) each query tile's reduces land in increasing KV-tile
    order (``_dq_step_in_order``; ``DqCounters``: an int32 counter per (batch, query head,
    query tile), zeroed by the host per call). PERSISTENT: the program's tiles in turn
    (``persistent_tile``), steps counted on across them (not with DETERMINISTIC)."""
    if PERSISTENT:
        gl.static_assert(not DETERMINISTIC)
        step0 = N_Q * 0
        for i in range(tiles_of_program(N_TILES, Schedule, HOST_SCHEDULE)):
            step0 = _dq_walk(persistent_tile(i, Schedule, HOST_SCHEDULE, TILE_ORDER), step0,
                             dq_desc, dq_bufs, dq_full, dq_empty, N_KV, causal_offset, H_Q,
                             H_KV, GROUP, n_kv_tiles, n_q_tiles, FullCounts, FullIndices,
                             PartialCounts, PartialIndices, PartialTileIds, PartialTiles,
                             stride_cb, stride_ch, stride_ib, stride_ih, stride_iq,
                             DqCounters, BLOCK_M, BLOCK_N, CAUSAL, DQ_BUFFERS, SPARSE,
                             MASK_BLOCK_Q, MASK_BLOCK_KV, DEBUG, DETERMINISTIC, DQ_T)
    else:
        _dq_walk(program_tile(Schedule, TILE_ORDER), N_Q * 0, dq_desc, dq_bufs, dq_full, dq_empty,
                 N_KV, causal_offset, H_Q, H_KV, GROUP, n_kv_tiles, n_q_tiles, FullCounts,
                 FullIndices, PartialCounts, PartialIndices, PartialTileIds, PartialTiles,
                 stride_cb, stride_ch, stride_ib, stride_ih, stride_iq, DqCounters, BLOCK_M,
                 BLOCK_N, CAUSAL, DQ_BUFFERS, SPARSE, MASK_BLOCK_Q, MASK_BLOCK_KV, DEBUG,
                 DETERMINISTIC, DQ_T)


@gluon.jit
def _dq_walk(pid, step0, dq_desc, dq_bufs, dq_full, dq_empty, N_KV, causal_offset, H_Q, H_KV,
             GROUP, n_kv_tiles, n_q_tiles, FullCounts, FullIndices, PartialCounts,
             PartialIndices, PartialTileIds, PartialTiles, stride_cb, stride_ch, stride_ib,
             stride_ih, stride_iq, DqCounters, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
             CAUSAL: gl.constexpr, DQ_BUFFERS: gl.constexpr, SPARSE: gl.constexpr,
             MASK_BLOCK_Q: gl.constexpr, MASK_BLOCK_KV: gl.constexpr, DEBUG: gl.constexpr,
             DETERMINISTIC: gl.constexpr, DQ_T: gl.constexpr):
    """Tile ``pid``'s dQ reduces, its steps numbered from ``step0``; returns the step after
    its last."""
    b, kv_h, n0, first_row, full_row, n_q_steps, n_steps, h0 = tile_walk(
        pid, N_KV, causal_offset, H_KV, GROUP, n_kv_tiles, n_q_tiles, BLOCK_M, BLOCK_N, CAUSAL)
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
                _dq_step(dq_desc, dq_bufs, dq_full, dq_empty, step, b * H_Q + h0 + g, m0,
                         DQ_BUFFERS, DEBUG, DQ_T)
                step += 1
        end = step
    else:
        for t in range(n_steps):
            h, m0 = step_rows(t, n_q_steps, h0, first_row, BLOCK_M)
            if DETERMINISTIC:
                # The KV tiles that visit a query tile are 0 .. k (``tile_walk``: a
                # tile's first row never decreases with its index, and every tile walks on
                # to the last query tile), so this tile's turn at any of its query tiles is
                # its own index. Per query head: a GQA program's heads each count their own.
                counter = DqCounters + ((b * H_Q + h) * n_q_tiles + m0 // BLOCK_M)
                _dq_step_in_order(dq_desc, dq_bufs, dq_full, dq_empty, step0 + t,
                                  b * H_Q + h, m0, counter, n0 // BLOCK_N, DQ_BUFFERS, DEBUG,
                                  DQ_T)
            else:
                _dq_step(dq_desc, dq_bufs, dq_full, dq_empty, step0 + t, b * H_Q + h, m0,
                         DQ_BUFFERS, DEBUG, DQ_T)
        end = step0 + n_steps
    return end


@gluon.jit
def _dq_step(dq_desc, dq_bufs, dq_full, dq_empty, t, bh, m0, DQ_BUFFERS: gl.constexpr,
             DEBUG: gl.constexpr, DQ_T: gl.constexpr):
    """Step t's staged dQ tile (rows from m0 of head row bh) added by one TMA reduce."""
    buf = t % DQ_BUFFERS
    mbarrier.wait(dq_full.index(buf), (t // DQ_BUFFERS) & 1)
    if (DEBUG & 16) == 0:
        dq_reduce(dq_desc, dq_bufs.index(buf), bh, m0, DQ_T)
    tma.store_wait(0)
    mbarrier.arrive(dq_empty.index(buf))



# ----------------------------------------------------------------------------- dQ in KV-tile order
# (DETERMINISTIC) fp32 additions do not commute bitwise, so dq is repeatable only if every
# query tile's partial tiles are added in one fixed order: here increasing KV tile, as FA3's
# deterministic backward does, by a counter per (batch, query head, query tile) in global
# memory. The dQ warp of KV tile n waits until the counter reads n (the KV tiles before it
# have added theirs), adds its tile, waits until the addition has been *performed* in global
# memory, and then increments the counter.
#
# Memory ordering. The reduce is written by the TMA unit (the async proxy); the counter is read
# and written by ordinary loads and atomics (the generic proxy). So:
#   * after the reduce, ``cp.async.bulk.wait_group 0`` (not ``.read``, which is all
#     ``tma.store_wait`` asks: that only says the shared-memory tile has been read) waits
#     until the reduce's writes are complete; ``fence.proxy.async.global`` then orders those
#     async-proxy writes before this thread's later generic-proxy accesses, so the release
#     below covers them;
#   * the increment is a ``red.release.gpu``: whoever acquires the new value sees the reduce;
#   * the waiter's load is an ``ld.acquire.gpu``, followed by ``fence.proxy.async.global`` so
#     that its TMA reduce (async proxy) is ordered after what the acquire made visible.
# The reduce is issued by one elected lane of the warp and the counter incremented by lane 0:
# ``bar.warp.sync`` between them orders the issuing lane's wait and fence before lane 0's
# release (a warp barrier orders the memory accesses of the lanes it joins).
#
# Deadlock. KV tile n waits only on tiles 0 .. n-1 of the same (batch, kv head), which never
# wait on it (tile 0 never waits; by induction each finishes), so the waits form no cycle. What
# they need is that those tiles *run*: the program of tile n - 1 is pid - 1 (pid = tile +
# n_kv_tiles (b H_kv + kv head)), and the hardware hands out a grid's programs in increasing
# pid order, so by the time pid runs, every lower pid is resident or done, and a waiting
# program holds its SM until then. Not guaranteed by the CUDA programming model (FA3 relies on
# the same order): a scheduler that started programs out of order while more programs exist
# than can be resident at once could fill every SM with waiters whose lower tiles never start.
# Sharing the GPU (MPS, green contexts, another stream's kernels) only delays, as long as the
# lower pids are started first.
@gluon.jit
def _wait_for_turn(counter, turn):
    """Spin until ``*counter == turn`` (acquire, then the generic -> async proxy fence)."""
    # Lane 0's value for every lane (shfl), so the loop's exit is the same for the whole warp.
    seen = _load_acquire(counter)
    while seen != turn:
        seen = _load_acquire(counter)
    gl.inline_asm_elementwise("fence.proxy.async.global;\n\tmov.b32 $0, 0;", "=r,r", [turn],
                              dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _load_acquire(counter):
    return gl.inline_asm_elementwise(
        "{\n\t.reg .b32 seen;\n\tld.acquire.gpu.global.b32 seen, [$1];\n\t"
        "shfl.sync.idx.b32 $0, seen, 0, 0x1f, -1;\n\t}", "=r,l", [counter],
        dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _pass_turn(counter):
    """This warp's bulk reduces complete and visible, then ``*counter += 1`` (release), once."""
    gl.inline_asm_elementwise(
        "{\n\t.reg .pred first;\n\t.reg .b32 lane;\n\t"
        "cp.async.bulk.wait_group 0;\n\t"
        "fence.proxy.async.global;\n\t"
        "bar.warp.sync -1;\n\t"
        "mov.u32 lane, %laneid;\n\t"
        "setp.eq.u32 first, lane, 0;\n\t"
        "@first red.release.gpu.global.add.s32 [$1], 1;\n\t"
        "mov.b32 $0, 0;\n\t}", "=r,l", [counter], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _dq_step_in_order(dq_desc, dq_bufs, dq_full, dq_empty, t, bh, m0, counter, turn,
                      DQ_BUFFERS: gl.constexpr, DEBUG: gl.constexpr, DQ_T: gl.constexpr):
    """``_dq_step`` at this KV tile's turn ``turn`` of the query tile whose
    counter is ``counter``. The turn is waited for before the tile is (the tile is usually
    still being computed then); the staging buffer goes back as soon as the reduce has read
    it, the turn once the reduce is complete."""
    buf = t % DQ_BUFFERS
    _wait_for_turn(counter, turn)
    mbarrier.wait(dq_full.index(buf), (t // DQ_BUFFERS) & 1)
    if (DEBUG & 16) == 0:
        dq_reduce(dq_desc, dq_bufs.index(buf), bh, m0, DQ_T)
    tma.store_wait(0)
    mbarrier.arrive(dq_empty.index(buf))
    _pass_turn(counter)


# ----------------------------------------------------------------------------- the MMA warps
@gluon.jit
def _ws_step(dk, dv, q_smem, do_smem, k_smem, v_smem, ds_smem, lse_smem, delta_smem,
             dq_bufs, dq_empty, t, m0, n0, N_KV, causal_offset, qk_scale, sm_scale, tile_base,
             MASKED: gl.constexpr, CAUSAL: gl.constexpr, TILE: gl.constexpr,
             HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
             NUM_WARPS: gl.constexpr, MASK_BLOCK_Q: gl.constexpr, DEBUG: gl.constexpr,
             DQ_BUFFERS: gl.constexpr, DQ_EARLY: gl.constexpr, DOCS: gl.constexpr = False,
             DQ_T: gl.constexpr = False):
    """One step of ``bwd_kernel._bwd_step``'s maths (same GEMMs, same orientation, same
    operands) that returns its dQ tile instead of adding it: (dk, dv, dq), every GEMM of
    the step completed. TILE: a block mask's partial block, whose keys x queries uint8 tile
    (rows MASK_BLOCK_Q apart from ``tile_base``) hides P^T's zeros, so dS^T's too.

    DOCS (gluon_bwd's ``doc_offsets``, a mask of causal packed documents): a partial block's
    visibility is computed instead of read: ``tile_base`` is then the int32 first key of
    every query row's document (``masks.row_ranges``), and key j is visible to query i iff
    first[i] <= j <= i.

    DQ_EARLY (gluon_bwd's ``dq_early``): the dQ GEMM is issued before dK's, and its tile is
    stored into step t's staging buffer (``_dq_stage``) while dK's GEMM still runs; the
    caller then only fences and hands it over. Otherwise the caller stores it after every
    GEMM of the step."""
    dq_layout: gl.constexpr = mma_layout(NUM_WARPS, BLOCK_M, HEAD_DIM)
    dv_tok, p_op, ds_t, ds_op = step_front(
        dv, k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, m0, n0, n0, N_KV,
        causal_offset, qk_scale, sm_scale, tile_base, MASKED, CAUSAL, TILE, DOCS, NUM_WARPS,
        BLOCK_N, HEAD_DIM, BLOCK_M, MASK_BLOCK_Q)
    if DQ_EARLY:
        dq_tok = dq_gemm(ds_t, ds_smem, k_smem, dq_layout, BLOCK_M, HEAD_DIM)
        dk_tok = warpgroup_mma(ds_op, q_smem, dk, is_async=True)
        # In issue order dV's, dQ's, dK's: at most one outstanding leaves dK's running.
        dv, dq, p_op = warpgroup_mma_wait(1, deps=(dv_tok, dq_tok, p_op))
        buf = t % DQ_BUFFERS
        mbarrier.wait(dq_empty.index(buf), dq_free_phase(t, DQ_BUFFERS))
        dq_stage(dq_bufs, buf, BLOCK_M, HEAD_DIM, DQ_T).store(dq)
        dk, ds_op = warpgroup_mma_wait(0, deps=(dk_tok, ds_op))
        return dk, dv, dq
    dk_tok = warpgroup_mma(ds_op, q_smem, dk, is_async=True)
    if DEBUG & 4:  # no dQ GEMM: a zero tile is handed over (prices the GEMM)
        dv, dk, p_op, ds_op = warpgroup_mma_wait(0, deps=(dv_tok, dk_tok, p_op, ds_op))
        return dk, dv, gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, dq_layout)
    dq_tok = dq_gemm(ds_t, ds_smem, k_smem, dq_layout, BLOCK_M, HEAD_DIM)
    dv, dk, dq, p_op, ds_op = warpgroup_mma_wait(0, deps=(dv_tok, dk_tok, dq_tok, p_op, ds_op))
    return dk, dv, dq


@gluon.jit
def step_front(dv, k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, m0, n0, key0, N_KV,
               causal_offset, qk_scale, sm_scale, tile_base, MASKED: gl.constexpr,
               CAUSAL: gl.constexpr, TILE: gl.constexpr, DOCS: gl.constexpr,
               NUM_WARPS: gl.constexpr, KEYS: gl.constexpr, HEAD_DIM: gl.constexpr,
               BLOCK_M: gl.constexpr, MASK_BLOCK_Q: gl.constexpr):
    """A step's maths up to dS^T, for KEYS keys from key0 (``k_smem``, ``v_smem``: their
    rows) of the KV tile from key n0, over NUM_WARPS warps: S^T and dP^T, P^T (MASKED: the
    dense limits; TILE: a partial block's rows of its uint8 tile at ``tile_base``, or with
    DOCS the rows' document starts there), dV's GEMM issued. Returns (dV's token, P^T's
    operand, dS^T, dS^T's operand): dV's GEMM still in flight, every other one completed."""
    dtype: gl.constexpr = q_smem.dtype
    st_layout: gl.constexpr = mma_layout(NUM_WARPS, KEYS, BLOCK_M)
    kv_layout: gl.constexpr = mma_layout(NUM_WARPS, KEYS, HEAD_DIM)
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kv_layout, k_width=2)
    zeros_st = gl.zeros([KEYS, BLOCK_M], gl.float32, st_layout)

    s_tok = warpgroup_mma(k_smem, q_smem.permute((1, 0)), zeros_st, use_acc=False,
                          is_async=True)
    dp_tok = warpgroup_mma(v_smem, do_smem.permute((1, 0)), zeros_st, use_acc=False,
                           is_async=True)
    cols: gl.constexpr = gl.SliceLayout(0, st_layout)
    offs_m = m0 + gl.arange(0, BLOCK_M, layout=cols)
    offs_n = key0 + gl.arange(0, KEYS, layout=gl.SliceLayout(1, st_layout))

    if TILE:  # read under the GEMMs
        if DOCS:  # one int32 per query instead of a byte per (key, query)
            first = gl.load(tile_base + offs_m)
            keys = gl.expand_dims(offs_n, 1)
            keep = (keys >= gl.expand_dims(first, 0)) & (keys <= gl.expand_dims(offs_m, 0))
        else:  # rows offs_n - n0 of the block's tile
            tile_offs = (gl.expand_dims((offs_n - n0) * MASK_BLOCK_Q, 1)
                         + gl.expand_dims(offs_m - m0, 0))
            keep = gl.load(tile_base + tile_offs) != 0

    s_t = warpgroup_mma_wait(1, deps=(s_tok,))
    lse2 = lse_smem.load(cols)
    p_t = probs_t(s_t, lse2, offs_n, offs_m, N_KV, causal_offset, qk_scale, MASKED, CAUSAL)
    if TILE:  # a where, not a product: a hidden score's exp2 may be inf
        p_t = gl.where(keep, p_t, 0.0)
    p16 = p_t.to(dtype)
    p_op = gl.convert_layout(p16, a_layout)
    dv_tok = warpgroup_mma(p_op, do_smem, dv, is_async=True)

    dp_t = warpgroup_mma_wait(1, deps=(dp_tok,))
    delta = delta_smem.load(cols)
    ds_t = (p16.to(gl.float32) * (dp_t - gl.expand_dims(delta, 0)) * sm_scale).to(dtype)
    ds_op = gl.convert_layout(ds_t, a_layout)
    return dv_tok, p_op, ds_t, ds_op


@gluon.jit
def dq_free_phase(t, DQ_BUFFERS: gl.constexpr):
    """The phase of step t's dQ staging buffer's "empty" barrier: the dQ warp's reduce of
    the tile before it in that buffer has read it."""
    return ((t // DQ_BUFFERS) & 1) ^ 1


@gluon.jit
def dq_stage(dq_bufs, buf, BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr,
             DQ_T: gl.constexpr):
    """Staging buffer ``buf`` seen as the (BLOCK_M, HEAD_DIM) dQ tile the MMA warps store:
    the buffer, or with DQ_T (``dq_transposed``: a D-major tile, (HEAD_DIM, BLOCK_M)) its
    transpose. In the 128-byte swizzle a warp's 64-bit stores of the row-major tile take
    twice the wavefronts they need (rows r and r^1 of a half warp share their 16-byte
    columns); the D-major tile's 32-bit stores land on 32 distinct banks."""
    if DQ_T:
        return dq_bufs.index(buf).reshape([HEAD_DIM, BLOCK_M]).permute((1, 0))
    else:
        return dq_bufs.index(buf).reshape([BLOCK_M, HEAD_DIM])


@gluon.jit
def dq_reduce(dq_desc, dq_tile, bh, m0, DQ_T: gl.constexpr):
    """One TMA reduce of a staged dQ tile into the accumulator's rows m0.. of head row bh
    (with DQ_T the accumulator is (B H_q, D, N_q): columns m0..)."""
    if DQ_T:
        tma_reduce_add(dq_desc, [bh, 0, m0], dq_tile)
    else:
        tma_reduce_add(dq_desc, [bh, m0, 0], dq_tile)


@gluon.jit
def _mma_step(dk, dv, k_buf, v_buf, q_bufs, do_bufs, lse_bufs, delta_bufs, dq_bufs, ds_smem,
              ready, empty, dq_full, dq_empty, t, m0, n0, N_KV, causal_offset, qk_scale,
              sm_scale, masked, tile_base, CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
              DQ_BUFFERS: gl.constexpr, NUM_WARPS: gl.constexpr, SPARSE: gl.constexpr,
              MASK_BLOCK_Q: gl.constexpr, DEBUG: gl.constexpr, DQ_EARLY: gl.constexpr,
              DOCS: gl.constexpr = False, DQ_T: gl.constexpr = False):
    """Step t (query rows from m0, in ring slot t % STAGES): its GEMMs, the masked maths
    (dense: every step, the causal diagonal and the N_kv tail by their limits; SPARSE: where
    ``masked``, a partial block, its tile at ``tile_base``, or with DOCS the rows' document
    starts there), its dQ tile handed to the dQ warp. Returns (dk, dv)."""
    slot = t % STAGES
    mbarrier.wait(ready.index(slot), (t // STAGES) & 1)
    # An index LLVM cannot see is 0, so K's and V's shared-memory descriptors are
    # rebuilt each step instead of held across it (bwd_kernel: hoisted, they spilled).
    zero = gl.inline_asm_elementwise("mov.b32 $0, 0;", "=r,r", [t], dtype=gl.int32,
                                     is_pure=False, pack=1)
    k_smem = k_buf.index(zero).reshape([BLOCK_N, HEAD_DIM])
    v_smem = v_buf.index(zero).reshape([BLOCK_N, HEAD_DIM])
    q_smem = q_bufs.index(slot).reshape([BLOCK_M, HEAD_DIM])
    do_smem = do_bufs.index(slot).reshape([BLOCK_M, HEAD_DIM])
    if not SPARSE:
        # A dense walk takes one path, the masked maths on every step (on a step that needs
        # no mask it hides nothing): a branch between the two maths doubled the step's code,
        # spilled (56 bytes at d128 with triton 3.6, none without it) and ran 1.01-1.16x
        # slower on the H200 (notes/gluon_notes.md, "One path for the dense walk").
        dk, dv, dq = _ws_step(dk, dv, q_smem, do_smem, k_smem, v_smem, ds_smem,
                              lse_bufs.index(slot), delta_bufs.index(slot), dq_bufs, dq_empty,
                              t, m0, n0, N_KV, causal_offset, qk_scale, sm_scale, tile_base,
                              True, CAUSAL, False, HEAD_DIM, BLOCK_M, BLOCK_N, NUM_WARPS,
                              MASK_BLOCK_Q, DEBUG, DQ_BUFFERS, DQ_EARLY, False, DQ_T)
    elif masked:  # a partial block: its tile replaces the dense mask (no CAUSAL with SPARSE)
        dk, dv, dq = _ws_step(dk, dv, q_smem, do_smem, k_smem, v_smem, ds_smem,
                              lse_bufs.index(slot), delta_bufs.index(slot), dq_bufs, dq_empty,
                              t, m0, n0, N_KV, causal_offset, qk_scale, sm_scale, tile_base,
                              False, CAUSAL, True, HEAD_DIM, BLOCK_M, BLOCK_N,
                              NUM_WARPS, MASK_BLOCK_Q, DEBUG, DQ_BUFFERS, DQ_EARLY, DOCS, DQ_T)
    else:
        dk, dv, dq = _ws_step(dk, dv, q_smem, do_smem, k_smem, v_smem, ds_smem,
                              lse_bufs.index(slot), delta_bufs.index(slot), dq_bufs, dq_empty,
                              t, m0, n0, N_KV, causal_offset, qk_scale, sm_scale, tile_base,
                              False, CAUSAL, False, HEAD_DIM, BLOCK_M, BLOCK_N, NUM_WARPS,
                              MASK_BLOCK_Q, DEBUG, DQ_BUFFERS, DQ_EARLY, False, DQ_T)
    # dQ into a free staging buffer (the dQ warp's reduce of its previous tile has read
    # it; with DQ_EARLY stored already, under dK's GEMM), made visible to the TMA unit;
    # after the barrier every warp's GEMMs of this step have completed (each waited for its
    # own): the ring slot goes back to the load warp, dS^T may be overwritten by the next
    # step, and the tile goes to the dQ warp.
    buf = t % DQ_BUFFERS
    if not DQ_EARLY:
        mbarrier.wait(dq_empty.index(buf), dq_free_phase(t, DQ_BUFFERS))
        dq_stage(dq_bufs, buf, BLOCK_M, HEAD_DIM, DQ_T).store(dq)
    fence_async_shared()
    warps_barrier()
    mbarrier.arrive(empty.index(slot))
    mbarrier.arrive(dq_full.index(buf))
    return dk, dv


@gluon.jit
def _mma_partition(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, lse_desc,
                   delta_desc, dq_desc, k_buf, v_buf, q_bufs, do_bufs, lse_bufs, delta_bufs,
                   dq_bufs, ds_smem, kv_ready, ready, empty, dq_full, dq_empty,
                   N_Q, N_KV, causal_offset, H_Q, H_KV, GROUP, n_kv_tiles, n_q_tiles,
                   qk_scale, sm_scale, FullCounts, FullIndices, PartialCounts,
                   PartialIndices, PartialTileIds, PartialTiles, stride_cb, stride_ch,
                   stride_ib, stride_ih, stride_iq,
                   HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                   STAGES: gl.constexpr, CAUSAL: gl.constexpr, DQ_BUFFERS: gl.constexpr,
                   SPARSE: gl.constexpr, MASK_BLOCK_Q: gl.constexpr,
                   MASK_BLOCK_KV: gl.constexpr, DEBUG: gl.constexpr, DQ_EARLY: gl.constexpr,
                   DOCS: gl.constexpr, DQ_T: gl.constexpr = False, Schedule=None,
                   TILE_ORDER: gl.constexpr = False):
    """Every step's GEMMs and softmax; dK and dV summed in registers and stored by TMA at the
    end (through K's and V's buffers); each step's dQ tile handed to the dQ warp. DOCS: the
    launch passes the rows' document starts where the partial tiles go (``_ws_step``).
    TILE_ORDER: the program's tile is the one ``Schedule`` lists at its id
    (``program_tile``)."""
    b, kv_h, n0, first_row, full_row, n_q_steps, n_steps, h0 = tile_walk(
        program_tile(Schedule, TILE_ORDER), N_KV, causal_offset, H_KV, GROUP, n_kv_tiles,
        n_q_tiles, BLOCK_M, BLOCK_N, CAUSAL)
    dtype: gl.constexpr = q_desc.dtype
    NUM_WARPS: gl.constexpr = 8  # MMA_WARPS
    kv_layout: gl.constexpr = mma_layout(NUM_WARPS, BLOCK_N, HEAD_DIM)
    dk = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, kv_layout)
    dv = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, kv_layout)
    # K and V have landed before anything reads them or (no step at all) dK/dV overwrite them.
    mbarrier.wait(kv_ready, 0)
    if SPARSE:
        step = n0 * 0
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
                # its tile keeps (keys past N_kv included: they are never visible).
                dk, dv = _mma_step(dk, dv, k_buf, v_buf, q_bufs, do_bufs, lse_bufs,
                                   delta_bufs, dq_bufs, ds_smem, ready, empty, dq_full,
                                   dq_empty, step, m0, n0, N_KV, causal_offset, qk_scale,
                                   sm_scale, partial, tile_base, False, HEAD_DIM, BLOCK_M,
                                   BLOCK_N, STAGES, DQ_BUFFERS, NUM_WARPS, True,
                                   MASK_BLOCK_Q, DEBUG, DQ_EARLY, DOCS, DQ_T)
                step += 1
    else:
        for t in range(n_steps):
            h, m0 = step_rows(t, n_q_steps, h0, first_row, BLOCK_M)
            dk, dv = _mma_step(dk, dv, k_buf, v_buf, q_bufs, do_bufs, lse_bufs, delta_bufs,
                               dq_bufs, ds_smem, ready, empty, dq_full, dq_empty, t, m0, n0,
                               N_KV, causal_offset, qk_scale, sm_scale, True, None,
                               CAUSAL, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, DQ_BUFFERS,
                               NUM_WARPS, False, MASK_BLOCK_Q, DEBUG, DQ_EARLY, False, DQ_T)

    # dK and dV leave through K's and V's buffers (every GEMM reading them has completed) and
    # TMA stores, which drop the rows past N_kv. A tile no query sees stores zeros.
    k_buf.index(0).reshape([BLOCK_N, HEAD_DIM]).store(dk.to(dtype))
    v_buf.index(0).reshape([BLOCK_N, HEAD_DIM]).store(dv.to(dtype))
    fence_async_shared()
    warps_barrier()
    tma_store(dk_desc, [b, kv_h, n0, 0], k_buf.index(0))
    tma_store(dv_desc, [b, kv_h, n0, 0], v_buf.index(0))
    tma.store_wait(0)


# ----------------------------------------------------------------------------- kernel
@gluon.jit
def ring_buffers(q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, STAGES: gl.constexpr):
    """The shared memory every step reads: K's and V's tiles (one each) and the ring of Q, dO,
    lse2 and delta (STAGES slots), in the TMA boxes' layouts."""
    dtype: gl.constexpr = q_desc.dtype
    q_block: gl.constexpr = q_desc.block_type.shape
    kv_block: gl.constexpr = k_desc.block_type.shape
    rows: gl.constexpr = lse_desc.block_type.shape[0]  # BLOCK_M
    k_buf = gl.allocate_shared_memory(dtype, [1] + kv_block, k_desc.layout)
    v_buf = gl.allocate_shared_memory(dtype, [1] + kv_block, v_desc.layout)
    q_bufs = gl.allocate_shared_memory(dtype, [STAGES] + q_block, q_desc.layout)
    do_bufs = gl.allocate_shared_memory(dtype, [STAGES] + q_block, do_desc.layout)
    lse_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, rows], lse_desc.layout)
    delta_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, rows], delta_desc.layout)
    return k_buf, v_buf, q_bufs, do_bufs, lse_bufs, delta_bufs


@gluon.jit
def step_buffers(q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, dq_desc,
                 STAGES: gl.constexpr, DQ_BUFFERS: gl.constexpr):
    """``ring_buffers`` and the dQ staging tiles."""
    k_buf, v_buf, q_bufs, do_bufs, lse_bufs, delta_bufs = ring_buffers(
        q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, STAGES)
    # dQ staging tiles in the TMA reduce's box and layout (rank 3: (1, BLOCK_M, D) of the
    # (B H_q, N_q, D) accumulator; 128-byte swizzle, which also spreads the accumulator's
    # stores over the banks, as bwd_kernel's staging tile).
    dq_bufs = gl.allocate_shared_memory(gl.float32, [DQ_BUFFERS] + dq_desc.block_type.shape,
                                        dq_desc.layout)
    return k_buf, v_buf, q_bufs, do_bufs, lse_bufs, delta_bufs, dq_bufs


@gluon.jit(do_not_specialize=["N_Q", "N_KV", "causal_offset", "H_Q", "H_KV", "GROUP",
                              "n_kv_tiles", "n_q_tiles", "stride_cb", "stride_ch",
                              "stride_ib", "stride_ih", "stride_iq"])
def _gluon_bwd_ws_kernel(
    q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, lse_desc, delta_desc, dq_desc,
    N_Q, N_KV, causal_offset, H_Q, H_KV, GROUP, n_kv_tiles, n_q_tiles, qk_scale, sm_scale,
    # The transposed block mask's lists (``BlockMask.kernel_args`` order); unused (dense
    # launches pass stand-ins) unless SPARSE.
    FullCounts, FullIndices, PartialCounts, PartialIndices, PartialTileIds, PartialTiles,
    stride_cb, stride_ch, stride_ib, stride_ih, stride_iq,
    # (DETERMINISTIC) int32 counters, one per (batch, query head, query tile), zeroed per
    # call; None otherwise (a constexpr then: the default kernel's parameters are unchanged).
    DqCounters,
    # (longest_first, TILE_ORDER) the tiles' order, int32 per program (``program_tile``); a
    # stand-in pointer, never read, otherwise.
    Schedule,
    HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr, CAUSAL: gl.constexpr, DQ_BUFFERS: gl.constexpr,
    LOAD_REGS: gl.constexpr, num_warps: gl.constexpr, SPARSE: gl.constexpr = False,
    MASK_BLOCK_Q: gl.constexpr = 128, MASK_BLOCK_KV: gl.constexpr = 128,
    DEBUG: gl.constexpr = 0, DETERMINISTIC: gl.constexpr = False,
    DQ_EARLY: gl.constexpr = False, DOCS: gl.constexpr = False, DQ_T: gl.constexpr = False,
    TILE_ORDER: gl.constexpr = False,
):
    # Program -> (KV tile, batch, kv head), as bwd_kernel's (``program_tile``, ``tile_walk``).
    # The ordered dQ needs the KV tiles of a query tile to be 0 .. k: a block mask's walk does
    # not give that (gluon_bwd refuses it).
    gl.static_assert(not (DETERMINISTIC and SPARSE))
    dtype: gl.constexpr = q_desc.dtype
    k_buf, v_buf, q_bufs, do_bufs, lse_bufs, delta_bufs, dq_bufs = step_buffers(
        q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, dq_desc, STAGES, DQ_BUFFERS)
    ds_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, BLOCK_M],
                                        gl.NVMMASharedLayout(swizzle_byte_width=128,
                                                             element_bitwidth=16, rank=2))
    kv_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    dq_full = gl.allocate_shared_memory(gl.int64, [DQ_BUFFERS, 1], mbarrier.MBarrierLayout())
    dq_empty = gl.allocate_shared_memory(gl.int64, [DQ_BUFFERS, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_ready, count=1)
    # One arrival per partition: an arrive in a partition of several warps is one thread's,
    # after a barrier of the partition.
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    for i in gl.static_range(DQ_BUFFERS):
        mbarrier.init(dq_full.index(i), count=1)
        mbarrier.init(dq_empty.index(i), count=1)
    fence_async_shared()

    # Every partition takes the same arguments, written out three times: a tuple assigned
    # to a name would turn the constexprs in it into tensors.
    gl.warp_specialize([
        (_mma_partition, (q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, lse_desc, delta_desc, dq_desc,
          k_buf, v_buf, q_bufs, do_bufs, lse_bufs, delta_bufs, dq_bufs, ds_smem, kv_ready,
          ready, empty, dq_full, dq_empty, N_Q, N_KV, causal_offset, H_Q, H_KV, GROUP,
          n_kv_tiles, n_q_tiles, qk_scale, sm_scale, FullCounts, FullIndices, PartialCounts,
          PartialIndices, PartialTileIds, PartialTiles, stride_cb, stride_ch, stride_ib,
          stride_ih, stride_iq, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, CAUSAL, DQ_BUFFERS, SPARSE,
          MASK_BLOCK_Q, MASK_BLOCK_KV, DEBUG, DQ_EARLY, DOCS, DQ_T, Schedule, TILE_ORDER)),
        (load_partition, (q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, lse_desc, delta_desc, dq_desc,
          k_buf, v_buf, q_bufs, do_bufs, lse_bufs, delta_bufs, dq_bufs, ds_smem, kv_ready,
          ready, empty, dq_full, dq_empty, N_Q, N_KV, causal_offset, H_Q, H_KV, GROUP,
          n_kv_tiles, n_q_tiles, qk_scale, sm_scale, FullCounts, FullIndices, PartialCounts,
          PartialIndices, PartialTileIds, PartialTiles, stride_cb, stride_ch, stride_ib,
          stride_ih, stride_iq, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, CAUSAL, DQ_BUFFERS, SPARSE,
          MASK_BLOCK_Q, MASK_BLOCK_KV, DEBUG, kv_ready, Schedule, 0, False, False, TILE_ORDER)),
        (dq_partition, (q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, lse_desc, delta_desc, dq_desc,
          k_buf, v_buf, q_bufs, do_bufs, lse_bufs, delta_bufs, dq_bufs, ds_smem, kv_ready,
          ready, empty, dq_full, dq_empty, N_Q, N_KV, causal_offset, H_Q, H_KV, GROUP,
          n_kv_tiles, n_q_tiles, qk_scale, sm_scale, FullCounts, FullIndices, PartialCounts,
          PartialIndices, PartialTileIds, PartialTiles, stride_cb, stride_ch, stride_ib,
          stride_ih, stride_iq, DqCounters, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, CAUSAL, DQ_BUFFERS, SPARSE,
          MASK_BLOCK_Q, MASK_BLOCK_KV, DEBUG, DETERMINISTIC, DQ_T, Schedule, 0, False, False,
          TILE_ORDER)),
    ],
                       [1, 1], [LOAD_REGS, LOAD_REGS])


# ----------------------------------------------------------------------------- dq from D-major
# (dq_transposed) The accumulator is (B H_q, D, N_q padded): dq is its transpose in dq's
# dtype and layout (its strides: q's, as ``_dq_cast_kernel`` writes it), one tile of rows a
# program, read along N_q and written along D (a torch copy of the transposed view took 2-3x
# the plain cast's time, enough to undo the kernel's gain at 4k).
@triton.jit(do_not_specialize=["N_Q", "N_COLS", "H_Q"])
def _dq_transposed_cast_kernel(ACC, DQ, N_Q, N_COLS, H_Q, stride_b, stride_h, stride_m,
                               HEAD_DIM: tl.constexpr, ROWS: tl.constexpr):
    bh = tl.program_id(0).to(tl.int64)  # (dq_cast_launch's grid)
    rows = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
    dims = tl.arange(0, HEAD_DIM)
    acc = tl.load(ACC + bh * HEAD_DIM * N_COLS + dims[:, None] * N_COLS + rows[None, :],
                  mask=rows[None, :] < N_Q, other=0.0)
    out = DQ + (bh // H_Q) * stride_b + (bh % H_Q) * stride_h
    tl.store(out + rows[:, None].to(tl.int64) * stride_m + dims[None, :],
             tl.trans(acc).to(DQ.dtype.element_ty), mask=rows[:, None] < N_Q)


def dq_from_transposed(dq_accum: torch.Tensor, seqlen_q: int, dtype: torch.dtype
                       ) -> torch.Tensor:
    """dq (B, H_q, N_q, D) contiguous in ``dtype`` from a D-major accumulator (B, H_q, D,
    N_q padded) fp32, outside a plan (a plan's ``dq_result`` writes it in q's layout)."""
    batch, heads, head_dim, columns = dq_accum.shape
    dq = torch.empty((batch, heads, seqlen_q, head_dim), device=dq_accum.device, dtype=dtype)
    grid, options = dq_cast_launch(seqlen_q, batch * heads, head_dim)
    _dq_transposed_cast_kernel[grid](*dq_cast_args(dq_accum, dq, seqlen_q, columns), **options)
    return dq


# ----------------------------------------------------------------------------- host side
class WsLaunchPlan(LaunchPlan):
    """``bwd_kernel.LaunchPlan`` (grids, preprocess, descriptors) for the warp-specialized
    kernel: its options, and dq_accum's TMA descriptor for the reduce.

    ``kv_major_mask``: for a block-masked backward, the mask's KV-major lists
    (``BlockMask.transposed``: per KV block, the query blocks that see it; anything with
    its ``block_size`` (KV, query) and ``kernel_args()``), None for a dense or causal one.
    ``docs``: the mask is causal self-attention documents or a causal window and the
    config's ``doc_offsets`` or ``window_offsets`` asks for it: each launch then passes the
    rows' first visible keys (``masks.row_ranges``) where the partial tiles go (``main_args``'
    ``doc_first``)."""

    def __init__(self, q: Any, k: Any, *, causal_mode: str, scale: float,
                 config: Mapping[str, Any], kv_major_mask: Any = None,
                 docs: bool = False, sm_count: int | None = None) -> None:
        super().__init__(q, k, causal_mode=causal_mode, scale=scale, config=config)
        batch, heads_q, seqlen_q, head_dim = q.shape
        block_m = int(config["BLOCK_M"])
        # q's GPU's multiprocessors (the head groups of a tile order, a persistent grid).
        self.sm_count = sm_count if sm_count is not None else (
            torch.cuda.get_device_properties(q.device).multi_processor_count
            if isinstance(q, torch.Tensor) and q.is_cuda else 132)
        self.mask_args: list[Any] | None = None
        if kv_major_mask is not None:
            self._plan_mask_walk(kv_major_mask, causal_mode, block_m, int(config["BLOCK_N"]))
        # dq_accum as (B H_q, N_q, D): a box of one head's BLOCK_M rows (those past N_q are
        # dropped by the TMA unit), fp32 in the 128-byte swizzle. With dq_transposed it is
        # (B H_q, D, N_q), its rows padded to 4 columns (TMA's 16-byte strides), the box
        # D-major (``dq_stage``).
        self.dq_transposed = bool(config.get("dq_transposed"))
        # (the preprocess zeroes only the row-major accumulator: ``dq_accumulator`` zeroes
        # this one)
        self.zero_dq_in_preprocess = not self.dq_transposed
        if self.dq_transposed:
            self.dq_columns = -(-seqlen_q // 4) * 4
            self.dq_shape = (batch * heads_q, head_dim, seqlen_q)
            self.dq_strides = [head_dim * self.dq_columns, self.dq_columns, 1]
            self.dq_block = [1, head_dim, block_m]
        else:
            self.dq_shape = (batch * heads_q, seqlen_q, head_dim)
            self.dq_strides = [seqlen_q * head_dim, head_dim, 1]
            self.dq_block = [1, block_m, head_dim]
        self.dq_layout = host_smem_layout(self.dq_block, 32)
        self.options = dict(
            HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=int(config["BLOCK_N"]),
            STAGES=int(config["stages"]), CAUSAL=causal_mode != "none",
            DQ_BUFFERS=int(config.get("dq_buffers", 1)), LOAD_REGS=LOAD_REGS,
            num_warps=MMA_WARPS, maxnreg=MAX_REGS)
        # dQ added in KV-tile order: one int32 counter per (batch, query head, query tile).
        self.deterministic = bool(config.get("deterministic"))
        if self.deterministic:
            self.options.update(DETERMINISTIC=True)
        if config.get("dq_early"):  # only where set: the default kernel's options unchanged
            self.options.update(DQ_EARLY=True)
        if self.dq_transposed:
            self.options.update(DQ_T=True)
        # bwd_kernel's switches this kernel honours: 4 (no dQ GEMM, a zero tile is handed
        # over) and 16 (no dQ reduce).
        if self.mask_args is not None:
            block_kv, block_q = kv_major_mask.block_size
            self.options.update(SPARSE=True, MASK_BLOCK_Q=block_q, MASK_BLOCK_KV=block_kv)
            if docs:
                self.options.update(DOCS=True)
        debug = int(os.environ.get("GLUON_BWD_DEBUG", DEBUG))
        if debug:
            self.options["DEBUG"] = debug
        self.tile_order: TileOrder | None = None
        if config.get("longest_first"):
            self._plan_tile_order(q, k, kv_major_mask, bool(config.get("persistent")))

    def _plan_mask_walk(self, kv_major_mask: Any, causal_mode: str, block_m: int,
                        block_n: int) -> None:
        """Check the mask's blocks against the tiles and pad the row vectors to whole mask
        blocks: a listed query block is walked whole (its last step may lie past N_q; its
        rows then read zeros and lse2 = +inf, so they add nothing, and their dQ rows are
        dropped by the TMA unit)."""
        block_kv, block_q = kv_major_mask.block_size
        if causal_mode != "none":
            raise ValueError(f"a block mask carries its own causality: causal must be 'none' "
                             f"with it, but got {causal_mode!r}")
        if block_q % block_m or block_kv % block_n:
            raise ValueError(f"BLOCK_M ({block_m}) and BLOCK_N ({block_n}) must divide the "
                             f"block mask's block size {(block_q, block_kv)} (query, kv)")
        n_blocks = -(-self.seqlen_q // block_q)
        self.rows_pad = n_blocks * block_q
        self.pre_tiles = self.rows_pad // PREPROCESS_ROWS
        self.pre_grid = (self.pre_tiles * self.rows_shape[0] * self.rows_shape[1],)
        self.rows_shape = (self.rows_shape[0], self.rows_shape[1], self.rows_pad)
        self.scalars[7] = self.rows_pad // block_m  # n_q_tiles: the kernel's N_Q_PAD / BLOCK_M
        self.mask_args = list(kv_major_mask.kernel_args())

    def _plan_tile_order(self, q: Any, k: Any, kv_major_mask: Any, persistent: bool) -> None:
        """(longest_first) The tiles' order from each call's mask (``TileOrder``, kept with
        the mask), read by the kernel's partitions at their program id."""
        if kv_major_mask is None:
            raise ValueError("longest_first orders a block mask's KV tiles by their walks: "
                             "the call has no block mask")
        assert self.mask_args is not None  # (the mask's: _plan_mask_walk)
        batch, heads_q, seqlen_q, head_dim = q.shape
        heads_kv = k.shape[1]
        group = heads_q // heads_kv
        n_kv_tiles = self.scalars[6]
        rows = batch * heads_kv
        # A launch's programs take the order dynamically, so head groups that keep Q/dO in
        # L2 cost no balance; a persistent grid's static rounds snake through it, which
        # balances a descending list, not the saw-tooth of many head groups (a model of the
        # d128 16k documents row, 2 rows a group: the busiest program 1.65x the mean, against
        # 1.03x for one group and 1.02x for the launch's dynamic order, matching the measured
        # 0.78x; notes/gluon_notes.md): one group there.
        rows_per_group = rows if persistent else persistent_head_group(
            rows, n_kv_tiles, self.sm_count, 2 * seqlen_q * head_dim * q.dtype.itemsize * group)
        self.tile_order = TileOrder(
            batch=batch, heads_q=heads_q, heads_kv=heads_kv, n_kv_tiles=n_kv_tiles,
            block_n=self.options["BLOCK_N"], mask_block_kv=kv_major_mask.block_size[0],
            strides=tuple(self.mask_args[6:8]), rows_per_group=rows_per_group)
        self.options.update(TILE_ORDER=True)

    def main_args(self, q: Any, k: Any, v: Any, do: Any, dk: Any, dv: Any, dq_accum: Any,
                  lse2: Any, delta: Any, dq_counters: Any = None, doc_first: Any = None
                  ) -> list[Any]:
        """The main launch's arguments; ``dq_counters``: the call's zeroed counters
        (``dq_counters``) where the plan is deterministic, made here if not given;
        ``doc_first``: with ``docs``, the rows' document starts (``row_ranges.row_first_keys``
        of ``rows_pad`` rows)."""
        args = super().main_args(q, k, v, do, dk, dv, dq_accum, lse2, delta)
        # The parent's list holds dq_accum itself after the eight descriptors: this kernel
        # takes the accumulator's TMA descriptor there.
        assert args[8] is dq_accum
        args[8] = self._dq_descriptor(dq_accum)
        if dq_counters is None:
            dq_counters = self.dq_counters(q)
        # Dense launches pass lse2 for the mask's pointers and zero strides (never read).
        mask = list(self.mask_args or [lse2] * 6 + [0] * 5)
        if doc_first is not None:  # (GluonBackwardPlan passes its mask tensors itself)
            mask[5] = doc_first
        return args + mask + [dq_counters] + self.tail_args(dk, mask)

    def tail_args(self, dk: Any, mask: list[Any], kv_major: Any = None) -> list[Any]:
        """The main launch's arguments after the dQ counters: the tiles' order (``mask``: the
        launch's six mask tensors, the call's block mask's or stand-ins; ``kv_major``: that
        KV-major BlockMask, which keeps its order), or ``dk`` standing in for that pointer,
        never read."""
        if self.tile_order is None:
            return [dk]
        return [self.tile_order(mask[0], mask[2], kv_major)]

    def dq_counters(self, q: torch.Tensor) -> torch.Tensor | None:
        """A new zeroed int32 counter per (batch, query head, query tile) for a deterministic
        call, None otherwise. New per call, never kept by a plan: the kernel leaves each at
        the number of KV tiles that added into its query tile, and a second call counting on
        from there would wait forever."""
        if not self.deterministic:
            return None
        batch, heads_q = q.shape[0], q.shape[1]
        return torch.zeros(batch * heads_q * self.scalars[7], device=q.device,
                           dtype=torch.int32)

    def dq_accumulator(self, q: torch.Tensor) -> torch.Tensor:
        """``LaunchPlan.dq_accumulator``; with dq_transposed (B, H_q, D, N_q padded), zeroed
        here (the preprocess zeroes only the row-major one). Until 2026-11-30 a zeroed
        row-major one was made beside it and dropped: a q-sized fp32 fill per backward."""
        if not self.dq_transposed:
            return super().dq_accumulator(q)
        batch, heads_q, _, head_dim = q.shape
        return torch.zeros((batch, heads_q, head_dim, self.dq_columns), device=q.device,
                           dtype=torch.float32)

    def dq_cast_kernel(self) -> Any:
        """The kernel that makes dq from the accumulator (the D-major cast with
        dq_transposed)."""
        return _dq_transposed_cast_kernel if self.dq_transposed else super().dq_cast_kernel()

    def _dq_descriptor(self, dq_accum: Any) -> Any:
        """dq_accum (contiguous (B, H_q, N_q, D) fp32) seen as (B H_q, N_q, D); with
        dq_transposed ((B, H_q, D, N_q padded)) as (B H_q, D, N_q)."""
        return TensorDescriptor(dq_accum, list(self.dq_shape), self.dq_strides,
                                self.dq_block, self.dq_layout)

    def main_kernel(self) -> Any:
        return _gluon_bwd_ws_kernel


def launch(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           o: torch.Tensor, lse: torch.Tensor, *, causal_mode: str, scale: float,
           config: Mapping[str, Any], block_mask: Any = None
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run the warp-specialized backward on validated CUDA inputs (``bwd_kernel.launch``'s
    contract); ``block_mask``: the forward's BlockMask (checked by the caller against q and
    k), whose KV-major lists the kernel walks, or None."""
    kv_major = None if block_mask is None else block_mask.transposed
    return launch_plan(functools.partial(WsLaunchPlan, kv_major_mask=kv_major), do, q, k, v,
                       o, lse, causal_mode=causal_mode, scale=scale, config=config)

