"""The Gluon forward template (Hopper only): its search space, constraints, defaults and entry.

The kernel and its launcher live in ``templates.gluon.fwd_kernel`` (torch + triton only, so it
can be emitted as standalone source); this module adds what the tuner and users need around
it. Written for triton 3.6's Gluon; on a triton without Gluon the template imports but
rejects every problem (``unsupported`` says why).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from templates.attention_reference import (
    attention_reference,
    forward_bytes,
    forward_flops,
    lse_error,
    random_inputs,
)
from templates.base import (
    KernelConfig,
    KernelLaunch,
    Problem,
    knob,
    relative_error,
)
from templates.compile import direct_launch, tensor_maps
from templates.compile.plan_cache import PlanCache
from templates.compile.standin_tensor import StandinTensor
from templates.device import DeviceInfo
from templates.flash.fwd import check_block_mask, pattern_mask
from templates.gluon import schedule as gluon_schedule
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
from templates.masks.row_ranges import WithFirstKeys, rows_take_offsets, takes_doc_offsets
from templates.registry import register

kernel, GLUON_MISSING = load_kernel_module("templates.gluon.fwd_kernel")
HEAD_DIMS = (64, 128, 256)
# Shared memory Triton adds to the tiles: the mbarriers and the warp-specialize state.
BARRIER_BYTES = 512
# Registers a consumer thread needs beyond its tiles (addresses, softmax temporaries, loop
# state): a config fits when its tiles (``live_per_thread``) stay this far under the
# consumer's register budget. Calibrated by compiling the space offline for sm_90 (triton
# 3.6, notes/gluon_notes.md): with 240 registers (ping-pong, 1 program per SM) tiles of 176
# compiled without spills and tiles of 224 spilled 128-1344 bytes; with 255 (no producer
# warp) 176 compiled in 216-227 registers and 224 spilled.
REGISTER_HEADROOM = 64
# Registers one wgmma instruction needs beyond its accumulator (m64 x N: N / 2 per thread):
# ptxas allocates every instruction within the kernel's maxnreg, even in a partition that
# setmaxnreg raised above it, and asked for 154 at N = 256 (session #18, triton 3.6: two
# programs per SM, maxnreg 128, 256-key blocks or D = 256 failed with C7602, "Insufficient
# registers"; the other warp-specialized configs whose maxnreg is under their consumers'
# budget compiled, d64-d256, notes/gluon_notes.md).
WGMMA_OPERAND_REGS = 26
# Shared memory of one SM (H100: 228 KiB), and what the system reserves per program.
SMEM_PER_SM = 228 * 1024
SMEM_RESERVED_PER_PROGRAM = 1024


@dataclass(frozen=True)
class GluonFwdConfig(KernelConfig):
    """One point of the Gluon forward kernel's search space."""

    BLOCK_M: int = knob(
        128, (64, 128, 256),
        "Query rows per program, split evenly over the consumer warpgroups (64 or 128 rows "
        "each). More rows reuse each K/V block more but hold a larger accumulator.")
    BLOCK_N: int = knob(
        128, (64, 128, 256),
        "Keys per KV block (one TMA load, one QK^T and one PV GEMM). Larger blocks amortize "
        "the per-block softmax bookkeeping and barriers but hold more score registers and "
        "shared memory per stage. 256 fits at d64 only, with P through shared memory.")
    kv_stages: int = knob(
        2, (1, 2, 3, 4),
        "K/V blocks the shared-memory ring holds: loads run this many blocks ahead of the "
        "GEMMs. Deeper hides more memory latency, costs 2 x BLOCK_N x D x 2 bytes per stage.")
    consumers: int = knob(
        2, (1, 2),
        "Consumer warpgroups per program (4 warps each) sharing every K/V block.")
    warp_specialize: bool = knob(
        True, (False, True),
        "One producer warp issues every TMA load (gl.warp_specialize, its registers given to "
        "the consumers by setmaxnreg); otherwise the consumer warps issue the loads between "
        "their GEMMs.")
    pingpong: bool = knob(
        True, (False, True),
        "Two consumer warpgroups in separate partitions take turns issuing GEMMs, so one's "
        "softmax runs under the other's GEMMs (FA3 ping-pong); without it they form one "
        "partition and run in step. Needs warp_specialize and consumers=2.")
    longest_first: bool = knob(
        False, (False, True),
        "Causal only: launch the query tiles that see the most keys first, so the longest "
        "programs do not end up alone in the last wave.")
    p_from_smem: bool = knob(
        False, (False, True),
        "The PV GEMM reads P from shared memory (written there after the softmax) instead of "
        "from registers: frees P's registers and lets the GEMM read both operands from shared "
        "memory, at the cost of a store, a fence and a warpgroup barrier per block.")
    persistent: bool = knob(
        False, (False, True),
        "One program per SM walks the tiles in rounds of one tile each: the producer loads "
        "the next tile's Q and K/V while the consumers finish the current one (no per-program "
        "launch or prologue), at the cost of a static assignment (causal: longest first, in "
        "L2-sized head groups, every other round reversed). Needs warp_specialize.")
    tree_max: bool = knob(
        False, (False, True),
        "The softmax's row max of each score block as a tree of independent maxima instead "
        "of one dependent chain per row (the same instructions, shorter latency): ahead at "
        "d64, behind at d128 dense on the H100 (notes/gluon_notes.md).")
    split_tail: bool = knob(
        False, (False, True),
        "Persistent grids: tiles cut into pieces of KV blocks run by different SMs, their "
        "partial results combined by the piece that ends last, where the host's cost model "
        "says the grid ends sooner; else as False. Dense: the last, partial round's tiles "
        "(``split_schedule``); causal: the longest tiles of a grid too small for whole "
        "tiles to balance (``cut_lpt_schedule``).")
    pack_gqa: bool = knob(
        False, (False, True),
        "GQA/MQA: the query heads of each KV head stacked into one head of their rows, so a "
        "tile of few queries per head fills its rows and each K/V block is loaded once for "
        "the group (causal masks map each row back to its query). Pays where N_q leaves "
        "most of a tile's rows empty (decoding several tokens, short chunks of a prompt).")
    ctas_per_sm: int = knob(
        1, (1, 2),
        "Programs meant to share an SM: the register budget (maxnreg) is split between them "
        "and their shared memory must fit together. Two programs overlap one's softmax with "
        "the other's GEMMs without any explicit scheduling, at the cost of half the "
        "registers and shared memory each.")
    doc_offsets: bool = knob(
        False, (False, True),
        "Under a block mask whose rows each see one causal range of keys (causal packed "
        "documents, BlockMask.documents; a causal window, the pattern sliding_causal:<w>), "
        "a partial block's visibility computed from its rows' first visible keys (one int32 "
        "a row) instead of read from its uint8 tile (a byte per score, loaded by the "
        "consumer warps under the softmax); other masks keep their tiles. Measured 1.46x on "
        "16k packed documents, 1.35x at 64k, 1.14-1.22x on causal windows (H200, d128): on "
        "by default under a block mask.")


