"""The forward FlashAttention template: its search space, constraints, defaults and entry point.

The kernel and its launcher live in ``templates.flash.fwd_kernel`` (torch + triton only, so it
can be emitted as standalone source); this module adds what the tuner and users need around it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from templates import kernel_common
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
    Template,
    knob,
    next_pow2,
    relative_error,
)
from templates.compile import direct_launch, tensor_maps
from templates.compile.plan_cache import PlanCache
from templates.compile.standin_tensor import StandinTensor
from templates.device import (
    DeviceInfo,
    check_interpreter_usable,
    current_device,
    interpreter_active,
)
from templates.flash import fwd_kernel as kernel
from templates.flash import softcap as softcap_kernel
from templates.interpreter_dtype import Float32Plan, as_float32, runs_in_float32
from templates.masks import listed_blocks, row_ranges
from templates.masks.block_mask import DEFAULT_BLOCK_SIZE, BlockMask
from templates.masks.mods import pattern_block_mask, pattern_problem
from templates.masks.row_ranges import WithFirstKeys, rows_take_offsets, takes_doc_offsets
from templates.registry import register

DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}
DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}
TORCH_DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}

# Bound on the fp32 values one thread holds live in the main loop: the output accumulator
# (BLOCK_M x BLOCK_D) plus the score tile (BLOCK_M x BLOCK_N), over 32 * num_warps threads.
# Calibrated on H100 + triton 3.6 (fwd_quick.py --compile-sweep, 499 configs, bf16,
# d 64/128/256; benchmarks/results/fwd_compile_sweep_h100.json): every config above 192
# spilled (54 to 1810 registers); at 192 most spill a little, yet 128x64 with 4 warps at d=128 (192, 26 spilled registers) is the fastest config
# measured at d=128; at 160 and below spills are rare and small.
MAX_LIVE_FP32_PER_THREAD = 192
# Barriers of the TMA pipeline: up to 1 KiB more than the tiles (same sweep).
TMA_BARRIER_BYTES = 1024


@dataclass(frozen=True)
class FwdConfig(KernelConfig):
    """One point of the forward kernel's search space."""

    BLOCK_M: int = knob(
        64, (16, 32, 64, 128, 256),
        "Query rows per program. Larger tiles reuse each K/V block for more rows (fewer loads "
        "per FLOP) but hold a larger accumulator per thread and launch fewer programs.")
    BLOCK_N: int = knob(
        64, (16, 32, 64, 128, 256),
        "Keys per inner-loop step. Larger steps amortize the softmax rescale and loop overhead "
        "but need more shared memory per pipeline stage and more score registers.")
    num_warps: int = knob(
        4, (4, 8),
        "Warps per program. 8 splits the accumulator over more threads (fewer registers each) "
        "at the cost of more synchronization per tile.")
    num_stages: int = knob(
        2, (1, 2, 3, 4, 5),
        "Software-pipeline depth of the KV loop: K/V blocks in flight at once. Deeper hides "
        "memory latency but multiplies the K/V shared-memory buffers.")
    use_tma: bool = knob(
        False, (False, True),
        "Load Q/K/V and store O through Hopper TMA tensor descriptors instead of pointer "
        "loads: fewer address registers and instructions; needs compute capability >= 9.0 and "
        "16-byte aligned strides.")
    pipeline_masked_loop: bool = knob(
        True, (False, True),
        "Also software-pipeline the masked loop (causal diagonal and N_kv tail, 1-3 blocks per "
        "tile). Pipelining it hides the first loads; not pipelining it saves prologue code and "
        "registers.")
    loop_unroll: int = knob(
        1, (1, 2),
        "Unroll factor of the unmasked KV loop: 2 gives the scheduler two iterations to "
        "interleave, but multiplies the pipelined K/V buffers (shared memory) and code size; "
        "on H100 it was 13-19% slower in every measured case.")
    grid_order: str = knob(
        "tiles_inner", kernel.GRID_ORDERS,
        "Program launch order. tiles_inner runs the query tiles of one head together (that "
        "head's K/V stay in L2); heads_inner runs one tile of many heads together (with GQA, "
        "the query heads of a kv group share K/V). heads_inner lost 1-28% on H100 dense MHA.")
    longest_first: bool = knob(
        False, (False, True),
        "Causal only: launch the query tiles that see the most keys first, so the longest "
        "programs do not end up alone in the last wave.")
    warp_specialize: bool = knob(
        False, (False, True),
        "Let the compiler split the unmasked KV loop into producer and consumer warps. Only "
        "allowed on Blackwell (see the constraint).")
    doc_offsets: bool = knob(
        False, (False, True),
        "Under a block mask whose rows each see one causal range of keys (causal packed "
        "documents, BlockMask.documents; a causal window, sliding_causal:<w>), a partial "
        "block's visibility from its rows' first visible keys (one int32 a row) instead of "
        "its uint8 tile; other masks keep their tiles. Measured 1.05-1.08x on packed "
        "documents (16k, 64k), 1.03-1.05x on causal windows (H200, d128): on by default "
        "under a block mask.")


