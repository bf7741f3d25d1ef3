"""The backward FlashAttention template: its search space, constraints, defaults and entry point.

The kernels and their launcher live in ``templates.flash.bwd_kernel`` (torch + triton only, so
it can be emitted as standalone source); this module adds what the tuner and users need around
them. The backward takes the forward's ``o`` and ``lse`` and the incoming gradient ``do`` and
returns ``(dq, dk, dv)``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch

from templates import kernel_common
from templates.attention_reference import (
    FLOAT64_SCORE_LIMIT,
    attention_reference,
    forward_flops,
)
from templates.base import KernelConfig, KernelLaunch, Problem, Template, knob, next_pow2
from templates.compile.plan_cache import PlanCache
from templates.compile.plan_keys import NO_PLAN, config_key, layout_key
from templates.compile.standin_tensor import StandinTensor
from templates.device import (
    DeviceInfo,
    check_interpreter_usable,
    current_device,
    interpreter_active,
)
from templates.flash import bwd_kernel as kernel
from templates.flash import softcap as softcap_kernel
from templates.flash.bwd_plan import BackwardPlan, block_mask_key
from templates.flash.fwd import check_block_mask, flash_attention_fwd, pattern_mask
from templates.flash.fwd_kernel import attn_mask_view
from templates.interpreter_dtype import as_float32, runs_in_float32
from templates.masks import listed_blocks
from templates.masks.block_mask import DEFAULT_BLOCK_SIZE, BlockMask
from templates.masks.mods import pattern_problem
from templates.registry import register

DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}
DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}
TORCH_DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}
TILES = (16, 32, 64, 128)  # tl.dot needs every dimension >= 16

# Bound on the 32-bit registers one thread needs for what stays live in a pass's loop: the
# fp32 accumulators, the loop-invariant operand tiles and two fp32 score tiles (P and dP),
# over 32 * num_warps threads. A thread has at most 255 registers; above this it spills.
# GUESS until calibrated on the GPU: the Triton tutorial's d=64 backward config (32x128 tiles,
# 4 warps) sits exactly at the bound.
MAX_REGISTERS_PER_THREAD = 256
# Shared memory the estimate does not itemize: barriers, small row vectors (a guess).
SMEM_SLACK_BYTES = 2048
# Score elements per chunk of the autograd reference (float32: 1 GiB per score-sized tensor).
REFERENCE_CHUNK_SCORES = 1 << 28


@dataclass(frozen=True)
class BwdConfig(KernelConfig):
    """One point of the backward kernels' search space."""

    BLOCK_M1: int = knob(
        32, TILES,
        "dK/dV pass: query rows per loop step. Larger steps mean fewer steps and bigger MMAs, "
        "but two BLOCK_N1 x BLOCK_M1 fp32 score tiles more per thread and a bigger Q/dO "
        "pipeline buffer per stage.")
    BLOCK_N1: int = knob(
        128, TILES,
        "dK/dV pass: keys per program. Its dK and dV accumulators (BLOCK_N1 x D fp32 each) stay "
        "in registers for the whole query walk; larger tiles reread Q/dO fewer times but need "
        "more registers and launch fewer programs.")
    BLOCK_M2: int = knob(
        128, TILES,
        "dQ pass (dq_mode=separate): query rows per program, whose dQ accumulator (BLOCK_M2 x "
        "D fp32) stays in registers. Unused with dq_mode=atomic.")
    BLOCK_N2: int = knob(
        32, TILES,
        "dQ pass (dq_mode=separate): keys per loop step; the K/V pipeline buffer per stage. "
        "Unused with dq_mode=atomic.")
    num_warps: int = knob(
        8, (4, 8),
        "Warps per program in the dK/dV and dQ passes. 8 splits the accumulators over more "
        "threads (fewer registers each) at the cost of more synchronization per tile.")
    num_stages: int = knob(
        3, (1, 2, 3, 4, 5),
        "Software-pipeline depth of both walks: tiles in flight at once. Deeper hides memory "
        "latency but multiplies the streamed tiles' shared-memory buffers.")
    dq_mode: str = knob(
        "separate", kernel.DQ_MODES,
        "How dQ is formed. atomic: the dK/dV pass adds dS K into an fp32 buffer with atomics "
        "(no recomputation, but atomic traffic and a nondeterministic summation order). "
        "separate: a second kernel per query tile recomputes Q K^T and dO V^T (40% more "
        "matmul work, deterministic, no atomics).")


def block_d(problem: Problem) -> int:
    return kernel.block_d_for(problem.head_dim)


