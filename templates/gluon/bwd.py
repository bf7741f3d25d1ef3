"""The Gluon backward template (Hopper only): its search space, constraints, defaults and entry.

The kernels and their launcher live in ``templates.gluon.bwd_kernel`` (torch + triton only, so
they can be emitted as standalone source). Like ``flash_bwd`` it takes the forward's ``o`` and
``lse`` and the incoming gradient ``do`` and returns ``(dq, dk, dv)``: the tuner measures it on
the same backward problems (inputs from ``FlashBwdTemplate.make_inputs``), so the two
backwards compete by measurement. Written for triton 3.6's Gluon; on a triton without Gluon
the template imports but rejects every problem.

Status (notes/gluon_notes.md, "The backward's dQ path", "The warp-specialized backward"):
right on the H100 and the H200 with 64 x 128 tiles, two warpgroups and a ring of three (the
only tiles offered). The ``warp_specialize`` knob selects the warp-specialized kernel
(``templates.gluon.bwd_ws_kernel``: load warp, dQ warp, two MMA warpgroups): right on the
H200 on every odd case of the GPU tests (2026-11-29), and at d128 1.22-1.29x the speed of the
kernel without it (0.78-0.92x cuDNN's backward, forward + backward 0.86-0.97x) and at d64
1.16-1.20x (0.70-0.76x cuDNN), so it is the default at both. Still slower than cuDNN's
backward: training runs it only where a sweep measures ``gluon_train`` faster than
``gluon_cudnn_train`` and SDPA. With a block mask (named patterns, blocks of 128 x 128, causal
"none": the mask's own causality) the warp-specialized kernel walks the mask's KV-major lists
(``block_mask_reason``): right on the H200, and forward + backward with the Gluon forward
1.02-1.19x compiled Flex's speed at d128 16k (notes/gluon_notes.md, "Block masks in the
warp-specialized backward"; docs/PERFORMANCE.md). Head dim 256 has a kernel of its own
(``templates.gluon.bwd_d256_kernel``, dense and causal): right on the H200 on every odd case
of its GPU tests and 1.05-1.10x cuDNN's backward there (2026-12-01, notes/gluon_notes.md,
"The d256 backward").
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from templates.base import KernelConfig, KernelLaunch, Problem, knob
from templates.compile.plan_cache import PlanCache
from templates.compile.plan_keys import NO_PLAN, config_key, layout_key
from templates.compile.standin_tensor import StandinTensor
from templates.device import DeviceInfo
from templates.flash.bwd import TEMPLATE as FLASH_BWD
from templates.flash.bwd_plan import block_mask_key
from templates.flash.fwd import check_block_mask
from templates.gluon.bwd_plan import GluonBackwardPlan
from templates.gluon.fwd import StandinBlockMask
from templates.gluon.template import (  # noqa: F401  DTYPE_NAMES, problem_of: re-exported
    DTYPE_NAMES,
    TORCH_DTYPES,
    GluonTemplate,
    load_kernel_module,
    problem_of,
)
from templates.masks import row_ranges
from templates.masks.block_mask import DEFAULT_BLOCK_SIZE, BlockMask
from templates.masks.patterns import parse_pattern
from templates.masks.row_ranges import causal_window, takes_offsets
from templates.registry import register

kernel, GLUON_MISSING = load_kernel_module("templates.gluon.bwd_kernel")
# The warp-specialized kernel (``warp_specialize``): its own module, which reuses the
# first's preprocess, step maths and launch plan.
ws_kernel, _ = load_kernel_module("templates.gluon.bwd_ws_kernel")
# Its two MMA warpgroups as two partitions (``split_warpgroups``).
split_kernel, _ = load_kernel_module("templates.gluon.bwd_split_kernel")
# Head dim 256: its own kernel (templates/gluon/bwd_d256_kernel.py: 64 x 64 tiles, the MMA
# warpgroups splitting dK/dV/dQ by columns); dense and causal only.
d256_kernel, _ = load_kernel_module("templates.gluon.bwd_d256_kernel")
HEAD_DIMS = (64, 128, 256)
D256 = 256
DTYPE_BYTES = 2
# Shared memory Triton adds to the tiles (the mbarriers and the tiles' alignment: 428 bytes
# for the warp-specialized kernel at d128, 560 for the split kernel, in the offline build),
# rounded up so that the estimate is an upper bound.
BARRIER_BYTES = 1024
# fp32 registers per thread the step's big tiles may hold: the dK and dV accumulators plus
# the S^T and dP^T tiles, (2 BLOCK_N D + 2 BLOCK_N BLOCK_M) / threads. Calibrated by the
# offline sm_90 build (triton 3.9, notes/gluon_notes.md): 128 compiled in 186 registers
# without spills; 192 in 250-255 registers, without spills (d128, 64x64 tiles, 4 warps) or
# with 8-24 bytes of stack (d128 64x128 and d64 128x128 tiles, 8 warps); above 192 was not
# compiled.
MAX_TILE_REGISTERS = 192
# The same bound for the warp-specialized kernel's MMA warpgroups, which run at 240
# registers (setmaxnreg, the load/dQ warps' warpgroup at 24), not 255. Calibrated by the
# offline sm_90 build (notes/gluon_notes.md, "The warp-specialized backward").
MAX_WS_TILE_REGISTERS = 192
# The mask patterns doc_offsets serves (templates/masks/patterns.py: causal packed documents).
DOCUMENTS_CAUSAL = "documents_causal"


@dataclass(frozen=True)
class GluonBwdConfig(KernelConfig):
    """One point of the Gluon backward kernel's search space."""

    BLOCK_M: int = knob(
        64, (64, 128),
        "Query rows per step (one TMA load of Q and dO, the N of the S^T and dP^T GEMMs). "
        "Larger steps halve the steps, barriers and atomics per key but double the S^T/dP^T "
        "registers: 128 fits d64 only, warp-specialized, dense without a block mask (1.12x "
        "the speed there on the H200; causal and masked walks spill).")
    BLOCK_N: int = knob(
        128, (64, 128),
        "Keys per program: its dK and dV accumulators (BLOCK_N x D fp32 each) stay in "
        "registers for the whole walk; more keys reread Q and dO fewer times.")
    stages: int = knob(
        3, (1, 2, 3, 4),
        "Q/dO steps the shared-memory ring holds: loads run this many steps ahead of the "
        "GEMMs, at 2 x BLOCK_M x D x 2 bytes per stage. Not 1 (spilled at d128 offline); 2 "
        "nowhere: the compute warps' own ring of two gave wrong dK/dV on the H100, the "
        "warp-specialized one an illegal memory access on the H200 (causes not found: "
        "notes/gluon_notes.md). 1 only at head_dim 256 (the d256 kernel: two stages do not "
        "fit its shared memory).")
    consumers: int = knob(
        2, (1, 2),
        "Warpgroups per program (4 warps each), each owning BLOCK_N / consumers keys of the "
        "dK/dV accumulators and S^T rows.")
    defer_dq: bool = knob(
        True, (False, True),
        "Add a step's dQ tile into the fp32 accumulator during the next step's S^T/dP^T "
        "GEMMs (chunks of one row per warp, atomics from shared memory) instead of after its "
        "own GEMMs with the tensor cores idle. Measured on the H200: 1.00-1.05x the speed.")
    warp_specialize: bool = knob(
        False, (False, True),
        "FlashAttention-3's structure (templates/gluon/bwd_ws_kernel.py): the two warpgroups "
        "only compute (setmaxnreg 240); one warp loads Q, dO, lse2 and delta by TMA into the "
        "ring (full/empty mbarriers), another adds each step's dQ tile, handed over in "
        "shared memory, into the fp32 accumulator by one TMA bulk reduce. Measured on the "
        "H200 at d128: 1.22-1.29x the speed without it.")
    dq_buffers: int = knob(
        1, (0, 1, 2),
        "dQ staging tiles (BLOCK_M x D fp32) of the warp-specialized kernel: with two the "
        "compute warps fill one while the dQ warp's reduce reads the other. Without "
        "warp_specialize only 1. 0 only at head_dim 256 (the d256 kernel): no staging tile "
        "and no dQ warp, the MMA warps add dQ by fp32 atomics from registers (FA3's d256 "
        "path), which leaves room for a ring of two.")
    deterministic: bool = knob(
        False, (False, True),
        "With warp_specialize, the dQ warp adds each query tile's dQ in increasing KV-tile "
        "order (an int32 counter per query tile in global memory, FA3's semaphore), so dq is "
        "bitwise repeatable between runs, at the price of the waits (H200: dense as fast as "
        "without it, causal at about half the speed; notes/gluon_notes.md, \"Deterministic "
        "dQ\").")
    doc_offsets: bool = knob(
        False, (False, True),
        "With a mask of causal packed documents (the documents_causal patterns, "
        "tuner.varlen_attention), each partial block's visibility is computed from its "
        "query rows' document starts (one int32 per row) instead of read from its uint8 "
        "tile (a byte per key and query, every step); other masks keep their tiles. "
        "Measured on the H200 (16k packed rows of mixed documents, d128): 1.03-1.04x the "
        "backward's speed, so the default for such masks.")
    dq_early: bool = knob(
        False, (False, True),
        "With warp_specialize, each step issues its dQ GEMM before dK's and stores the dQ "
        "tile for the dQ warp while dK's GEMM runs, instead of after every GEMM of the step "
        "(the tensor cores idle during that store). Measured on the H200: d64 1.03-1.05x "
        "the speed without it (d64's default), d128 0.95-1.01x (its accumulator beside dK's "
        "spills there).")
    split_warpgroups: bool = knob(
        False, (False, True),
        "With warp_specialize, the two MMA warpgroups run as two partitions "
        "(templates/gluon/bwd_split_kernel.py, FlashAttention-3's consumers), each with half "
        "the keys and half of each dQ tile, meeting on mbarriers only where the maths needs "
        "both (dS^T complete before the dQ GEMMs) instead of at two barriers of all 8 warps "
        "a step; a second dS^T tile in shared memory. Not with deterministic or dq_early. "
        "Measured on the H200 at d128 (with dq_transposed): 1.04-1.06x the speed at 4k "
        "causal, 0.98-1.03x at 4k dense and 16k; d128's default without a block mask.")
    dq_transposed: bool = knob(
        False, (False, True),
        "With warp_specialize, the fp32 dQ staging tile D-major (the accumulator laid out "
        "(B H_q, D, N_q), cast back to dq's layout after the kernel): in the 128-byte "
        "swizzle the row-major tile's 64-bit stores take twice the shared-memory wavefronts "
        "they need (Nsight Compute, notes/gluon_notes.md), the D-major tile's 32-bit stores "
        "one each. Measured on the H200: 0.99-1.07x the speed at d128 16k, 1.04-1.05x d64 dense, "
        "within noise at d128 4k and under block masks; the default without a block mask.")
    persistent: bool = knob(
        False, (False, True),
        "With split_warpgroups, a grid of one program per SM, each walking its KV tiles one "
        "after another (without a block mask the host's schedule, longest first to the least "
        "loaded program; with one, rounds of the grid in a snake order): the next tile's "
        "first Q/dO loads and its K and V run under the end of the one before, whose dK and "
        "dV leave by TMA through the dS^T and dQ staging tiles. Measured on the H200 at d128: "
        "causal 1.01-1.11x at 4k, 0.99-1.01x at 16k; dense 1.02-1.03x on walks of 256 steps, "
        "0.94-0.97x on 64-128; under block masks 0.90-1.00x. d128's default on causal walks "
        "and dense ones of 256 steps or more, without a block mask, and with longest_first "
        "on causal sliding windows (forward + backward 1.005-1.015x; documents and random "
        "blocks 0.89-0.92x).")
    window_offsets: bool = knob(
        False, (False, True),
        "With a causal sliding-window mask over as many queries as keys (the named pattern "
        "sliding_causal:<w>, as tuner.hf builds for sliding-window layers), each partial "
        "block's visibility is computed from its query rows' first visible keys (max(0, i - "
        "w + 1), one int32 per row) instead of read from its uint8 tile: doc_offsets' path. "
        "Other masks keep their tiles. Not yet measured on a GPU: off by default, and the "
        "first alternative a sweep of a sliding_causal problem measures.")
    longest_first: bool = knob(
        False, (False, True),
        "With warp_specialize and a block mask, the KV tiles run in order of decreasing "
        "walk (the query blocks the mask lists for each, worked out on the GPU once per "
        "mask): the grid's launch order, within head groups whose Q and dO fit in L2, or "
        "with persistent the one order its rounds snake through. In tile order a document's "
        "first tiles, which walk all of it, start wherever they fall, and the last long "
        "walks run alone at the end. "
        "Measured on the H200 with split_warpgroups at d128 (forward + backward, five runs, "
        "the forward unchanged): packed documents 1.024-1.043x the speed in tile "
        "order, random blocks 1.005-1.030x at 16k, sliding windows (equal walks) "
        "0.984-1.008x; d128's default under block masks. With persistent 0.78-0.95x at d128 "
        "and 1.01-1.03x at d64 when the rounds walked the order in head groups (a static "
        "snake through a saw-tooth: a model of the runs' masks puts the busiest program at "
        "1.65x the mean on documents); ordering all rows as one group (the model: 1.03x) "
        "measured 0.89-0.92x on documents and random blocks, 1.005-1.015x on sliding windows "
        "(persistent + longest_first: their default). The one-partition kernel (d64's default "
        "under masks): 0.99-1.01x.")
    dk_after_dq: bool = knob(
        False, (False, True),
        "With split_warpgroups, each step issues dK's GEMM after dQ's (FlashAttention-3's "
        "order at d128) instead of before the dS^T exchange, so that dK runs while the "
        "warpgroup writes its dQ columns into the staging tile and hands them over, where the "
        "tensor cores otherwise idle; the ring slot goes back once dK (which reads Q) is "
        "done. Built and compiled offline (no spills added, no serialized wgmma), not yet "
        "measured on a GPU: off by default.")