def block_d(problem: Problem) -> int:
    return kernel.block_d_for(problem.head_dim)


def shared_memory_estimate(problem: Problem, config: FwdConfig) -> int:
    """Bytes of shared memory Triton allocates: the Q tile plus the K/V buffers.

    Matches Triton 3.6 on H100 to within 1 KiB for all 499 configs of the compile sweep: a
    pipelined loop (num_stages >= 2) holds num_stages K tiles and as many V tiles, and
    unrolling multiplies them (128x128 at d=128, 3 stages, unroll 2 asked for 416 KiB); an
    unpipelined loop reuses one tile's worth for K and then V.
    """
    esize = DTYPE_BYTES[problem.dtype]
    d = block_d(problem)
    q_tile = config.BLOCK_M * d * esize
    kv_tile = config.BLOCK_N * d * esize
    if config.num_stages > 1:
        kv_bytes = 2 * kv_tile * config.num_stages * config.loop_unroll
    else:
        kv_bytes = kv_tile * config.loop_unroll
    return q_tile + kv_bytes + (TMA_BARRIER_BYTES if config.use_tma else 0)


def live_fp32_per_thread(problem: Problem, config: FwdConfig) -> int:
    """fp32 values each thread holds across the loop: accumulator plus score tile."""
    per_program = config.BLOCK_M * (block_d(problem) + config.BLOCK_N)
    return per_program // (32 * config.num_warps)