def shared_memory_estimate(problem: Problem, config: BwdConfig) -> dict[str, int]:
    """Bytes of shared memory per pass: the streamed tiles of each pipeline stage, the tiles
    loaded once, and the converted score tile fed back into a dot."""
    esize = DTYPE_BYTES[problem.dtype]
    d = block_d(problem)
    stages = max(1, config.num_stages)
    dkdv = (stages * 2 * config.BLOCK_M1 * d * esize      # Q and dO, per stage
            + 2 * config.BLOCK_N1 * d * esize             # K and V, loaded once
            + config.BLOCK_N1 * config.BLOCK_M1 * esize   # P^T / dS^T as a dot operand
            + SMEM_SLACK_BYTES)
    if config.dq_mode == "atomic":
        dkdv += config.BLOCK_M1 * d * 4  # layout conversion of the fp32 dQ tile for atomics
    estimate = {"dK/dV": dkdv}
    if config.dq_mode == "separate":
        estimate["dQ"] = (stages * 2 * config.BLOCK_N2 * d * esize    # K and V, per stage
                          + 2 * config.BLOCK_M2 * d * esize           # Q and dO, loaded once
                          + config.BLOCK_M2 * config.BLOCK_N2 * esize  # dS as a dot operand
                          + SMEM_SLACK_BYTES)
    return estimate


def registers_estimate(problem: Problem, config: BwdConfig) -> dict[str, int]:
    """32-bit registers per thread each pass keeps live across its loop (see the bound)."""
    words = DTYPE_BYTES[problem.dtype] / 4
    d = block_d(problem)
    threads = 32 * config.num_warps
    n1, m1 = config.BLOCK_N1, config.BLOCK_M1
    estimate = {"dK/dV": int((2 * n1 * d + 2 * n1 * d * words + 2 * n1 * m1) / threads)}
    if config.dq_mode == "separate":
        m2, n2 = config.BLOCK_M2, config.BLOCK_N2
        estimate["dQ"] = int((m2 * d + 2 * m2 * d * words + 2 * m2 * n2) / threads)
    return estimate