def shared_memory_estimate(problem: Problem, config: GluonBwdConfig) -> int:
    """Bytes of shared memory: K and V, the Q/dO ring with its lse2/delta rows, dS^T (and at
    D 256 P^T beside it), the fp32 dQ staging tile(s), the barriers."""
    d = problem.head_dim
    kv = 2 * config.BLOCK_N * d * DTYPE_BYTES
    ring = config.stages * (2 * config.BLOCK_M * d * DTYPE_BYTES + 2 * config.BLOCK_M * 4)
    # (the d256 kernel's dV GEMM reads P^T from shared memory too: a P^T tile per dS^T tile)
    tiles = (2 if config.split_warpgroups else 1) * (2 if d == D256 else 1)
    ds = tiles * config.BLOCK_N * config.BLOCK_M * DTYPE_BYTES
    dq = config.dq_buffers * config.BLOCK_M * d * 4
    return kv + ring + ds + dq + BARRIER_BYTES


def tile_registers(problem: Problem, config: GluonBwdConfig) -> int:
    """fp32 registers per thread of dK, dV, S^T and dP^T (see MAX_TILE_REGISTERS)."""
    threads = 128 * config.consumers
    n, m, d = config.BLOCK_N, config.BLOCK_M, problem.head_dim
    return (2 * n * d + 2 * n * m) // threads