class FlashFwdTemplate(Template):
    name = "flash_fwd"
    takes_softcap = True
    description = ("FlashAttention-2 forward (online softmax, exp2), dense, causal top-left or "
                   "bottom-right, GQA/MQA, head dim <= 256, pointer or TMA loads; returns "
                   "(o, lse).")
    config_cls = FwdConfig

    def source_modules(self) -> Sequence[str]:
        return [kernel.__name__, kernel_common.__name__, listed_blocks.__name__,
                row_ranges.__name__, softcap_kernel.__name__,
                direct_launch.__name__, tensor_maps.__name__, __name__]

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
            return (f"flash_fwd supports head_dim <= {kernel.MAX_HEAD_DIM}, but got "
                    f"{problem.head_dim}")
        return None

    def flops(self, problem: Problem) -> float:
        # Block-sparse problems count the dense-equivalent FLOPs (PROTOCOL.md), so TFLOP/s
        # compare with the dense kernel's and the density is reported beside them.
        return forward_flops(problem)

    def bytes_moved(self, problem: Problem) -> float:
        return forward_bytes(problem)

    # -- the space ----------------------------------------------------------------------------
    def constraint(self, problem: Problem, config: KernelConfig, device: DeviceInfo) -> str | None:
        config = self.config(config)
        assert isinstance(config, FwdConfig)
        reason = self.unsupported(problem)
        if reason:
            return reason
        if config.warp_specialize and device.family != "blackwell":
            return ("warp_specialize is only tried on Blackwell: on H100 with triton 3.6 it "
                    "failed to compile for about half the configs and never won")
        if problem.mask != "none":
            reason = block_mask_tile_reason(config, (DEFAULT_BLOCK_SIZE, DEFAULT_BLOCK_SIZE))
            if reason:
                return reason
            if config.loop_unroll > 1 or config.warp_specialize:
                return ("loop_unroll and warp_specialize only apply to the dense KV loop, not "
                        "to a block mask's listed blocks; use loop_unroll=1, "
                        "warp_specialize=False")
        elif config.doc_offsets:
            return ("doc_offsets reads a block mask's rows (causal documents or a causal "
                    "window): without a block mask use doc_offsets=False")
        if config.longest_first and problem.causal == "none":
            return ("longest_first only reorders causal launches (every non-causal tile has "
                    "the same work); use longest_first=False")
        if config.use_tma:
            reason = _tma_reason(problem, config, device)
            if reason:
                return reason
        smem = shared_memory_estimate(problem, config)
        if smem > device.smem_per_block:
            return (f"needs about {smem // 1024} KiB of shared memory (Q tile {config.BLOCK_M}x"
                    f"{block_d(problem)} + {max(1, config.num_stages)} stage(s) of K and V "
                    f"{config.BLOCK_N}x{block_d(problem)} in {problem.dtype}), more than the "
                    f"{device.smem_per_block // 1024} KiB a program may use on {device.name}")
        live = live_fp32_per_thread(problem, config)
        if live > MAX_LIVE_FP32_PER_THREAD:
            return (f"each thread would hold about {live} fp32 values (accumulator "
                    f"{config.BLOCK_M}x{block_d(problem)} + scores {config.BLOCK_M}x"
                    f"{config.BLOCK_N} over {config.num_warps} warps), more than "
                    f"{MAX_LIVE_FP32_PER_THREAD}: registers would spill; use more warps or "
                    f"smaller tiles")
        return None

    def known_good_configs(self, problem: Problem, device: DeviceInfo) -> list[KernelConfig]:
        """Runners-up on H100 (benchmarks/fwd_quick.py) that fit this problem, after the
        default: the search starts from them."""
        if device.family not in ("hopper", "blackwell"):
            return []
        causal = problem.causal != "none"
        measured = [
            FwdConfig(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3, use_tma=True),
            FwdConfig(BLOCK_M=128, BLOCK_N=128, num_warps=4, num_stages=3, use_tma=True),
            FwdConfig(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3),
            FwdConfig(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3, use_tma=True),
            FwdConfig(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=2, use_tma=True),
        ]
        default = self.default_config(problem, device)
        out: list[KernelConfig] = []
        if takes_doc_offsets(problem):  # the default's tiles too: a sweep measures the knob
            out.append(dataclasses.replace(default, doc_offsets=False))
        for cfg in measured:
            cfg = dataclasses.replace(cfg, longest_first=causal,
                                      doc_offsets=default.doc_offsets)
            if cfg != default and self.constraint(problem, cfg, device) is None:
                out.append(cfg)
        return out

    def default_config(self, problem: Problem, device: DeviceInfo) -> FwdConfig:
        start = dataclasses.replace(_heuristic(problem, device),
                                    doc_offsets=takes_doc_offsets(problem))
        for candidate in _shrinking(start):
            if self.constraint(problem, candidate, device) is None:
                return candidate
        raise RuntimeError(f"no forward config fits {problem.key()} on {device.name}")

    # -- running and checking -----------------------------------------------------------------
    def make_inputs(self, problem: Problem, device: str, seed: int = 0) -> dict[str, Any]:
        inputs = random_inputs(problem, device, seed)
        if problem.mask != "none":
            inputs["block_mask"] = pattern_mask(problem.mask, problem.seqlen_q,
                                                 problem.seqlen_kv, str(device))
        return inputs

    def run(self, inputs: Mapping[str, Any], config: KernelConfig) -> Any:
        cfg = self.config(config)
        assert isinstance(cfg, FwdConfig)
        return flash_attention_fwd(inputs["q"], inputs["k"], inputs["v"],
                                   causal=inputs["causal"], scale=inputs["scale"], config=cfg,
                                   block_mask=inputs.get("block_mask"),
                                   softcap=inputs.get("softcap"))

    def kernel_launches(self, problem: Problem, config: KernelConfig) -> list[KernelLaunch] | None:
        """The one launch ``run`` makes (dense problems only: a block mask's tensors have no
        stand-ins)."""
        if problem.mask != "none":
            return None
        cfg = self.config(config)
        dtype = TORCH_DTYPES[problem.dtype]
        q_shape = [problem.batch, problem.heads_q, problem.seqlen_q, problem.head_dim]
        kv_shape = [problem.batch, problem.heads_kv, problem.seqlen_kv, problem.head_dim]
        grid, args, options = kernel.kernel_call(
            StandinTensor(dtype, q_shape), StandinTensor(dtype, kv_shape),
            StandinTensor(dtype, kv_shape), StandinTensor(dtype, q_shape),
            StandinTensor(torch.float32, q_shape[:3]),
            causal_mode=problem.causal, scale=1.0 / math.sqrt(problem.head_dim),
            config=cfg.to_dict(), softcap=problem.softcap)
        return [(kernel._flash_fwd_kernel, grid, args, options)]

    def reference(self, inputs: Mapping[str, Any]) -> Any:
        block_mask = inputs.get("block_mask")
        return attention_reference(inputs["q"], inputs["k"], inputs["v"],
                                   causal=kernel.normalize_causal(inputs["causal"]),
                                   scale=inputs["scale"],
                                   mask=None if block_mask is None else block_mask.to_dense(),
                                   softcap=inputs.get("softcap", 0.0))

    def error(self, out: Any, ref: Any) -> float:
        """Largest of the relative errors of o and of lse (its -inf rows must match exactly)."""
        (o, lse), (o_ref, lse_ref) = out, ref
        return max(relative_error(o, o_ref), lse_error(lse, lse_ref))

    # -- code generation ----------------------------------------------------------------------
    def standalone_source(self, config: KernelConfig) -> str:
        return self._kernel_module_with_config(kernel, _STANDALONE_ENTRY, config)


