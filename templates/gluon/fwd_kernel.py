"""FlashAttention-3-style forward for Hopper (sm_90), written in Gluon.

This module imports only torch and triton (``GluonFwdTemplate.standalone_source`` emits it
verbatim with a config appended). Gluon (``triton.experimental.gluon``) is Triton's
lower-level language: layouts, shared memory, mbarriers, TMA and wgmma are explicit. Written
for triton 3.6's Gluon API (the GPU machines' wheel).

One kernel, specialized by constexprs:
  * K/V tiles arrive by TMA (rank-4 descriptors over (B, H, N, D), so strided views need no
    copy and rows past N read as zeros) into a ring of ``KV_STAGES`` shared buffers, each with
    a *ready* mbarrier (the copy landed) and, when warp-specialized, an *empty* one (every
    consumer is done with it);
  * QK^T and PV run on asynchronous wgmma: S_j = Q K_j^T is issued together with
    O += P_{j-1} V_{j-1}, and the softmax of block j runs while the PV GEMM of block j-1 is
    still on the tensor cores (FA3's intra-warpgroup overlap); P stays in registers as the A
    operand of the PV GEMM;
  * online softmax in the log2 domain: exp2 with ``scale * log2(e)`` folded into one multiply
    (``qk_scale``), the running max and sum in fp32;
  * masking only where needed: KV blocks below the causal diagonal and inside N_kv run the
    unmasked softmax, the diagonal blocks and the N_kv tail the masked one (a uniform
    run-time branch per block), blocks above the diagonal are never loaded;
  * ``WARP_SPECIALIZE``: one producer warp issues every TMA load (``gl.warp_specialize``) and
    the consumer warpgroups only compute; otherwise the consumer warps issue the loads
    themselves, ``KV_STAGES`` blocks ahead;
  * ``PINGPONG`` (warp-specialized, two consumer warpgroups): each warpgroup owns half of the
    query tile in its own partition, and a pair of mbarriers lets only one of them issue
    GEMMs at a time, so one warpgroup's softmax runs under the other's GEMMs (FA3's
    ping-pong). Without it, the consumer warpgroups form one partition that runs in step;
  * ``PERSISTENT``: one program per SM walks tiles in rounds; with two Q buffers per
    consumer (``Q_SLOTS``, where they fit) the next tile's Q loads during this one and O
    leaves by TMA through this tile's buffer; causal tiles come from the host's schedule
    (``lpt_schedule``: head groups in turn, each group's tiles longest first, each to the
    program with the least work so far), so every SM gets about the same work;
  * split tiles (``split_tail``, persistent grids): where whole tiles leave SMs idle (a
    dense grid's partial last round, a causal grid of few tiles), the host's schedule cuts
    tiles into pieces of KV blocks run by different programs (``split_schedule``,
    ``cut_lpt_schedule``); each piece stores its unnormalized O, m and l, and the piece
    that counts in last at the tile's counter combines them (``_combine_pieces``);
  * GQA/MQA by indexing: query head ``h`` reads kv head ``h // (H_q // H_kv)``; or packed
    (``pack_gqa``): the plan views q as (B, H_kv, H_q / H_kv x N_q, D), so one tile holds
    several query heads' rows and each K/V block is loaded once for them, the causal mask
    taking each row's query within its head (``_query_rows``);
  * causal top-left (SDPA) or bottom-right (FA2 with a KV cache) through ``causal_offset``.

Outputs: ``o`` (B, H_q, N_q, D) in the input dtype (laid out as q where q is a (B, N, H, D)
tensor viewed so, unless a persistent grid has one Q buffer per consumer; else contiguous:
``output_strides``), and
``lse`` (B, H_q, N_q) float32, the natural-log logsumexp of the scaled scores; a row that
sees no key gets o = 0 and lse = -inf.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Mapping
from typing import Any

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from templates.compile.direct_launch import DirectLaunch, PlannedDescriptor, current_stream
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
from templates.gluon.schedule import (  # noqa: F401  some re-exported: tests, benchmarks
    ENTRY_INTS,
    L2_KV_BYTES,
    MAX_SCHEDULED_TILES,
    TILE_OVERHEAD_BLOCKS,
    WHOLE_BLOCKS,
    SplitSchedule,
    causal_grid,
    causal_tile_costs,
    cut_lpt_schedule,
    head_group,
    lpt_schedule,
    schedule_table,
    split_schedule,
    whole_tile,
)
from templates.kernel_common import LN_2, normalize_causal, output_strides

# ln(2) inside the kernels: a jit function reads a global only as a constexpr.
LN_2_JIT = gl.constexpr(LN_2)

HEAD_DIMS = (64, 128, 256)
# Registers per thread of the producer warp's partition (setmaxnreg: multiples of 8, >= 24):
# it only computes coordinates and issues TMA copies.
PRODUCER_REGS = 24
# Register file per SM (65536 32-bit registers), split over the programs meant to share an
# SM (the ``ctas_per_sm`` knob).
REGISTER_FILE = 65536
# Dynamic shared memory one program may use on sm_90 (227 KiB), less what Triton adds (the
# mbarriers, the warp-specialize state).
SMEM_PER_PROGRAM = 227 * 1024 - 1024


# The host's schedule as the kernel reads it (``_program_tile``; ``templates.gluon.schedule``).
SCHEDULE_ENTRY = gl.constexpr(ENTRY_INTS)
WHOLE = gl.constexpr(WHOLE_BLOCKS)

# Tests set this: the launcher then fills ``o`` and ``lse`` with NaN before the kernel runs,
# so an element the kernel forgets to write shows up as NaN instead of stale memory.
DEBUG_POISON = False


# ----------------------------------------------------------------------------- layouts
@gluon.constexpr_function
def _mma_layout(num_warps, n):
    """wgmma accumulator layout of an (M, n) fp32 tile over ``num_warps`` warps stacked along M
    (each warpgroup owns 64 consecutive rows per repetition)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                     instr_shape=[16, n, 16])


# ----------------------------------------------------------------------------- softmax
@gluon.constexpr_function
def _halvings(n):
    """How many times a row of ``n`` columns halves before 8 are left (the columns of one
    wgmma accumulator row that lie in different registers of a thread)."""
    k = 0
    while n > 8:
        n //= 2
        k += 1
    return k


@gluon.jit
def _row_max(x, like, TREE: gl.constexpr):
    """Row maxima of a (rows x n) wgmma accumulator tile, in the layout of ``like``.
    ``gl.max`` folds a thread's values of a row in one dependent chain (31 deep at n = 128;
    its FMNMXs were the largest stall of the d64 softmax in ncu's samples); TREE halves the
    columns instead (independent maxima, log2(n / 8) levels, the same instruction count, all
    in registers). The same tree for the row sum measured slower (notes/gluon_notes.md)."""
    if TREE:
        ROWS: gl.constexpr = x.shape[0]
        for _ in gl.static_range(_halvings(x.shape[1])):
            x = gl.max(gl.reshape(x, [ROWS, 2, x.shape[1] // 2]), axis=1)
        out = gl.convert_layout(gl.max(x, axis=1), like.type.layout)
    else:
        out = gl.max(x, axis=1)
    return out


@gluon.jit
def _softmax_block(s, m_i, l_i, qk_scale, offs_m, start_n, N_KV, causal_offset, tile_base,
                   tile_on, MASKED: gl.constexpr, CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr,
                   SPARSE: gl.constexpr, MASK_BLOCK_KV: gl.constexpr, DIAG: gl.constexpr,
                   TREE_MAX: gl.constexpr):
    """One online-softmax step on the raw scores ``s`` (rows x BLOCK_N, fp32): returns
    (p, m_new, l_new, alpha) with p = exp2(s * qk_scale - m_new) and alpha the factor that
    rescales what was accumulated before. MASKED blocks hide keys past N_kv, for causal
    keys past each row's diagonal, and (SPARSE, where ``tile_on``) what the block mask's
    partial tile hides: its uint8 rows start at ``tile_base``, ``MASK_BLOCK_KV`` apart. A
    row with no visible key so far keeps m = -inf, and shifts by 0 instead so that p and
    alpha are exactly 0, never NaN.

    ``DIAG`` (timing experiments only): 1 drops the exponentials of the unmasked step
    (p = s * qk_scale - m), 2 drops the whole unmasked softmax (p = s), both wrong results;
    3 (right results) makes a persistent consumer wait for its O store at once instead of
    under the next tile's first GEMM (``_release_o_buffer``); 7 drops the combining of a
    split tile's pieces (each writes its own, wrong, O and LSE)."""
    if MASKED:
        visible = _visible(s, offs_m, start_n, N_KV, causal_offset, tile_base, tile_on, CAUSAL,
                           BLOCK_N, SPARSE, MASK_BLOCK_KV)
        # Hidden scores become -inf before the scale, which is positive (checked on the
        # host): the max and exp2(s * scale - m) are the unmasked step's instructions (one
        # FFMA per score; scaling first and masking after cost an FMUL, an FSEL and an FADD
        # more, and 11% of d64 causal's time at 512 tokens, notes/gluon_notes.md).
        s = gl.where(visible, s, float("-inf"))
        m_new = gl.maximum(m_i, _row_max(s, m_i, TREE_MAX) * qk_scale)
        m_shift = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(s * qk_scale - gl.expand_dims(m_shift, 1))
        alpha = gl.exp2(m_i - m_shift)
        l_new = l_i * alpha + gl.sum(p, 1)
    elif DIAG == 2:
        p = s
        m_new = m_i
        alpha = l_i * 0.0 + 1.0
        l_new = l_i
    elif DIAG == 1:
        m_new = gl.maximum(m_i, _row_max(s, m_i, TREE_MAX) * qk_scale)
        p = s * qk_scale - gl.expand_dims(m_new, 1)
        alpha = m_i - m_new
        l_new = l_i * alpha + gl.sum(p, 1)
    else:
        m_new = gl.maximum(m_i, _row_max(s, m_i, TREE_MAX) * qk_scale)
        p = gl.exp2(s * qk_scale - gl.expand_dims(m_new, 1))
        alpha = gl.exp2(m_i - m_new)
        l_new = l_i * alpha + gl.sum(p, 1)
    return p, m_new, l_new, alpha


@gluon.jit
def _visible(s, offs_m, start_n, N_KV, causal_offset, tile_base, tile_on, CAUSAL: gl.constexpr,
             BLOCK_N: gl.constexpr, SPARSE: gl.constexpr, MASK_BLOCK_KV: gl.constexpr):
    """Which scores of a masked block (keys from ``start_n``) a row sees: keys inside N_kv,
    for causal up to the row's diagonal, and (SPARSE, where ``tile_on``) what the block
    mask's partial tile keeps (see ``_softmax_block``). Each column is compared once, with
    the row's last visible key relative to the block (N_kv's bound folded into it per row,
    so one compare per score instead of two and an AND)."""
    cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s.type.layout))
    if CAUSAL:
        last_col = gl.minimum(offs_m + causal_offset, N_KV - 1) - start_n
        visible = gl.expand_dims(cols, 0) <= gl.expand_dims(last_col, 1)
    else:
        visible = gl.expand_dims(cols < N_KV - start_n, 0)
    if SPARSE == 2:
        # (doc_offsets) Key j visible to row i of a partial block iff first[i] <= j <= i:
        # the rows' first visible keys (``tile_base``, int32, one per row) instead of a
        # uint8 tile, one compare pair per score and 4 bytes per row.
        rows = gl.arange(0, s.shape[0], layout=gl.SliceLayout(1, s.type.layout))
        first = gl.load(tile_base + rows)
        keys = gl.expand_dims(cols + start_n, 0)
        in_range = (keys >= gl.expand_dims(first, 1)) & (keys <= gl.expand_dims(offs_m, 1))
        visible = visible & (in_range | (tile_on == 0))
    elif SPARSE:
        rows = gl.arange(0, s.shape[0], layout=gl.SliceLayout(1, s.type.layout))
        tile = gl.load(tile_base + gl.expand_dims(rows * MASK_BLOCK_KV, 1)
                       + gl.expand_dims(cols, 0), mask=visible & tile_on, other=1)
        visible = visible & (tile != 0)
    return visible


@gluon.jit
def _softmax_step(s, m_i, l_i, qk_scale, offs_m, j, start_n, n_full, m0, N_KV, causal_offset,
                  tile_base, tile_on, CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr,
                  SPARSE: gl.constexpr, MASK_BLOCK_KV: gl.constexpr, DIAG: gl.constexpr,
                  TREE_MAX: gl.constexpr):
    """``_softmax_block`` of KV block j, masked where ``_needs_mask`` says so. The two steps
    sit in basic blocks of their own (the run-time branch): in straight-line code ptxas moved
    the PV wait above the exponentials (seen in the SASS), so the softmax no longer ran under
    the PV GEMM."""
    if _needs_mask(j, start_n, n_full, m0, causal_offset, BLOCK_N, CAUSAL, SPARSE):
        p, m_i, l_i, alpha = _softmax_block(s, m_i, l_i, qk_scale, offs_m, start_n, N_KV,
                                            causal_offset, tile_base, tile_on, True, CAUSAL,
                                            BLOCK_N, SPARSE, MASK_BLOCK_KV, DIAG, TREE_MAX)
    else:
        p, m_i, l_i, alpha = _softmax_block(s, m_i, l_i, qk_scale, offs_m, start_n, N_KV,
                                            causal_offset, tile_base, tile_on, False, CAUSAL,
                                            BLOCK_N, SPARSE, MASK_BLOCK_KV, DIAG, TREE_MAX)
    return p, m_i, l_i, alpha


# ----------------------------------------------------------------------------- loads
@gluon.jit
def _load_kv(k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, b, kv_h, j,
             KV_STAGES: gl.constexpr, BLOCK_N: gl.constexpr, pred):
    """Issue the TMA copies of K and V block j into ring slot j % KV_STAGES (``pred`` False:
    nothing is issued)."""
    slot = j % KV_STAGES
    mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes, pred=pred)
    tma_load(k_desc, [b, kv_h, j * BLOCK_N, 0], k_ready.index(slot), k_bufs.index(slot),
              pred=pred)
    mbarrier.expect(v_ready.index(slot), v_desc.block_type.nbytes, pred=pred)
    tma_load(v_desc, [b, kv_h, j * BLOCK_N, 0], v_ready.index(slot), v_bufs.index(slot),
              pred=pred)