class GluonBwdTemplate(GluonTemplate):
    name = "gluon_bwd"
    description = ("FlashAttention-3-style backward for Hopper in Gluon: one program per KV "
                   "tile walks the query tiles of its GQA group (TMA ring of Q/dO/lse/delta, "
                   "async wgmma in the transposed orientation, P^T and dS^T as register "
                   "operands, dS^T staged in shared memory for dQ); by default warp-"
                   "specialized (a load warp fills the ring, a dQ warp adds each dQ tile by a "
                   "TMA bulk reduce), else dQ by fp32 vector atomics; a deterministic dQ "
                   "order as an option; dense, causal top-left or bottom-right, or a block "
                   "mask's listed blocks, GQA/MQA, head dim 64/128 (256 by its own kernel, "
                   "dense and causal), fp16/bf16. On the H200: 0.93-0.95x cuDNN's backward "
                   "at d128, 0.77-0.91x at d64, 1.05-1.10x at d256; the fastest "
                   "backward under block masks, so it prices gluon_train and flash_gluon "
                   "(the mask, varlen and sliding-window specs sweep it).")
    config_cls = GluonBwdConfig
    kernel = kernel
    gluon_missing = GLUON_MISSING
    head_dims = HEAD_DIMS
    head_dims_why = ("the head dims its kernels are built for: 64 and 128 by the split and "
                     "warp-specialized kernels, 256 by the d256 kernel")
    # The warp-specialized kernel walks a block mask's KV-major lists (``block_mask_reason``).
    block_masks = True

    # -- the problem --------------------------------------------------------------------------
    def unsupported(self, problem: Problem) -> str | None:
        reason = super().unsupported(problem)
        if reason is None and problem.head_dim == D256 and problem.mask != "none":
            return (f"gluon_bwd's d256 kernel walks dense and causal problems only, but got "
                    f"mask {problem.mask!r}: block masks at head_dim 256 run another backward")
        if reason is None and problem.mask != "none" and problem.causal != "none":
            return (f"a block mask carries its own causality (the *_causal patterns): "
                    f"gluon_bwd takes mask {problem.mask!r} with causal 'none', not "
                    f"{problem.causal!r}")
        return reason

    def flops(self, problem: Problem) -> float:
        return FLASH_BWD.flops(problem)  # 2.5 x the forward's, as flash_bwd's

    def bytes_moved(self, problem: Problem) -> float:
        return FLASH_BWD.bytes_moved(problem)

    # -- the space ----------------------------------------------------------------------------
    def constraint(self, problem: Problem, config: KernelConfig, device: DeviceInfo) -> str | None:
        cfg = self.config(config)
        assert isinstance(cfg, GluonBwdConfig)
        reason = self.unsupported_on(problem, device)
        if reason:
            return reason
        if problem.head_dim == D256 or _is_d256(cfg):
            return _d256_problem(problem, cfg, device)
        keys = cfg.BLOCK_N // cfg.consumers
        if keys not in (64, 128):
            return (f"each warpgroup takes 64 or 128 keys, but BLOCK_N {cfg.BLOCK_N} over "
                    f"{cfg.consumers} consumer(s) gives {keys}")
        smem = shared_memory_estimate(problem, cfg)
        if smem > device.smem_per_block:
            return (f"needs about {smem // 1024} KiB of shared memory (K and V {cfg.BLOCK_N}x"
                    f"{problem.head_dim}, {cfg.stages} stage(s) of Q and dO {cfg.BLOCK_M}x"
                    f"{problem.head_dim}, dS and the fp32 dQ tile), more than the "
                    f"{device.smem_per_block // 1024} KiB a program may use on {device.name}")
        regs = tile_registers(problem, cfg)
        bound = MAX_WS_TILE_REGISTERS if cfg.warp_specialize else MAX_TILE_REGISTERS
        if regs > bound:
            return (f"each thread would hold about {regs} registers of dK, dV, S^T and dP^T "
                    f"tiles (more than {bound}): registers would spill; use "
                    f"smaller tiles or more consumers")
        reason = _warp_specialize_problem(cfg)
        if reason:
            return reason
        if problem.mask != "none":  # sweep problems' masks have the default block size
            reason = block_mask_reason(cfg, (DEFAULT_BLOCK_SIZE, DEFAULT_BLOCK_SIZE))
            if reason:
                return reason
        if cfg.longest_first and problem.mask == "none":
            return ("longest_first orders a block mask's KV tiles by their walks: it needs a "
                    "masked problem (dense and causal grids have their own order)")
        if cfg.doc_offsets and not _causal_documents(problem):
            return (f"doc_offsets computes a causal packed-documents mask from its offsets: "
                    f"it needs a {DOCUMENTS_CAUSAL}:<L> problem, but the mask is "
                    f"{problem.mask!r}")
        if cfg.window_offsets and not _causal_window(problem):
            return (f"window_offsets computes a causal sliding window from its width: it "
                    f"needs a sliding_causal:<w> problem with as many queries as keys, but the "
                    f"mask is {problem.mask!r} over {problem.seqlen_q} queries and "
                    f"{problem.seqlen_kv} keys")
        # Measured wrong on the H100, causes not found (notes/gluon_notes.md, "Third GPU run"):
        # only 64 x 128 tiles over two warpgroups with a ring of three gave right gradients.
        if cfg.consumers == 1:
            return ("one consumer warpgroup (4 warps) crashed on the H100 with an illegal "
                    "address, with or without the dQ GEMM: not offered until found")
        # The warp-specialized kernel's ring (an empty barrier per slot, another protocol than
        # the compute warps' refill) of two slots crashed too: illegal memory access on the
        # H200, every case (benchmarks/results/gluon_bwd_h200_ws.json).
        if cfg.stages != 3:
            return (f"a ring of {cfg.stages} stages gave wrong dK/dV on the H100 and an illegal "
                    f"memory access on the H200 with warp_specialize (3 is right): not offered "
                    f"until found")
        if cfg.BLOCK_M != 64 and not cfg.warp_specialize:
            return (f"BLOCK_M {cfg.BLOCK_M} gave wrong gradients or crashed on the H100 "
                    f"without warp_specialize (64 is right): not offered until found")
        if cfg.BLOCK_M != 64 and problem.causal != "none":
            return (f"BLOCK_M {cfg.BLOCK_M} spills 40-144 bytes of registers a thread on a "
                    f"causal walk (offline sm_90 build; and measured 0.96x the speed of 64 "
                    f"on the H200): 64 where causal")
        return None

    def warp_specialized_configs(self, problem: Problem, device: DeviceInfo
                                 ) -> list[GluonBwdConfig]:
        """The warp-specialized configs that fit ``problem`` on ``device``: a ring of three
        with two dQ staging tiles (where they fit: d64) or one. The tests run them."""
        out = []
        for base in _candidates(problem):
            for stages, buffers in ((3, 2), (3, 1)):
                cfg = dataclasses.replace(base, warp_specialize=True, stages=stages,
                                          dq_buffers=buffers)
                if self.constraint(problem, cfg, device) is None and cfg not in out:
                    out.append(cfg)
        return out

    def default_config(self, problem: Problem, device: DeviceInfo) -> GluonBwdConfig:
        for candidate in _candidates(problem):
            if self.constraint(problem, candidate, device) is None:
                return candidate
        raise RuntimeError(f"no gluon_bwd config fits {problem.key()} on {device.name}")

    def run_constraint(self, problem: Problem, config: KernelConfig, device: DeviceInfo,
                       mask_block: tuple[int, int] | None) -> str | None:
        """``constraint`` for a call (``problem`` without its mask) whose block mask, if any,
        has blocks ``mask_block``."""
        cfg = self.config(config)
        assert isinstance(cfg, GluonBwdConfig)
        for name in ("doc_offsets", "window_offsets", "longest_first"):
            if getattr(cfg, name) and mask_block is None:
                return f"{name} reads a block mask, and the call has no block mask"
        # (The call's problem has no mask name: doc_offsets and window_offsets are the
        # mask's to use or not, longest_first needs one, which the call has.)
        reason = self.constraint(
            problem, dataclasses.replace(cfg, doc_offsets=False, window_offsets=False,
                                         longest_first=False), device)
        if reason is None and cfg.longest_first:
            reason = _warp_specialize_problem(cfg)
        if reason is None and mask_block is not None:
            reason = block_mask_reason(cfg, mask_block)
        return reason

    def run_default(self, problem: Problem, device: DeviceInfo,
                    mask_block: tuple[int, int] | None) -> GluonBwdConfig:
        """The first candidate the call takes; with a block mask, with ``doc_offsets`` (the
        mask decides: one of causal packed documents runs by its offsets, any other by its
        tiles, the same kernel as without the knob)."""
        reasons = []
        candidates = _candidates(problem, masked=mask_block is not None)
        if mask_block is not None:
            candidates = [dataclasses.replace(c, doc_offsets=True) for c in candidates]
        for candidate in candidates:
            reason = self.run_constraint(problem, candidate, device, mask_block)
            if reason is None:
                return candidate
            reasons.append(reason)
        blocks = f" with a block mask of blocks {mask_block}" if mask_block else ""
        raise ValueError(f"no gluon_bwd config fits {problem.key()}{blocks} on {device.name}: "
                         f"{reasons[0]}")

    def known_good_configs(self, problem: Problem, device: DeviceInfo) -> list[KernelConfig]:
        """The alternatives to the default a sweep measures first: the warp-specialized
        kernel's second dQ tile where it fits (d64), the kernel without warp specialization,
        at d64 its larger query step; for causal packed documents the default by its tiles
        (without ``doc_offsets``); for a causal sliding window the default with
        ``window_offsets`` first, and under a block mask the default on the persistent grid
        (neither measured yet: every sweep of such a problem measures them)."""
        candidates = _candidates(problem)
        alternatives = candidates[1:]
        if problem.mask != "none" and candidates[0].split_warpgroups:
            alternatives.insert(0, dataclasses.replace(candidates[0],
                                                       persistent=not candidates[0].persistent))
        if _causal_window(problem):
            alternatives.insert(0, dataclasses.replace(candidates[0], window_offsets=True))
        return [c for c in alternatives if self.constraint(problem, c, device) is None]

    # -- running and checking -----------------------------------------------------------------
    def make_inputs(self, problem: Problem, device: str, seed: int = 0) -> dict[str, Any]:
        """flash_bwd's: random q, k, v, do, the forward's o and lse, and the block mask of
        ``problem.mask`` (if any) under ``block_mask``."""
        return FLASH_BWD.make_inputs(problem, device, seed)

    def run(self, inputs: Mapping[str, Any], config: KernelConfig) -> Any:
        cfg = self.config(config)
        assert isinstance(cfg, GluonBwdConfig)
        return gluon_attention_bwd(inputs["do"], inputs["q"], inputs["k"], inputs["v"],
                                   inputs["o"], inputs["lse"], causal=inputs["causal"],
                                   scale=inputs["scale"], config=cfg,
                                   block_mask=inputs.get("block_mask"))

    def kernel_launches(self, problem: Problem, config: KernelConfig) -> list[KernelLaunch] | None:
        """The two Triton launches ``run`` makes (preprocess, main), over stand-in tensors
        (the dq cast is torch's)."""
        if kernel is None or self.unsupported(problem):
            return None
        cfg = self.config(config)
        assert isinstance(cfg, GluonBwdConfig)
        module = _kernel_module(cfg)
        dtype = TORCH_DTYPES[problem.dtype]
        q_shape = [problem.batch, problem.heads_q, problem.seqlen_q, problem.head_dim]
        kv_shape = [problem.batch, problem.heads_kv, problem.seqlen_kv, problem.head_dim]
        q, k = StandinTensor(dtype, q_shape), StandinTensor(dtype, kv_shape)
        scale = 1.0 / math.sqrt(problem.head_dim)
        if problem.mask != "none":
            if block_mask_reason(cfg, (DEFAULT_BLOCK_SIZE, DEFAULT_BLOCK_SIZE)):
                return None
            # The KV-major lists of a default-size mask: (N_kv, N_q) in (KV, query) blocks.
            kv_major = StandinBlockMask(problem.seqlen_kv, problem.seqlen_q)
            plan = _ws_plan_class(cfg)(q, k, causal_mode=problem.causal, scale=scale,
                                       config=cfg.to_dict(), kv_major_mask=kv_major,
                                       docs=cfg.doc_offsets or cfg.window_offsets)
        else:
            plan_cls = _ws_plan_class(cfg) if cfg.warp_specialize else module.LaunchPlan
            plan = plan_cls(q, k, causal_mode=problem.causal, scale=scale,
                            config=cfg.to_dict())
        rows = StandinTensor(torch.float32, list(plan.rows_shape))
        lse = StandinTensor(torch.float32, q_shape[:3])
        pre_args = plan.preprocess_args(StandinTensor(dtype, q_shape),
                                        StandinTensor(dtype, q_shape), lse, rows, rows,
                                        StandinTensor(torch.float32, q_shape))
        main_args = plan.main_args(q, k, StandinTensor(dtype, kv_shape),
                                   StandinTensor(dtype, q_shape), StandinTensor(dtype, kv_shape),
                                   StandinTensor(dtype, kv_shape),
                                   StandinTensor(torch.float32, q_shape), rows, rows,
                                   **_standin_counters(plan, problem),
                                   **_standin_doc_first(plan))
        return [(kernel._gluon_bwd_preprocess_kernel, plan.pre_grid, pre_args,
                 plan.preprocess_options()),
                (plan.main_kernel(), plan.grid, main_args, dict(plan.options))]

    def reference(self, inputs: Mapping[str, Any]) -> Any:
        return FLASH_BWD.reference(inputs)

    # -- code generation ----------------------------------------------------------------------
    def source_modules(self) -> list[str]:
        mods = list(super().source_modules())
        if ws_kernel is not None:
            mods[:0] = ["templates.gluon.bwd_tile_order", ws_kernel.__name__, row_ranges.__name__]
        if split_kernel is not None:  # (its persistent plan's host schedule first)
            mods[:0] = ["templates.gluon.schedule", split_kernel.__name__]
        if d256_kernel is not None:
            mods[:0] = [d256_kernel.__name__]
        return mods

    def standalone_source(self, config: KernelConfig) -> str:
        """The kernel module the config runs (the warp-specialized one inlines the other),
        with the config baked in."""
        cfg = self.config(config)
        assert isinstance(cfg, GluonBwdConfig)
        if self.kernel is None:
            raise NotImplementedError(self.gluon_missing)
        return self._kernel_module_with_config(_kernel_module(cfg), self.standalone_entry, cfg)

    standalone_entry = '''

# ----------------------------------------------------------------------------- baked-in config
CONFIG: dict[str, object] = CONFIG_LITERAL


def gluon_attention_bwd(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        o: torch.Tensor, lse: torch.Tensor, *, causal: bool | str = False,
                        scale: float | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of softmax(scale * q k^T) v with the config above baked in (Hopper GPUs).

    q, o, do: (B, H_q, N_q, D); k, v: (B, H_kv, N_kv, D), float16 or bfloat16, D 64 or 128;
    lse: (B, H_q, N_q) float32, the forward's natural-log logsumexp; causal: False, True
    (= "top_left"), "none", "top_left" or "bottom_right"; scale defaults to 1/sqrt(D).
    """
    causal_mode, softmax_scale = validate_inputs(do, q, k, v, o, lse, causal, scale)
    return launch(do, q, k, v, o, lse, causal_mode=causal_mode, scale=softmax_scale,
                  config=CONFIG)
'''


