"""Decode benchmark: flash_decode against itself with one split and against torch SDPA.

Follows ../shared/bench/PROTOCOL.md (decode rows): bf16, D=128, 32 query heads over 8 KV
heads, one query token; B=1 at 32k and 128k, B=8 at 32k, B=64 at 4k and with mixed lengths
around 4k (``mixed`` over an 8k cache: lengths 128..8192, mean ~4.1k), contiguous and paged.
Reports the bytes of K and V read per second (the cache's useful bytes, not GQA repeats)
beside the time, for: the default config, the same config with num_splits=1, the best of a
short sweep, and SDPA's FLASH_ATTENTION / CUDNN_ATTENTION / EFFICIENT_ATTENTION backends
alone (GQA through enable_gqa, or K/V repeated where a backend refuses it; contiguous
rows of one length only: SDPA has no per-sequence lengths). A device-to-device copy in
the same process gives the bandwidth ceiling.

Every output is checked against the float32 reference before its time counts. Timing:
triton.testing.do_bench(warmup=25, rep=100, return_mode="median"). Bounded to about three
minutes (the sweep stops at a deadline).

    python benchmarks/decode_bench.py [--json out.json] [--budget-s 150]
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from templates.base import Problem, relative_error  # noqa: E402
from templates.flash_decode import SPLIT_CHOICES, TEMPLATE, FlashDecodeConfig  # noqa: E402
from templates.flash_decode_kernel import check_decode_inputs, launch_decode  # noqa: E402

WARMUP_MS, REP_MS = 25, 100
SWEEP_BLOCK_N = (32, 64, 128)
SWEEP_WARPS = (4, 8)
SWEEP_STAGES = (2, 3, 4)


def decode(batch: int, seqlen: int, mask: str = "none") -> Problem:
    return Problem(batch, 32, 8, 1, seqlen, 128, dtype="bfloat16", causal="none", mask=mask)


# (name, problem, share of the sweep budget): the headline row sweeps longest.
ROWS: list[tuple[str, Problem, float]] = [
    ("b1-32k", decode(1, 32768), 3.0),
    ("b1-128k", decode(1, 131072), 1.0),
    ("b1-32k-paged16", decode(1, 32768, "paged:16"), 1.0),
    ("b8-32k", decode(8, 32768), 1.0),
    ("b64-4k", decode(64, 4096), 1.0),
    ("b64-mixed~4k", decode(64, 8192, "mixed"), 1.5),
    ("b64-mixed~4k-paged16", decode(64, 8192, "paged:16+mixed"), 1.0),
]
# Seconds a row takes besides its sweep (inputs, reference, default, one split, SDPA).
ROW_FIXED_S = 8.0


@dataclass
class Measurement:
    what: str
    us: float | None = None
    tb_per_s: float | None = None
    error: float | None = None
    config: dict[str, Any] | None = None
    note: str = ""


@dataclass
class RowResult:
    name: str
    problem: dict[str, Any]
    kv_bytes: float
    results: list[Measurement] = field(default_factory=list)

    def get(self, what: str) -> Measurement | None:
        return next((m for m in self.results if m.what == what), None)


def bench_ms(fn: Callable[[], Any]) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=WARMUP_MS, rep=REP_MS, return_mode="median"))


def copy_bandwidth() -> float:
    """Device-to-device copy of 1 GiB: bytes read plus written per second."""
    src = torch.randn(1 << 28, device="cuda")
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    return 2 * src.numel() * src.element_size() / (ms * 1e-3)


def measure(what: str, fn: Callable[[], torch.Tensor], ref_o: torch.Tensor, tol: float,
            kv_bytes: float, config: dict[str, Any] | None = None,
            note: str = "") -> Measurement:
    """Time ``fn`` only if its output matches the reference."""
    try:
        out = fn()
        torch.cuda.synchronize()
    except Exception as exc:  # a backend that refuses the shape is a result, not a crash
        return Measurement(what, config=config, note=f"{type(exc).__name__}: {exc}"[:160])
    err = relative_error(out, ref_o)
    if not err <= tol:
        return Measurement(what, error=err, config=config, note="wrong output: not timed")
    ms = bench_ms(fn)
    return Measurement(what, us=ms * 1e3, tb_per_s=kv_bytes / (ms * 1e-3) / 1e12, error=err,
                       config=config, note=note)


def ours(inputs: dict[str, Any], cfg: FlashDecodeConfig) -> Callable[[], torch.Tensor]:
    # Inputs were checked once: time the launches (and their output allocations) only.
    shape = check_decode_inputs(inputs["q"], inputs["k_cache"], inputs["v_cache"],
                                inputs["cache_seqlens"], inputs["block_table"])

    def call() -> torch.Tensor:
        return launch_decode(inputs["q"], inputs["k_cache"], inputs["v_cache"],
                             inputs["cache_seqlens"], inputs["block_table"], None, shape,
                             num_splits=cfg.num_splits, block_n=cfg.block_n,
                             num_warps=cfg.num_warps, num_stages=cfg.num_stages)[0]
    return call


def sweep_configs(problem: Problem, default: FlashDecodeConfig, device: Any) -> list[FlashDecodeConfig]:
    """A short sweep around the default, nearest first (so a cut-off sweep stays useful)."""
    splits = [s for s in SPLIT_CHOICES
              if default.num_splits / 8 <= s <= default.num_splits * 4]
    configs = {FlashDecodeConfig(num_splits=s, block_n=b, num_warps=w, num_stages=st)
               for s in splits for b in SWEEP_BLOCK_N for w in SWEEP_WARPS for st in SWEEP_STAGES}
    valid = [c for c in configs if TEMPLATE.constraint(problem, c, device) is None]

    def distance(c: FlashDecodeConfig) -> tuple[int, str]:
        differs = sum(getattr(c, k) != getattr(default, k) for k in default.to_dict())
        return differs, c.key()
    return sorted(valid, key=distance)


def sdpa_backends(inputs: dict[str, Any], row: RowResult, ref_o: torch.Tensor, tol: float) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    q, k, v = inputs["q"], inputs["k_cache"], inputs["v_cache"]
    group = q.shape[1] // k.shape[1]
    k_rep, v_rep = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    for name, backend in (("sdpa-fa2", SDPBackend.FLASH_ATTENTION),
                          ("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION),
                          ("sdpa-efficient", SDPBackend.EFFICIENT_ATTENTION)):
        def gqa(backend: Any = backend) -> torch.Tensor:
            with sdpa_kernel(backend):
                return sdpa(q, k, v, enable_gqa=True)

        def repeated(backend: Any = backend) -> torch.Tensor:
            with sdpa_kernel(backend):
                return sdpa(q, k_rep, v_rep)
        result = measure(name, gqa, ref_o, tol, row.kv_bytes, note="enable_gqa")
        if result.us is None:
            result = measure(name, repeated, ref_o, tol, row.kv_bytes,
                             note=f"K/V repeated ({result.note[:60]})")
        row.results.append(result)


def run_row(name: str, problem: Problem, device: Any, deadline: float) -> RowResult:
    inputs = TEMPLATE.make_inputs(problem, "cuda", seed=0)
    ref_o = TEMPLATE.reference(inputs)[0]
    tol = TEMPLATE.tolerance(problem)
    row = RowResult(name, problem.to_dict(), TEMPLATE.kv_bytes(problem))
    default = TEMPLATE.default_config(problem, device)
    row.results.append(measure("default", ours(inputs, default), ref_o, tol, row.kv_bytes,
                               default.to_dict()))
    one = replace(default, num_splits=1)
    row.results.append(measure("one-split", ours(inputs, one), ref_o, tol, row.kv_bytes,
                               one.to_dict()))
    best = row.get("default")
    tried = 0
    for cfg in sweep_configs(problem, default, device):
        if time.monotonic() > deadline:
            break
        result = measure("tuned", ours(inputs, cfg), ref_o, tol, row.kv_bytes, cfg.to_dict())
        tried += 1
        if result.us is not None and (best is None or best.us is None or result.us < best.us):
            best = result
    if best is not None:
        row.results.append(replace(best, what="tuned", note=f"best of {tried} swept"))
    if problem.mask == "none":
        sdpa_backends(inputs, row, ref_o, tol)
    del inputs
    torch.cuda.empty_cache()
    return row


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


def fmt(m: Measurement | None, copy_tb: float) -> str:
    if m is None:
        return "-"
    if m.us is None or m.tb_per_s is None:
        return "n/a"
    return f"{m.us:7.1f}us {m.tb_per_s:4.2f}TB/s {100 * m.tb_per_s / copy_tb:3.0f}%"


def print_table(rows: list[RowResult], copy_tb: float) -> None:
    print(f"\nK+V bytes read per second; % of the measured copy bandwidth {copy_tb:.2f} TB/s")
    head = (f"{'row':22} {'default':>26} {'x vs 1 split':>12} {'tuned':>26} "
            f"{'sdpa-fa2':>8} {'sdpa-cudnn':>10}")
    print(head)
    print("-" * len(head))
    for r in rows:
        default, one = r.get("default"), r.get("one-split")
        speedup = (f"{one.us / default.us:11.1f}x" if default and one and default.us and one.us
                   else f"{'-':>12}")
        sdpa = [r.get(n) for n in ("sdpa-fa2", "sdpa-cudnn")]
        sdpa_txt = [f"{m.tb_per_s:.2f}" if m and m.tb_per_s else "-" for m in sdpa]
        print(f"{r.name:22} {fmt(default, copy_tb):>26} {speedup} "
              f"{fmt(r.get('tuned'), copy_tb):>26} {sdpa_txt[0]:>8} {sdpa_txt[1]:>10}")
    for r in rows:
        tuned = r.get("tuned")
        if tuned and tuned.config:
            print(f"  {r.name}: tuned {tuned.config} ({tuned.note})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write every row here")
    parser.add_argument("--budget-s", type=float, default=150.0,
                        help="wall-clock budget; the sweeps stop when it is spent")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("decode_bench needs a CUDA GPU", file=sys.stderr)
        return 2
    from templates.device import current_device

    start = time.monotonic()
    device = current_device()
    env = environment()
    print(json.dumps(env))
    copy_tb = copy_bandwidth() / 1e12
    print(f"device-to-device copy: {copy_tb:.2f} TB/s (read + write)")
    rows: list[RowResult] = []
    for i, (name, problem, share) in enumerate(ROWS):
        # Share what is left of the budget among the rows still to run.
        left = args.budget_s - (time.monotonic() - start)
        shares_left = sum(r[2] for r in ROWS[i:])
        sweep_s = left * share / shares_left - ROW_FIXED_S * (len(ROWS) - i) * share / shares_left
        deadline = time.monotonic() + max(0.0, sweep_s)
        row = run_row(name, problem, device, deadline)
        rows.append(row)
        for m in row.results:
            print(f"{name:22} {m.what:15} {fmt(m, copy_tb):>28} err={m.error} {m.config or ''} "
                  f"{m.note}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"environment": env, "copy_tb_per_s": copy_tb,
                                         "rows": [asdict(r) for r in rows]}, indent=1,
                                        default=str))
    print(f"({time.monotonic() - start:.0f} s)")
    print_table(rows, copy_tb)
    return 0


if __name__ == "__main__":
    sys.exit(main())
