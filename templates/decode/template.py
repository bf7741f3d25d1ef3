"""Flash-decoding: a few new query tokens per sequence against a long, possibly paged, KV cache.

The KV length of every sequence is split across ``num_splits`` programs; each computes a
partial output and logsumexp over its chunk with an online softmax, and a small combine
kernel merges the partials through their logsumexps (or, with ``combine="fused"``, the last
split program of each row tile to finish merges them). The result is exact: the same
softmax as one pass over the whole cache, up to floating-point rounding.

The kernels and their launcher are in ``templates/decode/kernel.py`` (torch and triton
only, so ``standalone_source`` can export it); this module holds the template (search space,
constraints, default heuristic, counts), the entry point, inputs and the reference.

Layouts
    q            (B, H_q, N_q, D), any strides; N_q <= 16 new tokens (speculative decoding)
    k/v_cache    contiguous per sequence (B, H_kv, N_max, D), any strides, or
                 paged (num_pages, page_size, H_kv, D) (vLLM's layout), any strides, with
    block_table  (B, max_pages) int32: logical page p of sequence b is physical page
                 block_table[b, p]; only the first ceil(len_b / page_size) entries are read
    cache_seqlens (B,) int32, 0 <= len_b <= capacity (N_max, or max_pages * page_size)

Semantics: the N_q new tokens are the last N_q entries of the cache (already appended), so
query token t (0-based) attends to keys j < len_b - (N_q - 1 - t) (bottom-right causal).
A query row that sees no key (len_b == 0, or len_b < N_q for the first tokens) gets o = 0
and lse = -inf. ``lse`` is float32, natural log; ``o`` has q's dtype.

GQA packing: the ``H_q / H_kv`` query heads of one KV head and their N_q tokens are the M
rows of one tile (padded to at least 16 rows for ``tl.dot``), so each program reads its
K/V chunk once for the whole group. Above 64 rows the group is split over M tiles.

Paging: when the page size is a multiple of BLOCK_N every K/V tile lies inside one page
and the program looks the page up once per tile; otherwise (BLOCK_N above the page size,
e.g. vLLM's 16-token pages) each key row of the tile looks its page up. So every BLOCK_N
works with every page size and the page size does not constrain the search space.

Problem convention (the ``Problem.mask`` field of a decode problem), parts joined by ``+``:
    none                contiguous cache, every sequence as long as ``seqlen_kv``
    paged:<page_size>   paged cache with pages of ``page_size`` tokens
    mixed               per-sequence lengths spread evenly over (0, seqlen_kv]:
                        len_i = max(N_q, ceil(seqlen_kv * (i + 1) / B)), shuffled,
                        so the longest is seqlen_kv and the mean about seqlen_kv / 2
    e.g. ``paged:256``, ``mixed``, ``paged:16+mixed``
``seqlen_kv`` is the cache length; ``causal`` is ``bottom_right`` (``none`` is accepted
for one query token, where the two agree).

Knobs (``FlashDecodeConfig``)
    num_splits  programs the KV length of one sequence is split over: more fills the GPU
                when batch x KV heads is small, at the cost of a partial-output round trip
                and a combine pass
    block_n     keys per tile: larger tiles issue wider loads and fewer loop iterations,
                smaller ones waste less on the masked tail and need fewer registers
    num_warps   warps per program: more threads in flight per tile versus more programs
                per SM
    num_stages  software-pipelining depth of the K/V loads: hides HBM latency at the cost
                of shared memory
    combine     "separate": a second kernel merges the partials; "fused": each split
                program counts itself in on a per-row-tile atomic counter after storing its
                partial, and the last one merges (no second launch, no wait for the whole
                grid to drain before merging starts; costs an atomic per program and a
                serial merge at the end of the last one). The counters are cached per
                device and stream: see ``arrival_counters``
    kv_load     L2 hint of the K/V loads: "evict_first" lets the streamed-once K/V leave L2
                before the partials and q, which may shorten the merge's reads; "default"
                leaves it to the hardware
    whole_waves raise num_splits by up to an eighth so the grid is a multiple of the SM
                count (e.g. 32 -> 33 splits for 8 KV heads on 132 SMs): every SM then gets
                the same number of programs instead of a few SMs one fewer. The launcher
                rounds with the device's SM count; on the interpreter it changes nothing
"""

from __future__ import annotations

import ast
import inspect
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import triton