def rows_per_consumer(config: GluonFwdConfig) -> int:
    return config.BLOCK_M // config.consumers


def shared_memory_estimate(problem: Problem, config: GluonFwdConfig) -> int:
    """Bytes of shared memory: the Q tile (reused for O; two of them in a persistent program
    where they fit), the K and V rings, P when it goes through shared memory, the barriers."""
    assert kernel is not None  # without Gluon every problem is rejected before this
    d = problem.head_dim
    cfg = config.to_dict()
    return kernel.shared_memory_bytes(d, cfg, kernel.q_slots(d, cfg)) + BARRIER_BYTES


def kernel_maxnreg(config: GluonFwdConfig) -> int:
    """The kernel's register limit per thread (maxnreg), which ptxas compiles it within."""
    assert kernel is not None
    return kernel.register_budget(config.to_dict())[0]


def consumer_registers(config: GluonFwdConfig) -> int:
    """Registers per consumer thread under the config's register budget."""
    assert kernel is not None
    return kernel.register_budget(config.to_dict())[1]


def live_per_thread(problem: Problem, config: GluonFwdConfig) -> int:
    """fp32-equivalent registers of a consumer thread's tiles (see REGISTER_HEADROOM)."""
    rows = rows_per_consumer(config)
    p_regs = 0 if config.p_from_smem else config.BLOCK_N // 2
    return rows * (problem.head_dim + config.BLOCK_N + p_regs) // 128


