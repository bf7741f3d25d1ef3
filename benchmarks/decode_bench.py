"""Decode benchmark: flash_decode against itself with one split and against torch SDPA.

Follows docs/PROTOCOL.md (decode rows): bf16, D=128, 32 query heads over 8 KV
heads, one query token; B=1 at 32k and 128k, B=8 at 32k, B=64 at 4k and with mixed lengths
around 4k (``mixed`` over an 8k cache: lengths 128..8192, mean ~4.1k), contiguous and paged.
Reports the bytes of K and V read per second (the cache's useful bytes, not GQA repeats)
beside the time, for: the default config, the same with combine="fused", the same with
num_splits=1, the best of a short sweep (overall, and per combine mode), and SDPA's
FLASH_ATTENTION / CUDNN_ATTENTION / EFFICIENT_ATTENTION backends alone (GQA through
enable_gqa, or K/V repeated where a backend refuses it; contiguous rows of one length only:
SDPA has no per-sequence lengths). A device-to-device copy in the same process gives the
bandwidth ceiling.

The sweep has two phases. First the tile, warps, stages and splits around the default (and
the row's best config of an earlier result file, --seeds), nearest first, each in both
combine modes one after the other, so a sweep cut off by its deadline still compares them.
Then the two fastest of those with the cache hint (kv_load="evict_first") and whole_waves,
alone and together, in both combine modes.

Every output is checked against the float32 reference before its time counts. Timing:
triton.testing.do_bench(warmup=25, rep=100, return_mode="median"). Bounded to about three
minutes (the sweep stops at a deadline).

    python benchmarks/decode_bench.py [--json out.json] [--budget-s 150] [--rows b1-32k,...]
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
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from templates.base import Problem, relative_error  # noqa: E402
from templates.decode.kernel import (  # noqa: E402
    COMBINE_MODES,
    check_decode_inputs,
    rows_per_tile,
    whole_wave_splits,
)
from templates.decode.template import (  # noqa: E402
    SPLIT_CHOICES,
    TEMPLATE,
    FlashDecodeConfig,
    launch_with_config,
)

WARMUP_MS, REP_MS = 25, 100
SWEEP_BLOCK_N = (32, 64, 128)
SWEEP_WARPS = (4, 8)
SWEEP_STAGES = (2, 3, 4)
# Share of a row's sweep time for the first phase; the rest refines its two best.
STRUCTURE_SHARE = 0.65
REFINED_BASES = 2
DEFAULT_SEEDS = Path(__file__).resolve().parent / "results" / "decode_h100.json"


def decode(batch: int, seqlen: int, mask: str = "none") -> Problem:
    return Problem(batch, 32, 8, 1, seqlen, 128, dtype="bfloat16", causal="none", mask=mask)


# (name, problem, share of the sweep budget): the headline row sweeps longest.
ROWS: list[tuple[str, Problem, float]] = [
    ("b1-32k", decode(1, 32768), 4.0),
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
        return launch_with_config(inputs["q"], inputs["k_cache"], inputs["v_cache"],
                                  inputs["cache_seqlens"], inputs["block_table"], None, shape,
                                  cfg)[0]
    return call


def config_label(cfg: dict[str, Any] | None) -> str:
    """Short text of a config: s<splits> bn<block_n> w<warps> st<stages> <combine>, then the
    hints that are on."""
    if not cfg:
        return "-"
    hints = [str(cfg["kv_load"])] if cfg.get("kv_load", "default") != "default" else []
    hints += ["waves"] if cfg.get("whole_waves") else []
    return " ".join([f"s{cfg['num_splits']} bn{cfg['block_n']} w{cfg['num_warps']} "
                     f"st{cfg['num_stages']} {cfg.get('combine', 'separate')}", *hints])


def structure_configs(problem: Problem, default: FlashDecodeConfig, seeds: list[FlashDecodeConfig],
                      device: Any) -> list[FlashDecodeConfig]:
    """Phase one: splits, tile, warps and stages around the default, the seeds first and then
    nearest first (so a cut-off sweep stays useful), each in every combine mode in turn."""
    splits = [s for s in SPLIT_CHOICES
              if default.num_splits / 8 <= s <= default.num_splits * 4]
    bases = {FlashDecodeConfig(num_splits=s, block_n=b, num_warps=w, num_stages=st)
             for s in splits for b in SWEEP_BLOCK_N for w in SWEEP_WARPS for st in SWEEP_STAGES}

    def distance(c: FlashDecodeConfig) -> tuple[int, str]:
        differs = sum(getattr(c, k) != getattr(default, k) for k in default.to_dict())
        return differs, c.key()
    seeded = [replace(c, combine="separate") for c in seeds]
    ordered = seeded + sorted(bases - set(seeded), key=distance)
    configs = [replace(c, combine=mode) for c in ordered for mode in COMBINE_MODES]
    return unique_valid(problem, configs, device)


def hint_configs(problem: Problem, bases: list[FlashDecodeConfig],
                 device: Any) -> list[FlashDecodeConfig]:
    """Phase two: the cache hint and whole waves, alone and together, on the given bases in
    every combine mode."""
    configs = [replace(base, combine=mode, kv_load=kv, whole_waves=waves)
               for base in bases for mode in COMBINE_MODES
               for kv, waves in (("evict_first", False), ("default", True), ("evict_first", True))]
    return unique_valid(problem, configs, device)


def unique_valid(problem: Problem, configs: list[FlashDecodeConfig],
                 device: Any) -> list[FlashDecodeConfig]:
    seen: set[FlashDecodeConfig] = set()
    valid = []
    for c in configs:
        if c not in seen and TEMPLATE.constraint(problem, c, device) is None:
            seen.add(c)
            valid.append(c)
    return valid


def launched_splits(problem: Problem, cfg: FlashDecodeConfig, device: Any) -> int:
    """What whole_waves makes of num_splits on this device (the launcher rounds it)."""
    if not cfg.whole_waves:
        return cfg.num_splits
    programs = problem.batch * problem.heads_kv * triton.cdiv(
        problem.gqa_ratio * problem.seqlen_q, rows_per_tile(problem.gqa_ratio, problem.seqlen_q))
    return whole_wave_splits(programs, cfg.num_splits,
                             triton.cdiv(problem.seqlen_kv, cfg.block_n), device.sm_count)


def seed_configs(path: Path | None, row_name: str) -> list[FlashDecodeConfig]:
    """The best config an earlier run of this benchmark found for the row, if any."""
    if path is None or not path.exists():
        return []
    for row in json.loads(path.read_text()).get("rows", []):
        for m in row.get("results", []) if row.get("name") == row_name else []:
            if m.get("what") == "tuned" and m.get("config"):
                return [FlashDecodeConfig.from_dict(m["config"])]
    return []


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


def run_row(name: str, problem: Problem, device: Any, deadline: float,
            seeds: list[FlashDecodeConfig]) -> RowResult:
    inputs = TEMPLATE.make_inputs(problem, "cuda", seed=0)
    ref_o = TEMPLATE.reference(inputs)[0]
    tol = TEMPLATE.tolerance(problem)
    row = RowResult(name, problem.to_dict(), TEMPLATE.kv_bytes(problem))

    def timed(what: str, cfg: FlashDecodeConfig) -> Measurement:
        splits = launched_splits(problem, cfg, device)
        note = f"launched {splits} splits" if splits != cfg.num_splits else ""
        return measure(what, ours(inputs, cfg), ref_o, tol, row.kv_bytes, cfg.to_dict(), note)
    default = TEMPLATE.default_config(problem, device)
    row.results.append(timed("default", default))
    fused = replace(default, combine="fused")
    if TEMPLATE.constraint(problem, fused, device) is None:
        row.results.append(timed("default-fused", fused))
    row.results.append(timed("one-split", replace(default, num_splits=1)))

    swept = [m for m in row.results if m.what != "one-split"]
    phase_end = time.monotonic() + STRUCTURE_SHARE * max(0.0, deadline - time.monotonic())
    for cfg in structure_configs(problem, default, seeds, device):
        if time.monotonic() > phase_end:
            break
        if cfg not in (default, fused):  # timed above
            swept.append(timed("tuned", cfg))
    ranked = sorted((m for m in swept if m.us is not None), key=lambda m: m.us or 0.0)
    bases: list[FlashDecodeConfig] = []
    for m in ranked:
        base = replace(FlashDecodeConfig.from_dict(m.config or {}), combine="separate")
        if base not in bases and len(bases) < REFINED_BASES:
            bases.append(base)
    for cfg in hint_configs(problem, bases, device):
        if time.monotonic() > deadline:
            break
        if not cfg.whole_waves or launched_splits(problem, cfg, device) != cfg.num_splits:
            swept.append(timed("tuned", cfg))  # (whole waves that change nothing: skipped)
    tried = len(swept)
    for what, mode in (("tuned", None), *((f"tuned-{m}", m) for m in COMBINE_MODES)):
        pool = [m for m in swept if m.us is not None and m.config
                and (mode is None or m.config.get("combine") == mode)]
        if pool:
            best = min(pool, key=lambda m: m.us or 0.0)
            row.results.append(replace(best, what=what, note=f"best of {len(pool)} of "
                                                             f"{tried} swept {best.note}"))
    if problem.mask == "none":
        sdpa_backends(inputs, row, ref_o, tol)
    inputs.clear()  # free the caches before the next row
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
    head = (f"{'row':22} {'default':>26} {'default fused':>26} {'x vs 1 split':>12} "
            f"{'best separate':>26} {'best fused':>26} {'sdpa-fa2':>8} {'sdpa-cudnn':>10}")
    print(head)
    print("-" * len(head))
    for r in rows:
        default, one = r.get("default"), r.get("one-split")
        speedup = (f"{one.us / default.us:11.1f}x" if default and one and default.us and one.us
                   else f"{'-':>12}")
        sdpa = [r.get(n) for n in ("sdpa-fa2", "sdpa-cudnn")]
        sdpa_txt = [f"{m.tb_per_s:.2f}" if m and m.tb_per_s else "-" for m in sdpa]
        print(f"{r.name:22} {fmt(default, copy_tb):>26} {fmt(r.get('default-fused'), copy_tb):>26} "
              f"{speedup} {fmt(r.get('tuned-separate'), copy_tb):>26} "
              f"{fmt(r.get('tuned-fused'), copy_tb):>26} {sdpa_txt[0]:>8} {sdpa_txt[1]:>10}")
    for r in rows:
        for what in ("default", "tuned-separate", "tuned-fused"):
            m = r.get(what)
            if m and m.config:
                print(f"  {r.name:22} {what:15} {config_label(m.config):40} {m.note}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write every row here")
    parser.add_argument("--budget-s", type=float, default=150.0,
                        help="wall-clock budget; the sweeps stop when it is spent")
    parser.add_argument("--rows", help="comma-separated row names to run (default: all), e.g. "
                        "b1-32k to spend the whole budget on the issue's row")
    parser.add_argument("--seeds", type=Path, default=DEFAULT_SEEDS,
                        help="an earlier result file whose best config per row the sweep "
                             "tries first (default: %(default)s; a missing file: none)")
    args = parser.parse_args()
    rows_run = [r for r in ROWS if args.rows is None or r[0] in args.rows.split(",")]
    if not rows_run:
        print(f"--rows names none of {[r[0] for r in ROWS]}", file=sys.stderr)
        return 2
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
    for i, (name, problem, share) in enumerate(rows_run):
        # Share what is left of the budget among the rows still to run.
        left = args.budget_s - (time.monotonic() - start)
        shares_left = sum(r[2] for r in rows_run[i:])
        sweep_s = (left * share / shares_left
                   - ROW_FIXED_S * (len(rows_run) - i) * share / shares_left)
        deadline = time.monotonic() + max(0.0, sweep_s)
        row = run_row(name, problem, device, deadline, seed_configs(args.seeds, name))
        rows.append(row)
        for m in row.results:
            print(f"{name:22} {m.what:15} {fmt(m, copy_tb):>28} {config_label(m.config):40} "
                  f"err={m.error} {m.note}")
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