from templates.base import (
    KernelConfig,
    KernelLaunch,
    Problem,
    Template,
    inline_template_imports,
    knob,
    relative_error,
)
from templates.compile import direct_launch, plan_cache, tensor_maps
from templates.compile.plan_cache import PlanCache
from templates.compile.standin_tensor import StandinTensor
from templates.decode import kernel as flash_decode_kernel
from templates.decode.kernel import (
    COMBINE_MODES,
    KV_EVICTION,
    MAX_HEAD_DIM,
    MAX_QUERY_TOKENS,
    DecodeShape,
    check_cache_contents,
    check_decode_inputs,
    decode_launch_plan,
    decode_launches,
    launch_decode,
    pow2_at_least,
    rows_per_tile,
    run_decode_plan,
    smem_bytes,
)
from templates.device import DeviceInfo, check_interpreter_usable, current_device
from templates.interpreter_dtype import as_float32, runs_in_float32
from templates.registry import register

# ----------------------------------------------------------------------------- the space
SPLIT_CHOICES = (1, 2, 4, 8, 16, 32, 64, 128)
BLOCK_N_CHOICES = (16, 32, 64, 128, 256)
# A split shorter than this spends more on its partial output and the combine than it saves.
MIN_KEYS_PER_SPLIT = 256
# Programs per SM the default aims for: one resident program cannot keep enough loads in
# flight to cover HBM latency, two or more interleave theirs. A guess, not a measurement:
# the tuner searches num_splits.
PROGRAMS_PER_SM = 2
# Most elements of the K tile one thread may hold before registers spill (K and V tiles,
# the fp32 scores and the accumulator all live in registers at once).
MAX_TILE_ELEMS_PER_THREAD = 256
# Fewer than this and most of the warps' lanes idle on the loads.
MIN_TILE_ELEMS_PER_THREAD = 8


@dataclass(frozen=True)
class FlashDecodeConfig(KernelConfig):
    num_splits: int = knob(8, SPLIT_CHOICES,
                           "programs one sequence's KV length is split over: fills the GPU when "
                           "batch x KV heads is small, at the cost of a combine pass")
    block_n: int = knob(64, BLOCK_N_CHOICES,
                        "keys per tile: wider loads and fewer iterations vs registers and "
                        "masked-tail waste")
    num_warps: int = knob(4, (1, 2, 4, 8), "warps per program: threads per tile vs programs per SM")
    num_stages: int = knob(2, (1, 2, 3, 4),
                           "K/V load pipelining depth: hides HBM latency, costs shared memory")
    # "separate" stays the default until the fused merge is measured on a GPU.
    combine: str = knob("separate", COMBINE_MODES,
                        "merge of the splits' partials: a second kernel (separate), or the "
                        "last split program of each row tile to finish, found by an atomic "
                        "arrival counter (fused: no second launch and no grid-wide wait, at "
                        "the cost of one atomic per program and a serial merge in the last)")
    kv_load: str = knob("default", tuple(KV_EVICTION),
                        "L2 hint of the K/V loads: evict_first lets the streamed-once K/V "
                        "leave L2 first, which may keep the partials there for the merge")
    whole_waves: bool = knob(False, (False, True),
                             "raise num_splits by up to 1/8 so the grid is a multiple of the SM "
                             "count: equal programs per SM instead of a few SMs one short")


@dataclass(frozen=True)
class DecodeLayout:
    """What ``Problem.mask`` says about a decode problem (see the module docstring)."""

    page_size: int | None  # None: a contiguous cache
    mixed: bool


def parse_decode_mask(mask: str) -> DecodeLayout:
    """Parse ``none`` / ``paged:<page_size>`` / ``mixed`` / ``paged:<page_size>+mixed``."""
    page_size: int | None = None
    mixed = False
    if mask != "none":
        for part in mask.split("+"):
            if part == "mixed" and not mixed:
                mixed = True
            elif part.startswith("paged:") and page_size is None:
                text = part.removeprefix("paged:")
                if not text.isdigit() or int(text) < 1:
                    raise ValueError(f"a paged decode mask needs a positive page size, as in "
                                     f"'paged:256', but got {part!r}")
                page_size = int(text)
            else:
                raise ValueError(f"flash_decode masks are 'none', 'paged:<page_size>', 'mixed' "
                                 f"or both joined by '+', but got {mask!r}")
    return DecodeLayout(page_size, mixed)


