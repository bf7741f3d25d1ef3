"""Masked forward + backward benchmark: templates.flash_attention with a BlockMask against
compiled FlexAttention given the same mask, and torch SDPA with the mask materialized.

Follows docs/PROTOCOL.md: bf16, B = 16384 / N, H = 2048 / D, (B, H, N, D)
contiguous; rows d128 N=16k, d128 N=4k, d64 N=16k, each with three masks built at block 128:

  * ``sliding-causal:1024``: query i sees keys i-1024 <= j <= i (local causal attention);
  * ``document-causal:1024``: packed sequences, causal inside each document, documents of
    random lengths (uniform in [256, 1792], seeded) filling N, as a data loader packs them;
  * ``random:0.1``: 10% of the 128x128 blocks kept at random (seeded), plus the diagonal
    blocks so that every query sees a key (a row that sees none has no softmax, and backends
    differ in what they return for it): 11.0% of the blocks at N=16k, 12.9% at N=4k.

Our masks carry what callers' masks carry (``callers_view``): the sliding window's pattern
name and the documents' offsets (from 2026-11-30; earlier results' masks carried neither,
so their Gluon backward read every partial block's tile).

Per row, side by side in one process: ours (``flash_attention(q, k, v, block_mask=...)``,
default configs) forward and forward + backward, then (while the budget lasts) a short grid
of backward configs, FlexAttention (``torch.compile(flex_attention, dynamic=False)`` with
``create_block_mask`` of the same mask_mod) forward and forward + backward, on a Hopper GPU
with Gluon our Gluon forward (``gluon_attention_fwd(q, k, v, block_mask=...)``, the
template's default config; ``gluon``: inference, no graph) and our Gluon kernels both ways
(``gluon-train``: that forward, then the warp-specialized Gluon backward walking the same
mask, ``gluon_attention_bwd(..., block_mask=...)``, its default config: gluon_train's
pairing; ``flash-gluon``: the Triton forward, then that backward: flash_gluon's;
``gluon-split``: gluon-train with the backward's ``split_warpgroups`` knob, ``SPLIT_BWD``;
``gluon-split-lf``, ``gluon-pers``, ``gluon-pers-lf``: that with ``longest_first``,
``persistent`` or both; ``gluon-ws``, ``gluon-ws-lf``: the one-partition kernel with
``dq_early`` (d64's default under masks) without and with ``longest_first``;
``gluon-split-lf-win``, ``gluon-ws-win``: with ``window_offsets``; ``BWD_VARIANTS``), and SDPA
with the mask as a dense bool ``attn_mask``: the cuDNN backend if it takes the mask, else the
efficient one (FA2 takes no mask). A forward is timed as training runs it: inputs requiring
grad, the autograd graph built, no backward (Gluon's is an inference forward: no graph). One
forward + backward call is ``o = attention(q, k, v); torch.autograd.grad(o, (q, k, v), do)``.

FLOPs count only the visible work. Forward = 4 * B * H * D * P, where P is the number of
visible (query, key) pairs of the mask (counted exactly from the dense mask) and 4 = two
matmuls (Q K^T, P V) of 2 FLOPs per multiply-add; a causal mask gives PROTOCOL's halving
(N(N+1)/2 pairs). Forward + backward = 3.5 x forward (PROTOCOL: the backward counts 2.5 x
the forward). Masked pairs inside visited blocks, and all of SDPA's dense N^2 work, cost time
but count nothing, so every implementation of a row shares one FLOP count and its TFLOP/s
ratios are time ratios. The dense-equivalent TFLOP/s of PROTOCOL's block-sparse rows is
TFLOP/s / ``visible_fraction``; ``block_density`` is the fraction of blocks visited.

Every timed output (o, and dq/dk/dv for forward + backward) is first checked against SDPA in
float32 on the same bf16 inputs with the dense mask (the efficient backend on the GPU):
relative error (norm of the difference / norm of the reference) at most the bf16 tolerance,
1e-2. A call that fails the check is reported as failed and never timed. Timing:
triton.testing.do_bench(warmup=25, rep=100, return_mode="median"). The exit status is 1 if
any of our calls (ours, the grid, Gluon) fails its check.

The budget (--budget-s, default 240) counts compile time too (Triton, and Inductor for each
row's FlexAttention graphs): no row starts after it (those left out are listed), and the
backward grid shares what the rows leave. The JSON is written after every row.

    python benchmarks/masked_fwd_bwd_bench.py [--json out.json] [--budget-s 240] [--no-grid]
        [--impls gluon-train,flex,ours]   # only these (the grid is "ours-grid")
        [--rows 128:16384:document,64:16384]   # only these rows (D:N[:pattern prefix])
        [--shapes 128:8192,128:32768 --heads 1,32,16]   # other rows: D:N, and B,HQ,HKV (GQA)
    TRITON_INTERPRET=1 python benchmarks/masked_fwd_bwd_bench.py --smoke   # CPU: one tiny
        shape, our kernels and the reference only (no Flex, no SDPA, no CUDA timing)
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from collections.abc import Callable, Mapping
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field, replace
from functools import cache, partial
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.fwd_bwd_bench import GRID, bench_ms, environment  # noqa: E402
from templates.base import TOLERANCE, Problem, relative_error  # noqa: E402
from templates.device import current_device, interpreter_active  # noqa: E402
from templates.flash.autograd import flash_attention  # noqa: E402
from templates.flash.bwd import TEMPLATE as BWD  # noqa: E402
from templates.flash.bwd import BwdConfig, block_mask_tile_reason, fit_to_block_mask  # noqa: E402
from templates.flash.fwd import flash_attention_fwd  # noqa: E402
from templates.gluon.bwd import gluon_attention_bwd  # noqa: E402
from templates.gluon.fwd import GLUON_MISSING, gluon_attention_fwd  # noqa: E402
from templates.masks.block_mask import BlockMask, MaskMod  # noqa: E402
from templates.masks.document_offsets import DocumentOffsets  # noqa: E402
from templates.masks.mods import (  # noqa: E402
    document_mask,
    or_masks,
    pattern_mask_mod,
    sliding_window_mask,
)

TOKENS, HIDDEN = 16384, 2048
FWD_BWD_FACTOR = 3.5  # PROTOCOL: forward + backward = 3.5 x the forward's FLOPs
OUTPUTS = ("o", "dq", "dk", "dv")
FORWARD_ONLY = ("gluon",)  # an inference forward: no forward + backward step
Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
Call = Callable[[], tuple[torch.Tensor, ...]]


@dataclass(frozen=True)
class Setup:
    """What one run measures and how: the GPU benchmark or the CPU smoke run."""

    device: str
    dtype: torch.dtype
    block: int  # mask block size, both ways
    shapes: list[tuple[int, int]]  # (head dim, N), most wanted first (the budget cuts the tail)
    patterns: list[str]
    grid: Mapping[int, list[dict[str, Any]]]  # backward configs per head dim
    batch_heads: tuple[int, int] | None  # (B, H); None: PROTOCOL's 16384 / N, 2048 / D
    baselines: bool  # FlexAttention and SDPA (CUDA only)
    timer: Callable[[Call], float]
    kv_group: int = 1  # query heads per K/V head (GQA; --heads)

    def batch_and_heads(self, head_dim: int, seqlen: int) -> tuple[int, int]:
        return self.batch_heads or (TOKENS // seqlen, HIDDEN // head_dim)

    @property
    def tolerance(self) -> float:
        return TOLERANCE[str(self.dtype).removeprefix("torch.")]


def wall_ms(call: Call) -> float:
    """One call's wall time: proves the timing path under the interpreter, means nothing."""
    start = time.perf_counter()
    call()
    return (time.perf_counter() - start) * 1e3