_STANDALONE_ENTRY = '''

# ----------------------------------------------------------------------------- baked-in config
CONFIG: dict[str, object] = CONFIG_LITERAL


def flash_attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                        causal: bool | str = False, scale: float | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, lse) of softmax(scale * q k^T) v with the config above baked in.

    q: (B, H_q, N_q, D); k, v: (B, H_kv, N_kv, D), any strides; causal: False, True
    (= "top_left"), "none", "top_left" or "bottom_right"; scale defaults to 1/sqrt(D).
    """
    causal_mode, softmax_scale = validate_inputs(q, k, v, causal, scale)
    config = dict(CONFIG)
    if config["use_tma"] and tma_inputs_problem(q, k, v):
        config["use_tma"] = False  # this memory layout cannot use TMA: use pointer loads
    return launch(q, k, v, causal_mode=causal_mode, scale=softmax_scale, config=config)
'''


def _tma_reason(problem: Problem, config: FwdConfig, device: DeviceInfo) -> str | None:
    if not device.is_interpreter and device.family in ("volta-turing", "ampere-ada", "other"):
        return (f"use_tma needs a GPU with TMA (compute capability >= 9.0), but "
                f"{device.name} has {device.compute_capability}")
    row_bytes = problem.head_dim * DTYPE_BYTES[problem.dtype]
    if row_bytes % 16:
        return (f"use_tma needs rows of 16-byte multiples, but head_dim {problem.head_dim} in "
                f"{problem.dtype} is {row_bytes} bytes")
    if config.loop_unroll > 1 and config.num_stages > 1:
        # Precaution, not measured here: other projects report that unrolling a pipelined TMA
        # loop can fault at run time ("misaligned address"), which would take the tuner's
        # CUDA context down with it; unrolling never won with pointer loads either.
        return ("use_tma with loop_unroll > 1 and num_stages > 1 is not compiled (reported to "
                "fault at run time)")
    return None