class FlashBwdTemplate(Template):
    name = "flash_bwd"
    takes_softcap = True
    description = ("FlashAttention-2 backward: (dq, dk, dv) from q, k, v, o, do and the "
                   "forward's lse, recomputing P tile by tile; dK/dV per KV tile with the GQA "
                   "group summed in-program, dQ by fp32 atomics or a separate pass; dense, "
                   "causal top-left or bottom-right, block-sparse (the dK/dV pass walks the "
                   "transposed block lists) and SDPA attn_mask, head dim <= 256.")
    config_cls = BwdConfig

    def source_modules(self) -> Sequence[str]:
        return [kernel.__name__, kernel_common.__name__, listed_blocks.__name__,
                softcap_kernel.__name__, __name__]

    # -- the problem --------------------------------------------------------------------------
    def unsupported(self, problem: Problem) -> str | None:
        reason = super().unsupported(problem)  # a softcapped problem, where it does not cap
        if reason:
            return reason
        if problem.mask != "none":
            reason = pattern_problem(problem.mask, problem.seqlen_q, problem.seqlen_kv)
            if reason:
                return reason
        if problem.head_dim > kernel.MAX_HEAD_DIM:
            return (f"flash_bwd supports head_dim <= {kernel.MAX_HEAD_DIM}, but got "
                    f"{problem.head_dim}")
        return None

    def flops(self, problem: Problem) -> float:
        """2.5 x the forward's FLOPs (the FlashAttention papers' convention, PROTOCOL.md)."""
        return 2.5 * forward_flops(problem)

    def bytes_moved(self, problem: Problem) -> float:
        """Read q, k, v, o, do and lse once; write dq, dk, dv."""
        esize = DTYPE_BYTES[problem.dtype]
        q_like = problem.batch * problem.heads_q * problem.seqlen_q * problem.head_dim
        k_like = problem.batch * problem.heads_kv * problem.seqlen_kv * problem.head_dim
        rows = problem.batch * problem.heads_q * problem.seqlen_q
        return float(esize * (4 * q_like + 4 * k_like) + 4 * rows)

    # -- the space ----------------------------------------------------------------------------
    def constraint(self, problem: Problem, config: KernelConfig, device: DeviceInfo) -> str | None:
        """Why ``config`` is not worth a trial for ``problem`` on ``device``: it cannot run
        (``hard_constraint``), or it wastes work (a tile larger than the sequence, idle warps,
        knobs the dq_mode ignores set away from their defaults), or it would spill registers."""
        cfg = self.config(config)
        assert isinstance(cfg, BwdConfig)
        return (self.hard_constraint(problem, cfg, device) or _redundancy_reason(problem, cfg)
                or _warp_reason(cfg) or _register_reason(problem, cfg))

    def hard_constraint(self, problem: Problem, config: KernelConfig, device: DeviceInfo
                        ) -> str | None:
        """Why ``config`` cannot run ``problem`` on ``device`` at all (None if it can): the
        part of ``constraint`` that an explicitly requested config must satisfy."""
        cfg = self.config(config)
        assert isinstance(cfg, BwdConfig)
        mask_reason = None
        if problem.mask != "none":  # sweep problems use the default mask block size
            mask_reason = block_mask_tile_reason(cfg, (DEFAULT_BLOCK_SIZE, DEFAULT_BLOCK_SIZE))
        return (self.unsupported(problem) or mask_reason
                or _shared_memory_reason(problem, cfg, device))

    def default_config(self, problem: Problem, device: DeviceInfo) -> KernelConfig:
        return _default_config(self, problem, device)

    # -- running and checking -----------------------------------------------------------------
    def make_inputs(self, problem: Problem, device: str, seed: int = 0) -> dict[str, Any]:
        """Random q, k, v, do; o and lse from the forward kernel (or the reference forward
        where the forward template is not available)."""
        gen = torch.Generator(device=device).manual_seed(seed)
        dtype = TORCH_DTYPES[problem.dtype]

        def randn(heads: int, seqlen: int) -> torch.Tensor:
            shape = (problem.batch, heads, seqlen, problem.head_dim)
            return torch.randn(shape, generator=gen, device=device, dtype=dtype)

        q = randn(problem.heads_q, problem.seqlen_q)
        k = randn(problem.heads_kv, problem.seqlen_kv)
        v = randn(problem.heads_kv, problem.seqlen_kv)
        do = randn(problem.heads_q, problem.seqlen_q)
        scale = 1.0 / math.sqrt(problem.head_dim)
        block_mask = None
        if problem.mask != "none":
            block_mask = pattern_mask(problem.mask, problem.seqlen_q, problem.seqlen_kv,
                                       str(device))
        o, lse = forward_for_backward(q, k, v, causal=problem.causal, scale=scale,
                                      block_mask=block_mask, softcap=problem.softcap)
        inputs = {"q": q, "k": k, "v": v, "o": o, "lse": lse, "do": do,
                  "causal": problem.causal, "scale": scale}
        if problem.softcap:
            inputs["softcap"] = problem.softcap
        if block_mask is not None:
            inputs["block_mask"] = block_mask
        return inputs

    def run(self, inputs: Mapping[str, Any], config: KernelConfig) -> Any:
        cfg = self.config(config)
        assert isinstance(cfg, BwdConfig)
        return flash_attention_bwd(inputs["do"], inputs["q"], inputs["k"], inputs["v"],
                                   inputs["o"], inputs["lse"], causal=inputs["causal"],
                                   scale=inputs["scale"], config=cfg,
                                   block_mask=inputs.get("block_mask"),
                                   softcap=inputs.get("softcap"))

    def kernel_launches(self, problem: Problem, config: KernelConfig) -> list[KernelLaunch] | None:
        """The launches ``run`` makes, in order (dense problems only: a block mask's tensors
        have no stand-ins)."""
        if problem.mask != "none":
            return None
        cfg = self.config(config)
        assert isinstance(cfg, BwdConfig)
        dtype = TORCH_DTYPES[problem.dtype]
        q_shape = (problem.batch, problem.heads_q, problem.seqlen_q, problem.head_dim)
        kv_shape = (problem.batch, problem.heads_kv, problem.seqlen_kv, problem.head_dim)
        rows = q_shape[:3]
        dq_dtype = torch.float32 if cfg.dq_mode == "atomic" else dtype
        return kernel.kernel_calls(
            StandinTensor(dtype, q_shape), StandinTensor(dtype, q_shape),
            StandinTensor(dtype, kv_shape), StandinTensor(dtype, kv_shape),
            StandinTensor(dtype, q_shape), StandinTensor(torch.float32, rows),
            StandinTensor(torch.float32, rows), StandinTensor(torch.float32, rows),
            StandinTensor(dq_dtype, q_shape), StandinTensor(dtype, kv_shape),
            StandinTensor(dtype, kv_shape),
            causal_mode=problem.causal, scale=1.0 / math.sqrt(problem.head_dim),
            config=cfg.to_dict(), softcap=problem.softcap)

    def reference(self, inputs: Mapping[str, Any]) -> Any:
        block_mask = inputs.get("block_mask")
        return reference_grads(inputs["q"], inputs["k"], inputs["v"], inputs["do"],
                               causal=kernel.normalize_causal(inputs["causal"]),
                               scale=inputs["scale"],
                               mask=None if block_mask is None else block_mask.to_dense(),
                               softcap=inputs.get("softcap", 0.0))

    # -- code generation ----------------------------------------------------------------------
    def standalone_source(self, config: KernelConfig) -> str:
        return self._kernel_module_with_config(kernel, _STANDALONE_ENTRY, config)