class GluonFwdTemplate(GluonTemplate):
    name = "gluon_fwd"
    description = ("FlashAttention-3-style forward for Hopper in Gluon: TMA loads through an "
                   "mbarrier ring, async wgmma with softmax under the PV GEMM, optional "
                   "producer warp and ping-pong consumer warpgroups; dense, causal top-left "
                   "or bottom-right, block masks (their lists walked by the producer warp), "
                   "GQA/MQA (query heads packed per KV head where it pays), head dim "
                   "64/128/256, fp16/bf16; returns (o, lse).")
    config_cls = GluonFwdConfig
    kernel = kernel
    gluon_missing = GLUON_MISSING
    head_dims = HEAD_DIMS
    head_dims_why = "one TMA box and wgmma tile"
    block_masks = True

    def source_modules(self) -> Sequence[str]:
        # The kernel module launches through these (inlined into the standalone source too).
        return [*super().source_modules(), direct_launch.__name__, tensor_maps.__name__,
                gluon_schedule.__name__, row_ranges.__name__]

    # -- the problem --------------------------------------------------------------------------
    def flops(self, problem: Problem) -> float:
        return forward_flops(problem)  # as flash_fwd's (PROTOCOL.md)

    def bytes_moved(self, problem: Problem) -> float:
        return forward_bytes(problem)

    # -- the space ----------------------------------------------------------------------------
    def constraint(self, problem: Problem, config: KernelConfig, device: DeviceInfo) -> str | None:
        return self.run_constraint(problem, config, device, _pattern_mask_block(problem))

    def run_constraint(self, problem: Problem, config: KernelConfig, device: DeviceInfo,
                       mask_block: tuple[int, int] | None) -> str | None:
        """``constraint`` for a call whose block mask (if any) has blocks ``mask_block``."""
        cfg = self.config(config)
        assert isinstance(cfg, GluonFwdConfig)
        reason = self.unsupported_on(problem, device)
        if reason:
            return reason
        if cfg.pingpong and not (cfg.warp_specialize and cfg.consumers == 2):
            return "pingpong needs warp_specialize=True and consumers=2"
        if cfg.persistent and not cfg.warp_specialize:
            return "persistent needs warp_specialize=True (the producer warp walks the tiles)"
        if cfg.persistent and cfg.ctas_per_sm > 1:
            return "persistent programs take a whole SM each; use ctas_per_sm=1"
        if cfg.split_tail and not cfg.persistent:
            return "split_tail cuts the tiles of a persistent grid: needs persistent=True"
        if cfg.pack_gqa and problem.heads_q == problem.heads_kv:
            return (f"pack_gqa stacks the query heads that share a KV head: needs heads_q > "
                    f"heads_kv, but this problem has {problem.heads_q} of each; use "
                    f"pack_gqa=False")
        if cfg.split_tail and mask_block is not None:
            return ("split_tail does not cut a block mask's tiles (they walk their rows' "
                    "lists): use split_tail=False")
        if mask_block is not None:
            reason = block_mask_reason(cfg, mask_block)
            if reason:
                return reason
        elif cfg.doc_offsets:
            return ("doc_offsets reads a block mask's rows (causal documents or a causal "
                    "window): without a block mask use doc_offsets=False")
        elif cfg.persistent and problem.causal != "none" and not cfg.longest_first:
            return ("a persistent grid walks causal tiles longest first (its static "
                    "assignment is balanced only so): use longest_first=True")
        rows = rows_per_consumer(cfg)
        if rows not in (64, 128):
            return (f"each consumer warpgroup takes 64 or 128 query rows, but BLOCK_M "
                    f"{cfg.BLOCK_M} over {cfg.consumers} consumer(s) gives {rows}")
        if cfg.longest_first and problem.causal == "none":
            return ("longest_first only reorders causal launches (every non-causal tile has "
                    "the same work); use longest_first=False")
        smem = shared_memory_estimate(problem, cfg)
        if smem > device.smem_per_block:
            return (f"needs about {smem // 1024} KiB of shared memory (Q {cfg.BLOCK_M}x"
                    f"{problem.head_dim} + {cfg.kv_stages} stage(s) of K and V {cfg.BLOCK_N}x"
                    f"{problem.head_dim}), more than the {device.smem_per_block // 1024} KiB "
                    f"a program may use on {device.name}")
        if cfg.ctas_per_sm * (smem + SMEM_RESERVED_PER_PROGRAM) > SMEM_PER_SM:
            return (f"{cfg.ctas_per_sm} programs of about {smem // 1024} KiB of shared memory "
                    f"each do not fit in an SM's {SMEM_PER_SM // 1024} KiB")
        widest = max(cfg.BLOCK_N, problem.head_dim)  # the N of S = QK^T or of O += PV
        maxnreg = kernel_maxnreg(cfg)
        if widest // 2 + WGMMA_OPERAND_REGS > maxnreg:
            return (f"a GEMM {widest} wide needs about {widest // 2 + WGMMA_OPERAND_REGS} "
                    f"registers per thread in one instruction, more than the {maxnreg} that "
                    f"ptxas compiles {cfg.ctas_per_sm} program(s) per SM within: use "
                    f"ctas_per_sm=1 or BLOCK_N and D of 128 or less")
        live = live_per_thread(problem, cfg)
        budget = consumer_registers(cfg)
        if live > budget - REGISTER_HEADROOM:
            return (f"each consumer thread would hold about {live} registers of tiles "
                    f"({rows} rows x (D {problem.head_dim} + scores {cfg.BLOCK_N} + P "
                    f"{cfg.BLOCK_N // 2})) within a budget of {budget} registers "
                    f"({cfg.ctas_per_sm} program(s) per SM): registers would spill; use fewer "
                    f"rows per consumer, smaller blocks or one program per SM")
        return None

    def default_config(self, problem: Problem, device: DeviceInfo) -> GluonFwdConfig:
        return self.run_default(problem, device, _pattern_mask_block(problem))

    def run_default(self, problem: Problem, device: DeviceInfo,
                    mask_block: tuple[int, int] | None) -> GluonFwdConfig:
        """``default_config`` for a call whose block mask (if any) has blocks ``mask_block``:
        the heuristic's config fitted to them, then cheaper ones until one fits."""
        start = _heuristic(problem)
        if mask_block is not None:
            start = fit_to_block_mask(start, mask_block)
            # (a call's problem names no mask; its mask's rows decide at launch)
            offsets = problem.mask == "none" or takes_doc_offsets(problem)
            start = dataclasses.replace(start, doc_offsets=offsets)
        for candidate in _shrinking(start):
            if self.run_constraint(problem, candidate, device, mask_block) is None:
                return candidate
        blocks = f" with a block mask of blocks {mask_block}" if mask_block else ""
        raise ValueError(f"no gluon_fwd config fits {problem.key()}{blocks} on {device.name}")

    def known_good_configs(self, problem: Problem, device: DeviceInfo) -> list[KernelConfig]:
        """For a mask whose rows each see one causal range (causal documents, a causal
        window) the default with its tiles (``doc_offsets`` off): a sweep still measures
        the knob it defaults to."""
        if not takes_doc_offsets(problem):
            return []
        default = self.default_config(problem, device)
        assert isinstance(default, GluonFwdConfig)
        return [dataclasses.replace(default, doc_offsets=False)]

    # -- running and checking -----------------------------------------------------------------
    def make_inputs(self, problem: Problem, device: str, seed: int = 0) -> dict[str, Any]:
        inputs = random_inputs(problem, device, seed)
        if problem.mask != "none":
            inputs["block_mask"] = pattern_mask(problem.mask, problem.seqlen_q,
                                                 problem.seqlen_kv, str(device))
        return inputs

    def run(self, inputs: Mapping[str, Any], config: KernelConfig) -> Any:
        cfg = self.config(config)
        assert isinstance(cfg, GluonFwdConfig)
        return gluon_attention_fwd(inputs["q"], inputs["k"], inputs["v"],
                                   causal=inputs["causal"], scale=inputs["scale"], config=cfg,
                                   block_mask=inputs.get("block_mask"))

    def kernel_launches(self, problem: Problem, config: KernelConfig) -> list[KernelLaunch] | None:
        """The one launch ``run`` makes, over stand-in tensors."""
        if kernel is None or self.unsupported(problem):
            return None
        cfg = self.config(config)
        assert isinstance(cfg, GluonFwdConfig)
        return [standin_launch(problem, cfg)]

    def reference(self, inputs: Mapping[str, Any]) -> Any:
        block_mask = inputs.get("block_mask")
        return attention_reference(inputs["q"], inputs["k"], inputs["v"],
                                   causal=inputs["causal"], scale=inputs["scale"],
                                   mask=None if block_mask is None else block_mask.to_dense())

    def error(self, out: Any, ref: Any) -> float:
        """Largest of the relative errors of o and of lse (its -inf rows must match exactly)."""
        (o, lse), (o_ref, lse_ref) = out, ref
        return max(relative_error(o, o_ref), lse_error(lse, lse_ref))

    # -- code generation ----------------------------------------------------------------------
    standalone_entry = '''

# ----------------------------------------------------------------------------- baked-in config
CONFIG: dict[str, object] = CONFIG_LITERAL


def gluon_attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                        causal: bool | str = False, scale: float | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, lse) of softmax(scale * q k^T) v with the config above baked in (Hopper GPUs).

    q: (B, H_q, N_q, D); k, v: (B, H_kv, N_kv, D), float16 or bfloat16, D in 64/128/256;
    causal: False, True (= "top_left"), "none", "top_left" or "bottom_right"; scale
    defaults to 1/sqrt(D). Layouts TMA cannot read are copied to contiguous first.
    """
    causal_mode, softmax_scale = validate_inputs(q, k, v, causal, scale)
    return launch(q, k, v, causal_mode=causal_mode, scale=softmax_scale, config=CONFIG)
'''