def _heuristic(problem: Problem, device: DeviceInfo) -> FwdConfig:
    """Starting point per GPU family and head dim, before fitting it to the constraints."""
    d = problem.head_dim
    if device.is_interpreter:
        # Measured under the interpreter (2-core CPU, N=100..1000, d=64): per-op overhead
        # dominates, so big tiles run fastest (64x64 is 5-12x faster than 16x16, 128x64
        # faster still at N=1000).
        cfg = FwdConfig(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=2)
    elif device.family in ("hopper", "blackwell"):
        # Measured on H100 (triton 3.6, bf16, 16k tokens, N 4k / 16k, benchmarks/fwd_quick.py:
        # a grid of ~30 configs plus variants of the best, two runs). Each choice was the best
        # or within 5% of it (the same config timed twice in one run differed by up to 4.5%;
        # benchmarks/results/fwd_quick_h100.json). TFLOP/s of the final run,
        # non-causal 4k/16k then causal 4k/16k: d=64 456/460, 406/457; d=128 502/500,
        # 447/502; d=256 538/546, 449/541 (cuDNN: 478/463, 416/437; 606/630, 540/590;
        # 666/682, 564/592). Not pipelining the masked loop won 4-9% at d=64 non-causal only.
        # Blackwell: unmeasured, Hopper's choice is a guess there.
        causal = problem.causal != "none"
        if d <= 64:
            cfg = FwdConfig(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=2, use_tma=True,
                            pipeline_masked_loop=causal, longest_first=causal)
        elif d <= 128:
            cfg = FwdConfig(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=2, use_tma=True,
                            longest_first=causal)
        else:
            cfg = FwdConfig(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=2, use_tma=True,
                            longest_first=causal)
    elif device.family == "ampere-ada":
        # GUESSES: the Triton tutorial's ranges for mma.sync GPUs.
        if d <= 64:
            cfg = FwdConfig(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=3)
        elif d <= 128:
            cfg = FwdConfig(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3)
        else:
            cfg = FwdConfig(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2)
    else:
        cfg = FwdConfig(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2)
    if problem.dtype == "float32":
        cfg = dataclasses.replace(cfg, use_tma=False)
    # Short sequences: no tile larger than the sequence (rounded up to a power of two).
    block_m = min(cfg.BLOCK_M, max(16, next_pow2(problem.seqlen_q)))
    block_n = min(cfg.BLOCK_N, max(16, next_pow2(problem.seqlen_kv)))
    warps = cfg.num_warps if block_m >= 64 else 4
    return dataclasses.replace(cfg, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps,
                               longest_first=problem.causal != "none" and cfg.longest_first)