def _candidates(problem: Problem, masked: bool = False) -> list[GluonBwdConfig]:
    """The default first, then the alternatives; ``masked``: the call walks a block mask
    (its problem may not name it). FA3's shapes (H100, hdim 64: 128x128 tiles, hdim 128: 64
    queries x 128 keys, two MMA warpgroups), fitted to this kernel's register bound: 64
    queries x 128 keys (d64: 128 registers of tiles; d128: 192, at the bound), and at d64
    128 x 128. Three stages: one spilled 136 bytes at d128, two gave wrong dK/dV on the H100;
    one warpgroup (64 x 64 tiles) crashed there. The warp-specialized kernel first: on the
    H200 1.22-1.29x faster than the others at d128, 1.16-1.20x at d64 (its two dQ tiles timed
    the same as one there; benchmarks/results/gluon_bwd_h200_ws*.json). Measured on the H200
    (benchmarks/results/gluon_bwd_h200_split.json, gluon_bwd_h200_m128.json,
    gluon_bwd_h200_dq_transposed.json) and chosen here: at d64 dense, 128-query steps (1.12x
    dq_early's speed; 0.96x causal, where the diagonal's steps waste more, and spilled under
    masks offline); at d128, split_warpgroups (with the D-major dQ tile, PROTOCOL's timing,
    the rotation reversed every other round: 4k causal 1.04-1.06x, 4k dense and 16k
    0.98-1.03x; gluon_bwd_h200_split_order_*.json; under block masks 1.00-1.02x); the dQ staging tile
    D-major (``dq_transposed``) without a block mask."""
    if problem.head_dim == D256:
        # The d256 kernel, its dQ staging tile D-major or row-major, or no tile (dQ by atomics)
        # and a ring of two (none measured yet).
        return [D256_CONFIG, dataclasses.replace(D256_CONFIG, dq_transposed=False),
                dataclasses.replace(D256_CONFIG, stages=2, dq_buffers=0, dq_transposed=False)]
    base = GluonBwdConfig(BLOCK_M=64, BLOCK_N=128, stages=3, consumers=2)
    # dq_transposed on dense and causal walks: 0.99-1.07x at d128 16k, 1.01-1.05x at d64, within
    # noise at d128 4k; under block masks no gain (and a 4k row bound by host time).
    unmasked = not masked and problem.mask == "none"
    ws = [dataclasses.replace(base, warp_specialize=True, dq_buffers=n, dq_transposed=unmasked)
          for n in (1, 2)]
    if problem.head_dim <= 64:
        # dq_early: 1.03-1.05x at d64 (no spills there), 0.95-1.01x at d128 (H200,
        # gluon_bwd_h200_ws_dqe.json; with the one-path dense walk 0.94-1.02x at d128,
        # gluon_bwd_h200_one_path.json), so d64's default only.
        out = [dataclasses.replace(ws[0], dq_early=True), *ws, base,
               dataclasses.replace(base, BLOCK_M=128)]
        if unmasked and problem.causal == "none":
            out.insert(0, dataclasses.replace(ws[0], BLOCK_M=128))
    else:
        # split at d128 under block masks too: 1.00-1.02x the one-partition kernel on every
        # d128 row of masked_fwd_bwd_bench.py in two runs (documents 1.02x; H200,
        # masked_fwd_bwd_h200_persistent*.json); d64's masks keep dq_early, which split lacks.
        split = dataclasses.replace(ws[0], split_warpgroups=True)
        out = [split, *ws, base]
        if unmasked and (problem.causal != "none" or walk_steps(problem) >= LONG_WALK_STEPS):
            out.insert(0, dataclasses.replace(split, persistent=True))
        if not unmasked:
            # longest_first under block masks: forward + backward 1.024-1.043x on packed
            # documents, 1.005-1.030x on random blocks (16k), 0.984-1.008x on sliding
            # windows (H200, five runs, masked_fwd_bwd_h200_longest_first*.json).
            out.insert(0, dataclasses.replace(split, longest_first=True))
            if _causal_window(problem):
                # On the persistent grid (all rows one order): on sliding windows' equal walks
                # the next tile's loads under the last one's end pay, forward + backward
                # 1.005-1.015x at 16k, 1.009x at 4k, the backward kernel 1.03x (H200, three
                # runs, masked_fwd_bwd_h200_variants*.json); on documents and random blocks it
                # loses (0.89-0.92x: the launch order balances unequal walks better).
                out.insert(0, dataclasses.replace(split, longest_first=True, persistent=True))
    if _causal_documents(problem):  # doc_offsets: 1.03-1.04x on 16k packed rows (H200)
        out.insert(0, dataclasses.replace(out[0], doc_offsets=True))
    return out