def sequence_lengths(problem: Problem) -> list[int]:
    """The cache length of each sequence of ``problem`` (in batch order, before shuffling)."""
    layout = parse_decode_mask(problem.mask)
    if not layout.mixed:
        return [problem.seqlen_kv] * problem.batch
    return [max(problem.seqlen_q, -(-problem.seqlen_kv * (i + 1) // problem.batch))
            for i in range(problem.batch)]


def default_num_splits(batch: int, heads_kv: int, row_tiles: int, seqlen_kv: int, block_n: int,
                       sm_count: int) -> int:
    """Double the splits until the grid has PROGRAMS_PER_SM programs per SM, while each split
    keeps at least MIN_KEYS_PER_SPLIT keys (and a whole tile)."""
    programs = batch * heads_kv * row_tiles
    longest_split = max(MIN_KEYS_PER_SPLIT, block_n)
    splits = 1
    while (splits < SPLIT_CHOICES[-1] and programs * splits < PROGRAMS_PER_SM * sm_count
           and seqlen_kv >= 2 * splits * longest_split):
        splits *= 2
    return splits


def _row_tiles(problem: Problem) -> int:
    """Programs per (sequence, KV head) before the split: its query rows (GQA group x new
    tokens) in tiles of ``rows_per_tile``."""
    return triton.cdiv(problem.gqa_ratio * problem.seqlen_q,
                       rows_per_tile(problem.gqa_ratio, problem.seqlen_q))


def _elem_bytes(dtype: str) -> int:
    return 4 if dtype == "float32" else 2


class FlashDecodeTemplate(Template):
    name = "flash_decode"
    description = ("Flash-decoding: split-KV attention of a few query tokens against a long, "
                   "contiguous or paged KV cache, with GQA packing and an exact logsumexp "
                   "combine")
    config_cls = FlashDecodeConfig

    # -- the problem ------------------------------------------------------------------------
    def unsupported(self, problem: Problem) -> str | None:
        reason = super().unsupported(problem)  # a softcapped problem, where it does not cap
        if reason:
            return reason
        try:
            parse_decode_mask(problem.mask)
        except ValueError as exc:
            return str(exc)
        if problem.seqlen_q > MAX_QUERY_TOKENS:
            return (f"decode takes at most {MAX_QUERY_TOKENS} query tokens, but the problem has "
                    f"{problem.seqlen_q}; use flash_attention_fwd")
        if problem.head_dim > MAX_HEAD_DIM:
            return f"head dim must be at most {MAX_HEAD_DIM}, but got {problem.head_dim}"
        if problem.causal == "top_left" or (problem.causal == "none" and problem.seqlen_q > 1):
            return (f"decode is bottom-right causal among the new tokens (causal='bottom_right', "
                    f"or 'none' for one token), but got causal={problem.causal!r} with "
                    f"{problem.seqlen_q} query tokens")
        if problem.seqlen_q > problem.seqlen_kv:
            return (f"the cache holds the new tokens, so seqlen_kv ({problem.seqlen_kv}) must be "
                    f">= seqlen_q ({problem.seqlen_q})")
        return None

    def _visible_keys(self, problem: Problem) -> int:
        """Query-key pairs attended: token t of a sequence of length L sees L - (N_q-1-t)."""
        n_q = problem.seqlen_q
        return sum(max(0, length - (n_q - 1 - t))
                   for length in sequence_lengths(problem) for t in range(n_q))

    def flops(self, problem: Problem) -> float:
        return 4.0 * problem.heads_q * problem.head_dim * self._visible_keys(problem)

    def kv_bytes(self, problem: Problem) -> float:
        """Bytes of K and V read: every cached key and value of every sequence, once."""
        return float(sum(sequence_lengths(problem)) * problem.heads_kv * problem.head_dim * 2
                     * _elem_bytes(problem.dtype))

    def bytes_moved(self, problem: Problem) -> float:
        rows = problem.batch * problem.heads_q * problem.seqlen_q
        q_and_o = 2 * rows * problem.head_dim * _elem_bytes(problem.dtype)
        return self.kv_bytes(problem) + q_and_o + 4 * rows  # + the float32 lse

    # -- the space --------------------------------------------------------------------------
    def constraint(self, problem: Problem, config: KernelConfig, device: DeviceInfo) -> str | None:
        reason = self.unsupported(problem)
        if reason:
            return reason
        cfg = self.config(config)
        assert isinstance(cfg, FlashDecodeConfig)
        return (self._resource_reason(problem, cfg, device)
                or self._waste_reason(problem, cfg))

    def _resource_reason(self, problem: Problem, cfg: FlashDecodeConfig,
                         device: DeviceInfo) -> str | None:
        """Configs that cannot run: more shared memory than the device has."""
        rows = rows_per_tile(problem.gqa_ratio, problem.seqlen_q)
        need = smem_bytes(cfg.block_n, problem.head_dim, cfg.num_stages,
                          _elem_bytes(problem.dtype), rows)
        if need > device.smem_per_block:
            return (f"block_n={cfg.block_n} x num_stages={cfg.num_stages} at head dim "
                    f"{problem.head_dim} needs {need} B of shared memory, but {device.name} "
                    f"has {device.smem_per_block} B per program")
        return None

    def _waste_reason(self, problem: Problem, cfg: FlashDecodeConfig) -> str | None:
        """Configs that run correctly but cannot be fast: pruned from the search."""
        block_d = pow2_at_least(problem.head_dim, 16)
        per_thread = cfg.block_n * block_d // (32 * cfg.num_warps)
        if per_thread > MAX_TILE_ELEMS_PER_THREAD:
            return (f"a {cfg.block_n}x{block_d} K tile over {cfg.num_warps} warps is "
                    f"{per_thread} elements per thread (> {MAX_TILE_ELEMS_PER_THREAD}): "
                    f"registers would spill")
        if per_thread < MIN_TILE_ELEMS_PER_THREAD:
            return (f"a {cfg.block_n}x{block_d} K tile over {cfg.num_warps} warps is "
                    f"{per_thread} elements per thread (< {MIN_TILE_ELEMS_PER_THREAD}): "
                    f"most lanes would idle")
        if cfg.block_n > pow2_at_least(problem.seqlen_kv, 16):
            return (f"block_n={cfg.block_n} exceeds the cache length {problem.seqlen_kv} "
                    f"rounded up to a power of two: the tile would be mostly masked")
        tiles = triton.cdiv(problem.seqlen_kv, cfg.block_n)
        if cfg.num_splits > tiles:
            return (f"num_splits={cfg.num_splits} exceeds the {tiles} tiles of block_n="
                    f"{cfg.block_n} in the longest sequence ({problem.seqlen_kv}): some "
                    f"splits would get no keys")
        # Knobs that change nothing here: the same kernel as a config already in the space.
        if cfg.num_splits == 1 and cfg.combine != "separate":
            return "one split writes the output itself: there is no combine to fuse"
        if cfg.whole_waves and cfg.num_splits < 8:
            return (f"whole_waves adds at most an eighth of num_splits={cfg.num_splits}, "
                    f"which is less than one split")
        return None

    def known_good_configs(self, problem: Problem, device: DeviceInfo) -> list[KernelConfig]:
        """Where the H100 probe of the decode rows found the fastest configs (graph-replayed,
        2026-11-24: B1 32k/128k and B8 32k at 32/8 heads, d128, bf16; notes/dispatch_measurements.md):
        a grid of one or four programs per SM, 64- or 128-key tiles, three stages, the
        separate combine; and the fused combine of the first. The search starts from them."""
        if device.family not in ("hopper", "blackwell"):
            return []
        programs = problem.batch * problem.heads_kv * _row_tiles(problem)
        default = self.default_config(problem, device)
        out: list[KernelConfig] = []
        for waves, block_n, combine in ((1, 64, "separate"), (1, 128, "separate"),
                                        (4, 128, "separate"), (4, 64, "separate"),
                                        (1, 64, "fused")):
            splits = max(s for s in SPLIT_CHOICES
                         if s == 1 or programs * s <= waves * device.sm_count)
            cfg = FlashDecodeConfig(num_splits=splits, block_n=block_n, num_warps=4,
                                    num_stages=3,
                                    combine=combine if splits > 1 else "separate")
            if cfg != default and cfg not in out and \
                    self.constraint(problem, cfg, device) is None:
                out.append(cfg)
        return out

    def default_config(self, problem: Problem, device: DeviceInfo) -> FlashDecodeConfig:
        # Decode streams K/V: 64-key tiles at d=128 give 4 warps 64 elements of each tile per
        # thread, with room for 3 pipeline stages (100 KB at bf16) on Hopper. A starting
        # point from the tile arithmetic, not a measurement: tuning replaces it.
        block_d = pow2_at_least(problem.head_dim, 16)
        block_n = {16: 128, 32: 128, 64: 128, 128: 64}.get(block_d, 32)
        block_n = min(block_n, pow2_at_least(problem.seqlen_kv, 16))
        num_stages = 3 if device.family in ("hopper", "blackwell") else 2
        rows = rows_per_tile(problem.gqa_ratio, problem.seqlen_q)
        elem = _elem_bytes(problem.dtype)
        while num_stages > 1 and (smem_bytes(block_n, problem.head_dim, num_stages, elem, rows)
                                  > device.smem_per_block):
            num_stages -= 1
        while block_n > BLOCK_N_CHOICES[0] and (smem_bytes(block_n, problem.head_dim, num_stages,
                                                           elem, rows) > device.smem_per_block):
            block_n //= 2
        num_warps = 4
        while num_warps > 1 and block_n * block_d // (32 * num_warps) < MIN_TILE_ELEMS_PER_THREAD:
            num_warps //= 2
        splits = default_num_splits(problem.batch, problem.heads_kv, _row_tiles(problem),
                                    problem.seqlen_kv, block_n, device.sm_count)
        return FlashDecodeConfig(num_splits=splits, block_n=block_n, num_warps=num_warps,
                                 num_stages=num_stages)

    # -- running and checking ---------------------------------------------------------------
    def make_inputs(self, problem: Problem, device: str, seed: int = 0) -> dict[str, Any]:
        reason = self.unsupported(problem)
        if reason:
            raise ValueError(f"flash_decode cannot take {problem.key()}: {reason}")
        return make_decode_inputs(problem, device, seed)

    def run(self, inputs: Mapping[str, Any], config: KernelConfig) -> tuple[torch.Tensor, torch.Tensor]:
        # make_inputs built valid lengths and pages: skip the content check, whose
        # device-to-host copy would otherwise be timed with the kernel.
        return flash_decode(inputs["q"], inputs["k_cache"], inputs["v_cache"],
                            cache_seqlens=inputs["cache_seqlens"],
                            block_table=inputs.get("block_table"), scale=inputs.get("scale"),
                            config=self.config(config), check_contents=False)

    def kernel_launches(self, problem: Problem, config: KernelConfig) -> list[KernelLaunch] | None:
        """The split kernel's launch (and the separate combine's), with stand-in tensors laid
        out as ``make_decode_inputs`` lays them out (contiguous, or a paged pool)."""
        if self.unsupported(problem):
            return None
        cfg = self.config(config)
        assert isinstance(cfg, FlashDecodeConfig)
        layout = parse_decode_mask(problem.mask)
        dtype = getattr(torch, problem.dtype)
        b, h_kv, d = problem.batch, problem.heads_kv, problem.head_dim
        q = StandinTensor(dtype, (b, problem.heads_q, problem.seqlen_q, d))
        lengths = StandinTensor(torch.int32, (b,))
        if layout.page_size is None:
            cache_shape: tuple[int, ...] = (b, h_kv, problem.seqlen_kv, d)
            table = None
            shape = DecodeShape(b, problem.heads_q, h_kv, problem.seqlen_q, d,
                                problem.seqlen_kv, 0, 0)
        else:
            page = layout.page_size
            max_pages = -(-problem.seqlen_kv // page)
            pages = b * max_pages + 1  # the pool's size sets no stride: any count will do
            cache_shape = (pages, page, h_kv, d)
            table = StandinTensor(torch.int32, (b, max_pages))
            shape = DecodeShape(b, problem.heads_q, h_kv, problem.seqlen_q, d,
                                max_pages * page, page, pages)
        cache = StandinTensor(dtype, cache_shape)
        return decode_launches(q, cache, StandinTensor(dtype, cache_shape), lengths, table,
                               shape, StandinTensor, num_splits=cfg.num_splits,
                               block_n=cfg.block_n, num_warps=cfg.num_warps,
                               num_stages=cfg.num_stages, combine=cfg.combine,
                               kv_load=cfg.kv_load, whole_waves=cfg.whole_waves)

    def reference(self, inputs: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        return decode_reference(inputs["q"], inputs["k_cache"], inputs["v_cache"],
                                cache_seqlens=inputs["cache_seqlens"],
                                block_table=inputs.get("block_table"), scale=inputs.get("scale"))

    def error(self, out: Any, ref: Any) -> float:
        """Relative error of o and of lse; rows that see no key must be -inf in both."""
        (o, lse), (o_ref, lse_ref) = out, ref
        empty = torch.isneginf(lse_ref.cpu())
        if not torch.equal(torch.isneginf(lse.detach().cpu()), empty):
            return math.inf
        lse_seen = lse.detach().cpu().masked_fill(empty, 0.0)
        ref_seen = lse_ref.cpu().masked_fill(empty, 0.0)
        return max(relative_error(o, o_ref), relative_error(lse_seen, ref_seen))

    # -- code generation ----------------------------------------------------------------------
    def source_modules(self) -> list[str]:
        return [type(self).__module__, flash_decode_kernel.__name__, direct_launch.__name__,
                tensor_maps.__name__, plan_cache.__name__]

    def standalone_source(self, config: KernelConfig) -> str:
        cfg = self.config(config)
        assert isinstance(cfg, FlashDecodeConfig)
        return standalone_module_text(cfg, self.version())


# ----------------------------------------------------------------------------- entry point
def problem_of(q: torch.Tensor, shape: DecodeShape) -> Problem:
    """The Problem a call solves (seqlen_kv is the cache capacity, the lengths are unknown)."""
    dtype = str(q.dtype).removeprefix("torch.")
    return Problem(batch=shape.batch, heads_q=shape.heads_q, heads_kv=shape.heads_kv,
                   seqlen_q=shape.n_q, seqlen_kv=max(shape.capacity, shape.n_q),
                   head_dim=shape.head_dim, dtype=dtype,
                   causal="none" if shape.n_q == 1 else "bottom_right",
                   mask=f"paged:{shape.page_size}" if shape.page_size else "none")


def flash_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *,
                 cache_seqlens: torch.Tensor, block_table: torch.Tensor | None = None,
                 scale: float | None = None,
                 config: KernelConfig | Mapping[str, object] | None = None,
                 check_contents: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of N_q new tokens per sequence against its KV cache, split over the KV length.

    Args:
        q: (B, H_q, N_q, D), N_q <= 16, float16/bfloat16/float32, any strides.
        k_cache, v_cache: (B, H_kv, N_max, D), or paged (num_pages, page_size, H_kv, D) when
            ``block_table`` is given; q's dtype and device; any strides.
        cache_seqlens: (B,) int32 lengths, the N_q new tokens included.
        block_table: (B, max_pages) int32 physical page of each logical page, or None.
        scale: softmax scale; 1/sqrt(D) by default.
        config: a FlashDecodeConfig (or its dict); None takes the default heuristic.
        check_contents: check the lengths and the pages in use (one device-to-host copy);
            turn off only where they are known valid, e.g. a tight decode loop.

    Returns:
        (o, lse): o (B, H_q, N_q, D) in q's dtype; lse (B, H_q, N_q) float32 natural log.
        Query rows that see no key get o = 0 and lse = -inf.

    Raises:
        ValueError: bad shapes, dtypes, devices, lengths, block table, or a config that needs
            more shared memory than the device has.
    """
    key = _call_key(q, k_cache, v_cache, cache_seqlens, block_table, config)
    checked = _CHECKED_CALLS.get(key)
    if checked is None:
        checked = _check_call(q, k_cache, v_cache, cache_seqlens, block_table, config)
        _CHECKED_CALLS.put(key, checked)
    shape, cfg = checked
    if check_contents:
        check_cache_contents(shape, cache_seqlens, block_table)
    return launch_with_config(q, k_cache, v_cache, cache_seqlens, block_table, scale, shape, cfg)


# What checking a call's arguments and config gave, by the properties those checks read, so
# that a decode loop (or a sweep timing a config) pays for them once. Lengths and pages are
# values, not properties: their check runs on every call that asks for it.
_CHECKED_CALLS: PlanCache[tuple[DecodeShape, FlashDecodeConfig]] = PlanCache(maxsize=1024)


def _call_key(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              cache_seqlens: torch.Tensor, block_table: torch.Tensor | None,
              config: KernelConfig | Mapping[str, object] | None) -> tuple[object, ...] | None:
    tensors = (q, k_cache, v_cache, cache_seqlens, block_table)
    if not all(isinstance(t, torch.Tensor) for t in tensors[:4]) or not (
            block_table is None or isinstance(block_table, torch.Tensor)):
        return None  # not cached: the checks say what is wrong
    if isinstance(config, Mapping):
        config_key: object = tuple(sorted(config.items()))
    else:
        config_key = config  # KernelConfigs are frozen dataclasses: hashable
    return (config_key, *((None if t is None else (t.shape, t.stride(), t.dtype, t.device))
                          for t in tensors))


def _check_call(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                cache_seqlens: torch.Tensor, block_table: torch.Tensor | None,
                config: KernelConfig | Mapping[str, object] | None
                ) -> tuple[DecodeShape, FlashDecodeConfig]:
    shape = check_decode_inputs(q, k_cache, v_cache, cache_seqlens, block_table,
                                check_contents=False)
    check_interpreter_usable()
    template = TEMPLATE
    device = current_device(q.device.index) if q.is_cuda else current_device()
    problem = problem_of(q, shape)
    if config is None:
        return shape, template.default_config(problem, device)
    cfg = template.config(config)
    assert isinstance(cfg, FlashDecodeConfig)
    reason = template._resource_reason(problem, cfg, device)
    if reason:
        raise ValueError(f"config {cfg.key()} cannot run this problem: {reason}")
    return shape, cfg


def launch_with_config(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       cache_seqlens: torch.Tensor, block_table: torch.Tensor | None,
                       scale: float | None, shape: DecodeShape, cfg: FlashDecodeConfig, *,
                       want_lse: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """launch_decode with the knobs of ``cfg``, on inputs check_decode_inputs passed."""
    dtype = q.dtype
    if runs_in_float32(dtype):  # bf16 under the interpreter (templates.interpreter_dtype)
        q, k_cache, v_cache = as_float32(q, k_cache, v_cache)
    o, lse = launch_decode(q, k_cache, v_cache, cache_seqlens, block_table, scale, shape,
                           num_splits=cfg.num_splits, block_n=cfg.block_n,
                           num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                           combine=cfg.combine, kv_load=cfg.kv_load,
                           whole_waves=cfg.whole_waves, want_lse=want_lse)
    return (o if o.dtype == dtype else o.to(dtype)), lse


def kept_launch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                cache_seqlens: torch.Tensor, block_table: torch.Tensor | None,
                shape: DecodeShape, cfg: FlashDecodeConfig) -> Callable[..., torch.Tensor]:
    """For a caller that keys its calls by every property ``decode_launch_plan`` reads
    (shapes, strides, dtypes, device, 16-byte alignment): ``run(q, k_cache, v_cache,
    cache_seqlens, block_table, scale)`` -> o of a call like this one, through a plan made
    now. ``tuner.decode`` and the dispatcher keep one per key: a decode step then costs an
    output allocation and the launches."""
    if runs_in_float32(q.dtype):  # the interpreter's bf16: converted on every call
        def converted(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      cache_seqlens: torch.Tensor, block_table: torch.Tensor | None,
                      scale: float | None) -> torch.Tensor:
            return launch_with_config(q, k_cache, v_cache, cache_seqlens, block_table, scale,
                                      shape, cfg, want_lse=False)[0]
        return converted
    plan = decode_launch_plan(q, k_cache, v_cache, cache_seqlens, block_table, shape,
                              num_splits=cfg.num_splits, block_n=cfg.block_n,
                              num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                              combine=cfg.combine, kv_load=cfg.kv_load,
                              whole_waves=cfg.whole_waves)

    def run(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            cache_seqlens: torch.Tensor, block_table: torch.Tensor | None,
            scale: float | None) -> torch.Tensor:
        return run_decode_plan(plan, q, k_cache, v_cache, cache_seqlens, block_table, scale,
                               want_lse=False)[0]
    return run


# ----------------------------------------------------------------------------- inputs & reference
def make_decode_inputs(problem: Problem, device: str, seed: int = 0) -> dict[str, Any]:
    """Random q and caches (never zeros) for ``problem``; a paged pool is shuffled and its
    unused block-table entries are -1, so reading a page not in use would show."""
    layout = parse_decode_mask(problem.mask)
    dtype = getattr(torch, problem.dtype)
    gen_host = torch.Generator().manual_seed(seed)
    # Generate on the device itself: a 128k cache would take seconds through the host.
    gen = torch.Generator(device=device).manual_seed(seed)
    lengths = torch.tensor(sequence_lengths(problem), dtype=torch.int32)
    lengths = lengths[torch.randperm(problem.batch, generator=gen_host)]
    b, h_kv, d = problem.batch, problem.heads_kv, problem.head_dim
    q = torch.randn((b, problem.heads_q, problem.seqlen_q, d), generator=gen, device=device,
                    dtype=dtype)
    inputs: dict[str, Any] = {"q": q, "cache_seqlens": lengths.to(device), "scale": None,
                              "block_table": None}
    if layout.page_size is None:
        shape: tuple[int, ...] = (b, h_kv, problem.seqlen_kv, d)
    else:
        page = layout.page_size
        pages_used = [-(-int(n) // page) for n in lengths]
        total = sum(pages_used) + 1  # one spare page nobody uses
        physical = torch.randperm(total, generator=gen_host)
        table = torch.full((b, -(-problem.seqlen_kv // page)), -1, dtype=torch.int32)
        taken = 0
        for row, used in enumerate(pages_used):
            table[row, :used] = physical[taken:taken + used].to(torch.int32)
            taken += used
        inputs["block_table"] = table.to(device)
        shape = (total, page, h_kv, d)
    inputs["k_cache"] = torch.randn(shape, generator=gen, device=device, dtype=dtype)
    inputs["v_cache"] = torch.randn(shape, generator=gen, device=device, dtype=dtype)
    return inputs


def gather_sequence_kv(cache: torch.Tensor, block_table: torch.Tensor | None, b: int,
                       length: int) -> torch.Tensor:
    """The first ``length`` cached entries of sequence ``b`` as (H_kv, length, D)."""
    if block_table is None:
        return cache[b, :, :length]
    page_size = cache.shape[1]
    pages = block_table[b, : -(-length // page_size)].long()
    return cache[pages].flatten(0, 1)[:length].transpose(0, 1)


def decode_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *,
                     cache_seqlens: torch.Tensor, block_table: torch.Tensor | None = None,
                     scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain softmax(q k^T) v per sequence: float64 on the CPU, float32 on a GPU."""
    acc_dtype = torch.float64 if q.device.type == "cpu" else torch.float32
    batch, heads_q, n_q, head_dim = q.shape
    heads_kv = k_cache.shape[2] if block_table is not None else k_cache.shape[1]
    group = heads_q // heads_kv
    sm_scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    o = torch.zeros((batch, heads_q, n_q, head_dim), dtype=acc_dtype, device=q.device)
    lse = torch.full((batch, heads_q, n_q), -math.inf, dtype=acc_dtype, device=q.device)
    tok = torch.arange(n_q, device=q.device)
    for b, length in enumerate(cache_seqlens.tolist()):
        if length == 0:
            continue
        k = gather_sequence_kv(k_cache, block_table, b, length).to(acc_dtype)
        v = gather_sequence_kv(v_cache, block_table, b, length).to(acc_dtype)
        # (H_kv, group * N_q, D): the group's heads share their KV head without a copy of K.
        qb = q[b].to(acc_dtype).reshape(heads_kv, group * n_q, head_dim)
        scores = (qb @ k.transpose(1, 2)) * sm_scale
        visible = (torch.arange(length, device=q.device)[None, :]
                   < (length - n_q + 1 + tok)[:, None])  # (N_q, L)
        scores = scores.masked_fill(~visible.repeat(group, 1)[None], -math.inf)
        row_lse = torch.logsumexp(scores, dim=-1, keepdim=True)
        probs = torch.exp(scores - row_lse).nan_to_num(0.0)  # rows seeing no key: 0
        o[b] = (probs @ v).reshape(heads_q, n_q, head_dim)
        lse[b] = row_lse.reshape(heads_q, n_q)
    return o, lse


# ----------------------------------------------------------------------------- standalone
_STANDALONE_HEADER = '''"""Flash-decoding kernel exported by the attention tuner.

Template flash_decode, version {version}; config {key}.
Needs only torch and triton. Call flash_decode(q, k_cache, v_cache, cache_seqlens=...,
block_table=None, scale=None) -> (o, lse); check_decode_inputs says the layouts.
"""
'''

_STANDALONE_ENTRY = '''

NUM_SPLITS = {num_splits}
BLOCK_N = {block_n}
NUM_WARPS = {num_warps}
NUM_STAGES = {num_stages}
COMBINE = {combine!r}
KV_LOAD = {kv_load!r}
WHOLE_WAVES = {whole_waves}


def flash_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *,
                 cache_seqlens: torch.Tensor, block_table: torch.Tensor | None = None,
                 scale: float | None = None,
                 check_contents: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    shape = check_decode_inputs(q, k_cache, v_cache, cache_seqlens, block_table,
                                check_contents=check_contents)
    return launch_decode(q, k_cache, v_cache, cache_seqlens, block_table, scale, shape,
                         num_splits=NUM_SPLITS, block_n=BLOCK_N, num_warps=NUM_WARPS,
                         num_stages=NUM_STAGES, combine=COMBINE, kv_load=KV_LOAD,
                         whole_waves=WHOLE_WAVES)
'''


def standalone_module_text(cfg: FlashDecodeConfig, version: str) -> str:
    """The kernel module verbatim under a new docstring, then the config and an entry point."""
    source = inline_template_imports(inspect.getsource(flash_decode_kernel))
    docstring_end = ast.parse(source).body[0].end_lineno
    body = "".join(source.splitlines(keepends=True)[docstring_end:])
    return (_STANDALONE_HEADER.format(version=version, key=cfg.key()) + body
            + _STANDALONE_ENTRY.format(**cfg.to_dict()))


TEMPLATE = FlashDecodeTemplate()
register(TEMPLATE)