GPU = Setup(device="cuda", dtype=torch.bfloat16, block=128,
            shapes=[(128, 16384), (128, 4096), (64, 16384)],
            patterns=["sliding-causal:1024", "document-causal:1024", "random:0.1"],
            grid=GRID, batch_heads=None, baselines=True, timer=bench_ms)
# The Triton interpreter's bf16 arithmetic is wrong (triton 3.9: errors ~1e9); our launchers
# run bf16 there on float32 copies (templates/interpreter_dtype.py), which would not smoke-test
# a 16-bit kernel, so the smoke run uses fp16; mask block 32 so that N=128 has 4x4 blocks to
# skip.
SMOKE = Setup(device="cpu", dtype=torch.float16, block=32, shapes=[(32, 128)],
              patterns=["sliding-causal:40", "document-causal:48", "random:0.3"],
              grid={32: [dict(BLOCK_M1=32, BLOCK_N1=16, BLOCK_M2=16, BLOCK_N2=32, num_warps=4,
                              num_stages=1, dq_mode="separate")]},
              batch_heads=(1, 2), baselines=False, timer=wall_ms)


# ----------------------------------------------------------------------------- masks
def document_lengths(seqlen: int, mean: int, seed: int = 0) -> list[int]:
    """Lengths drawn uniformly from [mean / 4, 7 mean / 4] until they fill ``seqlen`` (the
    last one cut to fit)."""
    gen = torch.Generator().manual_seed(seed)
    lengths: list[int] = []
    while sum(lengths) < seqlen:
        drawn = int(torch.randint(mean // 4, 7 * mean // 4 + 1, (1,), generator=gen))
        lengths.append(min(drawn, seqlen - sum(lengths)))
    return lengths


def block_diagonal(block: int) -> MaskMod:
    def mask_mod(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                 ) -> torch.Tensor:
        return q // block == k // block

    return mask_mod


def pattern_mod(pattern: str, seqlen: int, block: int, device: str) -> MaskMod:
    """The mask_mod of one of this benchmark's patterns (see the module doc)."""
    name, _, arg = pattern.partition(":")
    if name == "sliding-causal":
        return sliding_window_mask(int(arg), causal=True)
    if name == "document-causal":
        return document_mask(document_lengths(seqlen, int(arg)), causal=True, device=device)
    if name == "random":
        kept = pattern_mask_mod(pattern, seqlen, seqlen, block_size=block, device=device)
        return or_masks(kept, block_diagonal(block))
    raise ValueError(f"unknown pattern {pattern!r}")


def callers_view(pattern: str, seqlen: int) -> dict[str, Any]:
    """What a caller's mask of this pattern carries besides its blocks, as tuner.hf and
    tuner.varlen_attention build them: a causal window's pattern name (``sliding_causal:<w>``,
    the query and the w - 1 keys before it: this benchmark's window + 1) and packed
    documents' offsets. The Gluon backward's ``window_offsets`` and ``doc_offsets`` read
    them."""
    name, _, arg = pattern.partition(":")
    if name == "sliding-causal":
        return {"pattern": f"sliding_causal:{int(arg) + 1}"}
    if name == "document-causal":
        return {"documents": DocumentOffsets.of_lengths(document_lengths(seqlen, int(arg)),
                                                        causal=True)}
    return {}


def dense_mask(mod: MaskMod, seqlen: int, device: str) -> torch.Tensor:
    """(N, N) bool, True = visible, straight from the mask_mod: the reference and SDPA share
    no code with our BlockMask."""
    idx = torch.arange(seqlen, device=device)
    zero = torch.zeros((), dtype=torch.long, device=device)
    return mod(zero, zero, idx[:, None], idx[None, :]).expand(seqlen, seqlen).contiguous()


# ----------------------------------------------------------------------------- rows
@dataclass
class Measurement:
    impl: str  # ours, ours-grid, flex, gluon, gluon-train, flash-gluon, sdpa-cudnn, sdpa-efficient
    step: str  # fwd, fwd+bwd
    status: str  # timed; wrong (failed the check, not timed); error (raised, not timed)
    ms: float | None = None
    tflops: float | None = None
    errors: dict[str, float] = field(default_factory=dict)
    config: dict[str, Any] | None = None
    note: str = ""


@dataclass
class Row:
    pattern: str
    head_dim: int
    seqlen: int
    batch: int
    heads: int
    visible_pairs: int  # per (batch, head)
    visible_fraction: float
    block_density: float
    fwd_flops: float
    results: list[Measurement] = field(default_factory=list)
    heads_kv: int = 0  # K/V heads (GQA where fewer than ``heads``); 0: as many as queries

    def __post_init__(self) -> None:
        self.heads_kv = self.heads_kv or self.heads

    @property
    def name(self) -> str:
        return f"d{self.head_dim} N{self.seqlen} {self.pattern}"

    def timed(self, impls: tuple[str, ...], step: str) -> Measurement | None:
        """The fastest timed measurement of ``step`` among ``impls``."""
        found = [m for m in self.results if m.impl in impls and m.step == step and m.ms]
        return min(found, key=lambda m: m.ms or 0.0, default=None)


@dataclass
class Case:
    """One row's inputs, masks and float32 reference outputs (o, dq, dk, dv)."""

    row: Row
    tensors: dict[str, torch.Tensor]
    mod: MaskMod
    block_mask: BlockMask
    dense: torch.Tensor
    ref: tuple[torch.Tensor, ...]


def prepare(setup: Setup, head_dim: int, seqlen: int, pattern: str) -> Case:
    batch, heads = setup.batch_and_heads(head_dim, seqlen)
    mod = pattern_mod(pattern, seqlen, setup.block, setup.device)
    dense = dense_mask(mod, seqlen, setup.device)
    block_mask = BlockMask.from_mask_mod(mod, None, None, seqlen, seqlen, setup.block,
                                         device=setup.device, **callers_view(pattern, seqlen))
    pairs = int(dense.sum())
    heads_kv = heads // setup.kv_group
    row = Row(pattern, head_dim, seqlen, batch, heads, pairs, pairs / seqlen ** 2,
              block_mask.density(), 4.0 * batch * heads * head_dim * pairs, heads_kv=heads_kv)
    gen = torch.Generator(device=setup.device).manual_seed(0)
    tensors = {name: torch.randn((batch, heads_kv if name in ("k", "v") else heads, seqlen,
                                  head_dim), generator=gen, device=setup.device,
                                 dtype=setup.dtype)
               for name in ("q", "k", "v", "do")}
    for name in ("q", "k", "v"):
        tensors[name].requires_grad_()
    return Case(row, tensors, mod, block_mask, dense, reference(tensors, dense))


def reference(t: dict[str, torch.Tensor], dense: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(o, dq, dk, dv) of SDPA in float32 with the dense mask (the efficient backend on the
    GPU: the math one would hold B x H x N^2 scores)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention

    leaves = [t[name].detach().float().requires_grad_() for name in ("q", "k", "v")]
    backend = sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION) if dense.is_cuda else nullcontext()
    q, k, v = leaves
    group = q.shape[1] // k.shape[1]  # GQA: K/V heads repeated (their gradients summed back)
    if group > 1:
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    with backend:
        o = scaled_dot_product_attention(q, k, v, attn_mask=dense)
        grads = torch.autograd.grad(o, leaves, t["do"].float())
    return (o.detach(), *grads)


def steps(attention: Attention, t: dict[str, torch.Tensor], backward: bool = True
          ) -> list[tuple[str, Call]]:
    def forward() -> tuple[torch.Tensor, ...]:
        return (attention(t["q"], t["k"], t["v"]),)

    def forward_backward() -> tuple[torch.Tensor, ...]:
        o = attention(t["q"], t["k"], t["v"])
        return (o, *torch.autograd.grad(o, (t["q"], t["k"], t["v"]), t["do"]))

    return [("fwd", forward), ("fwd+bwd", forward_backward)] if backward else [("fwd", forward)]


def measure(setup: Setup, case: Case, impl: str, step: str, call: Call,
            config: dict[str, Any] | None = None) -> Measurement:
    """Time ``call`` only if every output it returns matches the reference."""
    try:
        outs = call()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    except Exception as exc:  # a backend or config that refuses the problem is a result
        return Measurement(impl, step, "error", config=config,
                           note=f"{type(exc).__name__}: {exc}"[:300])
    refs = case.ref[:len(outs)]
    errors = {name: relative_error(out, ref)
              for name, out, ref in zip(OUTPUTS[:len(outs)], outs, refs, strict=True)}
    del outs
    worst = max(errors, key=lambda name: errors[name])
    if not errors[worst] <= setup.tolerance:  # NaN fails too
        return Measurement(impl, step, "wrong", errors=errors, config=config,
                           note=f"{worst} error {errors[worst]:.3g} over the tolerance "
                                f"{setup.tolerance:g}: not timed")
    ms = setup.timer(call)
    flops = case.row.fwd_flops * (1.0 if step == "fwd" else FWD_BWD_FACTOR)
    return Measurement(impl, step, "timed", ms, flops / (ms * 1e-3) / 1e12, errors, config)


# ----------------------------------------------------------------------------- implementations
def ours(block_mask: BlockMask, bwd_config: dict[str, Any] | None = None) -> Attention:
    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return flash_attention(q, k, v, block_mask=block_mask, bwd_config=bwd_config)

    return attention


def gluon(block_mask: BlockMask) -> Attention:
    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # An inference kernel: the inputs' autograd flag means nothing to it.
        return gluon_attention_fwd(q.detach(), k.detach(), v.detach(), block_mask=block_mask)[0]

    return attention


class _ThenGluonBackward(torch.autograd.Function):
    """``forward_fn`` (the Gluon forward: gluon_train's pair; the Triton one: flash_gluon's),
    and for the gradient the Gluon backward under the same block mask, fed the forward's o
    and lse."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                block_mask: BlockMask, forward_fn: Callable[..., Any],
                bwd_config: dict[str, Any] | None = None) -> torch.Tensor:
        o, lse = forward_fn(q, k, v, block_mask=block_mask)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.block_mask = block_mask
        ctx.bwd_config = bwd_config  # None: the call's default
        return o

    @staticmethod
    def backward(ctx: Any, do: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = gluon_attention_bwd(do, q, k, v, o, lse, block_mask=ctx.block_mask,
                                         config=ctx.bwd_config)
        return dq, dk, dv, None, None, None


def gluon_train(block_mask: BlockMask) -> Attention:
    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return _ThenGluonBackward.apply(  # type: ignore[no-any-return]
            q, k, v, block_mask, gluon_attention_fwd)

    return attention


# The warp-specialized backward with its two MMA warpgroups as two partitions.
SPLIT_BWD = {"BLOCK_M": 64, "BLOCK_N": 128, "stages": 3, "consumers": 2,
             "warp_specialize": True, "dq_buffers": 1, "split_warpgroups": True,
             "doc_offsets": True}


# The one-partition kernel as d64's default runs it under masks (dq_early).
ONE_PARTITION_BWD = {**SPLIT_BWD, "split_warpgroups": False, "dq_early": True}
# gluon-train with these backward configs (the kernels' grids and tile orders).
BWD_VARIANTS = {
    "gluon-split": SPLIT_BWD,
    "gluon-split-lf": {**SPLIT_BWD, "longest_first": True},
    "gluon-pers": {**SPLIT_BWD, "persistent": True},
    "gluon-pers-lf": {**SPLIT_BWD, "persistent": True, "longest_first": True},
    "gluon-ws": ONE_PARTITION_BWD,
    "gluon-ws-lf": {**ONE_PARTITION_BWD, "longest_first": True},
    # A causal window's partial blocks by the rows' first keys (sliding rows; a no-op on
    # the others): with the d128 default's order, and d64's default kernel.
    "gluon-split-lf-win": {**SPLIT_BWD, "longest_first": True, "window_offsets": True},
    "gluon-ws-win": {**ONE_PARTITION_BWD, "window_offsets": True},
}


def gluon_train_with(block_mask: BlockMask, bwd_config: dict[str, Any] = SPLIT_BWD) -> Attention:
    """gluon-train with the backward's config ``bwd_config`` (default SPLIT_BWD)."""
    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return _ThenGluonBackward.apply(  # type: ignore[no-any-return]
            q, k, v, block_mask, gluon_attention_fwd, bwd_config)

    return attention


def flash_gluon(block_mask: BlockMask) -> Attention:
    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return _ThenGluonBackward.apply(  # type: ignore[no-any-return]
            q, k, v, block_mask, flash_attention_fwd)

    return attention


def gluon_runs(setup: Setup) -> bool:
    """Whether the Gluon forward can run here: a Hopper GPU and a triton with Gluon."""
    return setup.device == "cuda" and not GLUON_MISSING and current_device().family == "hopper"


@cache
def compiled_flex() -> Any:
    from torch.nn.attention.flex_attention import flex_attention

    # Every row (shape x mask_mod) is one more compiled graph; past dynamo's limit (8)
    # flex_attention would fall back to eager and time something else.
    torch._dynamo.config.recompile_limit = 64
    return torch.compile(flex_attention, dynamic=False)


def flex(case: Case, setup: Setup) -> Attention:
    from torch.nn.attention.flex_attention import create_block_mask

    compiled = compiled_flex()
    n = case.row.seqlen
    flex_mask = create_block_mask(case.mod, None, None, n, n, device=setup.device,
                                  BLOCK_SIZE=setup.block)

    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return compiled(q, k, v, block_mask=flex_mask, enable_gqa=q.shape[1] != k.shape[1])

    return attention


def sdpa(backend: Any, dense: torch.Tensor) -> Attention:
    from torch.nn.attention import sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention

    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        with sdpa_kernel(backend):  # the forward's backend also runs its backward
            return scaled_dot_product_attention(q, k, v, attn_mask=dense,
                                                enable_gqa=q.shape[1] != k.shape[1])

    return attention


# ----------------------------------------------------------------------------- the run
def log(row: Row, m: Measurement) -> None:
    err = max(m.errors.values(), default=float("nan"))
    timing = f"{m.ms:9.3f} ms {m.tflops:6.1f} TFLOP/s" if m.ms and m.tflops else f"{m.status:>25}"
    print(f"{row.name:34} {m.impl:14} {m.step:8} {timing} err={err:.2e} {m.config or ''} "
          f"{m.note}", flush=True)


def implementations(setup: Setup, case: Case) -> list[tuple[str, Callable[[], Attention]]]:
    """Name and builder of each implementation a row times, ours first."""
    built: list[tuple[str, Callable[[], Attention]]] = [("ours", partial(ours, case.block_mask))]
    if gluon_runs(setup):
        built.append(("gluon", partial(gluon, case.block_mask)))
        built.append(("gluon-train", partial(gluon_train, case.block_mask)))
        built.append(("flash-gluon", partial(flash_gluon, case.block_mask)))
        built += [(name, partial(gluon_train_with, case.block_mask, cfg))
                  for name, cfg in BWD_VARIANTS.items()]
    if setup.baselines:
        from torch.nn.attention import SDPBackend

        built += [("flex", partial(flex, case, setup)),
                  ("sdpa-cudnn", partial(sdpa, SDPBackend.CUDNN_ATTENTION, case.dense)),
                  ("sdpa-efficient", partial(sdpa, SDPBackend.EFFICIENT_ATTENTION, case.dense))]
    return built


def measure_row(setup: Setup, head_dim: int, seqlen: int, pattern: str,
                only: frozenset[str] | None = None) -> Row:
    """Ours with default configs, then Gluon (where it runs: the inference forward, and
    both Gluon kernels), FlexAttention and SDPA (the first backend that runs)."""
    case = prepare(setup, head_dim, seqlen, pattern)
    row, t = case.row, case.tensors
    for impl, build in implementations(setup, case):
        if only is not None and impl not in only:
            continue
        if impl == "sdpa-efficient" and row.timed(("sdpa-cudnn",), "fwd+bwd"):
            break  # cuDNN took the mask: the efficient backend is only its fallback
        try:
            attention = build()
        except Exception as exc:  # e.g. create_block_mask refusing the mask_mod
            row.results.append(Measurement(impl, "fwd", "error", note=repr(exc)[:300]))
            log(row, row.results[-1])
            continue
        for step, call in steps(attention, t, backward=impl not in FORWARD_ONLY):
            row.results.append(measure(setup, case, impl, step, call))
            log(row, row.results[-1])
    return row


def grid_configs(setup: Setup, row: Row) -> list[BwdConfig]:
    """The setup's backward configs that can walk this row's mask, less the default."""
    device = current_device()
    name = str(setup.dtype).removeprefix("torch.")
    # A masked call's problem has no causal mode and no named mask (flash_bwd.resolve_config):
    # its default is the dense default fitted to the mask blocks.
    problem = Problem(row.batch, row.heads, row.heads_kv, row.seqlen, row.seqlen, row.head_dim,
                      name)
    blocks = (setup.block, setup.block)
    default_cfg = BWD.default_config(problem, device)
    assert isinstance(default_cfg, BwdConfig)
    default = fit_to_block_mask(default_cfg, blocks)
    configs: list[BwdConfig] = []
    for data in setup.grid.get(row.head_dim, []):
        cfg = BwdConfig.from_dict(data)
        reason = (BWD.constraint(problem, cfg, device) or block_mask_tile_reason(cfg, blocks))
        if reason:
            print(f"  {row.name}: skip {cfg.key()}: {reason}")
        elif cfg != default and cfg not in configs:
            configs.append(cfg)
    return configs


def run_grid(setup: Setup, row: Row, deadline: float) -> None:
    configs = grid_configs(setup, row)
    if not configs or time.monotonic() > deadline:
        return
    case = prepare(setup, row.head_dim, row.seqlen, row.pattern)
    for cfg in configs:
        if time.monotonic() > deadline:
            break
        _, call = steps(ours(case.block_mask, cfg.to_dict()), case.tensors)[1]
        row.results.append(measure(setup, case, "ours-grid", "fwd+bwd", call, cfg.to_dict()))
        log(row, row.results[-1])


def warm_up_gpu(seconds: float = 3.0) -> None:
    """Clocks ramp up under load: blocksparse_bench saw a cold GPU's first timings read up
    to ~35% slow."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        a @ a
        torch.cuda.synchronize()


def smoke_environment() -> dict[str, Any]:
    import triton

    return {"gpu": "cpu-interpreter", "torch": torch.__version__, "triton": triton.__version__,
            "date": datetime.datetime.now(datetime.UTC).isoformat(),
            "command": " ".join([sys.executable, *sys.argv])}


# ----------------------------------------------------------------------------- the table
def ratio(a: Measurement | None, b: Measurement | None) -> str:
    """a/b: b's time over a's (the TFLOP/s ratio; > 1 where a is faster)."""
    if a is None or b is None or not a.ms or not b.ms:
        return "-"
    return f"{b.ms / a.ms:.2f}x"


def print_tables(rows: list[Row]) -> None:
    sdpa_impls = ("sdpa-cudnn", "sdpa-efficient")
    for unit, value in (("TFLOP/s (visible work)", "tflops"), ("ms", "ms")):
        def cell(m: Measurement | None, value: str = value) -> str:
            return "-" if m is None else f"{getattr(m, value):.{1 if value == 'tflops' else 3}f}"

        print(f"\n{unit}; ours/flex = flex ms / ours ms; gluon/ours = ours ms / gluon ms; "
              f"best = default or grid backward; glu f+b = gluon-train (Gluon both ways), "
              f"glu/flex = flex f+b ms / gluon-train f+b ms; f+g = flash-gluon (the Triton "
              f"forward, the Gluon backward)")
        head = (f"{'row':34} {'vis':>5} {'ours fwd':>9} {'flex fwd':>9} {'ours/flex':>9} "
                f"{'gluon fwd':>9} {'gluon/ours':>10} "
                f"{'ours f+b':>9} {'best f+b':>9} {'flex f+b':>9} {'best/flex':>9} "
                f"{'glu f+b':>9} {'glu/flex':>9} {'f+g f+b':>9} {'f+g/flex':>9} "
                f"{'sdpa fwd':>9} {'sdpa f+b':>9}  sdpa backend")
        print(head)
        print("-" * len(head))
        for r in rows:
            ours_fwd, flex_fwd = r.timed(("ours",), "fwd"), r.timed(("flex",), "fwd")
            gluon_fwd = r.timed(("gluon",), "fwd")
            best, flex_fb = r.timed(("ours", "ours-grid"), "fwd+bwd"), r.timed(("flex",),
                                                                                "fwd+bwd")
            sdpa_fb = r.timed(sdpa_impls, "fwd+bwd")
            glu_fb = r.timed(("gluon-train",), "fwd+bwd")
            fg_fb = r.timed(("flash-gluon",), "fwd+bwd")
            print(f"{r.name:34} {r.visible_fraction:5.3f} {cell(ours_fwd):>9} "
                  f"{cell(flex_fwd):>9} {ratio(ours_fwd, flex_fwd):>9} "
                  f"{cell(gluon_fwd):>9} {ratio(gluon_fwd, ours_fwd):>10} "
                  f"{cell(r.timed(('ours',), 'fwd+bwd')):>9} {cell(best):>9} "
                  f"{cell(flex_fb):>9} {ratio(best, flex_fb):>9} "
                  f"{cell(glu_fb):>9} {ratio(glu_fb, flex_fb):>9} "
                  f"{cell(fg_fb):>9} {ratio(fg_fb, flex_fb):>9} "
                  f"{cell(r.timed(sdpa_impls, 'fwd')):>9} {cell(sdpa_fb):>9}  "
                  f"{sdpa_fb.impl if sdpa_fb else '-'}")
    failed = [(r.name, m) for r in rows for m in r.results if m.status != "timed"]
    for name, m in failed:
        print(f"not timed: {name} {m.impl} {m.step} ({m.status}): {m.note}")


def selected_rows(specs: list[tuple[int, int, str]], wanted: str
                  ) -> list[tuple[int, int, str]]:
    """The rows of ``specs`` (head dim, N, pattern) that ``wanted`` names: comma-separated
    ``D:N`` or ``D:N:pattern``, the pattern a prefix of the row's."""
    out = []
    for d, n, pattern in specs:
        for item in wanted.split(","):
            parts = item.strip().split(":", 2)
            if (len(parts) >= 2 and parts[0] == str(d) and parts[1] == str(n)
                    and (len(parts) == 2 or pattern.startswith(parts[2]))):
                out.append((d, n, pattern))
                break
    return out


def with_shapes(setup: Setup, shapes: str | None, heads: str | None) -> Setup:
    """``setup`` with ``--shapes`` (D:N,...) and ``--heads`` (B,HQ,HKV) where given; a
    ValueError naming what is wrong otherwise."""
    if shapes:
        try:
            pairs = [tuple(int(x) for x in item.split(":")) for item in shapes.split(",")]
        except ValueError:
            pairs = []
        if not pairs or any(len(p) != 2 or min(p) < 1 for p in pairs):
            raise ValueError(f"--shapes {shapes!r}: comma-separated D:N, both positive "
                             f"integers, e.g. 128:8192,128:32768")
        setup = replace(setup, shapes=[(p[0], p[1]) for p in pairs])
    if heads:
        try:
            batch, hq, hkv = (int(x) for x in heads.split(","))
        except ValueError:
            raise ValueError(f"--heads {heads!r}: B,HQ,HKV, three positive integers, e.g. "
                             f"1,32,16") from None
        if min(batch, hq, hkv) < 1 or hq % hkv:
            raise ValueError(f"--heads {heads!r}: B, HQ and HKV must be positive, HQ a "
                             f"multiple of HKV")
        setup = replace(setup, batch_heads=(batch, hq), kv_group=hq // hkv)
    return setup


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write every row here")
    parser.add_argument("--budget-s", type=float, default=240.0,
                        help="wall-clock budget: no new row, and no grid config, after it")
    parser.add_argument("--no-grid", action="store_true", help="default backward config only")
    parser.add_argument("--impls", help="comma-separated implementations to run (default: "
                        "all; e.g. gluon-train,flex), the others skipped")
    parser.add_argument("--rows", help="comma-separated rows to run, each D:N or D:N:pattern "
                        "(a prefix of it: 128:16384:document), the others skipped")
    parser.add_argument("--shapes", help="the rows' head dims and lengths instead of "
                        "PROTOCOL's, comma-separated D:N (e.g. 128:8192,128:32768)")
    parser.add_argument("--heads", help="batch, query heads and K/V heads of every row, "
                        "B,HQ,HKV (e.g. 1,32,16: GQA), instead of PROTOCOL's 16384 / N, "
                        "2048 / D with as many K/V heads")
    parser.add_argument("--smoke", action="store_true",
                        help="CPU under TRITON_INTERPRET=1: one tiny shape, ours and the "
                             "reference only")
    args = parser.parse_args(argv)
    if args.smoke and not interpreter_active():
        parser.error("--smoke runs the kernels on the CPU: set TRITON_INTERPRET=1")
    if not args.smoke and (not torch.cuda.is_available() or interpreter_active()):
        print("masked_fwd_bwd_bench needs a CUDA GPU (or --smoke)", file=sys.stderr)
        return 2
    setup = SMOKE if args.smoke else GPU
    try:
        setup = with_shapes(setup, args.shapes, args.heads)
    except ValueError as exc:
        parser.error(str(exc))
    only = frozenset(args.impls.split(",")) if args.impls else None
    start = time.monotonic()
    env = smoke_environment() if args.smoke else environment()
    print(json.dumps(env))
    if not args.smoke:
        warm_up_gpu()
    specs = [(d, n, p) for d, n in setup.shapes for p in setup.patterns]
    if args.rows:
        specs = selected_rows(specs, args.rows)
        if not specs:
            known = ", ".join(f"{d}:{n}:{p}" for d, n in setup.shapes for p in setup.patterns)
            parser.error(f"--rows {args.rows!r} names none of the rows ({known})")
    rows: list[Row] = []

    def save() -> None:  # after every row: a run cut short keeps what it measured
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(
                {"environment": env, "dtype": str(setup.dtype), "block_size": setup.block,
                 "tolerance": setup.tolerance, "fwd_bwd_flops_factor": FWD_BWD_FACTOR,
                 "rows": [asdict(r) for r in rows]}, indent=1))

    for i, spec in enumerate(specs):
        if time.monotonic() - start > args.budget_s:
            print(f"budget spent: {len(specs) - i} row(s) not run: {specs[i:]}")
            break
        rows.append(measure_row(setup, *spec, only=only))
        save()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    grid = not args.no_grid and (only is None or "ours-grid" in only)
    for i, row in enumerate(rows if grid else []):
        # Share what is left of the budget among the rows still to run.
        left = args.budget_s - (time.monotonic() - start)
        if left <= 0:
            print(f"budget spent: no grid for {len(rows) - i} row(s)")
            break
        run_grid(setup, row, time.monotonic() + left / (len(rows) - i))
        save()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    print(f"({time.monotonic() - start:.0f} s)")
    print_tables(rows)
    wrong = any(m.status == "wrong" and m.impl.startswith(("ours", "gluon"))
                for r in rows for m in r.results)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
