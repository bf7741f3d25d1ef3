"""Forward + backward benchmark: templates.flash_attention (autograd, flash_fwd + flash_bwd)
against torch SDPA's FLASH_ATTENTION and CUDNN_ATTENTION backends, fwd+bwd.

Follows docs/PROTOCOL.md (standard suite): bf16, D in 64/128, N in 1k/4k/16k,
B = 16384 / N, H = 2048 / D, causal and not, (B, H, N, D) contiguous. TFLOP/s counts
fwd+bwd as 3.5 x the forward's FLOPs (4 * B * H * N^2 * D, halved for causal). One call is
``torch.autograd.grad(attention(q, k, v), (q, k, v), do)``.

Per row: our kernels with their default configs, then (while the budget lasts) a short grid of
backward configs with the default forward; SDPA FA2 and cuDNN; optionally compiled
FlexAttention (``--flex``). Every implementation's gradients are checked against SDPA's
(FA2, or cuDNN where FA2 refuses) before its time counts: bf16 on both sides, so the
tolerance is twice the bf16 one. Timing: triton.testing.do_bench(warmup=25, rep=100,
return_mode="median"). Defaults and SDPA run first for every row; the grid then shares what
is left of the budget (about four minutes in all by default).

    python benchmarks/fwd_bwd_bench.py [--json out.json] [--budget-s 240] [--flex]
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from templates.base import TOLERANCE, Problem, relative_error  # noqa: E402
from templates.flash.autograd import flash_attention  # noqa: E402
from templates.flash.bwd import TEMPLATE as BWD  # noqa: E402
from templates.flash.bwd import BwdConfig  # noqa: E402
from templates.kernel_common import normalize_causal

WARMUP_MS, REP_MS = 25, 100
# Two bf16 implementations each carry ~TOLERANCE["bfloat16"] of error against the exact answer.
GRAD_TOL = 2 * TOLERANCE["bfloat16"]
TOKENS, HIDDEN = 16384, 2048
DEVICE = "cuda"
DTYPE = torch.bfloat16

# Backward configs around the defaults (GUESSES to map the space, not tuned results).
GRID: dict[int, list[dict[str, Any]]] = {
    64: [
        # The default's tiles with 8 warps: its dK/dV kernel then stops spilling (4 warps: 504
        # / 712 stack bytes dense / causal; 8 warps, 4 stages: 0; triton 3.6 compiled offline,
        # benchmarks/results/compile_check_sm90_triton36.json). Not timed yet.
        dict(BLOCK_M1=32, BLOCK_N1=128, BLOCK_M2=128, BLOCK_N2=32, num_warps=8, num_stages=4),
        dict(BLOCK_M1=32, BLOCK_N1=128, BLOCK_M2=128, BLOCK_N2=32, num_warps=4, num_stages=3),
        dict(BLOCK_M1=64, BLOCK_N1=128, BLOCK_M2=128, BLOCK_N2=64, num_warps=8, num_stages=3),
        dict(BLOCK_M1=64, BLOCK_N1=64, BLOCK_M2=64, BLOCK_N2=64, num_warps=4, num_stages=3),
        dict(BLOCK_M1=128, BLOCK_N1=128, BLOCK_M2=128, BLOCK_N2=128, num_warps=8, num_stages=2),
        dict(BLOCK_M1=32, BLOCK_N1=64, BLOCK_M2=64, BLOCK_N2=32, num_warps=4, num_stages=4),
        dict(BLOCK_M1=32, BLOCK_N1=128, num_warps=4, num_stages=5, dq_mode="atomic"),
        dict(BLOCK_M1=64, BLOCK_N1=128, num_warps=8, num_stages=3, dq_mode="atomic"),
        dict(BLOCK_M1=64, BLOCK_N1=64, num_warps=4, num_stages=3, dq_mode="atomic"),
    ],
    128: [
        dict(BLOCK_M1=64, BLOCK_N1=128, BLOCK_M2=128, BLOCK_N2=64, num_warps=8, num_stages=2),
        dict(BLOCK_M1=32, BLOCK_N1=64, BLOCK_M2=64, BLOCK_N2=32, num_warps=4, num_stages=3),
        dict(BLOCK_M1=64, BLOCK_N1=64, BLOCK_M2=64, BLOCK_N2=64, num_warps=4, num_stages=2),
        dict(BLOCK_M1=16, BLOCK_N1=128, BLOCK_M2=128, BLOCK_N2=16, num_warps=8, num_stages=4),
        dict(BLOCK_M1=32, BLOCK_N1=128, BLOCK_M2=64, BLOCK_N2=64, num_warps=8, num_stages=3),
        dict(BLOCK_M1=32, BLOCK_N1=128, num_warps=8, num_stages=3, dq_mode="atomic"),
        dict(BLOCK_M1=64, BLOCK_N1=128, num_warps=8, num_stages=2, dq_mode="atomic"),
        dict(BLOCK_M1=32, BLOCK_N1=64, num_warps=4, num_stages=3, dq_mode="atomic"),
    ],
}
ROWS = [(d, n, causal) for d in (64, 128) for n in (1024, 4096, 16384) for causal in (False, True)]
# The grid runs on the rows the target names first (d=128, N >= 4k).
GRID_ORDER = sorted(ROWS, key=lambda r: (r[0] != 128, r[1] < 4096, r[1], r[2]))

Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class Measurement:
    what: str
    ms: float | None = None
    tflops: float | None = None
    grad_error: float | None = None
    config: dict[str, Any] | None = None
    note: str = ""


@dataclass
class RowResult:
    head_dim: int
    seqlen: int
    causal: bool
    batch: int
    heads: int
    flops: float
    results: list[Measurement] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"d{self.head_dim} N{self.seqlen} {'causal' if self.causal else 'dense'}"

    def get(self, what: str) -> Measurement | None:
        return next((m for m in self.results if m.what == what), None)

    def best_grid(self) -> Measurement | None:
        timed = [m for m in self.results if m.what in ("default", "grid") and m.ms is not None]
        return min(timed, key=lambda m: m.ms or 0.0, default=None)


def bench_ms(fn: Callable[[], Any]) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=WARMUP_MS, rep=REP_MS, return_mode="median"))


def make_row(head_dim: int, seqlen: int, causal: bool) -> tuple[RowResult, dict[str, Any]]:
    batch, heads = TOKENS // seqlen, HIDDEN // head_dim
    fwd_flops = 4.0 * batch * heads * seqlen * seqlen * head_dim / (2 if causal else 1)
    row = RowResult(head_dim, seqlen, causal, batch, heads, 3.5 * fwd_flops)
    gen = torch.Generator(device=DEVICE).manual_seed(0)

    def randn() -> torch.Tensor:
        return torch.randn(batch, heads, seqlen, head_dim, generator=gen, device=DEVICE,
                           dtype=DTYPE)

    tensors = {"q": randn().requires_grad_(), "k": randn().requires_grad_(),
               "v": randn().requires_grad_(), "do": randn()}
    return row, tensors


def fwd_bwd(attention: Attention, t: dict[str, Any]) -> Callable[[], tuple[torch.Tensor, ...]]:
    def call() -> tuple[torch.Tensor, ...]:
        o = attention(t["q"], t["k"], t["v"])
        return torch.autograd.grad(o, (t["q"], t["k"], t["v"]), t["do"])
    return call


def measure(what: str, call: Callable[[], tuple[torch.Tensor, ...]], row: RowResult,
            ref: tuple[torch.Tensor, ...] | None, config: dict[str, Any] | None = None,
            note: str = "") -> tuple[Measurement, tuple[torch.Tensor, ...] | None]:
    """Time ``call`` only if its gradients match ``ref`` (None: this call is the reference)."""
    try:
        grads = call()
        torch.cuda.synchronize()
    except Exception as exc:  # a backend or config that refuses the shape is a result
        return Measurement(what, config=config, note=f"{type(exc).__name__}: {exc}"[:200]), None
    err = None
    if ref is not None:
        err = max(relative_error(g, r) for g, r in zip(grads, ref, strict=True))
        if not err <= GRAD_TOL:
            return Measurement(what, grad_error=err, config=config,
                               note="gradients differ from SDPA: not timed"), None
    ms = bench_ms(call)
    return Measurement(what, ms=ms, tflops=row.flops / (ms * 1e-3) / 1e12, grad_error=err,
                       config=config, note=note), grads


def sdpa(backend: Any, causal: bool) -> Attention:
    from torch.nn.attention import sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention

    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # The backend chosen for the forward also runs its backward.
        with sdpa_kernel(backend):
            return scaled_dot_product_attention(q, k, v, is_causal=causal)
    return attention


def ours(causal: bool, bwd_config: dict[str, Any] | None = None) -> Attention:
    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return flash_attention(q, k, v, causal=causal, bwd_config=bwd_config)
    return attention


def flex(causal: bool, seqlen: int) -> Attention:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    compiled = torch.compile(flex_attention)
    block_mask = None
    if causal:
        block_mask = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None,
                                       seqlen, seqlen)

    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return compiled(q, k, v, block_mask=block_mask)
    return attention


def baseline_and_default(spec: tuple[int, int, bool], with_flex: bool) -> RowResult:
    """SDPA FA2 / cuDNN (the first that runs is the gradient reference) and our defaults."""
    from torch.nn.attention import SDPBackend

    row, t = make_row(*spec)
    ref = None
    for what, backend in (("sdpa-fa2", SDPBackend.FLASH_ATTENTION),
                          ("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION)):
        m, grads = measure(what, fwd_bwd(sdpa(backend, row.causal), t), row, ref)
        row.results.append(m)
        if ref is None and grads is not None:
            ref, m.note = grads, "gradient reference"
    if ref is None:
        print(f"{row.name}: no SDPA backend ran; our rows are not timed", file=sys.stderr)
        return row
    problem = Problem(row.batch, row.heads, row.heads, row.seqlen, row.seqlen, row.head_dim,
                      "bfloat16", normalize_causal(row.causal))
    from templates.device import current_device

    default = BWD.default_config(problem, current_device())
    m, _ = measure("default", fwd_bwd(ours(row.causal), t), row, ref, default.to_dict())
    row.results.append(m)
    if with_flex:
        m, _ = measure("flex", fwd_bwd(flex(row.causal, row.seqlen), t), row, ref)
        row.results.append(m)
    return row


def grid_configs(row: RowResult) -> list[BwdConfig]:
    from templates.device import current_device

    device = current_device()
    problem = Problem(row.batch, row.heads, row.heads, row.seqlen, row.seqlen, row.head_dim,
                      "bfloat16", normalize_causal(row.causal))
    default = BWD.default_config(problem, device)
    configs = []
    for data in GRID[row.head_dim]:
        cfg = BwdConfig.from_dict(data)
        reason = BWD.constraint(problem, cfg, device)
        if reason:
            print(f"  {row.name}: skip {cfg.key()}: {reason}")
        elif cfg != default and cfg not in configs:
            configs.append(cfg)
    return configs


def run_grid(row: RowResult, deadline: float) -> int:
    """Time the grid on ``row`` until ``deadline``; returns how many configs ran."""
    _, t = make_row(row.head_dim, row.seqlen, row.causal)
    ref_m = next((m for m in row.results if m.note == "gradient reference"), None)
    if ref_m is None:
        return 0
    from torch.nn.attention import SDPBackend

    backend = SDPBackend.FLASH_ATTENTION if ref_m.what == "sdpa-fa2" else SDPBackend.CUDNN_ATTENTION
    ref = fwd_bwd(sdpa(backend, row.causal), t)()
    ran = 0
    for cfg in grid_configs(row):
        if time.monotonic() > deadline:
            break
        m, _ = measure("grid", fwd_bwd(ours(row.causal, cfg.to_dict()), t), row, ref,
                       cfg.to_dict())
        row.results.append(m)
        ran += 1
        print(f"  {row.name:22} grid {fmt(m):>18} err={m.grad_error} {cfg.key()} {m.note}")
    return ran


def environment() -> dict[str, Any]:
    import triton

    props = torch.cuda.get_device_properties(0)
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version",
                                 "--format=csv,noheader"], capture_output=True, text=True,
                                timeout=10, check=False).stdout.strip().splitlines()[0]
    except (OSError, IndexError, subprocess.SubprocessError):
        driver = ""
    return {"gpu": props.name, "sm_count": props.multi_processor_count, "driver": driver,
            "torch": torch.__version__, "triton": triton.__version__,
            "cuda": torch.version.cuda, "date": datetime.datetime.now(datetime.UTC).isoformat(),
            "command": " ".join([sys.executable, *sys.argv])}


def fmt(m: Measurement | None) -> str:
    if m is None:
        return "-"
    if m.ms is None or m.tflops is None:
        return "n/a"
    return f"{m.ms:8.3f}ms {m.tflops:5.0f}"


def print_table(rows: list[RowResult]) -> None:
    print("\nfwd+bwd TFLOP/s (3.5 x forward FLOPs), bf16, B=16384/N, H=2048/D")
    head = (f"{'row':20} {'sdpa-fa2':>9} {'sdpa-cudnn':>10} {'ours dflt':>9} {'ours best':>9} "
            f"{'best/cudnn':>10} {'flex':>6}  best config")
    print(head)
    print("-" * len(head))
    for r in rows:
        def tf(m: Measurement | None) -> str:
            return f"{m.tflops:.0f}" if m is not None and m.tflops else "-"
        best, cudnn = r.best_grid(), r.get("sdpa-cudnn")
        ratio = (f"{best.tflops / cudnn.tflops:.2f}x" if best and best.tflops and cudnn
                 and cudnn.tflops else "-")
        grid_n = sum(m.what == "grid" for m in r.results)
        cfg = (best.config if best and best.what == "grid" else "default") if best else "-"
        print(f"{r.name:20} {tf(r.get('sdpa-fa2')):>9} {tf(cudnn):>10} {tf(r.get('default')):>9} "
              f"{tf(best):>9} {ratio:>10} {tf(r.get('flex')):>6}  {cfg} (of {grid_n} grid)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write every row here")
    parser.add_argument("--budget-s", type=float, default=240.0,
                        help="wall-clock budget; the backward grid stops when it is spent")
    parser.add_argument("--flex", action="store_true",
                        help="also time compiled FlexAttention (adds its compile time)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("fwd_bwd_bench needs a CUDA GPU", file=sys.stderr)
        return 2
    start = time.monotonic()
    env = environment()
    print(json.dumps(env))
    rows: dict[tuple[int, int, bool], RowResult] = {}
    for spec in ROWS:
        row = baseline_and_default(spec, args.flex)
        rows[spec] = row
        for m in row.results:
            print(f"{row.name:22} {m.what:12} {fmt(m):>18} err={m.grad_error} {m.note}")
        torch.cuda.empty_cache()
    for i, spec in enumerate(GRID_ORDER):
        # Share what is left of the budget among the rows still to run.
        left = args.budget_s - (time.monotonic() - start)
        if left <= 0:
            print(f"budget spent: no grid for {len(GRID_ORDER) - i} row(s)")
            break
        deadline = time.monotonic() + left / (len(GRID_ORDER) - i)
        run_grid(rows[spec], deadline)
        torch.cuda.empty_cache()
    ordered = [rows[spec] for spec in ROWS]
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"environment": env, "grad_tolerance": GRAD_TOL,
                                         "rows": [asdict(r) for r in ordered]}, indent=1,
                                        default=str))
    print(f"({time.monotonic() - start:.0f} s)")
    print_table(ordered)
    return 0


if __name__ == "__main__":
    sys.exit(main())