_STANDALONE_ENTRY = '''

# ----------------------------------------------------------------------------- baked-in config
CONFIG: dict[str, object] = CONFIG_LITERAL


def flash_attention_bwd(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        o: torch.Tensor, lse: torch.Tensor, *, causal: bool | str = False,
                        scale: float | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of softmax(scale * q k^T) v with the config above baked in.

    q, o, do: (B, H_q, N_q, D); k, v: (B, H_kv, N_kv, D), any strides; lse: (B, H_q, N_q)
    float32, the forward's natural-log logsumexp; causal: False, True (= "top_left"), "none",
    "top_left" or "bottom_right"; scale defaults to 1/sqrt(D).
    """
    causal_mode, softmax_scale = validate_inputs(do, q, k, v, o, lse, causal, scale)
    return launch(do, q, k, v, o, lse, causal_mode=causal_mode, scale=softmax_scale,
                  config=CONFIG)
'''


# ----------------------------------------------------------------------------- constraints
def _tile_limits(problem: Problem) -> tuple[int, int]:
    """The largest useful query and key tiles: the lengths rounded up to a power of two."""
    return max(16, next_pow2(problem.seqlen_q)), max(16, next_pow2(problem.seqlen_kv))


def _redundancy_reason(problem: Problem, cfg: BwdConfig) -> str | None:
    """Configs that compute exactly what a smaller or canonical one does: not worth a trial."""
    default = BwdConfig()
    if cfg.dq_mode == "atomic" and (cfg.BLOCK_M2, cfg.BLOCK_N2) != (default.BLOCK_M2,
                                                                     default.BLOCK_N2):
        return (f"BLOCK_M2/BLOCK_N2 are unused with dq_mode='atomic'; keep them at their "
                f"defaults ({default.BLOCK_M2}, {default.BLOCK_N2}) so one kernel is not "
                f"measured under several names")
    q_limit, kv_limit = _tile_limits(problem)
    tiles = [("BLOCK_M1", cfg.BLOCK_M1, "seqlen_q", problem.seqlen_q, q_limit),
             ("BLOCK_N1", cfg.BLOCK_N1, "seqlen_kv", problem.seqlen_kv, kv_limit)]
    if cfg.dq_mode == "separate":
        tiles += [("BLOCK_M2", cfg.BLOCK_M2, "seqlen_q", problem.seqlen_q, q_limit),
                  ("BLOCK_N2", cfg.BLOCK_N2, "seqlen_kv", problem.seqlen_kv, kv_limit)]
    for name, tile, length_name, length, limit in tiles:
        if tile > limit:
            return (f"{name}={tile} is larger than {length_name}={length} needs ({limit} "
                    f"covers it): a smaller tile computes the same with less padding")
    return None


def _warp_reason(cfg: BwdConfig) -> str | None:
    """Every thread should hold at least two elements of a pass's score tile; below that the
    warps replicate each other's work (16x16 tiles still fit 4 warps, for tiny problems)."""
    passes = [("dK/dV", cfg.BLOCK_N1, cfg.BLOCK_M1, "BLOCK_N1 x BLOCK_M1")]
    if cfg.dq_mode == "separate":
        passes.append(("dQ", cfg.BLOCK_M2, cfg.BLOCK_N2, "BLOCK_M2 x BLOCK_N2"))
    for pass_name, rows, cols, names in passes:
        if rows * cols < cfg.num_warps * 32 * 2:
            return (f"the {pass_name} score tile {names} = {rows}x{cols} gives each of the "
                    f"{32 * cfg.num_warps} threads of {cfg.num_warps} warps fewer than two "
                    f"elements; use fewer warps or larger tiles")
    return None


def _shared_memory_reason(problem: Problem, cfg: BwdConfig, device: DeviceInfo) -> str | None:
    for pass_name, smem in shared_memory_estimate(problem, cfg).items():
        if smem > device.smem_per_block:
            return (f"the {pass_name} pass needs about {smem // 1024} KiB of shared memory "
                    f"({max(1, cfg.num_stages)} pipeline stage(s), head dim padded to "
                    f"{block_d(problem)}, {problem.dtype}), more than the "
                    f"{device.smem_per_block // 1024} KiB a program may use on {device.name}; "
                    f"use fewer stages or smaller tiles")
    return None


def _register_reason(problem: Problem, cfg: BwdConfig) -> str | None:
    for pass_name, registers in registers_estimate(problem, cfg).items():
        if registers > MAX_REGISTERS_PER_THREAD:
            return (f"the {pass_name} pass would keep about {registers} registers per thread "
                    f"live (accumulators, operand tiles and scores over {cfg.num_warps} warps, "
                    f"head dim padded to {block_d(problem)}), more than "
                    f"{MAX_REGISTERS_PER_THREAD}: registers would spill; use more warps or "
                    f"smaller tiles")
    return None