# The persistent split kernel without a block mask (H200, three runs of gluon_bwd_bench.py,
# gluon_bwd_h200_persistent*.json; x the non-persistent kernel's speed): causal 4k
# 1.01-1.11x (the host's longest-first schedule evens out walks that the launch order
# leaves unequal), 16k 0.99-1.01x; dense walks of 256 steps or more (16k MHA and GQA 2)
# 1.02-1.03x, of 64-128 (4 x 4k) 0.94-0.97x (why not traced): persistent on causal walks and
# on dense ones from this many steps. Under block masks it read 0.90-1.00x (the rounds'
# static order against the launch order's dynamic one, on walks of unequal length).
LONG_WALK_STEPS = 256


def walk_steps(problem: Problem) -> int:
    """Steps of a dense program's walk: its query tiles of 64 rows, times the GQA group."""
    return -(-problem.seqlen_q // 64) * (problem.heads_q // problem.heads_kv)


# The d256 kernel's config (``bwd_d256_kernel``): 64 queries x 64 keys, the two MMA
# warpgroups as two partitions (split_warpgroups) splitting dK/dV/dQ by columns, a ring of
# one (two do not fit beside the 64 KiB dQ staging tile), one dQ staging tile. The default at
# head_dim 256, with the staging tile D-major (1.00-1.02x the row-major tile's speed).
D256_CONFIG = GluonBwdConfig(BLOCK_M=64, BLOCK_N=64, stages=1, consumers=2,
                             warp_specialize=True, split_warpgroups=True, dq_buffers=1,
                             dq_transposed=True)


def _is_d256(cfg: GluonBwdConfig) -> bool:
    """Whether ``cfg`` runs the d256 kernel: the split kernel's two warpgroups over 64 keys
    (32 each, which the kernels of D 64 and 128 refuse)."""
    return cfg.split_warpgroups and cfg.BLOCK_N == 64


def _d256_problem(problem: Problem, cfg: GluonBwdConfig, device: DeviceInfo) -> str | None:
    """``constraint`` at head_dim 256 (or for the d256 kernel's config): what the d256 kernel
    takes, each refusal with its reason."""
    if problem.head_dim != D256:
        return (f"BLOCK_N 64 over two split warpgroups is the d256 kernel's tile (head_dim "
                f"256), but the problem's head_dim is {problem.head_dim}: each warpgroup takes "
                f"64 or 128 keys there")
    if d256_kernel is None:
        return "the d256 kernel module did not import"
    if problem.mask != "none":
        return ("the d256 backward walks dense and causal problems only: block masks are not "
                "built at head_dim 256")
    wanted = {"warp_specialize": True, "split_warpgroups": True, "BLOCK_M": 64, "BLOCK_N": 64,
              "consumers": 2, "defer_dq": True}
    wrong = {name: getattr(cfg, name) for name, value in wanted.items()
             if getattr(cfg, name) != value}
    if wrong:
        return (f"head_dim 256 runs the d256 kernel only (templates/gluon/bwd_d256_kernel.py: "
                f"{', '.join(f'{k}={v}' for k, v in wanted.items())}; 64 x 64 tiles, dK/dV "
                f"split by columns over the two warpgroups), but the config has {wrong}")
    if (cfg.stages, cfg.dq_buffers) not in ((1, 1), (2, 0)):
        return (f"the d256 kernel runs a ring of one with one 64 KiB dQ staging tile (stages 1, "
                f"dq_buffers 1) or a ring of two with dQ added by atomics (stages 2, "
                f"dq_buffers 0): nothing else fits its shared memory, but the config has "
                f"stages {cfg.stages}, dq_buffers {cfg.dq_buffers}")
    if cfg.dq_buffers == 0 and cfg.dq_transposed:
        return ("dq_transposed lays out the dQ staging tile: with dq_buffers 0 (no tile, "
                "atomics) the d256 kernel adds dQ row-major")
    taken = [name for name in ("deterministic", "dq_early", "persistent", "longest_first",
                               "doc_offsets", "window_offsets", "dk_after_dq")
             if getattr(cfg, name)]
    if taken:
        return (f"the d256 kernel does not take {', '.join(taken)} (dense and causal walks, "
                f"one program per KV tile, dQ reduced in any order)")
    smem = shared_memory_estimate(problem, cfg)
    if smem > device.smem_per_block:
        return (f"the d256 kernel needs about {smem} bytes of shared memory (K, V, one stage "
                f"of Q and dO, two P^T/dS^T pairs, the fp32 dQ tile), more than the "
                f"{device.smem_per_block} a program may use on {device.name}")
    return None


def _warp_specialize_problem(cfg: GluonBwdConfig) -> str | None:
    """Why ``cfg``'s warp-specialization knobs do not go together (None if they do)."""
    if cfg.persistent and not cfg.split_warpgroups:
        return "persistent is the split kernel's grid: it needs split_warpgroups"
    if cfg.dk_after_dq and not cfg.split_warpgroups:
        return ("dk_after_dq orders the split kernel's GEMMs: it needs split_warpgroups (the "
                "other kernels issue dK's GEMM before the dS^T exchange)")
    if not cfg.warp_specialize:
        if cfg.dq_buffers != 1:
            return (f"dq_buffers {cfg.dq_buffers} needs warp_specialize (without it the "
                    f"compute warps add their one dQ tile themselves)")
        if cfg.deterministic:
            return ("deterministic needs warp_specialize (the dQ warp orders the reduces; "
                    "without it every warp adds its dQ by atomics in no fixed order)")
        if cfg.split_warpgroups:
            return "split_warpgroups splits the warp-specialized kernel: it needs warp_specialize"
        if cfg.dq_early:
            return ("dq_early needs warp_specialize (it moves the hand-over of the dQ tile to "
                    "the dQ warp)")
        if cfg.dq_transposed:
            return ("dq_transposed lays out the warp-specialized kernel's dQ staging tile: it "
                    "needs warp_specialize (without it dQ is added by atomics)")
        if cfg.longest_first:
            return ("longest_first orders the warp-specialized kernels' tiles: it needs "
                    "warp_specialize")
        return None
    if ws_kernel is None:
        return "the warp-specialized kernel module did not import"
    if cfg.dq_buffers == 0:
        return ("dq_buffers 0 (no staging tile: dQ by atomics from the MMA warps) is the d256 "
                "kernel's (head_dim 256)")
    if not cfg.defer_dq:
        return ("defer_dq=False has no meaning with warp_specialize (the dQ warp adds every "
                "tile): leave it at True")
    if cfg.consumers != 2:
        return "warp_specialize runs two MMA warpgroups (consumers=2)"
    if cfg.split_warpgroups:
        if split_kernel is None:
            return "the split kernel module did not import"
        taken = [name for name in ("deterministic", "dq_early") if getattr(cfg, name)]
        if taken:
            return (f"split_warpgroups does not take {', '.join(taken)} (its kernel has no "
                    f"ordered dQ and issues dQ's GEMM last)")
    return None


def block_mask_reason(config: GluonBwdConfig, block_size: tuple[int, int]) -> str | None:
    """Why ``config`` cannot walk a block mask of ``block_size`` (query, kv), None if it
    can: the warp-specialized kernel walks masks of the sweeps' default blocks."""
    if _is_d256(config):
        return ("the d256 backward walks dense and causal problems only: block masks are not "
                "built at head_dim 256")
    if not config.warp_specialize:
        return ("only the warp-specialized kernel walks a block mask (its load warp walks the "
                "mask's KV-major lists): use warp_specialize=True")
    if config.deterministic:
        return ("deterministic is not offered with a block mask: the KV tiles that see a "
                "query block are the mask's, not 0 .. k, so a counter cannot tell a tile its "
                "turn")
    if tuple(block_size) != (DEFAULT_BLOCK_SIZE, DEFAULT_BLOCK_SIZE):
        return (f"gluon_bwd walks block masks of {DEFAULT_BLOCK_SIZE} x {DEFAULT_BLOCK_SIZE} "
                f"blocks (the sweeps' default; the only ones verified), but got a block mask "
                f"of blocks {tuple(block_size)}")
    if DEFAULT_BLOCK_SIZE % config.BLOCK_M or DEFAULT_BLOCK_SIZE % config.BLOCK_N:
        return (f"BLOCK_M ({config.BLOCK_M}) and BLOCK_N ({config.BLOCK_N}) must divide the "
                f"block mask's block size {tuple(block_size)}")
    if config.BLOCK_M != 64:
        return (f"BLOCK_M {config.BLOCK_M} spills 112-168 bytes of registers a thread under a "
                f"block mask (offline sm_90 build): 64 under masks")
    return None


def _standin_counters(plan: Any, problem: Problem) -> dict[str, Any]:
    """A deterministic warp-specialized plan's dQ counters as a stand-in (the plan would
    allocate real ones), as ``main_args``'s keyword; nothing for other plans."""
    if not getattr(plan, "deterministic", False):
        return {}
    count = problem.batch * problem.heads_q * plan.scalars[7]
    return {"dq_counters": StandinTensor(torch.int32, [count])}


def _causal_documents(problem: Problem) -> bool:
    """Whether ``problem``'s mask is a pattern of causal packed documents (doc_offsets')."""
    return parse_pattern(problem.mask)[0] == DOCUMENTS_CAUSAL


def _causal_window(problem: Problem) -> bool:
    """Whether ``problem``'s mask is a causal sliding window over as many queries as keys
    (window_offsets'; the rule ``row_ranges.causal_window`` reads a mask by)."""
    return row_ranges.pattern_window(problem.mask, problem.seqlen_q,
                                   problem.seqlen_kv) is not None


def _standin_doc_first(plan: Any) -> dict[str, Any]:
    """A doc_offsets plan's rows' document starts as a stand-in, as ``main_args``'s keyword;
    nothing for other plans."""
    if not plan.options.get("DOCS"):
        return {}
    return {"doc_first": StandinTensor(torch.int32, [plan.rows_pad])}


def _kernel_module(cfg: GluonBwdConfig) -> Any:
    """The kernel module ``cfg`` runs."""
    if _is_d256(cfg):
        return d256_kernel
    if cfg.split_warpgroups:
        return split_kernel
    return ws_kernel if cfg.warp_specialize else kernel


def _ws_plan_class(cfg: GluonBwdConfig) -> Any:
    """The warp-specialized launch plan ``cfg`` runs (its module imported: the constraint
    refuses the config otherwise)."""
    if _is_d256(cfg):
        assert d256_kernel is not None
        return d256_kernel.D256LaunchPlan
    module = split_kernel if cfg.split_warpgroups else ws_kernel
    assert module is not None
    return module.SplitLaunchPlan if cfg.split_warpgroups else module.WsLaunchPlan


def compile_for(problem: Problem, config: KernelConfig) -> list[Any]:
    """Triton's compiled kernels (preprocess, main) for ``problem`` under ``config``, without
    allocating or launching anything (needs a Hopper GPU or an ``offline_target``)."""
    return [fn.warmup(*args, grid=grid, **options)
            for fn, grid, args, options in TEMPLATE.standin_launches(problem, config)]


# ----------------------------------------------------------------------------- entry point
def gluon_attention_bwd(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        o: torch.Tensor, lse: torch.Tensor, *, causal: bool | str = False,
                        scale: float | None = None,
                        config: GluonBwdConfig | Mapping[str, object] | None = None,
                        block_mask: BlockMask | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention backward on a Hopper GPU: (dq, dk, dv) of o = softmax(scale q k^T [causal]
    [masked]) v.

    Args:
        do, q, o: (B, H_q, N_q, D) float16 or bfloat16 on a CUDA device of compute capability
            9.x, D 64, 128 or 256 (256 without a block mask); layouts TMA cannot read are
            copied first.
        k, v: (B, H_kv, N_kv, D), same dtype and device; H_q a multiple of H_kv (GQA/MQA).
        lse: (B, H_q, N_q) float32, the forward's natural-log logsumexp (-inf for rows that
            see no key: their gradients are 0). ``gluon_attention_fwd``'s and
            ``flash_attention_fwd``'s lse are this.
        causal: False / "none"; True / "top_left"; "bottom_right" (as the forwards).
        scale: softmax scale, default 1/sqrt(D); must be the forward's.
        config: a ``GluonBwdConfig`` or a mapping of its fields; None takes the default.
        block_mask: the forward's ``BlockMask`` (blocks of 128 x 128; its causality is its
            own, so causal must be "none"), or None. The warp-specialized kernel walks, per
            KV tile, only the query blocks its transposed lists give.

    Returns:
        dq, dk, dv in the inputs' dtype and shapes, each laid out as ``torch.empty_like`` of
        its input (a packed caller's gradients need no copy). dq is summed with fp32
        atomics: not bitwise reproducible between runs (dk and dv are), unless the config is
        ``deterministic`` (warp-specialized, no block mask).

    Raises:
        TypeError / ValueError naming the offending argument or the constraint the config
        violates; RuntimeError where Gluon is missing.
    """
    if kernel is None:
        raise RuntimeError(GLUON_MISSING)
    key = _plan_key(do, q, k, v, o, lse, causal, scale, config, block_mask)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _validated_plan(do, q, k, v, o, lse, causal, scale, config, block_mask)
        _PLANS.put(key, plan)
    return plan(do, q, k, v, o, lse, block_mask)


# Backward plans of gluon_attention_bwd by _plan_key: a repeated call skips the checks, the
# config choice, the launch plan and its descriptors' layouts, and launches both kernels
# directly (templates.gluon.bwd_plan).
_PLANS: PlanCache[GluonBackwardPlan] = PlanCache(maxsize=1024)


def _plan_key(do: Any, q: Any, k: Any, v: Any, o: Any, lse: Any, causal: Any, scale: Any,
              config: Any, block_mask: Any) -> tuple[object, ...] | None:
    """Everything ``_validated_plan`` reads from its arguments (classes, shapes, strides,
    dtypes and devices of the six tensors, causal, scale, config, the block mask's geometry),
    or None where no plan is kept (the full path then raises the right error). Pointer
    alignment enters where TMA reads it (q, k, v, do: a misaligned one is copied first);
    the plan launches other misaligned pointers through the JIT."""
    if block_mask is not None and not isinstance(block_mask, BlockMask):
        return None
    config = config_key(TEMPLATE, config, GluonBwdConfig)
    if config is NO_PLAN:
        return None
    try:
        return (layout_key(do, q, k, v, o, lse),
                (do.data_ptr() | q.data_ptr() | k.data_ptr() | v.data_ptr()) % 16,
                causal.__class__, causal, scale.__class__, scale, config,
                block_mask_key(block_mask), takes_offsets(block_mask),
                causal_window(block_mask) is not None,
                # the pricing switches (benchmarks/gluon_bwd_price.py sets them per run)
                os.environ.get("GLUON_BWD_DEBUG"))
    except (AttributeError, TypeError, RuntimeError):  # not tensors; fake tensors
        return None


def _validated_plan(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    o: torch.Tensor, lse: torch.Tensor, causal: bool | str,
                    scale: float | None, config: GluonBwdConfig | Mapping[str, object] | None,
                    block_mask: BlockMask | None) -> GluonBackwardPlan:
    """Check the arguments, choose or check the config and plan both launches (see
    ``gluon_attention_bwd`` for the errors)."""
    assert kernel is not None
    causal_mode, softmax_scale = kernel.validate_inputs(do, q, k, v, o, lse, causal, scale,
                                                        head_dims=HEAD_DIMS)
    mask_block = None
    if block_mask is not None:
        check_block_mask(block_mask, q, k)
        if causal_mode != "none":
            raise ValueError(f"causal must be 'none' with a block_mask (the mask carries its "
                             f"own causality), but got {causal!r}")
        mask_block = block_mask.block_size
    cfg = TEMPLATE.config_to_run(q, k, causal_mode, config, mask_block)
    assert isinstance(cfg, GluonBwdConfig)
    assert block_mask is None or cfg.warp_specialize
    module = _kernel_module(cfg)
    # As bwd_kernel.launch_plan: layouts TMA cannot read are copied first (per call, by the
    # plan); the launch plan is made for the copies' layout.
    ready = [kernel.tma_ready(t) for t in (q, k, v, do)]
    copy_inputs = any(r is not t for r, t in zip(ready, (q, k, v, do), strict=True))
    if cfg.warp_specialize:
        launch_plan = _ws_plan_class(cfg)(
            ready[0], ready[1], causal_mode=causal_mode, scale=softmax_scale,
            config=cfg.to_dict(),
            kv_major_mask=None if block_mask is None else block_mask.transposed,
            docs=_takes_first_keys(cfg, block_mask))
    else:
        launch_plan = module.LaunchPlan(ready[0], ready[1], causal_mode=causal_mode,
                                        scale=softmax_scale, config=cfg.to_dict())
    return GluonBackwardPlan(launch_plan, kernel._gluon_bwd_preprocess_kernel,
                             warp_specialized=cfg.warp_specialize, copy_inputs=copy_inputs,
                             copy_o=o.stride(-1) != 1)


def _takes_first_keys(cfg: GluonBwdConfig, block_mask: BlockMask | None) -> bool:
    """Whether the call's partial blocks go by the rows' first keys (``masks.row_ranges``): the
    config's doc_offsets for a mask of causal documents, its window_offsets for a causal
    sliding window."""
    return ((cfg.doc_offsets and takes_offsets(block_mask))
            or (cfg.window_offsets and causal_window(block_mask) is not None))


TEMPLATE = GluonBwdTemplate()
register(TEMPLATE)