@gluon.jit
def _refill(desc, bufs, ready, slot, b, kv_h, j, n_blocks, BLOCK_N: gl.constexpr):
    """Non-warp-specialized programs: load block j (if there is one) into ring ``slot``."""
    pred = j < n_blocks
    mbarrier.expect(ready.index(slot), desc.block_type.nbytes, pred=pred)
    tma_load(desc, [b, kv_h, j * BLOCK_N, 0], ready.index(slot), bufs.index(slot),
              pred=pred)


@gluon.jit
def _tile_coords(t, n_q_tiles, head_group, H_Q, GROUP, N_KV, causal_offset, lists,
                 BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr,
                 TILE_ORDER: gl.constexpr, SPARSE: gl.constexpr,
                 MASK_BLOCK_Q: gl.constexpr, MASK_BLOCK_KV: gl.constexpr, WARPS: gl.constexpr):
    """(b, h, kv_h, bh, m0, n_blocks, n_full, lrow) of tile t (``WARPS``: the calling
    partition's). Tiles of one head are consecutive (its K/V stay in L2 while they run).
    TILE_ORDER == 1 (causal): tiles come in groups of ``head_group`` heads (1 outside
    persistent grids), each group's tiles by decreasing length, from the query tile that sees
    most keys down, head after head within a length: a group's K/V stay in L2 while a
    persistent grid walks it in rounds of similar lengths. TILE_ORDER 2-4: t is a tile of
    the host's schedule (``_program_tile``), numbered as without an order. KV blocks
    [0, n_full) need no mask, [n_full, n_blocks) do; n_full <= n_blocks.

    SPARSE: the tile walks the KV blocks its block-mask row lists (``lists``, see
    ``_kv_start``), full ones first, in steps of BLOCK_N keys; ``lrow`` is where that row's
    lists start (0 otherwise). Causal full blocks that cross a row's diagonal are masked by
    the caller (``_needs_mask``)."""
    if TILE_ORDER == 1:
        per_group = head_group * n_q_tiles
        within = t % per_group
        tile = n_q_tiles - 1 - within // head_group
        bh = (t // per_group) * head_group + within % head_group
    else:
        tile = t % n_q_tiles
        bh = t // n_q_tiles
    b = bh // H_Q
    h = bh % H_Q
    kv_h = h // GROUP
    m0 = tile * BLOCK_M
    lrow = 0
    if CAUSAL:
        # Row i sees keys j <= i + causal_offset (0 top-left, N_kv - N_q bottom-right), i
        # its query's index in its head (``_query_rows``: a packed GQA tile spans heads).
        first_q, last_q = _query_rows(m0, BLOCK_M, lists[14], lists[15])
        kv_end = gl.maximum(gl.minimum(N_KV, last_q + 1 + causal_offset), 0)
    if SPARSE:
        SUB: gl.constexpr = MASK_BLOCK_KV // BLOCK_N
        (full_counts, _, partial_counts, _, _, _, stride_cb, stride_ch, stride_ib, stride_ih,
         stride_iq, _, _, _, _, _) = lists
        mask_row = m0 // MASK_BLOCK_Q
        counts = b * stride_cb + h * stride_ch + mask_row
        lrow = b * stride_ib + h * stride_ih + mask_row * stride_iq
        n_full_listed = gl.load(full_counts + counts)
        n_partial_listed = gl.load(partial_counts + counts)
        if CAUSAL:
            # Listed blocks wholly right of the tile's last row's diagonal are hidden from
            # every row: the lists ascend, so the walk stops before them.
            blocks_end = gl.cdiv(kv_end, MASK_BLOCK_KV)
            n_full_listed = _listed_before(lists[1] + lrow, n_full_listed, blocks_end, WARPS)
            n_partial_listed = _listed_before(lists[3] + lrow, n_partial_listed, blocks_end,
                                              WARPS)
        n_full = n_full_listed * SUB
        n_blocks = n_full + n_partial_listed * SUB
    elif CAUSAL:
        first_row_sees = gl.maximum(first_q + causal_offset + 1, 0)
        n_full = gl.minimum(first_row_sees // BLOCK_N, N_KV // BLOCK_N)
        n_blocks = gl.cdiv(kv_end, BLOCK_N)
    else:
        n_full = N_KV // BLOCK_N
        n_blocks = gl.cdiv(N_KV, BLOCK_N)
    return b, h, kv_h, bh, m0, n_blocks, n_full, lrow


@gluon.jit
def _query_rows(m0, ROWS: gl.constexpr, q_per_head, PACKED: gl.constexpr):
    """(first, last) query index, within its head, of the tile rows [m0, m0 + ROWS) for the
    causal bounds. Unpacked the rows are the queries. PACKED GQA (the query heads of one KV
    head stacked, ``q_per_head`` rows each; ``pack_gqa``): a tile within one head maps its
    rows, and one that spans heads takes every query of a head (0 .. q_per_head - 1), as
    the mask then sees both ends. ``gluon_schedule.query_rows`` is the host's copy."""
    first = m0
    last = m0 + ROWS - 1
    if PACKED:
        head = m0 // q_per_head
        within = head == last // q_per_head
        first = gl.where(within, m0 - head * q_per_head, 0)
        last = gl.where(within, last - head * q_per_head, q_per_head - 1)
    return first, last


@gluon.jit
def _listed_before(entries, count, blocks_end, WARPS: gl.constexpr):
    """How many of the ``count`` ascending block indices at ``entries`` are below
    ``blocks_end`` (read ``32 * WARPS`` at a time by the calling partition's warps)."""
    CHUNK: gl.constexpr = 32 * WARPS
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
    n = count * 0
    for c in range(0, count, CHUNK):
        offs = c + gl.arange(0, CHUNK, layout=layout)
        block = gl.load(entries + offs, mask=offs < count, other=2147483647)
        n += gl.sum((block < blocks_end).to(gl.int32), 0)
    return n


@gluon.jit
def _kv_start(j, n_full, lrow, lists, BLOCK_N: gl.constexpr, SPARSE: gl.constexpr,
              MASK_BLOCK_KV: gl.constexpr):
    """The first key of the tile's KV block j: j * BLOCK_N, or (SPARSE) step j of the walk
    over the mask row's listed blocks, full ones then partial ones, each MASK_BLOCK_KV //
    BLOCK_N steps long (``lists``: the counts, indices, tile ids and tiles of
    ``BlockMask.kernel_args`` and its strides)."""
    if SPARSE:
        SUB: gl.constexpr = MASK_BLOCK_KV // BLOCK_N
        full_indices = lists[1]
        partial_indices = lists[3]
        if j < n_full:
            block = gl.load(full_indices + lrow + j // SUB)
        else:
            block = gl.load(partial_indices + lrow + (j - n_full) // SUB)
        start = block * MASK_BLOCK_KV + (j % SUB) * BLOCK_N
    else:
        start = j * BLOCK_N
    return start


@gluon.jit
def _needs_mask(j, start_n, n_full, m0, causal_offset, BLOCK_N: gl.constexpr,
                CAUSAL: gl.constexpr, SPARSE: gl.constexpr):
    """Whether KV block j (keys from ``start_n``) takes the masked softmax for rows from m0:
    past the unmasked blocks [0, n_full), or (SPARSE and causal) a listed full block that
    crosses the first row's diagonal (dense causal tiles count those in n_full already)."""
    masked = j >= n_full
    if SPARSE and CAUSAL:
        masked = masked | (start_n + BLOCK_N - 1 > m0 + causal_offset)
    return masked


@gluon.jit
def _mask_tile(j, n_full, lrow, m0, lists, BLOCK_N: gl.constexpr, SPARSE: gl.constexpr,
               MASK_BLOCK_Q: gl.constexpr, MASK_BLOCK_KV: gl.constexpr):
    """(SPARSE) Where the uint8 mask of KV block j for the rows from m0 starts, and whether
    block j is a partial one (a full block has no tile: the address is then unused);
    otherwise (an unused address, False)."""
    if SPARSE == 2:  # (doc_offsets) lists[5]: the rows' first visible keys, one per row
        partial = j >= n_full
        base = lists[5] + m0
    elif SPARSE:
        SUB: gl.constexpr = MASK_BLOCK_KV // BLOCK_N
        partial = j >= n_full
        # Slot 0 of the row is readable even where the row lists no partial block.
        tile_id = gl.load(lists[4] + lrow + gl.maximum(j - n_full, 0) // SUB)
        base = (lists[5] + tile_id.to(gl.int64) * (MASK_BLOCK_Q * MASK_BLOCK_KV)
                + (m0 % MASK_BLOCK_Q) * MASK_BLOCK_KV + (j % SUB) * BLOCK_N)
    else:
        partial = False
        base = lists[5]
    return base, partial


@gluon.jit
def _program_tiles(n_tiles, lists, ORDER: gl.constexpr):
    """How many tiles (or pieces of tiles) this program of a persistent grid walks (see
    ``_program_tile``)."""
    p = gl.program_id(0)
    grid = gl.num_programs(0)
    if ORDER >= 2:
        # The host's schedule: grid + 1 offsets into the entries that follow them.
        listed = gl.load(lists[11] + p + 1) - gl.load(lists[11] + p)
        if ORDER == 3:
            # The whole rounds come before the listed pieces.
            listed += n_tiles // grid
        return listed
    rounds = gl.cdiv(n_tiles, grid)
    last = (rounds - 1) * grid + p
    if ORDER == 1:  # noqa: SIM102  (a constexpr, then a run-time condition)
        if (rounds - 1) % 2 == 1:
            last = (rounds - 1) * grid + grid - 1 - p
    return gl.where(last < n_tiles, rounds, rounds - 1)


@gluon.jit
def _program_tile(r, n_tiles, lists, ORDER: gl.constexpr):
    """What this program of a persistent grid takes in round r: (tile, first KV block, end
    block, piece, base, count). The tile comes by grid stride; with ORDER 1 (the kernel's
    longest-first order) the direction reversed every other round, so that no program takes
    the longer tile of every round; with ORDER 2 it is the program's r-th entry of the
    host's schedule (``lpt_schedule``); with ORDER 3 the whole rounds go by grid stride and
    the rest are the program's entries of the host's schedule (``split_schedule``), which
    cuts the last round's tiles into ``count`` pieces run by different programs: ``piece``
    is this one's slot among the tile's slots ``base .. base + count - 1`` of the split
    workspace, -1 for a whole tile; with ORDER 4 every tile or piece is an entry of a
    causal grid's schedule (``cut_lpt_schedule``). The blocks [first, end) are capped by the
    tile's own count (end ``WHOLE``: all of them)."""
    p = gl.program_id(0)
    grid = gl.num_programs(0)
    if ORDER == 4:
        return _listed_entry(lists, p, grid, r)
    if ORDER == 2:
        entry = lists[11] + grid + 1 + (gl.load(lists[11] + p) + r) * SCHEDULE_ENTRY
        return (gl.load(entry), gl.to_tensor(0), gl.to_tensor(WHOLE), gl.to_tensor(-1),
                gl.to_tensor(-1), gl.to_tensor(1))
    if ORDER == 1:  # noqa: SIM102  (a constexpr, then a run-time condition)
        if r % 2 == 1:
            p = grid - 1 - p
    tile = r * grid + p
    first = gl.to_tensor(0)
    end = gl.to_tensor(WHOLE)
    piece = gl.to_tensor(-1)
    base = gl.to_tensor(-1)
    count = gl.to_tensor(1)
    if ORDER == 3:
        # (No loads for the whole rounds: their tiles start without waiting on memory.)
        rounds = n_tiles // grid
        if r >= rounds:
            tile, first, end, piece, base, count = _listed_entry(lists, p, grid, r - rounds)
    return tile, first, end, piece, base, count


@gluon.jit
def _listed_entry(lists, p, grid, k):
    """Program p's k-th entry of the host's schedule (``lists[11]``: grid + 1 offsets, then
    ``SCHEDULE_ENTRY`` ints per entry): (tile, first, end, piece, base, count)."""
    entry = lists[11] + grid + 1 + (gl.load(lists[11] + p) + k) * SCHEDULE_ENTRY
    return (gl.load(entry), gl.load(entry + 1), gl.load(entry + 2), gl.load(entry + 3),
            gl.load(entry + 4), gl.load(entry + 5))


@gluon.jit
def _producer_tile(q_desc, k_desc, v_desc, q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready,
                   v_ready, k_empty, v_empty, b, h, kv_h, q_row0, first, end, n_full, lrow,
                   lists, it0, tc,
                   Q_LOADS: gl.constexpr, Q_ROWS: gl.constexpr, KV_STAGES: gl.constexpr,
                   BLOCK_N: gl.constexpr, PERSISTENT: gl.constexpr, Q_SLOTS: gl.constexpr,
                   SPARSE: gl.constexpr, MASK_BLOCK_KV: gl.constexpr):
    """The producer warp, one tile (the program's ``tc``-th): the query rows of each consumer
    into its Q buffer ``tc % Q_SLOTS`` (in a persistent program, once that consumer released
    what the buffer held), then K and V block by block, each into its ring slot once every
    consumer released the block that held it: blocks [first, end) of the tile (all of them
    but for a piece of a split tile). ``it0`` counts the blocks of earlier tiles (ring
    position and phase); empty barriers start in phase 0, so the first pass through a ring
    waits for nothing."""
    q_phase = (tc // Q_SLOTS) & 1
    for c in gl.static_range(Q_LOADS):
        q_buf = c * Q_SLOTS + tc % Q_SLOTS
        if PERSISTENT:
            mbarrier.wait(q_empty.index(q_buf), q_phase ^ 1)
        mbarrier.expect(q_ready.index(q_buf), q_desc.block_type.nbytes)
        tma_load(q_desc, [b, h, q_row0 + c * Q_ROWS, 0], q_ready.index(q_buf),
                  q_bufs.index(q_buf))
    for j in range(first, end):
        g = it0 + j - first
        slot = g % KV_STAGES
        phase = ((g // KV_STAGES) & 1) ^ 1
        start_n = _kv_start(j, n_full, lrow, lists, BLOCK_N, SPARSE, MASK_BLOCK_KV)
        mbarrier.wait(k_empty.index(slot), phase)
        mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes)
        tma_load(k_desc, [b, kv_h, start_n, 0], k_ready.index(slot), k_bufs.index(slot))
        mbarrier.wait(v_empty.index(slot), phase)
        mbarrier.expect(v_ready.index(slot), v_desc.block_type.nbytes)
        tma_load(v_desc, [b, kv_h, start_n, 0], v_ready.index(slot), v_bufs.index(slot))


# ----------------------------------------------------------------------------- consumer
@gluon.jit
def _stage_p(p, p_op, p_smem, P_SMEM: gl.constexpr):
    """P (fp32, the scores' layout) as the next PV GEMM's A operand: in registers, in the
    wgmma operand layout (returned), or stored to ``p_smem`` for a shared-memory operand (the
    placeholder ``p_op`` is returned unchanged)."""
    if P_SMEM:
        p_smem.store(p.to(p_smem.dtype))
        fence_async_shared()
        warps_barrier()
        out = p_op
    else:
        out = gl.convert_layout(p.to(p_op.dtype), p_op.type.layout)
    return out


@gluon.jit
def _issue_pv(p_op, p_smem, v_smem, acc, P_SMEM: gl.constexpr):
    """O += P V, asynchronously, with P from registers or from shared memory."""
    if P_SMEM:
        tok = warpgroup_mma(p_smem, v_smem, acc, is_async=True)
    else:
        tok = warpgroup_mma(p_op, v_smem, acc, is_async=True)
    return tok


@gluon.jit
def _wait_pv(o_tok, p_op, p, P_SMEM: gl.constexpr):
    """Wait for every GEMM in flight, after the softmax: returns (acc, p). The register
    operand P_{j-1} stays alive until then; the new p goes through the wait too, which keeps
    LLVM from moving the softmax below it (ptxas sees the dependency only as a comment: the
    caller keeps the softmax in a basic block of its own for ptxas)."""
    if P_SMEM:
        acc, p = warpgroup_mma_wait(0, deps=(o_tok, p))
    else:
        acc, p_op, p = warpgroup_mma_wait(0, deps=(o_tok, p_op, p))
    return acc, p


@gluon.jit
def _kv_steps(acc, p_op, m_i, l_i, alpha, n_full, first, end, lrow, lists, it0, ev0, q_smem,
              p_smem, k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty,
              turns, b, kv_h, m0, offs_m, N_KV, causal_offset, qk_scale,
              ME: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
              KV_STAGES: gl.constexpr, CAUSAL: gl.constexpr, WARP_SPECIALIZE: gl.constexpr,
              PINGPONG: gl.constexpr, P_SMEM: gl.constexpr, SPARSE: gl.constexpr,
              MASK_BLOCK_Q: gl.constexpr, MASK_BLOCK_KV: gl.constexpr, DIAG: gl.constexpr,
              TREE_MAX: gl.constexpr):
    """KV blocks j in [first + 1, end): S_j = Q K_j^T is issued together with
    O += P_{j-1} V_{j-1}, and the softmax of block j runs while the PV GEMM is still on the
    tensor cores; blocks that ``_needs_mask`` take the masked softmax (causal diagonal, N_kv
    tail, a block mask's partial blocks). Block j's ring position is ``it0 + j``, its
    ping-pong turn ``ev0 + j`` (the caller offsets both by earlier tiles of a persistent
    program and by ``first``). Carries (acc, P_{j-1} as the A
    operand in registers (or a placeholder when P_SMEM keeps it in ``p_smem``), m, l,
    alpha)."""
    s_layout: gl.constexpr = offs_m.type.layout.parent
    o_layout: gl.constexpr = acc.type.layout
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    s_zero = gl.zeros([offs_m.shape[0], BLOCK_N], gl.float32, s_layout)
    for j in range(first + 1, end):
        g = it0 + j
        slot = g % KV_STAGES
        phase = (g // KV_STAGES) & 1
        prev = (g - 1) % KV_STAGES
        prev_phase = ((g - 1) // KV_STAGES) & 1
        # (SPARSE: list reads, issued before the waits so that they land under the GEMMs.)
        start_n = _kv_start(j, n_full, lrow, lists, BLOCK_N, SPARSE, MASK_BLOCK_KV)
        tile_base, tile_on = _mask_tile(j, n_full, lrow, m0, lists, BLOCK_N, SPARSE,
                                        MASK_BLOCK_Q, MASK_BLOCK_KV)
        if PINGPONG:
            mbarrier.wait(turns.index(ME), (ev0 + j) & 1)
        mbarrier.wait(k_ready.index(slot), phase)
        k_smem = k_bufs.index(slot).reshape([BLOCK_N, HEAD_DIM])
        s_tok = warpgroup_mma(q_smem, k_smem.permute((1, 0)), s_zero, use_acc=False,
                              is_async=True)
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
        mbarrier.wait(v_ready.index(prev), prev_phase)
        v_smem = v_bufs.index(prev).reshape([BLOCK_N, HEAD_DIM])
        o_tok = _issue_pv(p_op, p_smem, v_smem, acc, P_SMEM)
        if PINGPONG:
            mbarrier.arrive(turns.index(1 - ME), count=1)
        s = warpgroup_mma_wait(1, deps=(s_tok,))
        p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, qk_scale, offs_m, j, start_n, n_full,
                                           m0, N_KV, causal_offset, tile_base, tile_on, CAUSAL,
                                           BLOCK_N, SPARSE, MASK_BLOCK_KV, DIAG, TREE_MAX)
        if WARP_SPECIALIZE:
            mbarrier.arrive(k_empty.index(slot), count=1)
        else:
            # Every warp is done with K_j: refill its slot (programs without the producer
            # warp are never persistent, so it0 = 0 and j is the block index).
            warps_barrier()
            _refill(k_desc, k_bufs, k_ready, slot, b, kv_h, j + KV_STAGES, end, BLOCK_N)
        acc, p = _wait_pv(o_tok, p_op, p, P_SMEM)
        p_op = _stage_p(p, p_op, p_smem, P_SMEM)
        if WARP_SPECIALIZE:
            mbarrier.arrive(v_empty.index(prev), count=1)
        else:
            # Every warp is done with V_{j-1}: refill its slot.
            warps_barrier()
            _refill(v_desc, v_bufs, v_ready, prev, b, kv_h, j - 1 + KV_STAGES, end, BLOCK_N)
    return acc, p_op, m_i, l_i, alpha


@gluon.jit
def _release_o_buffer(q_empty, q_buf, tc):
    """A persistent consumer with two Q buffers: once the TMA store of the previous tile's O
    has read buffer ``q_buf``, hand it back, so the producer may load the tile after next
    into it (``tc`` counts this program's tiles: the first has no previous one)."""
    tma.store_wait(0)
    if tc > 0:
        mbarrier.arrive(q_empty.index(q_buf), count=1)


@gluon.jit
def _consumer_tile(q_desc, k_desc, v_desc, o_desc, Out, LSE,
                   q_bufs, p_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready, v_ready,
                   k_empty, v_empty, turns, b, h, kv_h, bh, q_row0, first, end, n_full, lrow,
                   lists, N_Q, N_KV, causal_offset, qk_scale, it0, ev0, tc, piece, base, count,
                   ME: gl.constexpr, NUM_WARPS: gl.constexpr, ROWS: gl.constexpr,
                   HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, KV_STAGES: gl.constexpr,
                   CAUSAL: gl.constexpr, WARP_SPECIALIZE: gl.constexpr,
                   PINGPONG: gl.constexpr, P_SMEM: gl.constexpr, PERSISTENT: gl.constexpr,
                   Q_SLOTS: gl.constexpr, SPARSE: gl.constexpr, MASK_BLOCK_Q: gl.constexpr,
                   MASK_BLOCK_KV: gl.constexpr, DIAG: gl.constexpr, TREE_MAX: gl.constexpr,
                   SPLIT: gl.constexpr):
    """One consumer, one tile: ``ROWS`` query rows (from row ``q_row0 + ME * ROWS`` of the
    head) over ``NUM_WARPS`` warps, against the tile's KV blocks [first, end); writes its
    rows of O and LSE. Without WARP_SPECIALIZE it also issues the loads. SPLIT: the tile may
    be one of ``count`` pieces (``piece`` >= 0), combined by the last one to end
    (``_combine_pieces``).

    Pingpong: each consumer takes turns[ME] before issuing its GEMMs of a block and hands
    turns[1 - ME] over right after, so the two consumers' GEMMs alternate on the tensor cores
    and each one's softmax runs under the other's GEMMs. Every consumer issues n + 1 GEMM
    batches per tile of n = end - first blocks (S_first; S_j with PV_{j-1}; PV_last), the
    k-th of the program waiting on phase k & 1 (``ev0`` batches came before this tile).

    Q (and O) buffer: ``tc % Q_SLOTS`` of this consumer for the program's ``tc``-th tile. With
    one slot, a persistent program hands it back once its last S GEMM completed (the next
    tile's Q loads under the last PV GEMM) and stores O from registers; with two, the next
    tile's Q loads during this whole tile, and O leaves through this tile's buffer by TMA."""
    dtype: gl.constexpr = q_desc.dtype
    s_layout: gl.constexpr = _mma_layout(NUM_WARPS, BLOCK_N)
    o_layout: gl.constexpr = _mma_layout(NUM_WARPS, HEAD_DIM)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

    # Only the producer warp walks a block mask's lists (the template refuses the rest).
    gl.static_assert(WARP_SPECIALIZE or not SPARSE)
    if not WARP_SPECIALIZE:
        # The consumer warps load for themselves: Q, then the first KV_STAGES blocks.
        mbarrier.expect(q_ready.index(0), q_desc.block_type.nbytes)
        tma_load(q_desc, [b, h, q_row0, 0], q_ready.index(0), q_bufs.index(0))
        for i in gl.static_range(KV_STAGES):
            _load_kv(k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, b, kv_h, i, KV_STAGES,
                     BLOCK_N, i < end)

    m0 = q_row0 + ME * ROWS
    # The rows' query indices for the causal mask (in their heads, where GQA is packed).
    offs_m = m0 + gl.arange(0, ROWS, layout=row_s)
    if CAUSAL and lists[15]:
        offs_m = offs_m % lists[14]
    m_i = gl.full([ROWS], float("-inf"), gl.float32, row_s)
    l_i = gl.full([ROWS], 0.0, gl.float32, row_s)
    acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, o_layout)

    q_buf = ME * Q_SLOTS + tc % Q_SLOTS
    q_smem = q_bufs.index(q_buf).reshape([ROWS, HEAD_DIM])
    p_smem = p_bufs.index(ME)
    # P's registers (a placeholder when P lives in p_smem).
    p_op = gl.to_tensor(0) if P_SMEM else gl.zeros([ROWS, BLOCK_N], dtype, p_layout)
    mbarrier.wait(q_ready.index(q_buf), (tc // Q_SLOTS) & 1)
    # O from registers: the one Q buffer of a persistent program goes back before O is ready.
    O_FROM_REGISTERS: gl.constexpr = PERSISTENT and Q_SLOTS == 1
    # With two, the previous tile's O store is waited for under this tile's first GEMM.
    DEFER_O_WAIT: gl.constexpr = PERSISTENT and Q_SLOTS == 2 and DIAG != 3
    prev_buf = ME * Q_SLOTS + (tc + 1) % Q_SLOTS

    if end > first:
        # -- the first block: S alone.
        slot0 = it0 % KV_STAGES
        start0 = _kv_start(first, n_full, lrow, lists, BLOCK_N, SPARSE, MASK_BLOCK_KV)
        tile_base, tile_on = _mask_tile(first, n_full, lrow, m0, lists, BLOCK_N, SPARSE,
                                        MASK_BLOCK_Q, MASK_BLOCK_KV)
        if PINGPONG:
            mbarrier.wait(turns.index(ME), ev0 & 1)
        mbarrier.wait(k_ready.index(slot0), (it0 // KV_STAGES) & 1)
        k_smem = k_bufs.index(slot0).reshape([BLOCK_N, HEAD_DIM])
        s_tok = warpgroup_mma(q_smem, k_smem.permute((1, 0)),
                              gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout), use_acc=False,
                              is_async=True)
        if PINGPONG:
            mbarrier.arrive(turns.index(1 - ME), count=1)
        if DEFER_O_WAIT:
            _release_o_buffer(q_empty, prev_buf, tc)
        s = warpgroup_mma_wait(0, deps=(s_tok,))
        if WARP_SPECIALIZE:
            mbarrier.arrive(k_empty.index(slot0), count=1)
        p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, qk_scale, offs_m, first, start0, n_full,
                                           m0, N_KV, causal_offset, tile_base, tile_on, CAUSAL,
                                           BLOCK_N, SPARSE, MASK_BLOCK_KV, DIAG, TREE_MAX)
        # P: the A operand of the PV GEMM, in registers (16-bit: half the registers of S) or
        # in shared memory.
        p_op = _stage_p(p, p_op, p_smem, P_SMEM)
        if not WARP_SPECIALIZE:
            # Every warp is done with K_0: refill its slot (V_0 is read in the next step).
            warps_barrier()
            _refill(k_desc, k_bufs, k_ready, 0, b, kv_h, KV_STAGES, end, BLOCK_N)

        # -- blocks first + 1 .. end - 1.
        acc, p_op, m_i, l_i, alpha = _kv_steps(
            acc, p_op, m_i, l_i, alpha, n_full, first, end, lrow, lists, it0 - first,
            ev0 - first, q_smem,
            p_smem, k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, turns,
            b, kv_h, m0, offs_m, N_KV, causal_offset, qk_scale, ME, HEAD_DIM, BLOCK_N,
            KV_STAGES, CAUSAL, WARP_SPECIALIZE, PINGPONG, P_SMEM, SPARSE, MASK_BLOCK_Q,
            MASK_BLOCK_KV, DIAG, TREE_MAX)
        if O_FROM_REGISTERS:
            # Every GEMM that reads Q has completed: the producer may load the next tile's.
            mbarrier.arrive(q_empty.index(q_buf), count=1)

        # -- the last PV GEMM.
        last = it0 + end - first - 1
        slot = last % KV_STAGES
        if PINGPONG:
            mbarrier.wait(turns.index(ME), (ev0 + end - first) & 1)
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
        mbarrier.wait(v_ready.index(slot), (last // KV_STAGES) & 1)
        v_smem = v_bufs.index(slot).reshape([BLOCK_N, HEAD_DIM])
        o_tok = _issue_pv(p_op, p_smem, v_smem, acc, P_SMEM)
        if PINGPONG:
            mbarrier.arrive(turns.index(1 - ME), count=1)
        acc, p = _wait_pv(o_tok, p_op, p, P_SMEM)
        if WARP_SPECIALIZE:
            mbarrier.arrive(v_empty.index(slot), count=1)
    else:
        if O_FROM_REGISTERS:
            mbarrier.arrive(q_empty.index(q_buf), count=1)
        if DEFER_O_WAIT:
            _release_o_buffer(q_empty, prev_buf, tc)

    # -- epilogue: a piece of a split tile hands its partial over; the tile's O and LSE.
    l_o = gl.convert_layout(l_i, row_o)
    m_o = gl.convert_layout(m_i, row_o)
    if SPLIT and DIAG != 7:
        CONSUMERS: gl.constexpr = 2 if PINGPONG else 1
        acc, m_o, l_o, owner = _combine_pieces(acc, m_o, l_o, piece, base, count, lists, ME,
                                               CONSUMERS)
        if owner:
            _write_tile(acc, m_o, l_o, o_desc, Out, LSE, q_bufs, q_smem, q_buf, b, h, bh, m0,
                        N_Q, ROWS, HEAD_DIM, O_FROM_REGISTERS)
    else:
        _write_tile(acc, m_o, l_o, o_desc, Out, LSE, q_bufs, q_smem, q_buf, b, h, bh, m0, N_Q,
                    ROWS, HEAD_DIM, O_FROM_REGISTERS)
    if not O_FROM_REGISTERS and not DEFER_O_WAIT:
        # Waits until the copy has read the buffer, not until it reached global memory.
        tma.store_wait(0)
        if PERSISTENT:
            # The producer may load the tile after next into this buffer.
            mbarrier.arrive(q_empty.index(q_buf), count=1)


@gluon.jit
def _write_tile(acc, m_o, l_o, o_desc, Out, LSE, q_bufs, q_smem, q_buf, b, h, bh, m0, N_Q,
                ROWS: gl.constexpr, HEAD_DIM: gl.constexpr, O_FROM_REGISTERS: gl.constexpr):
    """A consumer's rows of O (normalized) and LSE; rows that saw no key get o = 0 and
    lse = -inf (never NaN). O leaves from registers or, through the consumer's Q buffer, by a
    TMA store that the caller waits for."""
    o_layout: gl.constexpr = acc.type.layout
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    dtype: gl.constexpr = o_desc.dtype
    seen = l_o > 0.0
    l_safe = gl.where(seen, l_o, 1.0)
    o = acc / gl.expand_dims(l_safe, 1)
    lse = gl.where(seen, (m_o + gl.log2(l_safe)) * LN_2_JIT, float("-inf"))
    rows = m0 + gl.arange(0, ROWS, layout=row_o)
    row_ok = rows < N_Q
    gl.store(LSE + bh.to(gl.int64) * N_Q + rows, lse, mask=row_ok)
    if O_FROM_REGISTERS:
        # The Q buffer already holds the next tile's rows: O goes out from registers
        # (contiguous (B, H, N_q, D)).
        cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
        offs = ((bh.to(gl.int64) * N_Q + gl.expand_dims(rows, 1)) * HEAD_DIM
                + gl.expand_dims(cols, 0))
        gl.store(Out + offs, o.to(dtype), mask=gl.expand_dims(row_ok, 1))
    else:
        # O leaves through this consumer's Q buffer (every GEMM that read Q has completed)
        # and a TMA store, which drops the rows past N_q.
        q_smem.store(o.to(dtype))
        fence_async_shared()
        tma_store(o_desc, [b, h, m0, 0], q_bufs.index(q_buf))


@gluon.jit
def _combine_pieces(acc, m_o, l_o, piece, base, count, lists, ME: gl.constexpr,
                    CONSUMERS: gl.constexpr):
    """A consumer's rows of a piece of a split tile (``piece`` >= 0, see ``_program_tile``):
    stores its partial result (the unnormalized O, m and l of its rows) in slot ``piece`` of
    the split workspace (``lists[12]``) and counts itself in at the tile's counter
    (``lists[13]``). The piece that counts in last combines the slots ``base .. base + count
    - 1`` in that order (so the result does not depend on which piece ended last), sets the
    counter back to 0 for the next launch, and returns the tile's (acc, m, l, True); the
    others return (.., False) and the tile is not theirs to write. A whole tile (piece -1)
    returns its own values and True."""
    owner = piece < 0
    if piece >= 0:
        partials = lists[12]
        counters = lists[13]
        o_layout: gl.constexpr = acc.type.layout
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
        ROWS: gl.constexpr = acc.shape[0]
        D: gl.constexpr = acc.shape[1]
        # One slot per consumer: its rows' O, then m, then l (fp32).
        SLOT: gl.constexpr = ROWS * (D + 2)
        rows = gl.arange(0, ROWS, layout=row_o)
        offs = (gl.expand_dims(rows, 1) * D
                + gl.expand_dims(gl.arange(0, D, layout=gl.SliceLayout(0, o_layout)), 0))
        mine = partials + (piece * CONSUMERS + ME).to(gl.int64) * SLOT
        gl.store(mine + offs, acc)
        gl.store(mine + ROWS * D + rows, m_o)
        gl.store(mine + ROWS * D + ROWS + rows, l_o)
        # Every warp has stored before the one thread that runs the atomic releases them.
        warps_barrier()
        counter = counters + base * CONSUMERS + ME
        owner = gl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == count - 1
        if owner:
            gl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")
            acc = gl.zeros([ROWS, D], gl.float32, o_layout)
            m_o = gl.full([ROWS], float("-inf"), gl.float32, row_o)
            l_o = gl.zeros([ROWS], gl.float32, row_o)
            for i in range(count):
                part = partials + ((base + i) * CONSUMERS + ME).to(gl.int64) * SLOT
                # Plain loads: the acquire (one thread's atomic, then the barrier of the
                # result's broadcast) invalidated this SM's L1 (CCTL.IVALL in the SASS).
                # ".cg" loads compiled to strong ones and measured 5-8% slower on grids of
                # 32-64 tiles (session #13).
                m_k = gl.load(part + ROWS * D + rows)
                l_k = gl.load(part + ROWS * D + ROWS + rows)
                acc_k = gl.load(part + offs)
                m_new = gl.maximum(m_o, m_k)
                shift = gl.where(m_new == float("-inf"), 0.0, m_new)
                a = gl.exp2(m_o - shift)
                c = gl.exp2(m_k - shift)
                acc = acc * gl.expand_dims(a, 1) + acc_k * gl.expand_dims(c, 1)
                l_o = l_o * a + l_k * c
                m_o = m_new
    return acc, m_o, l_o, owner


@gluon.jit
def _consumer(q_desc, k_desc, v_desc, o_desc, Out, LSE, q_bufs, p_bufs, k_bufs, v_bufs,
              q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, turns, n_tiles, n_q_tiles,
              head_group, H_Q, GROUP, N_Q, N_KV, causal_offset, qk_scale, lists,
              ME: gl.constexpr, NUM_WARPS: gl.constexpr, ROWS: gl.constexpr,
              HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              KV_STAGES: gl.constexpr, CAUSAL: gl.constexpr, TILE_ORDER: gl.constexpr,
              WARP_SPECIALIZE: gl.constexpr, PINGPONG: gl.constexpr, P_SMEM: gl.constexpr,
              PERSISTENT: gl.constexpr, Q_SLOTS: gl.constexpr, SPARSE: gl.constexpr,
              MASK_BLOCK_Q: gl.constexpr, MASK_BLOCK_KV: gl.constexpr, DIAG: gl.constexpr,
              TREE_MAX: gl.constexpr):
    """A consumer over its program's tiles: one (tile = program id), or, persistent, one per
    round (``_program_tile``), with ring, turn and Q-buffer phases carried across tiles."""
    if PINGPONG and ME == 1:
        # Consumer 1 hands the first turn to consumer 0.
        mbarrier.arrive(turns.index(0), count=1)
    if PERSISTENT:
        it0 = 0
        ev0 = 0
        for tc in range(_program_tiles(n_tiles, lists, TILE_ORDER)):
            t, first, end, piece, base, count = _program_tile(tc, n_tiles, lists, TILE_ORDER)
            b, h, kv_h, bh, m0, n_blocks, n_full, lrow = _tile_coords(
                t, n_q_tiles, head_group, H_Q, GROUP, N_KV, causal_offset, lists, BLOCK_M,
                BLOCK_N, CAUSAL, TILE_ORDER, SPARSE, MASK_BLOCK_Q, MASK_BLOCK_KV, NUM_WARPS)
            end = gl.minimum(end, n_blocks)
            _consumer_tile(q_desc, k_desc, v_desc, o_desc, Out, LSE, q_bufs, p_bufs, k_bufs,
                           v_bufs, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, turns,
                           b, h, kv_h, bh, m0, first, end, n_full, lrow, lists, N_Q, N_KV,
                           causal_offset, qk_scale, it0, ev0, tc, piece, base, count, ME,
                           NUM_WARPS, ROWS, HEAD_DIM, BLOCK_N, KV_STAGES, CAUSAL,
                           WARP_SPECIALIZE, PINGPONG, P_SMEM, PERSISTENT, Q_SLOTS, SPARSE,
                           MASK_BLOCK_Q, MASK_BLOCK_KV, DIAG, TREE_MAX, TILE_ORDER >= 3)
            it0 += end - first
            if end > first:
                ev0 += end - first + 1
        # The last tile's O store must have read shared memory before the program ends.
        tma.store_wait(0)
    else:
        b, h, kv_h, bh, m0, n_blocks, n_full, lrow = _tile_coords(
            gl.program_id(0), n_q_tiles, head_group, H_Q, GROUP, N_KV, causal_offset, lists,
            BLOCK_M, BLOCK_N, CAUSAL, TILE_ORDER, SPARSE, MASK_BLOCK_Q, MASK_BLOCK_KV,
            NUM_WARPS)
        _consumer_tile(q_desc, k_desc, v_desc, o_desc, Out, LSE, q_bufs, p_bufs, k_bufs,
                       v_bufs, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, turns, b,
                       h, kv_h, bh, m0, 0, n_blocks, n_full, lrow, lists, N_Q, N_KV,
                       causal_offset, qk_scale, 0, 0, 0, -1, -1, 1, ME, NUM_WARPS, ROWS,
                       HEAD_DIM, BLOCK_N, KV_STAGES, CAUSAL, WARP_SPECIALIZE, PINGPONG, P_SMEM,
                       PERSISTENT, Q_SLOTS, SPARSE, MASK_BLOCK_Q, MASK_BLOCK_KV, DIAG, TREE_MAX,
                       False)


@gluon.jit
def _producer(q_desc, k_desc, v_desc, q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready,
              v_ready, k_empty, v_empty, n_tiles, n_q_tiles, head_group, H_Q, GROUP, N_KV,
              causal_offset, lists,
              Q_LOADS: gl.constexpr, ROWS: gl.constexpr, BLOCK_M: gl.constexpr,
              BLOCK_N: gl.constexpr, KV_STAGES: gl.constexpr, CAUSAL: gl.constexpr,
              TILE_ORDER: gl.constexpr, PERSISTENT: gl.constexpr, Q_SLOTS: gl.constexpr,
              SPARSE: gl.constexpr, MASK_BLOCK_Q: gl.constexpr, MASK_BLOCK_KV: gl.constexpr):
    """The producer warp over its program's tiles (the consumers' sequence)."""
    if PERSISTENT:
        it0 = 0
        for tc in range(_program_tiles(n_tiles, lists, TILE_ORDER)):
            t, first, end, _, _, _ = _program_tile(tc, n_tiles, lists, TILE_ORDER)
            b, h, kv_h, bh, m0, n_blocks, n_full, lrow = _tile_coords(
                t, n_q_tiles, head_group, H_Q, GROUP, N_KV, causal_offset, lists, BLOCK_M,
                BLOCK_N, CAUSAL, TILE_ORDER, SPARSE, MASK_BLOCK_Q, MASK_BLOCK_KV, 1)
            end = gl.minimum(end, n_blocks)
            _producer_tile(q_desc, k_desc, v_desc, q_bufs, k_bufs, v_bufs, q_ready, q_empty,
                           k_ready, v_ready, k_empty, v_empty, b, h, kv_h, m0, first, end,
                           n_full, lrow, lists, it0, tc, Q_LOADS, ROWS, KV_STAGES, BLOCK_N,
                           PERSISTENT, Q_SLOTS, SPARSE, MASK_BLOCK_KV)
            it0 += end - first
    else:
        b, h, kv_h, bh, m0, n_blocks, n_full, lrow = _tile_coords(
            gl.program_id(0), n_q_tiles, head_group, H_Q, GROUP, N_KV, causal_offset, lists,
            BLOCK_M, BLOCK_N, CAUSAL, TILE_ORDER, SPARSE, MASK_BLOCK_Q, MASK_BLOCK_KV, 1)
        _producer_tile(q_desc, k_desc, v_desc, q_bufs, k_bufs, v_bufs, q_ready, q_empty,
                       k_ready, v_ready, k_empty, v_empty, b, h, kv_h, m0, 0, n_blocks, n_full,
                       lrow, lists, 0, 0, Q_LOADS, ROWS, KV_STAGES, BLOCK_N, PERSISTENT,
                       Q_SLOTS, SPARSE, MASK_BLOCK_KV)


# Every partition of a warp-specialized program takes the same arguments (worker partitions
# take scalars, descriptors and constexpr objects, no tensors and no plain Python numbers).
@gluon.jit
def _consumer_default(q_desc, k_desc, v_desc, o_desc, Out, LSE, q_bufs, p_bufs, k_bufs, v_bufs,
                      q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, turns, n_tiles,
                      n_q_tiles, head_group, H_Q, GROUP, N_Q, N_KV, causal_offset, qk_scale, lists,
                      NUM_WARPS: gl.constexpr, ROWS: gl.constexpr, HEAD_DIM: gl.constexpr,
                      BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, KV_STAGES: gl.constexpr,
                      CAUSAL: gl.constexpr, TILE_ORDER: gl.constexpr,
                      PINGPONG: gl.constexpr, P_SMEM: gl.constexpr, PERSISTENT: gl.constexpr,
                      Q_SLOTS: gl.constexpr,
                      SPARSE: gl.constexpr, MASK_BLOCK_Q: gl.constexpr,
                      MASK_BLOCK_KV: gl.constexpr, DIAG: gl.constexpr, TREE_MAX: gl.constexpr):
    """The default partition of a warp-specialized program: consumer 0."""
    _consumer(q_desc, k_desc, v_desc, o_desc, Out, LSE, q_bufs, p_bufs, k_bufs, v_bufs,
              q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, turns, n_tiles, n_q_tiles,
              head_group, H_Q, GROUP, N_Q, N_KV, causal_offset, qk_scale, lists, 0, NUM_WARPS, ROWS,
              HEAD_DIM,
              BLOCK_M, BLOCK_N, KV_STAGES, CAUSAL, TILE_ORDER, True, PINGPONG, P_SMEM,
              PERSISTENT, Q_SLOTS, SPARSE, MASK_BLOCK_Q, MASK_BLOCK_KV, DIAG, TREE_MAX)


@gluon.jit
def _consumer_second(q_desc, k_desc, v_desc, o_desc, Out, LSE, q_bufs, p_bufs, k_bufs, v_bufs,
                     q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, turns, n_tiles,
                     n_q_tiles, head_group, H_Q, GROUP, N_Q, N_KV, causal_offset, qk_scale, lists,
                     NUM_WARPS: gl.constexpr, ROWS: gl.constexpr, HEAD_DIM: gl.constexpr,
                     BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, KV_STAGES: gl.constexpr,
                     CAUSAL: gl.constexpr, TILE_ORDER: gl.constexpr,
                     PINGPONG: gl.constexpr, P_SMEM: gl.constexpr, PERSISTENT: gl.constexpr,
                     Q_SLOTS: gl.constexpr,
                     SPARSE: gl.constexpr, MASK_BLOCK_Q: gl.constexpr,
                     MASK_BLOCK_KV: gl.constexpr, DIAG: gl.constexpr, TREE_MAX: gl.constexpr):
    """Consumer 1 of a ping-pong program (its own 4-warp partition)."""
    _consumer(q_desc, k_desc, v_desc, o_desc, Out, LSE, q_bufs, p_bufs, k_bufs, v_bufs,
              q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, turns, n_tiles, n_q_tiles,
              head_group, H_Q, GROUP, N_Q, N_KV, causal_offset, qk_scale, lists, 1, NUM_WARPS, ROWS,
              HEAD_DIM,
              BLOCK_M, BLOCK_N, KV_STAGES, CAUSAL, TILE_ORDER, True, PINGPONG, P_SMEM,
              PERSISTENT, Q_SLOTS, SPARSE, MASK_BLOCK_Q, MASK_BLOCK_KV, DIAG, TREE_MAX)


@gluon.jit
def _producer_partition(q_desc, k_desc, v_desc, o_desc, Out, LSE, q_bufs, p_bufs, k_bufs,
                        v_bufs, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, turns,
                        n_tiles, n_q_tiles, head_group, H_Q, GROUP, N_Q, N_KV, causal_offset,
                        qk_scale, lists,
                        NUM_WARPS: gl.constexpr, ROWS: gl.constexpr, HEAD_DIM: gl.constexpr,
                        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                        KV_STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                        TILE_ORDER: gl.constexpr, PINGPONG: gl.constexpr,
                        P_SMEM: gl.constexpr, PERSISTENT: gl.constexpr, Q_SLOTS: gl.constexpr,
                        SPARSE: gl.constexpr, MASK_BLOCK_Q: gl.constexpr,
                        MASK_BLOCK_KV: gl.constexpr, DIAG: gl.constexpr, TREE_MAX: gl.constexpr):
    """The producer partition (one warp)."""
    Q_LOADS: gl.constexpr = 2 if PINGPONG else 1
    _producer(q_desc, k_desc, v_desc, q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready,
              v_ready, k_empty, v_empty, n_tiles, n_q_tiles, head_group, H_Q, GROUP, N_KV,
              causal_offset, lists, Q_LOADS, ROWS, BLOCK_M, BLOCK_N, KV_STAGES, CAUSAL,
              TILE_ORDER, PERSISTENT, Q_SLOTS, SPARSE, MASK_BLOCK_Q, MASK_BLOCK_KV)


# ----------------------------------------------------------------------------- kernel
@gluon.jit(do_not_specialize=["N_Q", "N_KV", "causal_offset", "H_Q", "GROUP", "n_q_tiles",
                              "n_tiles", "head_group", "q_per_head", "stride_cb", "stride_ch",
                              "stride_ib", "stride_ih", "stride_iq"])
def _gluon_fwd_kernel(
    q_desc, k_desc, v_desc, o_desc, Out, LSE,
    FullCounts, FullIndices, PartialCounts, PartialIndices, PartialTileIds, PartialTiles,
    Schedule, Partials, Counters, N_Q, N_KV, causal_offset, H_Q, GROUP, n_q_tiles, n_tiles,
    head_group, qk_scale, q_per_head,
    stride_cb, stride_ch, stride_ib, stride_ih, stride_iq,
    HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    KV_STAGES: gl.constexpr, CAUSAL: gl.constexpr, TILE_ORDER: gl.constexpr,
    WARP_SPECIALIZE: gl.constexpr, PINGPONG: gl.constexpr, CONSUMER_REGS: gl.constexpr,
    PRODUCER_REGS: gl.constexpr, P_SMEM: gl.constexpr, PERSISTENT: gl.constexpr,
    Q_SLOTS: gl.constexpr, SPARSE: gl.constexpr, MASK_BLOCK_Q: gl.constexpr,
    MASK_BLOCK_KV: gl.constexpr, DIAG: gl.constexpr, TREE_MAX: gl.constexpr,
    PACK_GQA: gl.constexpr, num_warps: gl.constexpr,
):
    # Program p owns tile p (in _tile_coords' order) or, persistent, one tile per round of
    # ``grid`` tiles or its part of the host's ``Schedule`` (_program_tile). SPARSE: a block
    # mask's lists (``BlockMask.kernel_args`` order; dense launches pass LSE and zeros, compiled
    # out) travel as one tuple, and the schedule with them (TILE_ORDER >= 2; else LSE), and
    # the split workspace and its counters (TILE_ORDER 3 and 4; else LSE), and the query
    # rows per head of a packed GQA group and whether it is packed (a constexpr: unpacked
    # code compiles as without it), see ``_query_rows``.
    lists = (FullCounts, FullIndices, PartialCounts, PartialIndices, PartialTileIds,
             PartialTiles, stride_cb, stride_ch, stride_ib, stride_ih, stride_iq, Schedule,
             Partials, Counters, q_per_head if PACK_GQA else 0, PACK_GQA)
    dtype: gl.constexpr = q_desc.dtype
    q_block: gl.constexpr = q_desc.block_type.shape
    kv_block: gl.constexpr = k_desc.block_type.shape
    Q_LOADS: gl.constexpr = 2 if PINGPONG else 1
    ROWS: gl.constexpr = BLOCK_M // Q_LOADS
    q_bufs = gl.allocate_shared_memory(dtype, [Q_LOADS * Q_SLOTS] + q_block, q_desc.layout)
    if P_SMEM:
        p_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, BLOCK_N], dtype)
        p_bufs = gl.allocate_shared_memory(dtype, [Q_LOADS, ROWS, BLOCK_N], p_layout)
    else:  # unused
        p_bufs = gl.allocate_shared_memory(dtype, [Q_LOADS, 8, 8],
                                           gl.NVMMASharedLayout.get_default_for([8, 8], dtype))
    k_bufs = gl.allocate_shared_memory(dtype, [KV_STAGES] + kv_block, k_desc.layout)
    v_bufs = gl.allocate_shared_memory(dtype, [KV_STAGES] + kv_block, v_desc.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [Q_LOADS * Q_SLOTS, 1],
                                        mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [Q_LOADS * Q_SLOTS, 1],
                                        mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [KV_STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [KV_STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [KV_STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [KV_STAGES, 1], mbarrier.MBarrierLayout())
    turns = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for c in gl.static_range(Q_LOADS * Q_SLOTS):
        mbarrier.init(q_ready.index(c), count=1)
        mbarrier.init(q_empty.index(c), count=1)
    for i in gl.static_range(KV_STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        # One arrival per consumer partition releases a slot.
        mbarrier.init(k_empty.index(i), count=Q_LOADS)
        mbarrier.init(v_empty.index(i), count=Q_LOADS)
    for i in gl.static_range(2):
        mbarrier.init(turns.index(i), count=1)
    fence_async_shared()

    if WARP_SPECIALIZE:
        WG_WARPS: gl.constexpr = 4
        PRODUCER_WARPS: gl.constexpr = 1
        if PINGPONG:
            gl.warp_specialize([
                (_consumer_default, (
                    q_desc, k_desc, v_desc, o_desc, Out, LSE, q_bufs, p_bufs, k_bufs, v_bufs,
                    q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, turns, n_tiles,
                    n_q_tiles, head_group, H_Q, GROUP, N_Q, N_KV, causal_offset, qk_scale, lists,
                    WG_WARPS, ROWS,
                    HEAD_DIM, BLOCK_M, BLOCK_N, KV_STAGES, CAUSAL, TILE_ORDER, PINGPONG,
                    P_SMEM, PERSISTENT, Q_SLOTS, SPARSE, MASK_BLOCK_Q, MASK_BLOCK_KV, DIAG,
                    TREE_MAX)),
                (_consumer_second, (
                    q_desc, k_desc, v_desc, o_desc, Out, LSE, q_bufs, p_bufs, k_bufs, v_bufs,
                    q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, turns, n_tiles,
                    n_q_tiles, head_group, H_Q, GROUP, N_Q, N_KV, causal_offset, qk_scale, lists,
                    WG_WARPS, ROWS,
                    HEAD_DIM, BLOCK_M, BLOCK_N, KV_STAGES, CAUSAL, TILE_ORDER, PINGPONG,
                    P_SMEM, PERSISTENT, Q_SLOTS, SPARSE, MASK_BLOCK_Q, MASK_BLOCK_KV, DIAG,
                    TREE_MAX)),
                (_producer_partition, (
                    q_desc, k_desc, v_desc, o_desc, Out, LSE, q_bufs, p_bufs, k_bufs, v_bufs,
                    q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, turns, n_tiles,
                    n_q_tiles, head_group, H_Q, GROUP, N_Q, N_KV, causal_offset, qk_scale, lists,
                    PRODUCER_WARPS,
                    ROWS, HEAD_DIM, BLOCK_M, BLOCK_N, KV_STAGES, CAUSAL, TILE_ORDER,
                    PINGPONG, P_SMEM, PERSISTENT, Q_SLOTS, SPARSE, MASK_BLOCK_Q, MASK_BLOCK_KV,
                    DIAG, TREE_MAX)),
            ], [WG_WARPS, PRODUCER_WARPS], [CONSUMER_REGS, PRODUCER_REGS])
        else:
            gl.warp_specialize([
                (_consumer_default, (
                    q_desc, k_desc, v_desc, o_desc, Out, LSE, q_bufs, p_bufs, k_bufs, v_bufs,
                    q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, turns, n_tiles,
                    n_q_tiles, head_group, H_Q, GROUP, N_Q, N_KV, causal_offset, qk_scale, lists,
                    num_warps,
                    ROWS, HEAD_DIM, BLOCK_M, BLOCK_N, KV_STAGES, CAUSAL, TILE_ORDER,
                    PINGPONG, P_SMEM, PERSISTENT, Q_SLOTS, SPARSE, MASK_BLOCK_Q, MASK_BLOCK_KV,
                    DIAG, TREE_MAX)),
                (_producer_partition, (
                    q_desc, k_desc, v_desc, o_desc, Out, LSE, q_bufs, p_bufs, k_bufs, v_bufs,
                    q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, turns, n_tiles,
                    n_q_tiles, head_group, H_Q, GROUP, N_Q, N_KV, causal_offset, qk_scale, lists,
                    PRODUCER_WARPS,
                    ROWS, HEAD_DIM, BLOCK_M, BLOCK_N, KV_STAGES, CAUSAL, TILE_ORDER,
                    PINGPONG, P_SMEM, PERSISTENT, Q_SLOTS, SPARSE, MASK_BLOCK_Q, MASK_BLOCK_KV,
                    DIAG, TREE_MAX)),
            ], [PRODUCER_WARPS], [PRODUCER_REGS])
    else:
        _consumer(q_desc, k_desc, v_desc, o_desc, Out, LSE, q_bufs, p_bufs, k_bufs, v_bufs,
                  q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, turns, n_tiles,
                  n_q_tiles, head_group, H_Q, GROUP, N_Q, N_KV, causal_offset, qk_scale, lists,
                  0, num_warps, ROWS, HEAD_DIM, BLOCK_M, BLOCK_N, KV_STAGES, CAUSAL,
                  TILE_ORDER, False, False, P_SMEM, False, 1, SPARSE, MASK_BLOCK_Q,
                  MASK_BLOCK_KV, DIAG, TREE_MAX)


# ----------------------------------------------------------------------------- host side
def consumer_warps(config: Mapping[str, Any]) -> int:
    """Warps of the kernel's own (default) partition: one warpgroup per consumer, or one
    warpgroup when the consumers ping-pong in separate partitions."""
    return 4 if config["pingpong"] else 4 * int(config["consumers"])


def register_budget(config: Mapping[str, Any]) -> tuple[int, int]:
    """(maxnreg, consumer registers per thread): the register file split over
    ``ctas_per_sm`` programs; warp-specialized programs give the producer warp's
    warpgroup PRODUCER_REGS and the rest to the consumers (setmaxnreg, multiples of 8)."""
    ws = bool(config["warp_specialize"])
    warpgroups = int(config["consumers"]) + (1 if ws else 0)
    per_thread = REGISTER_FILE // (int(config["ctas_per_sm"]) * warpgroups * 128)
    maxnreg = min(255, per_thread - per_thread % 8)
    if not ws:
        return maxnreg, maxnreg
    consumer = min(256, (maxnreg * warpgroups - PRODUCER_REGS) // (warpgroups - 1))
    return maxnreg, consumer - consumer % 8


def launch_options(head_dim: int, causal: bool, config: Mapping[str, Any],
                   diag: int = 0, mask_block: tuple[int, int] | None = None,
                   host_schedule: bool = True, split: bool = False, pack_gqa: bool = False
                   ) -> dict[str, Any]:
    """The kernel's constexprs and launch options for a config (``diag``: timing
    experiments only, see ``_softmax_block``; ``mask_block``: the block size of the block
    mask the kernel walks, None without one; ``host_schedule``: a persistent longest-first
    grid walks the host's ``lpt_schedule``, else the kernel's own order in two rounds per
    head group; ``split``: a persistent grid walks the host's schedule of cut tiles,
    ``split_schedule`` or, causal, ``cut_lpt_schedule``; ``pack_gqa``: the launch packs
    GQA, ``LaunchPlan.pack``)."""
    ws = bool(config["warp_specialize"])
    maxnreg, consumer_regs = register_budget(config)
    block_m, block_n = int(config["BLOCK_M"]), int(config["BLOCK_N"])
    mask_block_q, mask_block_kv = mask_block or (block_m, block_n)
    options: dict[str, Any] = dict(
        HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n,
        KV_STAGES=int(config["kv_stages"]), CAUSAL=causal,
        # A block mask's tiles come in its lists' order (their lengths are the mask's).
        TILE_ORDER=tile_order(config, causal, mask_block is not None, host_schedule, split),
        WARP_SPECIALIZE=ws, PINGPONG=bool(config["pingpong"]), CONSUMER_REGS=consumer_regs,
        PRODUCER_REGS=PRODUCER_REGS, P_SMEM=bool(config["p_from_smem"]),
        PERSISTENT=bool(config["persistent"]), Q_SLOTS=q_slots(head_dim, config),
        # SPARSE: 0 dense, 1 a block mask's uint8 tiles, 2 its rows' first keys instead
        # (``doc_offsets``: causal documents or a causal window; every ``if SPARSE`` holds).
        SPARSE=(2 if config.get("doc_offsets") else True) if mask_block is not None else False,
        MASK_BLOCK_Q=mask_block_q, MASK_BLOCK_KV=mask_block_kv,
        DIAG=diag, TREE_MAX=bool(config["tree_max"]), PACK_GQA=pack_gqa,
        num_warps=consumer_warps(config),
    )
    if ws or int(config["ctas_per_sm"]) > 1:
        options["maxnreg"] = maxnreg
    return options


def tile_order(config: Mapping[str, Any], causal: bool, sparse: bool,
               host_schedule: bool = True, split: bool = False) -> int:
    """The kernel's TILE_ORDER: 0 tiles in order, 1 longest first in the kernel's own
    order (``_tile_coords``), 2 a persistent grid's host-made schedule (``lpt_schedule``),
    3 a dense persistent grid's host-made schedule with its last round's tiles cut into
    pieces (``split_schedule``), 4 a causal one's with its longest tiles cut
    (``cut_lpt_schedule``)."""
    if split:
        return 4 if causal else 3
    if not (config["longest_first"] and causal and not sparse):
        return 0
    return 2 if config["persistent"] and host_schedule else 1


def shared_memory_bytes(head_dim: int, config: Mapping[str, Any], q_slots: int) -> int:
    """Bytes of the tiles in shared memory: Q (and O) buffers, the K and V rings, P when it
    goes through shared memory."""
    q_tile = int(config["BLOCK_M"]) * head_dim * 2
    kv = 2 * int(config["kv_stages"]) * int(config["BLOCK_N"]) * head_dim * 2
    p_tile = int(config["BLOCK_M"]) * int(config["BLOCK_N"]) * 2 if config["p_from_smem"] else 0
    return q_slots * q_tile + kv + p_tile


def q_slots(head_dim: int, config: Mapping[str, Any]) -> int:
    """Q buffers per consumer: two in a persistent program where they fit in shared memory
    (the next tile's Q loads during this one, and O leaves through this tile's buffer by
    TMA), else one (a persistent program then stores O from registers)."""
    if config["persistent"] and shared_memory_bytes(head_dim, config, 2) <= SMEM_PER_PROGRAM:
        return 2
    return 1


def q_rows_per_load(config: Mapping[str, Any]) -> int:
    """Rows of one Q (and O) TMA block: half the tile when two consumers ping-pong."""
    return int(config["BLOCK_M"]) // (2 if config["pingpong"] else 1)


# The launch options that are not also the kernel's constexprs (num_warps is both).
LAUNCH_ONLY_OPTIONS = ("maxnreg",)


class LaunchPlan:
    """One launch of ``_gluon_fwd_kernel`` less its tensors: grid, constexprs and scalars,
    worked out once from the inputs' shapes, dtype, causal mode, scale and config. Calling it
    launches on tensors laid out like the ones it was made from.

    Launches go through a ``DirectLaunch`` once the first has compiled: every integer argument
    is fixed by the plan and descriptors are typed by dtype and block shape, so what Triton
    specializes on beyond the plan is the 16-byte alignment of ``Out`` and ``LSE`` (q, k, v
    must be aligned for TMA anyway); calls whose five tensors are all aligned (always so for
    the outputs) take the direct launch, others the JIT's."""

    # Set by the entry point: these inputs' layout needs a contiguous copy before TMA.
    copy_inputs = False
    # (doc_offsets) rows of first keys a call's mask is handed with (``gluon_fwd``); 0: none.
    first_key_rows = 0

    def __init__(self, q: Any, k: Any, *, causal_mode: str, scale: float,
                 config: Mapping[str, Any], diag: int = 0, sm_count: int | None = None,
                 block_mask: Any = None, host_schedule: bool = True,
                 tile_overhead: int = TILE_OVERHEAD_BLOCKS,
                 combine: float | None = None) -> None:
        """``sm_count`` sizes a persistent grid: q's GPU's multiprocessor count by default
        (132, an H100's, for stand-in tensors). ``block_mask``: a ``BlockMask`` (or anything
        with its ``block_size`` and ``kernel_args``) the kernel walks; calls then pass one of
        the same geometry (``mask_key``). ``host_schedule`` False: a persistent causal grid
        keeps the kernel's own order; ``tile_overhead``: the schedule's per-tile cost beyond
        its KV blocks; ``combine``: the split schedules' cost of a piece per piece of its
        tile (``COMBINE_BLOCKS_PER_PIECE`` by default) (all three for A/B timings only)."""
        batch, heads_q, seqlen_q, head_dim = q.shape
        heads_kv, seqlen_kv = k.shape[1], k.shape[2]
        block_m = int(config["BLOCK_M"])
        causal = causal_mode != "none"
        offset = seqlen_kv - seqlen_q if causal_mode == "bottom_right" else 0
        self.sparse = block_mask is not None
        # Packed GQA (``pack_gqa``): the H_q / H_kv query heads of each KV head stacked into
        # one head of that many times N_q rows (a view of a contiguous q), so that tiles of a
        # few queries per head fill their rows and each K/V block serves the whole group.
        # The kernel then sees H_kv heads of rows; the causal mask maps each row back to its
        # query (``_query_rows``, ``q_per_head``).
        self.q_shape = (batch, heads_q, seqlen_q, head_dim)
        gqa_group = heads_q // heads_kv
        # (``pack_gqa`` is absent from configs made before the knob.)
        self.pack = bool(config.get("pack_gqa")) and gqa_group > 1
        q_per_head = 0
        if self.pack:
            if self.sparse:
                raise ValueError("pack_gqa does not walk a block mask (its rows are one "
                                 "head's queries): use pack_gqa=False")
            q_per_head = seqlen_q
            heads_q, seqlen_q = heads_kv, seqlen_q * gqa_group
        self.packed_q_shape = (batch, heads_q, seqlen_q, head_dim)
        n_q_tiles = -(-seqlen_q // block_m)
        n_tiles = n_q_tiles * batch * heads_q
        group = 1
        persistent = bool(config["persistent"])
        if persistent and sm_count is None:
            sm_count = (torch.cuda.get_device_properties(q.device).multi_processor_count
                        if isinstance(q, torch.Tensor) and q.is_cuda else 132)
        # Tiles cut into pieces where whole ones leave SMs idle and the cost model says the
        # grid ends sooner: a dense grid's partial last round (``split_schedule``), a causal
        # grid of few tiles (``cut_lpt_schedule``).
        self.split: SplitSchedule | None = None
        split_args: tuple[Any, ...] = ()
        split_table: Any = None
        if (persistent and config.get("split_tail") and not self.sparse and host_schedule
                and n_tiles <= MAX_SCHEDULED_TILES):
            assert sm_count is not None
            block_n = int(config["BLOCK_N"])
            if causal:
                # (A causal grid of few tiles: its longest ones cut, ``cut_lpt_schedule``.)
                blocks = tuple(causal_tile_costs(n_q_tiles, block_m, block_n, seqlen_kv,
                                                 offset, 0, q_per_head))
                split_args = (n_q_tiles, batch * heads_q, blocks, sm_count, head_dim,
                              combine)
                self.split, split_table = _cut_lpt_schedule(*split_args), _cut_lpt_table
            else:
                split_args = (n_tiles, -(-seqlen_kv // block_n), sm_count, head_dim, combine)
                self.split, split_table = _split_schedule(*split_args), _split_table
        self.options = launch_options(head_dim, causal, config, diag,
                                      tuple(block_mask.block_size) if self.sparse else None,
                                      host_schedule and n_tiles <= MAX_SCHEDULED_TILES,
                                      self.split is not None, self.pack)
        # The host's tile schedule (TILE_ORDER 2-4): what makes it (``table(*args)``), and
        # the int32 tensor on q's device that eager launches read (None until the first one
        # where the plan was made inside a CUDA graph's capture: ``launch_tensors``).
        self.schedule_source: tuple[Any, tuple[Any, ...]] | None = None
        self.schedule: Any = None
        if persistent:
            assert sm_count is not None
            self.grid = (min(n_tiles, sm_count),)
            if self.options["TILE_ORDER"] in (1, 2):
                group = head_group(batch * heads_q, n_q_tiles,
                                   2 * seqlen_kv * head_dim * 2, sm_count)
            if self.split is not None:
                self.grid = (sm_count,)
                self.schedule_source = (split_table, split_args)
            elif self.options["TILE_ORDER"] == 2:
                costs = causal_tile_costs(n_q_tiles, block_m, int(config["BLOCK_N"]),
                                          seqlen_kv, offset, tile_overhead, q_per_head)
                self.schedule_source = (_causal_table, (n_q_tiles, batch * heads_q, group,
                                                        tuple(costs), self.grid[0]))
            elif self.options["TILE_ORDER"] == 1:
                self.grid = (causal_grid(group * n_q_tiles, sm_count),)
        else:
            self.grid = (n_tiles,)
        if self.schedule_source is not None and not _capturing(q):
            self.schedule = _schedule(q, *self.schedule_source)
        # The split workspace per (device, stream): see ``workspace``.
        self._workspaces: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.out_shape = (batch, heads_q, seqlen_q, head_dim)
        # The lists' strides (counts per batch and head, lists per batch, head and row).
        self.mask_strides = list(block_mask.kernel_args()[6:]) if self.sparse else [0] * 5
        # A persistent grid with one Q buffer per consumer stores O from registers as a
        # contiguous tensor; a TMA store takes any layout. Packed, o is contiguous (its view
        # as (B, H_q, N_q, D) is the caller's).
        self.out_strides = ((heads_q * seqlen_q * head_dim, seqlen_q * head_dim, head_dim, 1)
                            if self.pack or (self.options["PERSISTENT"]
                                             and self.options["Q_SLOTS"] == 1)
                            else output_strides(self.out_shape, tuple(q.stride())))
        self.lse_shape = (batch, heads_q, seqlen_q)
        self.scalars = [seqlen_q, seqlen_kv, offset, heads_q, heads_q // heads_kv, n_q_tiles,
                        n_tiles, group, scale * LOG2_E, q_per_head]
        bits = 16
        q_block = [1, 1, q_rows_per_load(config), head_dim]
        kv_block = [1, 1, int(config["BLOCK_N"]), head_dim]
        self.q_block, self.kv_block = q_block, kv_block
        self.kv_layout = host_smem_layout(kv_block, bits)
        self.q_layout = host_smem_layout(q_block, bits)
        self._descriptors = [
            PlannedDescriptor(functools.partial(tma_descriptor, block=block, layout=layout))
            for block, layout in ((q_block, self.q_layout), (kv_block, self.kv_layout),
                                  (kv_block, self.kv_layout), (q_block, self.q_layout))]
        self._launch = DirectLaunch(
            _gluon_fwd_kernel, self.grid,
            {k: v for k, v in self.options.items() if k not in LAUNCH_ONLY_OPTIONS},
            {k: v for k, v in self.options.items() if k in (*LAUNCH_ONLY_OPTIONS, "num_warps")},
            dict(enumerate(self._descriptors)))
        self._device_guard: bool | None = None

    def descriptors(self, q: Any, k: Any, v: Any, o: Any) -> list[Any]:
        return [make(t) for make, t in zip(self._descriptors, (q, k, v, o), strict=True)]

    def packed(self, q: Any) -> Any:
        """q as the kernel reads it: itself, or packed (``pack_gqa``) as (B, H_kv,
        H_q / H_kv x N_q, D), a view where q's layout allows one, else a copy (a stand-in
        of that shape for a stand-in q)."""
        if not self.pack:
            return q
        if isinstance(q, torch.Tensor):
            return q.reshape(self.packed_q_shape)
        return type(q)(q.dtype, list(self.packed_q_shape))

    def args(self, q: Any, k: Any, v: Any, o: Any, lse: Any, block_mask: Any = None
             ) -> list[Any]:
        """The kernel's arguments (q as the kernel reads it, ``packed``; ``o`` and ``lse`` as
        the plan allocates them: ``out_shape`` laid out as ``out_strides``, ``lse_shape``;
        without a block mask its six tensors are ``lse``, never read, and so is the schedule
        without one)."""
        lists = block_mask.kernel_args()[:6] if self.sparse else [lse] * 6
        return [*self.descriptors(q, k, v, o), o, lse, *lists, *self.launch_tensors(lse),
                *self.scalars, *self.mask_strides]

    def launch_tensors(self, lse: Any, stream: int | None = None) -> tuple[Any, Any, Any]:
        """(schedule, partials, counters) for a launch that writes ``lse`` on its current
        stream (``stream``: already looked up); ``lse`` for each one the kernel never reads.

        A launch captured into a CUDA graph (checked only for plans with a schedule) reads
        nothing an eager launch or another graph writes, nor anything a cache of ours may
        free while the graph lives: the schedule through ``_graph_schedule``, a workspace of
        its own (``workspace``)."""
        if self.schedule_source is None:  # (no schedule: no split either)
            return lse, lse, lse
        if _capturing(lse):
            return (_graph_schedule(lse, self.schedule, *self.schedule_source),
                    *self.workspace(lse, stream, capturing=True))
        if self.schedule is None:  # (the plan was made inside a capture)
            self.schedule = _schedule(lse, *self.schedule_source)
        return (self.schedule, *self.workspace(lse, stream))

    def workspace(self, lse: Any, stream: int | None = None, capturing: bool = False
                  ) -> tuple[Any, Any]:
        """(partials, counters) of a split plan (``split_schedule``, ``cut_lpt_schedule``) on
        ``lse``'s device and its current stream (``stream``: already looked up): fp32 room
        for every piece's partial result (one slot per piece and consumer: its rows' O, m
        and l) and an int32 counter per split tile and consumer, zeroed once. The piece that
        counts in last sets its counter back to 0, so launches on one stream, which run in
        order, share them; another stream gets its own. ``capturing``: a launch captured
        into a CUDA graph gets a set of its own from the graph's pool, zeroed at each replay
        and never shared (two graphs captured on one stream may replay at once on two, and
        memory zeroed only at a replay is no use to an eager launch). Without a split,
        ``lse`` twice (never read)."""
        if self.split is None:
            return lse, lse
        block_m, head_dim = self.options["BLOCK_M"], self.options["HEAD_DIM"]
        consumers = 2 if self.options["PINGPONG"] else 1
        sizes = (self.split.slots * block_m * (head_dim + 2), self.split.slots * consumers)
        if not isinstance(lse, torch.Tensor):  # a stand-in (compile checks)
            return type(lse)(torch.float32, [sizes[0]]), type(lse)(torch.int32, [sizes[1]])
        if not capturing:
            if stream is None:
                stream = current_stream(lse.device.index) if lse.is_cuda else 0
            key = (lse.device.index or 0, stream)
            found = self._workspaces.get(key)
            if found is not None:
                return found
        made = (torch.empty(sizes[0], dtype=torch.float32, device=lse.device),
                torch.zeros(sizes[1], dtype=torch.int32, device=lse.device))
        if not capturing:
            self._workspaces[key] = made
        return made

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 block_mask: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(o, lse) on q, k, v (and, for a plan made with one, a block mask of the same
        geometry)."""
        if self.sparse != (block_mask is not None):
            raise ValueError("this launch plan was made " + (
                "for a block mask: pass one" if self.sparse else "without a block mask"))
        q_rows = self.packed(q)
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
                self._launch_on_current(q_rows, k, v, o, lse, block_mask)
        else:
            self._launch_on_current(q_rows, k, v, o, lse, block_mask)
        if self.pack:
            return o.view(self.q_shape), lse.view(self.q_shape[:3])
        return o, lse

    def _launch_on_current(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           o: torch.Tensor, lse: torch.Tensor, block_mask: Any) -> None:
        o_ptr, lse_ptr = o.data_ptr(), lse.data_ptr()
        if self.sparse or (q.data_ptr() | k.data_ptr() | v.data_ptr() | o_ptr | lse_ptr) % 16:
            # (Block masks: their tensors change with every mask, through the JIT's binder.)
            _gluon_fwd_kernel[self.grid](*self.args(q, k, v, o, lse, block_mask),
                                         **self.options)
            return
        stream = current_stream(q.device.index) if q.is_cuda else 0  # (CPU: stand-in tests)
        # Out and LSE as addresses: the launcher then makes no driver call for them.
        schedule, partials, counters = self.launch_tensors(lse, stream)
        if not self._launch.try_direct(stream, q, k, v, o, o_ptr, lse_ptr, *[lse_ptr] * 6,
                                       schedule.data_ptr(), partials.data_ptr(),
                                       counters.data_ptr(), *self.scalars, *self.mask_strides):
            self._launch.launch_on(stream, q, k, v, o, o, lse, *[lse] * 6, schedule, partials,
                                   counters, *self.scalars, *self.mask_strides)


def _capturing(like: Any) -> bool:
    """Whether a launch on ``like``'s device goes into a CUDA graph being captured now."""
    return (isinstance(like, torch.Tensor) and like.is_cuda
            and torch.cuda.is_current_stream_capturing())


# Schedules made for eager launches, by (device, table, args): a plan is made per call where
# nothing keeps plans (``launch``, the standalone source's entry), and a schedule is a Python
# walk over every tile plus a copy to the GPU. The kernel only reads it, so plans of one
# problem share it. Dropping one here frees nothing a plan still holds.
_SCHEDULES: dict[tuple[Any, ...], torch.Tensor] = {}
MAX_KEPT_SCHEDULES = 64
# What captured graphs read of the schedules, kept for the process's life: a graph replays
# with the addresses it was captured with, long after any plan or cache of ours let go (a
# plan cache evicts plans that only graph replays use). Eager schedules by address, and
# pinned host copies (torch 2.11 refuses a copy from pageable memory inside a capture: seen
# on the H200) by (table, args).
_GRAPH_HELD: dict[int, torch.Tensor] = {}
_GRAPH_HOST_TABLES: dict[tuple[Any, ...], torch.Tensor] = {}


def _schedule(like: Any, table: Any, args: tuple[Any, ...]) -> Any:
    """The schedule ``table(*args)`` as an int32 tensor on ``like``'s device (made once and
    kept in ``_SCHEDULES``), or for a stand-in ``like`` a stand-in of its length."""
    if not isinstance(like, torch.Tensor):
        return type(like)(torch.int32, [len(table(*args))])
    key = (like.device, table, args)
    made = _SCHEDULES.get(key)
    if made is not None:
        return made
    made = torch.tensor(table(*args), dtype=torch.int32, device=like.device)
    if len(_SCHEDULES) >= MAX_KEPT_SCHEDULES:
        # (Another thread may have been there first.)
        with contextlib.suppress(KeyError, RuntimeError, StopIteration):
            del _SCHEDULES[next(iter(_SCHEDULES))]
    _SCHEDULES[key] = made
    return made


def _graph_schedule(like: torch.Tensor, eager: torch.Tensor | None, table: Any,
                    args: tuple[Any, ...]) -> torch.Tensor:
    """The schedule ``table(*args)`` for a launch being captured into a CUDA graph, where no
    copy from the host may wait: ``eager`` (the plan's) or another made before the capture,
    held from now on for the process's life; else a copy from pinned host memory (held too)
    that the graph repeats at each replay, into the graph's own pool."""
    made = eager if eager is not None else _SCHEDULES.get((like.device, table, args))
    if made is not None:
        _GRAPH_HELD.setdefault(made.data_ptr(), made)
        return made
    host = _GRAPH_HOST_TABLES.get((table, args))
    if host is None:
        host = _GRAPH_HOST_TABLES.setdefault(
            (table, args), torch.tensor(table(*args), dtype=torch.int32).pin_memory())
    return host.to(like.device, non_blocking=True)


@functools.lru_cache(maxsize=64)
def _causal_table(n_q_tiles: int, batch_heads: int, group: int, costs: tuple[int, ...],
                  programs: int) -> tuple[int, ...]:
    owned = lpt_schedule(n_q_tiles, batch_heads, group, costs, programs)
    return tuple(schedule_table([[whole_tile(t) for t in mine] for mine in owned]))


@functools.lru_cache(maxsize=64)
def _split_schedule(n_tiles: int, blocks: int, programs: int, head_dim: int,
                    combine: float | None = None) -> SplitSchedule | None:
    return split_schedule(n_tiles, blocks, programs, head_dim, combine=combine)


@functools.lru_cache(maxsize=64)
def _cut_lpt_schedule(n_q_tiles: int, batch_heads: int, blocks: tuple[int, ...], programs: int,
                      head_dim: int, combine: float | None = None) -> SplitSchedule | None:
    return cut_lpt_schedule(n_q_tiles, batch_heads, blocks, programs, head_dim,
                            combine=combine)


@functools.lru_cache(maxsize=64)
def _cut_lpt_table(n_q_tiles: int, batch_heads: int, blocks: tuple[int, ...], programs: int,
                   head_dim: int, combine: float | None = None) -> tuple[int, ...]:
    split = _cut_lpt_schedule(n_q_tiles, batch_heads, blocks, programs, head_dim, combine)
    assert split is not None
    return tuple(schedule_table(split.entries))


@functools.lru_cache(maxsize=64)
def _split_table(n_tiles: int, blocks: int, programs: int, head_dim: int,
                 combine: float | None = None) -> tuple[int, ...]:
    # The kernel walks the whole rounds by grid stride (``_program_tile``): only the last
    # round's entries are listed.
    split = _split_schedule(n_tiles, blocks, programs, head_dim, combine)
    assert split is not None
    rounds = n_tiles // programs
    return tuple(schedule_table([mine[rounds:] for mine in split.entries]))


def validate_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    causal: bool | str, scale: float | None) -> tuple[str, float]:
    """Check shapes, dtypes and devices; return (causal mode, softmax scale)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, but got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D (batch, heads, seqlen, head_dim), "
                             f"but got shape {tuple(t.shape)}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name} must be float16 or bfloat16, but got {t.dtype}")
        if t.numel() == 0:
            raise ValueError(f"{name} must not be empty, but got shape {tuple(t.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must share one dtype, but got {q.dtype}, {k.dtype}, "
                        f"{v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must be on one device, but got {q.device}, {k.device}, "
                         f"{v.device}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, but got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q and k must share batch and head_dim, but got {tuple(q.shape)} "
                         f"and {tuple(k.shape)}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"heads of q ({q.shape[1]}) must be a multiple of heads of k/v "
                         f"({k.shape[1]})")
    if q.shape[3] not in HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {list(HEAD_DIMS)}, but got {q.shape[3]}")
    mode = normalize_causal(causal)
    if scale is None:
        return mode, 1.0 / math.sqrt(q.shape[3])
    if isinstance(scale, bool) or not isinstance(scale, int | float) or not math.isfinite(scale):
        raise ValueError(f"scale must be a finite number or None, but got {scale!r}")
    return mode, float(scale)


def mask_key(block_mask: Any) -> tuple[object, ...] | None:
    """What a launch plan reads from a block mask (its geometry, the lists' strides and
    the 16-byte alignment of its tensors: Triton specializes on it), None for none."""
    if block_mask is None:
        return None
    args = block_mask.kernel_args()
    return (tuple(block_mask.shape), tuple(block_mask.block_size), tuple(args[6:]),
            tuple(t.data_ptr() % 16 == 0 for t in args[:6]), block_mask.device)


def launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal_mode: str,
           scale: float, config: Mapping[str, Any], block_mask: Any = None
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the kernel on validated CUDA inputs with a config given as a plain mapping (and a
    block mask already checked against q and k, or None)."""
    q, k, v = tma_ready(q), tma_ready(k), tma_ready(v)
    plan = LaunchPlan(q, k, causal_mode=causal_mode, scale=scale, config=config,
                      block_mask=block_mask)
    return plan(q, k, v, block_mask)