# ----------------------------------------------------------------------------- defaults
def _heuristic(problem: Problem, device: DeviceInfo) -> BwdConfig:
    """Starting point per GPU family and head dim, before fitting it to the constraints."""
    d = problem.head_dim
    if device.is_interpreter:
        # Measured under the interpreter (2-core CPU, N=17..100, d=40..64): per-op overhead
        # dominates, so 32-row tiles run 2-4x faster than 16-row ones, and atomic dQ (two
        # kernels instead of three) is faster still.
        cfg = BwdConfig(BLOCK_M1=32, BLOCK_N1=32, num_warps=4, num_stages=1, dq_mode="atomic")
    elif device.family in ("hopper", "blackwell"):
        # GUESSES, to be replaced by measured winners (benchmarks/fwd_bwd_bench.py): the
        # Triton tutorial's backward tiles, more warps as the head dim grows.
        if d <= 64:
            cfg = BwdConfig(BLOCK_M1=32, BLOCK_N1=128, BLOCK_M2=128, BLOCK_N2=32,
                            num_warps=4, num_stages=5)
        elif d <= 128 and problem.mask != "none":
            # Measured (H100, masked_fwd_bwd_h100.json, notes/benchmarks_notes.md): the
            # backward grid's winner on 5 of the 6 d128 block-mask rows, 1.17-1.22x faster
            # than the tiles below.
            cfg = BwdConfig(BLOCK_M1=64, BLOCK_N1=64, BLOCK_M2=64, BLOCK_N2=64,
                            num_warps=4, num_stages=2)
        elif d <= 128:
            cfg = BwdConfig(BLOCK_M1=32, BLOCK_N1=128, BLOCK_M2=128, BLOCK_N2=32,
                            num_warps=8, num_stages=3)
        else:
            cfg = BwdConfig(BLOCK_M1=32, BLOCK_N1=64, BLOCK_M2=64, BLOCK_N2=32,
                            num_warps=8, num_stages=2)
    else:
        # GUESSES for mma.sync GPUs with 99-163 KiB of shared memory.
        if d <= 64:
            cfg = BwdConfig(BLOCK_M1=32, BLOCK_N1=128, BLOCK_M2=128, BLOCK_N2=32,
                            num_warps=4, num_stages=3)
        elif d <= 128:
            cfg = BwdConfig(BLOCK_M1=32, BLOCK_N1=64, BLOCK_M2=64, BLOCK_N2=32,
                            num_warps=4, num_stages=2)
        else:
            cfg = BwdConfig(BLOCK_M1=16, BLOCK_N1=64, BLOCK_M2=64, BLOCK_N2=16,
                            num_warps=8, num_stages=1)
    # Short sequences: no tile larger than the sequence (rounded up to a power of two).
    q_limit, kv_limit = _tile_limits(problem)
    cfg = dataclasses.replace(cfg, BLOCK_M1=min(cfg.BLOCK_M1, q_limit),
                              BLOCK_N1=min(cfg.BLOCK_N1, kv_limit))
    if cfg.dq_mode == "separate":
        cfg = dataclasses.replace(cfg, BLOCK_M2=min(cfg.BLOCK_M2, q_limit),
                                  BLOCK_N2=min(cfg.BLOCK_N2, kv_limit))
    if _warp_reason(cfg):  # tiles clamped to a short sequence: fewer warps
        cfg = dataclasses.replace(cfg, num_warps=4)
    return cfg


def _distance(cfg: BwdConfig, start: BwdConfig) -> float:
    """How far ``cfg`` strays from ``start``; growing a tile costs more than shrinking it."""
    cost = 0.0
    for name in ("BLOCK_M1", "BLOCK_N1", "BLOCK_M2", "BLOCK_N2", "num_warps"):
        step = math.log2(getattr(cfg, name) / getattr(start, name))
        cost += 2 * step if step > 0 else -step
    cost += 0.5 * abs(cfg.num_stages - start.num_stages)
    return cost + (10.0 if cfg.dq_mode != start.dq_mode else 0.0)


@lru_cache(maxsize=1)
def _space() -> tuple[BwdConfig, ...]:
    return tuple(BwdConfig.grid())


