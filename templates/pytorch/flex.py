"""Compiled FlexAttention as tuning candidates for block masks: ``torch_flex`` (forward) and
``torch_flex_train`` (forward + backward).

``torch.nn.attention.flex_attention.flex_attention`` compiled once per process
(``torch.compile(flex_attention, dynamic=False)``, as ``benchmarks/masked_fwd_bwd_bench.py``
times it) is the other way to run a ``tuner.BlockMask`` call: on the H100 our block-sparse
forward was 1.09-1.37x Flex, but Flex's forward + backward beat ours at d128 by 1.2-1.4x
(notes/benchmarks_notes.md). Which one runs a block-mask call is decided by measurement
(docs/DISPATCH.md), so Flex is measured like our kernels: in the same trial worker, against the
same reference, timed by the same timer, stored in the same tables.

The mask is ours, converted exactly (``to_flex_block_mask``): our full blocks are Flex's full
blocks (no mask_mod), our partial blocks Flex's partial blocks, with a mask_mod that reads our
stored (Q_BLOCK, KV_BLOCK) tile of the block. A causal call (``is_causal`` or a causal
problem) is folded in at the block level: blocks above the diagonal are dropped, full blocks
it crosses become partial (with an all-visible tile), and the mask_mod ands the causal test.
The conversion is kept on the mask object (one per causal mode), so a mask reused across calls
(a sweep's, a model's layers') converts once, and one made per call is freed with it.

Problems: block-sparse ones (``Problem.mask`` a named pattern, ``templates.masks.mods``), the
mask the sweep builds for them with ``pattern_block_mask``. Dense problems are ``torch_sdpa``'s.
Knobs: Flex's forward tiles (``kernel_options`` BLOCK_M / BLOCK_N; 0 leaves them to Flex's
own heuristic), which must divide the mask's blocks (128 for the sweeps' masks); the training
template runs Flex's own tiles only (one config).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.attention.flex_attention import BlockMask as FlexBlockMask
from torch.nn.attention.flex_attention import flex_attention

from templates.attention_reference import (
    attention_reference,
    forward_bytes,
    forward_flops,
    random_inputs,
)
from templates.base import KernelConfig, Problem, Template, knob, next_pow2
from templates.device import DeviceInfo
from templates.flash.bwd import reference_grads
from templates.flash.fwd import pattern_mask
from templates.masks.block_mask import BlockMask, block_lists, listed_slots
from templates.masks.mods import pattern_problem
from templates.registry import register

__all__ = ["FlexConfig", "compiled_flex_attention", "flex", "block_size_problem",
           "to_flex_block_mask"]

# Past dynamo's default recompile limit (8) a compiled flex_attention silently falls back to
# eager (the unfused math path): every shape, mask_mod and kernel_options value is one more
# graph, and a sweep worker or a model meets more than 8 of them.
RECOMPILE_LIMIT = 64
MIN_HEAD_DIM = 16  # Flex refuses smaller embedding dims

_COMPILED: Callable[..., Any] | None = None


def compiled_flex_attention() -> Callable[..., Any]:
    """``torch.compile(flex_attention, dynamic=False)``, made once per process."""
    global _COMPILED
    if _COMPILED is None:
        # lazy: torch._dynamo +0.98 s at import (2-core CPU); only compiled flex needs it
        import torch._dynamo

        config = torch._dynamo.config
        config.recompile_limit = max(config.recompile_limit, RECOMPILE_LIMIT)
        _COMPILED = torch.compile(flex_attention, dynamic=False)
    return _COMPILED


# ----------------------------------------------------------------------------- the mask
def causal_offset(causal: str, seqlen_q: int, seqlen_kv: int) -> int | None:
    """Query i sees keys j <= i + offset: 0 for top-left, N_kv - N_q for bottom-right,
    None for no causal mask."""
    if causal == "none":
        return None
    if causal == "top_left":
        return 0
    if causal == "bottom_right":
        return seqlen_kv - seqlen_q
    raise ValueError(f"causal must be 'none', 'top_left' or 'bottom_right', but got {causal!r}")


def to_flex_block_mask(block_mask: BlockMask, causal: str = "none") -> Any:
    """Flex's BlockMask for exactly ``block_mask`` (and ``causal`` on top), built once per mask
    object and causal mode (kept on the mask)."""
    cache: dict[str, Any] = block_mask.__dict__.setdefault("_flex_block_masks", {})
    flex_mask = cache.get(causal)
    if flex_mask is None:
        flex_mask = cache[causal] = _convert(block_mask, causal)
    return flex_mask


def _convert(block_mask: BlockMask, causal: str) -> Any:
    bm, hm, nq, nk = block_mask.full_indices.shape
    qb, kb = block_mask.block_size
    n_q, n_kv = block_mask.seqlen_q, block_mask.seqlen_kv
    device = block_mask.device
    # Per block: 0 not visited, 1 full, 2 partial (with its tile's row in ``tiles``).
    kind = torch.zeros(bm, hm, nq, nk, dtype=torch.int8, device=device)
    tile_of = torch.zeros(bm, hm, nq, nk, dtype=torch.int32, device=device)
    kind[block_mask._scatter_index(block_mask.full_counts, block_mask.full_indices, 0, nq)] = 1
    where = block_mask._scatter_index(block_mask.partial_counts, block_mask.partial_indices, 0,
                                      nq)
    kind[where] = 2
    tile_of[where] = block_mask.partial_tile_ids[listed_slots(block_mask.partial_counts, nk)]
    # One all-visible tile after the stored ones: for full blocks the causal edge crosses, and
    # so that the mask_mod never indexes an empty tensor. The tile count is padded to a power
    # of two: the compiled Flex is specialized to the shapes of the tensors its mask_mod
    # reads, so masks of one geometry recompile only when their count crosses one.
    ones = block_mask.partial_tiles.shape[0]
    tiles = torch.zeros(next_pow2(ones + 1), qb, kb, dtype=torch.uint8, device=device)
    tiles[:ones] = block_mask.partial_tiles
    tiles[ones] = 1
    offset = causal_offset(causal, n_q, n_kv)
    if offset is not None:
        q_blocks = torch.arange(nq, device=device)
        k_blocks = torch.arange(nk, device=device)
        first_row = q_blocks * qb
        last_row = torch.clamp((q_blocks + 1) * qb, max=n_q) - 1
        first_key = k_blocks * kb
        last_key = torch.clamp((k_blocks + 1) * kb, max=n_kv) - 1
        all_seen = last_key[None, :] <= first_row[:, None] + offset  # (nq, nk)
        none_seen = first_key[None, :] > last_row[:, None] + offset
        kind = torch.where(none_seen, torch.zeros_like(kind), kind)
        crossed = (kind == 1) & ~all_seen
        kind = torch.where(crossed, torch.full_like(kind, 2), kind)
        tile_of = torch.where(crossed, torch.full_like(tile_of, ones), tile_of)
    full_counts, full_indices = block_lists(kind == 1)
    partial_counts, partial_indices = block_lists(kind == 2)
    tile_of, tiles = tile_of.contiguous(), tiles.contiguous()

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor,
                 kv_idx: torch.Tensor) -> torch.Tensor:
        tile = tile_of[b % bm, h % hm, q_idx // qb, kv_idx // kb]
        seen = tiles[tile, q_idx % qb, kv_idx % kb] != 0
        return seen if offset is None else seen & (kv_idx <= q_idx + offset)

    return FlexBlockMask.from_kv_blocks(partial_counts, partial_indices, full_counts,
                                        full_indices, BLOCK_SIZE=(qb, kb), mask_mod=mask_mod,
                                        seq_lengths=(n_q, n_kv))


# ----------------------------------------------------------------------------- running
def flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: BlockMask, *,
         causal: str = "none", scale: float | None = None, enable_gqa: bool = False,
         config: FlexConfig | None = None, softcap: float = 0.0) -> torch.Tensor:
    """Compiled FlexAttention of (B, H, L, E) inputs under ``block_mask`` (and ``causal``);
    differentiable. Rows that see no key give zeros, as ours. ``softcap`` > 0 caps the scaled
    scores by a score_mod (``softcap * tanh(s / softcap)``, Gemma 2)."""
    reason = block_size_problem(block_mask)
    if reason:
        raise ValueError(reason)
    options = None if config is None else config.kernel_options()
    return compiled_flex_attention()(  # type: ignore[no-any-return]
        q, k, v, block_mask=to_flex_block_mask(block_mask, causal), scale=scale,
        enable_gqa=enable_gqa, kernel_options=options if q.is_cuda else None,
        score_mod=softcap_score_mod(softcap) if softcap else None)


@functools.lru_cache(maxsize=8)
def softcap_score_mod(softcap: float) -> Callable[..., torch.Tensor]:
    """Flex's score_mod capping the scaled score; one function per cap, so a compiled graph
    that specializes on it is reused by every call with that cap."""

    def capped(score: torch.Tensor, b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor,
               kv_idx: torch.Tensor) -> torch.Tensor:
        return torch.tanh(score / softcap) * softcap

    return capped


# Flex's tiles on Hopper: its forward's are 128 and must divide the mask's blocks. Smaller
# blocks with matching kernel_options pass the forward, but no backward config of Flex's
# autotuner then fits (torch 2.11 on the H100: "NoValidChoicesError" in
# flex_attention_backward), so masks of smaller blocks run ours.
FLEX_MIN_BLOCK = 128


def block_size_problem(block_mask: BlockMask) -> str | None:
    """Why Flex cannot run ``block_mask`` (None if it can)."""
    qb, kb = block_mask.block_size
    if qb % FLEX_MIN_BLOCK or kb % FLEX_MIN_BLOCK:
        return (f"FlexAttention needs mask blocks that are multiples of {FLEX_MIN_BLOCK} "
                f"(its tiles), but this mask's are {qb} x {kb}")
    return None


@dataclass(frozen=True)
class FlexConfig(KernelConfig):
    """Flex's forward tiles (``kernel_options``); 0 = Flex's own choice."""

    block_m: int = knob(0, (0, 64, 128),
                        "Query rows per forward program (Flex's BLOCK_M). 0: Flex's heuristic "
                        "(128 at d<=128 on Hopper). Must divide the mask's query block.")
    block_n: int = knob(0, (0, 32, 64, 128),
                        "Keys per forward step (Flex's BLOCK_N). 0: Flex's heuristic. Must "
                        "divide the mask's KV block.")

    def kernel_options(self) -> dict[str, int] | None:
        options = {name: value for name, value in (("BLOCK_M", self.block_m),
                                                   ("BLOCK_N", self.block_n)) if value}
        return options or None


class _FlexTemplate(Template):
    """What the forward and the training templates share: problems, space, inputs."""

    config_cls = FlexConfig
    takes_softcap = True  # by a score_mod

    def unsupported(self, problem: Problem) -> str | None:
        reason = super().unsupported(problem)  # a softcapped problem, where it does not cap
        if reason:
            return reason
        if problem.mask == "none":
            return (f"{self.name} is a candidate for block masks; dense problems are "
                    f"torch_sdpa's")
        reason = pattern_problem(problem.mask, problem.seqlen_q, problem.seqlen_kv)
        if reason:
            return reason
        if problem.head_dim < MIN_HEAD_DIM:
            return (f"FlexAttention needs a head dim of at least {MIN_HEAD_DIM}, but got "
                    f"{problem.head_dim}")
        return None

    def constraint(self, problem: Problem, config: KernelConfig, device: DeviceInfo
                   ) -> str | None:
        cfg = self.config(config)
        assert isinstance(cfg, FlexConfig)
        if cfg.kernel_options() and device.is_interpreter:
            return "Flex's kernel_options tiles apply to its CUDA kernels only"
        return None

    def default_config(self, problem: Problem, device: DeviceInfo) -> FlexConfig:
        return FlexConfig()

    def make_inputs(self, problem: Problem, device: str, seed: int = 0) -> dict[str, Any]:
        inputs = random_inputs(problem, device, seed, grad_out=True)
        inputs["block_mask"] = pattern_mask(problem.mask, problem.seqlen_q, problem.seqlen_kv,
                                             str(device))
        return inputs

    def _call(self, inputs: Mapping[str, Any], config: KernelConfig, q: torch.Tensor,
              k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        cfg = self.config(config)
        assert isinstance(cfg, FlexConfig)
        return flex(q, k, v, inputs["block_mask"], causal=inputs["causal"],
                    scale=inputs["scale"], enable_gqa=q.shape[1] != k.shape[1], config=cfg,
                    softcap=inputs.get("softcap", 0.0))

    @staticmethod
    def _dense_mask(inputs: Mapping[str, Any]) -> torch.Tensor:
        return inputs["block_mask"].to_dense()  # type: ignore[no-any-return]


class TorchFlexTemplate(_FlexTemplate):
    name = "torch_flex"
    description = ("compiled FlexAttention forward (torch.compile(flex_attention)) under the "
                   "problem's block mask, converted exactly from ours: the other candidate "
                   "for block-mask calls beside our block-sparse flash_fwd.")

    def flops(self, problem: Problem) -> float:
        # Dense-equivalent, as flash_fwd counts block-sparse problems: the dispatcher compares
        # the two by time, which this cancels out of.
        return forward_flops(problem)

    def bytes_moved(self, problem: Problem) -> float:
        return forward_bytes(problem, lse=False)

    def run(self, inputs: Mapping[str, Any], config: KernelConfig) -> Any:
        return self._call(inputs, config, inputs["q"], inputs["k"], inputs["v"])

    def reference(self, inputs: Mapping[str, Any]) -> Any:
        return attention_reference(inputs["q"], inputs["k"], inputs["v"],
                                   causal=inputs["causal"], scale=inputs["scale"],
                                   mask=self._dense_mask(inputs),
                                   softcap=inputs.get("softcap", 0.0))[0]


class TorchFlexTrainTemplate(_FlexTemplate):
    name = "torch_flex_train"
    description = ("compiled FlexAttention forward + backward under the problem's block mask; "
                   "compared with flash_fwd + flash_bwd by the dispatcher for block-mask calls "
                   "that need a gradient.")

    def constraint(self, problem: Problem, config: KernelConfig, device: DeviceInfo
                   ) -> str | None:
        cfg = self.config(config)
        assert isinstance(cfg, FlexConfig)
        if cfg.kernel_options():
            # Plain BLOCK_M / BLOCK_N reach Flex's backward too in some torch versions (only
            # ``fwd_``-prefixed keys are the forward's alone, and not in every version).
            return ("torch_flex_train runs Flex's own tiles (block_m = block_n = 0): the "
                    "forward's BLOCK_M / BLOCK_N are not the backward's")
        return super().constraint(problem, config, device)

    def flops(self, problem: Problem) -> float:
        return 3.5 * forward_flops(problem)  # forward + backward, as torch_sdpa_train

    def bytes_moved(self, problem: Problem) -> float:
        return 2.0 * forward_bytes(problem, lse=False)

    def run(self, inputs: Mapping[str, Any], config: KernelConfig) -> Any:
        q, k, v = (inputs[name].detach().requires_grad_() for name in ("q", "k", "v"))
        with torch.enable_grad():
            o = self._call(inputs, config, q, k, v)
            return torch.autograd.grad(o, (q, k, v), inputs["do"])

    def reference(self, inputs: Mapping[str, Any]) -> Any:
        return reference_grads(inputs["q"], inputs["k"], inputs["v"], inputs["do"],
                               causal=inputs["causal"], scale=inputs["scale"],
                               mask=self._dense_mask(inputs),
                               softcap=inputs.get("softcap", 0.0))


TORCH_FLEX = register(TorchFlexTemplate())
TORCH_FLEX_TRAIN = register(TorchFlexTrainTemplate())