def _pattern_mask_block(problem: Problem) -> tuple[int, int] | None:
    """The blocks of a problem's mask pattern: built with the default block size
    (``make_inputs``); None for an unmasked problem."""
    return (DEFAULT_BLOCK_SIZE, DEFAULT_BLOCK_SIZE) if problem.mask != "none" else None


def block_mask_reason(config: GluonFwdConfig, block_size: tuple[int, int]) -> str | None:
    """Why ``config`` cannot walk a block mask of ``block_size`` (query, kv), None if it
    can."""
    if block_size[0] % config.BLOCK_M or block_size[1] % config.BLOCK_N:
        return (f"BLOCK_M ({config.BLOCK_M}) and BLOCK_N ({config.BLOCK_N}) must divide the "
                f"block mask's block size {block_size} (query, kv): a tile reads one mask row")
    if not config.warp_specialize:
        return ("the producer warp walks a block mask's lists: use warp_specialize=True")
    if config.longest_first:
        return ("a block mask's tiles run in its rows' order (the mask sets their lengths): "
                "use longest_first=False")
    if config.pack_gqa:
        return ("pack_gqa does not walk a block mask (its rows are one head's queries): "
                "use pack_gqa=False")
    return None


def fit_to_block_mask(config: GluonFwdConfig, block_size: tuple[int, int]) -> GluonFwdConfig:
    """``config`` with tiles no larger than the mask's blocks (powers of two both, so the
    smaller divides the larger) and no longest-first order; ValueError for blocks under 64
    (a consumer's wgmma tile is 64 rows, a key block at least 64 keys)."""
    if min(block_size) < 64:
        raise ValueError(f"gluon_fwd walks block masks of blocks of at least 64 x 64, but got "
                         f"a block mask of blocks {tuple(block_size)}")
    consumers = max(1, min(config.consumers, block_size[0] // 64))
    return dataclasses.replace(config, BLOCK_M=min(config.BLOCK_M, block_size[0]),
                               BLOCK_N=min(config.BLOCK_N, block_size[1]), consumers=consumers,
                               pingpong=config.pingpong and consumers == 2, longest_first=False,
                               split_tail=False, pack_gqa=False)


@dataclass(frozen=True)
class StandinBlockMask:
    """The geometry of a block mask of the default block size, broadcast over batch and heads,
    with stand-in tensors: what a launch reads from a ``BlockMask``, for compile checks."""

    seqlen_q: int
    seqlen_kv: int
    block_size: tuple[int, int] = (DEFAULT_BLOCK_SIZE, DEFAULT_BLOCK_SIZE)

    def kernel_args(self) -> list[Any]:
        nq = -(-self.seqlen_q // self.block_size[0])
        nk = -(-self.seqlen_kv // self.block_size[1])
        counts, lists = StandinTensor(torch.int32, [1, 1, nq]), StandinTensor(torch.int32,
                                                                               [1, 1, nq, nk])
        tiles = StandinTensor(torch.uint8, [1, *self.block_size])
        return [counts, lists, counts, lists, lists, tiles, 0, 0, 0, 0, nk]


def _heuristic(problem: Problem) -> GluonFwdConfig:
    """Starting point per head dim, before fitting it to the constraints: FA3's shape (two
    ping-pong consumer warpgroups of 64 rows, a producer warp, 128-key blocks; 64-key blocks
    at D = 256, where 128 would spill), 2 stages, and the persistent grid at D <= 128 and for
    d256 causal from 4k query rows.
    Measured on H100 (bf16, PROTOCOL shapes, notes/gluon_notes.md run 5, medians of 3
    readings, x cuDNN in the same process), persistent / not: d128 dense 0.95 / 0.81 at 512,
    0.99 / 0.89 at 1k, 1.02 / 1.00 at 4k, 1.02 / 1.02 at 16k; d128 causal 0.87 / 0.70,
    0.97 / 0.83, 1.08 / 0.99, 1.11 / 1.10; d64 dense 0.92 / 0.73 at 512 to 1.01 / 1.00 at
    16k, d64 causal 0.76 / 0.55 to 1.02 / 1.04. At D = 256 (one Q buffer per consumer fits)
    the persistent grid was not ahead in run 3, so it stays off there, except on long causal
    rows (``_long_causal_d256``, H200, session #19). Within noise (~5%):
    3 stages; clearly behind: 64-key blocks at D <= 128, P through shared memory, two
    programs per SM, no producer warp, consumers in step (runs 1-3). The row max as a tree
    at d64 only: against the chain, 7 rounds (session #11), d64 2k-16k 0.95-0.99 of the time
    (causal 4k/16k 0.967/0.951), 512-1k 0.99-1.01; d128 1.00-1.02, so not there. Tiles cut
    into pieces (``split_tail``; its cost models decide where to cut): against
    whole tiles (session #13, 7 rounds) dense grids of 32-64 tiles 0.60-0.89 of the time at
    d128 and 0.62-0.73 at d64, PROTOCOL 8k/16k 0.98-0.99 (the model leaves 512-4k whole;
    cut, d64 2k and under read 1.01-1.03); causal grids of 16-128 tiles 0.51-0.93. GQA
    packed (``pack_gqa``) where that fills the tiles' rows clearly better
    (``packing_fills_rows``): on the H200 (session #15) 0.49-0.81 of the unpacked time with
    few queries per head on a grid of enough tiles (B 8, or a 16k cache), 0.97-1.04 on
    the smallest grids. 256-key blocks at d64 (P through shared memory; H200, session #16):
    1.06-1.11 of the time dense at 512-4k, 1.08-1.81 causal, 0.98 at 16k dense only."""
    causal = problem.causal != "none"
    persistent = ((problem.head_dim <= 128 or _long_causal_d256(problem))
                  and not _uneven_document_walks(problem))
    block_n = 64 if problem.head_dim > 128 else 128
    return GluonFwdConfig(BLOCK_M=128, BLOCK_N=block_n, kv_stages=2, consumers=2,
                          warp_specialize=True, pingpong=True,
                          longest_first=causal and problem.mask == "none",
                          persistent=persistent,
                          tree_max=problem.head_dim == 64,
                          split_tail=persistent and problem.mask == "none",
                          pack_gqa=packing_fills_rows(problem, 128))


def _uneven_document_walks(problem: Problem) -> bool:
    """Causal packed documents at d128 (``documents_causal:<L>``): each query tile walks the
    keys of its document up to itself, so walks differ tile to tile, and one program per
    tile (the hardware hands the next tile to the SM that frees first) beats a persistent
    grid's static rounds in the mask's row order. Measured on the H200 (2026-11-30, 32/16
    and 32/8 heads, doc_offsets; ``docs_fwd_configs.py``, ``mask_vs_batch.py``), time with
    the persistent grid over without: 16 x 1024 in 16k 1.14, 8 x 2048 1.03, 4 x 4096 1.00,
    13 packed documents of 200-4000 in 16k 1.03 and 52 in 64k 1.01, the pattern's stand-in
    rows 1.06 (16k) and 1.12 (64k). A causal window's walks are even: persistent there
    (64k window 1024: 0.93 without it)."""
    return problem.head_dim == 128 and parse_pattern(problem.mask)[0] == "documents_causal"


# The shortest causal rows (N_q) at D = 256 where the persistent grid (the host's longest-first
# schedule, split tails) is the default; shorter ones keep one program per tile.
D256_PERSISTENT_CAUSAL_FROM = 4096


def _long_causal_d256(problem: Problem) -> bool:
    """Whether a D = 256 problem takes the persistent grid: causal without a block mask, with
    at least D256_PERSISTENT_CAUSAL_FROM query rows. At D = 256 only one Q buffer per consumer
    fits, so a persistent program loads a tile's Q only after the previous tile's last S
    GEMM; my reading of the numbers below (not measured apart): what the host's schedule
    gains on causal grids (programs balanced by their tiles' KV blocks) outweighs that wait
    only once tiles are long. Measured on the H200 (session #19, PROTOCOL shapes, 7 rounds,
    ``gluon_fwd_ab_h200_d256_persistent_causal.json``), persistent + split tails / one program
    per tile, time: causal 512 1.139, 1k 1.049, 2k 1.003, 4k 0.948, 8k 0.951, 16k 0.996
    (session #15: 4k 0.967, 16k 1.012; the long search's TPE: 4k 0.958); dense 1.01-1.12 at
    every length (``..._dense.json``), so dense stays off."""
    return (problem.head_dim > 128 and problem.causal != "none" and problem.mask == "none"
            and problem.seqlen_q >= D256_PERSISTENT_CAUSAL_FROM)


def packing_fills_rows(problem: Problem, block_m: int) -> bool:
    """Whether packed GQA (``pack_gqa``) fills the tiles' rows clearly better: the share of
    rows that hold a query unpacked under 3/4 of the share packed (N_q = 16 of 4 heads: 1
    tile of 64 queries instead of 4 of 16; N_q a multiple of BLOCK_M: no gain). On the H200
    a smaller gain did not pay: N_q = 200 of 4 heads (7 tiles instead of 8) read 1.00x
    dense and 0.96x causal (notes/gluon_notes.md, "Packed GQA"). Not with a block mask
    (refused)."""
    group = problem.heads_q // problem.heads_kv
    if group == 1 or problem.mask != "none":
        return False
    def filled(rows: int) -> float:
        return rows / (-(-rows // block_m) * block_m)
    return filled(problem.seqlen_q) < 0.75 * filled(group * problem.seqlen_q)


def _shrinking(cfg: GluonFwdConfig) -> list[GluonFwdConfig]:
    """``cfg``, then cheaper variants: fewer stages, smaller key blocks, one consumer."""
    out = [cfg]
    for stages in range(cfg.kv_stages - 1, 0, -1):
        out.append(dataclasses.replace(out[-1], kv_stages=stages))
    if out[-1].BLOCK_N > 64:
        out.append(dataclasses.replace(out[-1], BLOCK_N=64, kv_stages=cfg.kv_stages))
        for stages in range(cfg.kv_stages - 1, 0, -1):
            out.append(dataclasses.replace(out[-1], kv_stages=stages))
    out.append(dataclasses.replace(out[-1], BLOCK_M=64, consumers=1, pingpong=False,
                                   persistent=False, split_tail=False))
    return out


def standin_launch(problem: Problem, config: GluonFwdConfig, diag: int = 0) -> KernelLaunch:
    """The launch of ``config`` for ``problem`` over stand-in tensors (``diag``: a timing
    experiment's DIAG, see the kernel's ``_softmax_block``; benchmarks/gluon_sass_diff.py)."""
    assert kernel is not None
    dtype = TORCH_DTYPES[problem.dtype]
    q_shape = [problem.batch, problem.heads_q, problem.seqlen_q, problem.head_dim]
    kv_shape = [problem.batch, problem.heads_kv, problem.seqlen_kv, problem.head_dim]
    q = StandinTensor(dtype, q_shape)
    k, v = StandinTensor(dtype, kv_shape), StandinTensor(dtype, kv_shape)
    block_mask: Any = (StandinBlockMask(problem.seqlen_q, problem.seqlen_kv)
                       if problem.mask != "none" else None)
    data = config.to_dict()
    data["doc_offsets"] = config.doc_offsets and block_mask is not None
    plan = kernel.LaunchPlan(q, k, causal_mode=problem.causal,
                             scale=1.0 / math.sqrt(problem.head_dim), config=data,
                             diag=diag, block_mask=block_mask)
    if data["doc_offsets"]:  # the rows' first keys (int32) where the tiles go
        rows = row_ranges.tile_rows(problem.seqlen_q, config.BLOCK_M)
        block_mask = _StandinFirstKeys(block_mask, StandinTensor(torch.int32, [rows]))
    # (As the plan allocates them: packed GQA runs on (B, H_kv, group x N_q) rows.)
    o = StandinTensor(dtype, list(plan.out_shape))
    lse = StandinTensor(torch.float32, list(plan.lse_shape))
    return (kernel._gluon_fwd_kernel, plan.grid,
            plan.args(plan.packed(q), k, v, o, lse, block_mask), dict(plan.options))


@dataclass(frozen=True)
class _StandinFirstKeys:
    """A stand-in block mask as the doc_offsets kernel reads it (``WithFirstKeys``)."""

    mask: StandinBlockMask
    first: StandinTensor

    def kernel_args(self) -> list[Any]:
        args = self.mask.kernel_args()
        return [*args[:5], self.first, *args[6:]]


def compile_for(problem: Problem, config: KernelConfig) -> Any:
    """Triton's compiled kernel for ``problem``'s inputs under ``config``, without allocating
    or launching anything (needs a Hopper GPU or an ``offline_target``)."""
    ((fn, grid, args, options),) = TEMPLATE.standin_launches(problem, config)
    return fn.warmup(*args, grid=grid, **options)


# ----------------------------------------------------------------------------- entry point
def gluon_attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                        causal: bool | str = False, scale: float | None = None,
                        config: GluonFwdConfig | Mapping[str, object] | None = None,
                        block_mask: BlockMask | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention forward on a Hopper GPU: (o, lse) of softmax(scale * q k^T [causal]
    [block mask]) v.

    Args:
        q: (B, H_q, N_q, D) float16 or bfloat16 on a CUDA device of compute capability 9.x,
            D in 64, 128, 256; any strides (layouts TMA cannot read are copied first).
        k, v: (B, H_kv, N_kv, D), same dtype and device; H_q a multiple of H_kv (GQA/MQA).
        causal: False / "none"; True / "top_left" (query i sees keys j <= i, as torch SDPA);
            "bottom_right" (j <= i + N_kv - N_q, as FlashAttention-2 with a KV cache).
        scale: softmax scale (> 0), default 1/sqrt(D).
        config: a ``GluonFwdConfig`` or a mapping of its fields; None takes the template's
            default for this problem (fitted to the block mask's blocks, if one is given).
        block_mask: a ``BlockMask`` for (N_q, N_kv), batch and head dims 1 or B / H_q, on q's
            device: only the blocks it lists are computed (with ``causal`` too, both apply).
            BLOCK_M and BLOCK_N must divide its block size (the default's 128 do).

    Returns:
        o (B, H_q, N_q, D) in q's dtype, contiguous or laid out as q (``output_strides``);
        lse (B, H_q, N_q) float32, the natural logsumexp of the scaled scores (-inf, with
        o = 0, for rows that see no key).

    Raises:
        TypeError / ValueError naming the offending argument or the constraint the config
        violates; RuntimeError where Gluon is missing.
    """
    if kernel is None:
        raise RuntimeError(GLUON_MISSING)
    key = _plan_key(q, k, v, causal, scale, config, block_mask)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _validated_plan(q, k, v, causal, scale, config, block_mask)
        _PLANS.put(key, plan)
    if plan.copy_inputs:
        q, k, v = kernel.tma_ready(q), kernel.tma_ready(k), kernel.tma_ready(v)
    if plan.first_key_rows:
        return plan(q, k, v, WithFirstKeys(block_mask, plan.first_key_rows))
    return plan(q, k, v, block_mask)


_PLANS: PlanCache[Any] = PlanCache(maxsize=1024)



def _plan_key(q: Any, k: Any, v: Any, causal: Any, scale: Any, config: Any, block_mask: Any
              ) -> tuple[object, ...] | None:
    """What ``_validated_plan`` reads from its arguments (shapes, strides, dtype, device,
    16-byte alignment, causal, scale, config, the block mask's geometry), or None where no
    plan is kept."""
    if kernel is None or (block_mask is not None and not isinstance(block_mask, BlockMask)):
        return None
    if config is not None and not isinstance(config, GluonFwdConfig):
        if not isinstance(config, Mapping):
            return None
        try:
            config = TEMPLATE.config(config)
        except (TypeError, ValueError):
            return None
    try:
        return (q.__class__, k.__class__, v.__class__, q.shape, k.shape, v.shape,
                q.stride(), k.stride(), v.stride(), q.dtype, k.dtype, v.dtype,
                q.device, k.device, v.device, (q.data_ptr() | k.data_ptr() | v.data_ptr()) % 16,
                causal.__class__, causal, scale.__class__, scale, config,
                kernel.mask_key(block_mask), rows_take_offsets(block_mask))
    except (AttributeError, TypeError, RuntimeError):
        return None


def _validated_plan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool | str,
                    scale: float | None, config: GluonFwdConfig | Mapping[str, object] | None,
                    block_mask: BlockMask | None) -> Any:
    assert kernel is not None
    causal_mode, softmax_scale = kernel.validate_inputs(q, k, v, causal, scale)
    if softmax_scale <= 0:
        raise ValueError(f"scale must be positive (the softmax takes the row max, and sets "
                         f"hidden scores to -inf, before scaling), but got {softmax_scale}")
    if block_mask is not None:
        check_block_mask(block_mask, q, k)
    cfg = TEMPLATE.config_to_run(q, k, causal_mode, config,
                                 None if block_mask is None else block_mask.block_size)
    assert isinstance(cfg, GluonFwdConfig)
    data = cfg.to_dict()
    # doc_offsets only where the mask's rows are one causal range each; others keep tiles.
    data["doc_offsets"] = cfg.doc_offsets and rows_take_offsets(block_mask)
    plan = kernel.LaunchPlan(q, k, causal_mode=causal_mode, scale=softmax_scale,
                             config=data, block_mask=block_mask)
    # (doc_offsets) the rows' first keys cover every row of the grid's query tiles.
    plan.first_key_rows = (row_ranges.tile_rows(q.shape[2], cfg.BLOCK_M)
                           if data["doc_offsets"] else 0)
    plan.copy_inputs = any(kernel.tma_layout_problem(t, name) is not None
                           for name, t in (("q", q), ("k", k), ("v", v)))
    return plan


TEMPLATE = GluonFwdTemplate()
register(TEMPLATE)