def _shrinking(cfg: BwdConfig) -> list[BwdConfig]:
    """``cfg``, then ever cheaper variants: more warps, fewer stages, halved tiles."""
    out = [cfg, dataclasses.replace(cfg, num_warps=8)]
    for stages in range(cfg.num_stages - 1, 0, -1):
        out.append(dataclasses.replace(out[-1], num_stages=stages))
    while True:
        last = out[-1]
        n1, m1, m2, n2 = last.BLOCK_N1, last.BLOCK_M1, last.BLOCK_M2, last.BLOCK_N2
        if n1 >= m1 and n1 > 16:
            n1 //= 2
        elif m1 > 16:
            m1 //= 2
        if last.dq_mode == "separate":
            if m2 >= n2 and m2 > 16:
                m2 //= 2
            elif n2 > 16:
                n2 //= 2
        smaller = dataclasses.replace(last, BLOCK_N1=n1, BLOCK_M1=m1, BLOCK_M2=m2, BLOCK_N2=n2)
        if smaller == last:
            return out
        out.append(smaller)


@lru_cache(maxsize=512)
def _default_config(template: FlashBwdTemplate, problem: Problem, device: DeviceInfo
                    ) -> BwdConfig:
    start = _heuristic(problem, device)
    for candidate in _shrinking(start):
        if template.constraint(problem, candidate, device) is None:
            return candidate
    # The greedy path found nothing: the nearest valid point of the space (same dq_mode).
    nearby = [c for c in _space() if c.dq_mode == start.dq_mode]
    for candidate in sorted(nearby, key=lambda c: _distance(c, start)):
        if template.constraint(problem, candidate, device) is None:
            return candidate
    raise RuntimeError(f"no backward config fits {problem.key()} on {device.name}: "
                       f"{template.constraint(problem, start, device)}")


# ----------------------------------------------------------------------------- references
def forward_for_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: str,
                         scale: float, block_mask: BlockMask | None = None,
                         softcap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, lse) the backward consumes: the forward kernel's."""
    return flash_attention_fwd(q, k, v, causal=causal, scale=scale, block_mask=block_mask,
                               softcap=softcap)