def _shrinking(cfg: FwdConfig) -> list[FwdConfig]:
    """``cfg``, then ever cheaper variants: more warps, fewer stages, smaller tiles."""
    out = [cfg, dataclasses.replace(cfg, num_warps=8)]
    for stages in range(cfg.num_stages - 1, 0, -1):
        out.append(dataclasses.replace(out[-1], num_stages=stages))
    while out[-1].BLOCK_N > 16 or out[-1].BLOCK_M > 16:
        last = out[-1]
        if last.BLOCK_N >= last.BLOCK_M and last.BLOCK_N > 16:
            out.append(dataclasses.replace(last, BLOCK_N=last.BLOCK_N // 2))
        else:
            out.append(dataclasses.replace(last, BLOCK_M=last.BLOCK_M // 2))
    out.append(dataclasses.replace(out[-1], use_tma=False))
    return out


def compile_for(problem: Problem, config: KernelConfig) -> Any:
    """Triton's compiled kernel for ``problem``'s inputs (as ``make_inputs`` lays them out)
    under ``config``, without allocating or launching anything (needs a CUDA device or an
    ``offline_target``; dense problems only)."""
    launches = TEMPLATE.kernel_launches(problem, config)
    if launches is None:
        raise ValueError(f"no stand-in launch for {problem.key()} (block masks have none)")
    ((fn, grid, args, options),) = launches
    return fn.warmup(*args, grid=grid, **options)


# ----------------------------------------------------------------------------- entry point
def problem_of(q: torch.Tensor, k: torch.Tensor, causal_mode: str,
               softcap: float = 0.0) -> Problem:
    return Problem(batch=q.shape[0], heads_q=q.shape[1], heads_kv=k.shape[1],
                   seqlen_q=q.shape[2], seqlen_kv=k.shape[2], head_dim=q.shape[3],
                   dtype=DTYPE_NAMES[q.dtype], causal=causal_mode, softcap=softcap)


def flash_attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                        causal: bool | str = False, attn_mask: torch.Tensor | None = None,
                        block_mask: BlockMask | None = None, scale: float | None = None,
                        config: FwdConfig | Mapping[str, object] | None = None,
                        softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention forward: (o, lse) of softmax(scale * q k^T [masked]) v.

    Args:
        q: (B, H_q, N_q, D) float16, bfloat16 or float32, any strides.
        k, v: (B, H_kv, N_kv, D), same dtype and device; H_q a multiple of H_kv (GQA/MQA).
        causal: False / "none"; True / "top_left" (query i sees keys j <= i, as torch SDPA);
            "bottom_right" (j <= i + N_kv - N_q, as FlashAttention-2 with a KV cache).
        attn_mask: as torch SDPA's, broadcastable to (B, H_q, N_q, N_kv): bool (True =
            attend) or float (added to the scaled scores); read tile by tile in the kernel.
        block_mask: a ``BlockMask`` for (N_q, N_kv) with batch and head dims 1 or B / H_q:
            only its listed blocks are computed. The config's BLOCK_M and BLOCK_N must divide
            its block size (the default config is fitted to it).
            All masks combine: a pair is visible only where every one given lets it through.
        scale: softmax scale, default 1/sqrt(D).
        config: an ``FwdConfig`` or a mapping of its fields; None takes the template's default
            for this problem and device.
        softcap: cap the scaled scores as Gemma 2 does, ``softcap * tanh(s / softcap)``,
            before any mask; None or 0: no cap. A finite number >= 0.

    Returns:
        o (B, H_q, N_q, D) in q's dtype, contiguous (or laid out as q where q is a (B, N, H, D)
        tensor viewed so, as torch SDPA's cuDNN backend returns it); lse (B, H_q, N_q) float32,
        the natural logsumexp of the scaled, masked scores (-inf, with o = 0, for rows that see
        no key).

    Raises:
        TypeError / ValueError naming the offending argument, the config field, or the
        constraint the config violates for this problem and device.
    """
    plan = _cached_plan(q, k, v, causal, attn_mask, block_mask, scale, config, softcap)
    if attn_mask is not None:
        attn_mask = kernel.broadcast_attn_mask(attn_mask, q, k)
    rows = getattr(plan, "first_key_rows", 0)
    if rows:  # (doc_offsets) the rows' first keys where the kernel reads the tiles
        return plan(q, k, v, WithFirstKeys(block_mask, rows), attn_mask)
    return plan(q, k, v, block_mask, attn_mask)


def launch_plan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                causal: bool | str = False, scale: float | None = None,
                config: FwdConfig | Mapping[str, object] | None = None,
                softcap: float | None = None) -> ForwardPlan:
    """What ``flash_attention_fwd`` (without masks) checks and works out for these arguments,
    from its plan cache: calling the plan on tensors of the same shapes, strides, dtype, device
    and 16-byte alignment launches the kernel with none of the checks (a caller that keys on
    all of those, as ``tuner.attention`` does, skips this module's key and lookup too).

    Raises what ``flash_attention_fwd`` raises for the same arguments."""
    return _cached_plan(q, k, v, causal, None, None, scale, config, softcap)


def _cached_plan(q: Any, k: Any, v: Any, causal: Any, attn_mask: Any, block_mask: Any,
                 scale: Any, config: Any, softcap: Any = None) -> ForwardPlan:
    key = _plan_key(q, k, v, causal, attn_mask, block_mask, scale, config, softcap)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _validated_plan(q, k, v, causal, attn_mask, block_mask, scale, config, softcap)
        _PLANS.put(key, plan)
    return plan


# What a forward plan is called as: plan(q, k, v, block_mask, attn_mask) -> (o, lse).
ForwardPlan = kernel.LaunchPlan | Float32Plan

# Launch plans of flash_attention_fwd by _plan_key: a repeated call skips the checks and the
# config choice (150-300 us of host time per call on the H100 before, at any shape). A decode
# loop makes one per step, so the bound is generous; a plan is a few hundred bytes.
_PLANS: PlanCache[ForwardPlan] = PlanCache(maxsize=1024)


def _plan_key(q: Any, k: Any, v: Any, causal: Any, attn_mask: Any, block_mask: Any, scale: Any,
              config: Any, softcap: Any = None) -> tuple[object, ...] | None:
    """Everything ``_validated_plan`` reads from its arguments, or None for arguments of a kind
    no plan is kept for (the full path then raises the right error).

    Tensors enter by class, shape, strides, dtype and device, plus whether all three data
    pointers are 16-byte aligned (TMA needs it); masks by what their checks read; scalars with
    their class, so that 1 (refused) never matches True (accepted). A mapping config is
    validated into an FwdConfig first, on every call: pass an FwdConfig to skip that.
    Values never enter: the plan does not depend on them.
    """
    if config is not None and not isinstance(config, FwdConfig):
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
                softcap.__class__, softcap,
                None if attn_mask is None else (attn_mask.__class__, attn_mask.shape,
                                                attn_mask.dtype, attn_mask.device),
                None if block_mask is None else (block_mask.__class__, block_mask.shape,
                                                 block_mask.block_size, block_mask.device,
                                                 rows_take_offsets(block_mask)))
    except (AttributeError, TypeError, RuntimeError):  # not tensors; fake tensors: no pointer
        return None


def _validated_plan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool | str,
                    attn_mask: torch.Tensor | None, block_mask: BlockMask | None,
                    scale: float | None, config: FwdConfig | Mapping[str, object] | None,
                    softcap: float | None = None) -> ForwardPlan:
    """Check the arguments, choose or check the config, and plan the launch (see
    ``flash_attention_fwd`` for the errors)."""
    causal_mode, softmax_scale = kernel.validate_inputs(q, k, v, causal, scale)
    cap = kernel_common.check_softcap(softcap)
    if config is not None and not isinstance(config, FwdConfig | Mapping):
        raise TypeError(f"config must be an FwdConfig, a mapping of its fields or None, but "
                        f"got {type(config).__name__}")
    chosen = None if config is None else TEMPLATE.config(config)
    if q.device.type != "cuda" and not interpreter_active():
        raise ValueError(f"the kernel runs on CUDA tensors (or under TRITON_INTERPRET=1), but q "
                         f"is on {q.device}")
    check_interpreter_usable()
    if block_mask is not None:
        check_block_mask(block_mask, q, k)
    mask_view = None if attn_mask is None else kernel.attn_mask_view(attn_mask, q, k)
    problem = problem_of(q, k, causal_mode, cap)
    device = current_device(q.device.index) if q.is_cuda else current_device()
    if chosen is None:
        cfg = TEMPLATE.default_config(problem, device)
        if cfg.use_tma and kernel.tma_inputs_problem(q, k, v):
            cfg = dataclasses.replace(cfg, use_tma=False)  # this layout cannot use TMA
        if block_mask is not None:  # (doc_offsets: the mask's rows decide at launch)
            cfg = dataclasses.replace(fit_to_block_mask(cfg, block_mask.block_size),
                                      doc_offsets=True)
    else:
        assert isinstance(chosen, FwdConfig)
        cfg = chosen
        # (the call's problem names no mask: doc_offsets is checked against the mask itself)
        checked = cfg if block_mask is None else dataclasses.replace(cfg, doc_offsets=False)
        reason = TEMPLATE.constraint(problem, checked, device)
        if reason:
            raise ValueError(f"config {cfg.key()} cannot run {problem.key()} on "
                             f"{device.name}: {reason}")
        reason = kernel.tma_inputs_problem(q, k, v) if cfg.use_tma else None
        if reason:
            raise ValueError(f"config {cfg.key()}: {reason}; use use_tma=False for this layout")
        reason = None if block_mask is None else block_mask_tile_reason(cfg,
                                                                        block_mask.block_size)
        if reason:
            raise ValueError(f"config {cfg.key()}: {reason}")
    upcast = runs_in_float32(q.dtype)  # bf16 under the interpreter (templates.interpreter_dtype)
    planned_q, planned_k, planned_v = as_float32(q, k, v) if upcast else (q, k, v)
    data = cfg.to_dict()
    # doc_offsets only where the mask's rows are one causal range each; others keep tiles.
    data["doc_offsets"] = cfg.doc_offsets and rows_take_offsets(block_mask)
    plan = kernel.LaunchPlan(planned_q, planned_k, planned_v, causal_mode=causal_mode,
                             scale=softmax_scale, config=data, block_mask=block_mask,
                             attn_mask=mask_view, softcap=cap)
    planned: ForwardPlan = Float32Plan(plan) if upcast else plan
    if data["doc_offsets"]:  # the rows' first keys cover every row of the query tiles
        planned.first_key_rows = row_ranges.tile_rows(q.shape[2], cfg.BLOCK_M)  # type: ignore[union-attr]
    return planned


def block_mask_tile_reason(config: FwdConfig, block_size: tuple[int, int]) -> str | None:
    """Why ``config``'s tiles cannot walk a block mask of ``block_size`` (None if they can):
    a query tile must lie inside one mask row block, a KV step inside one mask block."""
    if block_size[0] % config.BLOCK_M or block_size[1] % config.BLOCK_N:
        return (f"BLOCK_M ({config.BLOCK_M}) and BLOCK_N ({config.BLOCK_N}) must divide the "
                f"block mask's block size {block_size} (query, kv)")
    return None


def fit_to_block_mask(config: FwdConfig, block_size: tuple[int, int]) -> FwdConfig:
    """``config`` with tiles no larger than the mask's blocks (both powers of two, so the
    smaller divides the larger), and no dense-loop-only options."""
    return dataclasses.replace(config, BLOCK_M=min(config.BLOCK_M, block_size[0]),
                               BLOCK_N=min(config.BLOCK_N, block_size[1]), loop_unroll=1,
                               warp_specialize=False)


def check_block_mask(block_mask: BlockMask, q: torch.Tensor, k: torch.Tensor) -> None:
    """Raise if ``block_mask`` does not describe attention of q over k."""
    if not isinstance(block_mask, BlockMask):
        raise TypeError(f"block_mask must be a templates.BlockMask or None, but got "
                        f"{type(block_mask).__name__}")
    bm, hm, n_q, n_kv = block_mask.shape
    if (n_q, n_kv) != (q.shape[2], k.shape[2]):
        raise ValueError(f"block_mask is for (N_q, N_kv) = {(n_q, n_kv)}, but q and k have "
                         f"{(q.shape[2], k.shape[2])}")
    if bm not in (1, q.shape[0]) or hm not in (1, q.shape[1]):
        raise ValueError(f"block_mask's (batch, heads) {(bm, hm)} must be 1 or match q's "
                         f"{(q.shape[0], q.shape[1])}")
    if block_mask.device != q.device:
        raise ValueError(f"block_mask must be on q's device {q.device}, but is on "
                         f"{block_mask.device}; use block_mask.to(device)")


@functools.lru_cache(maxsize=16)
def pattern_mask(pattern: str, seqlen_q: int, seqlen_kv: int, device: str) -> BlockMask:
    """Sweep problems name their mask; built once per problem and device (a 16k x 16k one
    takes seconds on a CPU), so every trial times the same pattern."""
    return pattern_block_mask(pattern, seqlen_q, seqlen_kv, device=device)


TEMPLATE = FlashFwdTemplate()
register(TEMPLATE)