def reference_grads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, *,
                    causal: str, scale: float, mask: torch.Tensor | None = None,
                    softcap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) by torch autograd through the plain-torch reference attention.

    ``mask`` as ``attention_reference``'s (bool or additive, broadcast to (B, H_q, N_q,
    N_kv)), ``softcap`` as its. float64, or float32 on a GPU for large problems; computed
    per chunk of (batch, kv
    heads) so that memory stays bounded by REFERENCE_CHUNK_SCORES score elements per tensor.
    """
    batch, heads_q, seqlen_q, _ = q.shape
    heads_kv, seqlen_kv = k.shape[1], k.shape[2]
    group = heads_q // heads_kv
    big_on_gpu = q.is_cuda and batch * heads_q * seqlen_q * seqlen_kv > FLOAT64_SCORE_LIMIT
    compute = torch.float32 if big_on_gpu else torch.float64
    kv_heads_per_chunk = max(1, REFERENCE_CHUNK_SCORES // (group * seqlen_q * seqlen_kv))
    grads = [torch.empty(t.shape, device=t.device, dtype=compute) for t in (q, k, v)]
    for b in range(batch):
        for h0 in range(0, heads_kv, kv_heads_per_chunk):
            h1 = min(heads_kv, h0 + kv_heads_per_chunk)
            q_heads, kv_heads = slice(h0 * group, h1 * group), slice(h0, h1)
            leaves = [t[b:b + 1, heads].to(compute).requires_grad_()
                      for t, heads in ((q, q_heads), (k, kv_heads), (v, kv_heads))]
            chunk_mask = None if mask is None else mask.expand(
                batch, heads_q, seqlen_q, seqlen_kv)[b:b + 1, q_heads]
            with torch.enable_grad():
                o, _ = attention_reference(*leaves, causal=causal, scale=scale,
                                           compute_dtype=compute, mask=chunk_mask,
                                           softcap=softcap)
                chunk = torch.autograd.grad(o, leaves, do[b:b + 1, q_heads].to(compute))
            for out, part, heads in zip(grads, chunk, (q_heads, kv_heads, kv_heads),
                                        strict=True):
                out[b:b + 1, heads] = part
    return grads[0], grads[1], grads[2]


# ----------------------------------------------------------------------------- entry point
def problem_of(q: torch.Tensor, k: torch.Tensor, causal_mode: str,
               softcap: float = 0.0) -> Problem:
    return Problem(batch=q.shape[0], heads_q=q.shape[1], heads_kv=k.shape[1],
                   seqlen_q=q.shape[2], seqlen_kv=k.shape[2], head_dim=q.shape[3],
                   dtype=DTYPE_NAMES[q.dtype], causal=causal_mode, softcap=softcap)


def resolve_config(config: BwdConfig | Mapping[str, object] | None, problem: Problem,
                   device: DeviceInfo, block_size: tuple[int, int] | None = None) -> BwdConfig:
    """The config to launch: the default for ``problem`` on ``device`` when None (with tiles
    fitted to a block mask of ``block_size``), else ``config`` validated against the space and
    the hard constraints (an explicit config may be wasteful for this problem, e.g. tiles
    longer than a short sequence, but it must run)."""
    if config is None:
        cfg = TEMPLATE.default_config(problem, device)
        assert isinstance(cfg, BwdConfig)
        return cfg if block_size is None else fit_to_block_mask(cfg, block_size)
    if not isinstance(config, BwdConfig | Mapping):
        raise TypeError(f"config must be a BwdConfig, a mapping of its fields or None, "
                        f"but got {type(config).__name__}")
    cfg = TEMPLATE.config(config)
    assert isinstance(cfg, BwdConfig)
    reason = TEMPLATE.hard_constraint(problem, cfg, device)
    if not reason and block_size is not None:
        reason = block_mask_tile_reason(cfg, block_size)
    if reason:
        raise ValueError(f"config {cfg.key()} cannot run {problem.key()} on {device.name}: "
                         f"{reason}")
    return cfg


def block_mask_tile_reason(config: BwdConfig, block_size: tuple[int, int]) -> str | None:
    """Why ``config``'s tiles cannot walk a block mask of ``block_size`` (None if they can):
    every query tile must lie inside one mask row block, every KV tile inside one mask block."""
    q_block, kv_block = block_size
    tiles = [("BLOCK_M1", config.BLOCK_M1, q_block), ("BLOCK_N1", config.BLOCK_N1, kv_block)]
    if config.dq_mode == "separate":
        tiles += [("BLOCK_M2", config.BLOCK_M2, q_block), ("BLOCK_N2", config.BLOCK_N2, kv_block)]
    for name, tile, block in tiles:
        if block % tile:
            return (f"{name} ({tile}) must divide the block mask's block size {block_size} "
                    f"(query, kv)")
    return None


def fit_to_block_mask(config: BwdConfig, block_size: tuple[int, int]) -> BwdConfig:
    """``config`` with tiles no larger than the mask's blocks (both powers of two, so the
    smaller divides the larger)."""
    q_block, kv_block = block_size
    return dataclasses.replace(config, BLOCK_M1=min(config.BLOCK_M1, q_block),
                               BLOCK_N1=min(config.BLOCK_N1, kv_block),
                               BLOCK_M2=min(config.BLOCK_M2, q_block),
                               BLOCK_N2=min(config.BLOCK_N2, kv_block))


def flash_attention_bwd(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        o: torch.Tensor, lse: torch.Tensor, *, causal: bool | str = False,
                        scale: float | None = None,
                        config: BwdConfig | Mapping[str, object] | None = None,
                        attn_mask: torch.Tensor | None = None,
                        block_mask: BlockMask | None = None, softcap: float | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention backward: (dq, dk, dv) of o = softmax(scale * q k^T [masked]) v.

    Args:
        do: (B, H_q, N_q, D), the gradient of o; any strides.
        q: (B, H_q, N_q, D) float16, bfloat16 or float32, any strides.
        k, v: (B, H_kv, N_kv, D), same dtype and device; H_q a multiple of H_kv (GQA/MQA).
        o: (B, H_q, N_q, D), the forward's output; any strides.
        lse: (B, H_q, N_q) float32, the forward's natural-log logsumexp of the scaled, masked
            scores (-inf for rows that see no key: their gradients are 0).
        causal: False / "none"; True / "top_left" (query i sees keys j <= i, as torch SDPA);
            "bottom_right" (j <= i + N_kv - N_q, as FlashAttention-2 with a KV cache).
        scale: softmax scale, default 1/sqrt(D); must be the forward's.
        config: a ``BwdConfig`` or a mapping of its fields; None takes the template's default
            for this problem and device.
        attn_mask, block_mask: the forward's (see ``flash_attention_fwd``); the gradients are
            those of the masked attention. attn_mask itself gets no gradient.
        softcap: the forward's cap (None or 0: none); the gradients are those of the capped
            scores, ``softcap * tanh(s / softcap)``.

    Returns:
        dq, dk, dv in the inputs' dtype and shapes (q's, k's, v's), each laid out as
        ``torch.empty_like`` of its input (a packed caller's gradients need no copy), dk and
        dv contiguous where k and v are laid out differently.

    Raises:
        TypeError / ValueError naming the offending argument, the config field, or the
        constraint the config violates for this problem and device.
    """
    key = _plan_key(do, q, k, v, o, lse, causal, scale, config, attn_mask, block_mask, softcap)
    planned = _PLANS.get(key)
    if planned is None:
        planned = _validated_plan(do, q, k, v, o, lse, causal, scale, config, attn_mask,
                                  block_mask, softcap)
        _PLANS.put(key, planned)
    return planned(do, q, k, v, o, lse, block_mask, attn_mask)


class PlannedBackward:
    """A kept ``BackwardPlan`` and what the entry does around it: the attn_mask's kernel view
    (``attn_mask_view``) and, for bf16 under the interpreter, float32 copies of the inputs
    (``templates.interpreter_dtype``), the gradients cast back to the inputs' dtypes."""

    def __init__(self, plan: BackwardPlan, upcast: bool) -> None:
        self.plan = plan
        self.upcast = upcast

    def __call__(self, do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 o: torch.Tensor, lse: torch.Tensor, block_mask: BlockMask | None,
                 attn_mask: torch.Tensor | None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        mask_view = None if attn_mask is None else attn_mask_view(attn_mask, q, k)
        if not self.upcast:
            return self.plan(do, q, k, v, o, lse, block_mask, mask_view)
        ldo, lq, lk, lv, lo = as_float32(do, q, k, v, o)
        dq, dk, dv = self.plan(ldo, lq, lk, lv, lo, lse, block_mask, mask_view)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


# Backward plans of flash_attention_bwd by _plan_key: a repeated call skips the checks, the
# config choice and the working out of its three launches, and launches them directly
# (templates.flash.bwd_plan). As the forward's: one per layout and mask geometry.
_PLANS: PlanCache[PlannedBackward] = PlanCache(maxsize=1024)


def _plan_key(do: Any, q: Any, k: Any, v: Any, o: Any, lse: Any, causal: Any, scale: Any,
              config: Any, attn_mask: Any, block_mask: Any, softcap: Any
              ) -> tuple[object, ...] | None:
    """Everything ``_validated_plan`` reads from its arguments, or None for arguments of a kind
    no plan is kept for (the full path then raises the right error).

    Tensors enter by class, shape, strides, dtype and device; an attn_mask likewise (its
    kernel view follows from those), a block mask by its geometry (``block_mask_key``);
    scalars with their class, so that 1 (refused) never matches True. A mapping config is
    validated into a BwdConfig first, on every call: pass a BwdConfig to skip that. Values
    never enter: the plan does not depend on them. Whether the six inputs' pointers are all
    16-byte aligned enters too (what Triton specializes on); the plan also checks every
    pointer at each call, those of the masks included, and launches misaligned ones through
    the JIT (``BackwardPlan``)."""
    config = config_key(TEMPLATE, config, BwdConfig)
    if config is NO_PLAN:
        return None
    try:
        return (layout_key(do, q, k, v, o, lse),
                (do.data_ptr() | q.data_ptr() | k.data_ptr() | v.data_ptr() | o.data_ptr()
                 | lse.data_ptr()) % 16,
                causal.__class__, causal, scale.__class__, scale, config,
                softcap.__class__, softcap,
                None if attn_mask is None else layout_key(attn_mask),
                block_mask_key(block_mask))
    except (AttributeError, TypeError, RuntimeError):  # not tensors; fake tensors
        return None


def _validated_plan(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    o: torch.Tensor, lse: torch.Tensor, causal: bool | str,
                    scale: float | None, config: BwdConfig | Mapping[str, object] | None,
                    attn_mask: torch.Tensor | None, block_mask: BlockMask | None,
                    softcap: float | None) -> PlannedBackward:
    """Check the arguments, choose or check the config, and plan the launches (see
    ``flash_attention_bwd`` for the errors)."""
    causal_mode, softmax_scale = kernel.validate_inputs(do, q, k, v, o, lse, causal, scale)
    cap = kernel_common.check_softcap(softcap)
    if q.device.type != "cuda" and not interpreter_active():
        raise ValueError(f"the kernels run on CUDA tensors (or under TRITON_INTERPRET=1), but q "
                         f"is on {q.device}")
    check_interpreter_usable()

    if block_mask is not None:
        check_block_mask(block_mask, q, k)
    mask_view = None if attn_mask is None else attn_mask_view(attn_mask, q, k)
    problem = problem_of(q, k, causal_mode, cap)
    device = current_device(q.device.index) if q.is_cuda else current_device()
    cfg = resolve_config(config, problem, device,
                         None if block_mask is None else block_mask.block_size)
    # bf16 under the interpreter runs on float32 copies (templates.interpreter_dtype); the
    # gradients come back in the inputs' dtype.
    upcast = runs_in_float32(q.dtype)
    ldo, lq, lk, lv, lo = as_float32(do, q, k, v, o) if upcast else (do, q, k, v, o)
    plan = BackwardPlan(ldo, lq, lk, lv, lo, lse, causal_mode=causal_mode,
                        scale=softmax_scale, config=cfg.to_dict(), block_mask=block_mask,
                        attn_mask=mask_view, softcap=cap)
    return PlannedBackward(plan, upcast)


TEMPLATE: FlashBwdTemplate = register(FlashBwdTemplate())
