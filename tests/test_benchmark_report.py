"""benchmarks/report.py on a tiny synthetic results directory, in the benchmark scripts' formats."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.benchmark_scripts import load_benchmark_script


@pytest.fixture(scope="module")
def report() -> ModuleType:
    return load_benchmark_script("report")


# ----------------------------------------------------------------------------- synthetic data
DEVICE = {"name": "Synthetic GPU", "driver_version": "999.1", "triton_version": "9.9.0",
          "torch_version": "9.8.0", "cuda_version": "77.0", "compute_capability": "9.0"}


def env(command: str) -> dict[str, Any]:
    return {"gpu": "Synthetic GPU", "sm_count": 1, "driver": "999.1", "torch": "9.8.0+cu77",
            "triton": "9.9.0", "cuda": "77.0", "date": "2030-01-02T03:04:05.678+00:00",
            "command": command}


def fwd_config(bm: int, bn: int, warps: int = 4, stages: int = 2, tma: bool = True,
               causal: bool = False) -> dict[str, Any]:
    return {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": warps, "num_stages": stages,
            "use_tma": tma, "pipeline_masked_loop": True, "loop_unroll": 1,
            "grid_order": "tiles_inner", "longest_first": causal, "warp_specialize": False}


def fwd_rows() -> list[dict[str, Any]]:
    """fwd_quick.py rows: d128 4k dense / causal and d64 4k dense."""
    rows: list[dict[str, Any]] = []

    def add(problem: str, kernel: str, tflops: float | None, config: dict[str, Any] | None = None,
            failed: str = "") -> None:
        row: dict[str, Any] = {"problem": problem, "kernel": kernel}
        if config is not None:
            row["config"] = config
        if tflops is None:
            row["failed"] = failed
        else:
            row.update(error=0.001, ms=1.0, tflops=tflops)
        rows.append(row)

    dense = "b4-hq16-hkv16-q4096-kv4096-d128-bfloat16-dense"
    causal = "b4-hq16-hkv16-q4096-kv4096-d128-bfloat16-causal-top_left"
    d64 = "b4-hq32-hkv32-q4096-kv4096-d64-bfloat16-dense"
    for problem, fa2, cudnn in ((dense, 300, 480), (causal, 200, 360), (d64, 250, 380)):
        add(problem, "sdpa-FA2", fa2)
        add(problem, "sdpa-cuDNN", cudnn)
        add(problem, "sdpa-EFF", 100)
    add(dense, "flash_fwd-default", 400, fwd_config(64, 64))
    add(dense, "flash_fwd-grid", 500, fwd_config(128, 64))
    add(dense, "flash_fwd-variant", 450, fwd_config(128, 64, stages=3))
    add(causal, "flash_fwd-default", 300, fwd_config(128, 64, causal=True))
    add(causal, "flash_fwd-grid", 330, fwd_config(128, 128, warps=8, causal=True))
    add(d64, "flash_fwd-default", 440, fwd_config(64, 128))
    add(d64, "flash_fwd-grid", 400, fwd_config(128, 128))
    add(d64, "flash_fwd-grid", None, fwd_config(128, 64), failed="relative error 0.5 vs SDPA")
    return rows


def measurement(what: str, tflops: float | None, config: dict[str, Any] | None = None,
                note: str = "") -> dict[str, Any]:
    # flops = 1e12 per call, so ms = 1000 / TFLOP/s.
    return {"what": what, "ms": None if tflops is None else 1000.0 / tflops, "tflops": tflops,
            "grad_error": 0.001, "config": config, "note": note}


def fwd_bwd_row(head_dim: int, seqlen: int, causal: bool,
                results: list[dict[str, Any]]) -> dict[str, Any]:
    return {"head_dim": head_dim, "seqlen": seqlen, "causal": causal, "batch": 16384 // seqlen,
            "heads": 2048 // head_dim, "flops": 1e12, "results": results}


BWD = {"BLOCK_M1": 32, "BLOCK_N1": 128, "BLOCK_M2": 128, "BLOCK_N2": 32, "num_warps": 4,
       "num_stages": 3, "dq_mode": "separate"}


def decode_result(what: str, us: float | None, tb: float | None,
                  config: dict[str, Any] | None = None, note: str = "") -> dict[str, Any]:
    return {"what": what, "us": us, "tb_per_s": tb, "error": 0.002, "config": config,
            "note": note}


def decode_row(name: str, mask: str, results: list[dict[str, Any]]) -> dict[str, Any]:
    problem = {"batch": 1, "heads_q": 32, "heads_kv": 8, "seqlen_q": 1, "seqlen_kv": 32768,
               "head_dim": 128, "dtype": "bfloat16", "causal": "none", "mask": mask}
    return {"name": name, "problem": problem, "kv_bytes": 134217728.0, "results": results}


def blocksparse_rows() -> list[dict[str, Any]]:
    """blocksparse_bench.py rows: dense 4 ms; random:0.1 (the target) and document:8."""
    rows: list[dict[str, Any]] = []

    def add(pattern: str, density: float, kernel: str, ms: float | None,
            config: dict[str, Any] | None = None) -> None:
        row: dict[str, Any] = {"pattern": pattern, "density": density, "kernel": kernel,
                               "config": config, "error": 0.002}
        if ms is None:
            row["failed"] = "error 0.5 over the tolerance 0.01"
        else:
            row.update(ms=ms, tflops_dense_equiv=2000.0 / ms)
        rows.append(row)

    grid = {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2, "use_tma": True}
    add("dense", 1.0, "ours-dense", 4.0)
    add("random:0.1", 0.1, "ours-default", 0.8)
    add("random:0.1", 0.1, "ours-grid", 0.5, grid)
    add("random:0.1", 0.1, "ours-grid", None, {**grid, "num_stages": 3})
    rows.append({"pattern": "random:0.1", "kernel": "ours-grid",  # did not compile
                 "config": {**grid, "BLOCK_M": 256}, "failed": "OutOfResources('shared')"})
    add("random:0.1", 0.1, "flex", 0.7)
    add("document:8", 0.125, "ours-default", 0.4)
    add("document:8", 0.125, "ours-grid", 0.45, {**grid, "pipeline_masked_loop": False})
    add("document:8", 0.125, "flex", 0.6)
    return rows


def masked_result(impl: str, step: str, ms: float | None, config: dict[str, Any] | None = None,
                  status: str = "timed", note: str = "") -> dict[str, Any]:
    # fwd_flops = 1e12 per call and fwd+bwd counts 3.5x: TFLOP/s = 1000 (or 3500) / ms.
    flops = 1e12 * (3.5 if step == "fwd+bwd" else 1.0)
    return {"impl": impl, "step": step, "status": status, "ms": ms,
            "tflops": None if ms is None else flops / ms / 1e9, "errors": {"o": 0.002},
            "config": config, "note": note}


def masked_rows() -> list[dict[str, Any]]:
    """masked_fwd_bwd_bench.py rows: ours faster than Flex forward in the first, slower in the
    second; the grid wins one backward; one of our calls failed its check."""
    def row(pattern: str, head_dim: int, results: list[dict[str, Any]]) -> dict[str, Any]:
        return {"pattern": pattern, "head_dim": head_dim, "seqlen": 4096, "batch": 4,
                "heads": 2048 // head_dim, "visible_pairs": 1, "visible_fraction": 0.125,
                "block_density": 0.14, "fwd_flops": 1e12, "results": results}

    return [
        row("random:0.1", 128, [
            masked_result("ours", "fwd", 2.0), masked_result("ours", "fwd+bwd", 10.0),
            masked_result("flex", "fwd", 3.0), masked_result("flex", "fwd+bwd", 8.0),
            masked_result("sdpa-cudnn", "fwd", 20.0),
            masked_result("sdpa-cudnn", "fwd+bwd", 70.0),
            masked_result("ours-grid", "fwd+bwd", 7.0, {**BWD, "num_stages": 2}),
            masked_result("ours-grid", "fwd+bwd", 9.0, BWD),
            masked_result("ours-grid", "fwd+bwd", None, {**BWD, "num_warps": 8},
                          status="wrong", note="dq: relative error 0.3 > 0.01. More text")]),
        row("sliding-causal:1024", 64, [
            masked_result("ours", "fwd", 2.5), masked_result("ours", "fwd+bwd", 5.0),
            masked_result("flex", "fwd", 2.0), masked_result("flex", "fwd+bwd", 5.5),
            masked_result("sdpa-efficient", "fwd", 25.0),
            masked_result("sdpa-efficient", "fwd+bwd", 80.0)]),
    ]


def sweep_problem(label: str, best: float, default: float, counts: dict[str, int],
                  wall_s: float, bench_s: float) -> dict[str, Any]:
    """One problem of ``tuner sweep NAME --json``, budget 4."""
    return {"label": label, "template": "flash_fwd", "problem_key": label.replace(" ", "-"),
            "budget": 4, "counts": counts, "measured": counts.get("ok", 0), "reused": 0,
            "best_tflops": best, "best_config": {"BLOCK_M": 64}, "default_tflops": default,
            "speedup": best / default, "wall_s": wall_s, "bench_s": bench_s, "skipped": None,
            "ok": counts.get("ok", 0), "failed": {k: v for k, v in counts.items() if k != "ok"},
            "seconds_per_trial": wall_s / 4, "bench_seconds_per_trial": bench_s / 4}


def write_results(directory: Path) -> Path:
    directory.mkdir()
    (directory / "fwd_quick_syn.json").write_text(json.dumps({
        "device": DEVICE, "rows": fwd_rows(), "date": "2030-01-01",
        "command": "python3 benchmarks/fwd_quick.py --synthetic"}))
    (directory / "fwd_bwd_syn.json").write_text(json.dumps({
        "environment": env("python benchmarks/fwd_bwd_bench.py --synthetic"),
        "grad_tolerance": 0.02, "rows": [
            fwd_bwd_row(128, 1024, False, [  # below N = 4k: not part of the target
                measurement("sdpa-fa2", 200, note="gradient reference"),
                measurement("sdpa-cudnn", 500), measurement("default", 100, BWD)]),
            fwd_bwd_row(128, 4096, False, [
                measurement("sdpa-fa2", 300, note="gradient reference"),
                measurement("sdpa-cudnn", 500), measurement("default", 450, BWD),
                measurement("flex", 350), measurement("grid", 520, {**BWD, "num_stages": 2})]),
            fwd_bwd_row(128, 16384, True, [
                measurement("sdpa-fa2", 320, note="gradient reference"),
                measurement("sdpa-cudnn", 500), measurement("default", 480, BWD),
                measurement("flex", None, note="OutOfMemoryError: CUDA out of memory. Tried"),
                measurement("grid", 400, {**BWD, "num_warps": 8})]),
        ]}))
    (directory / "decode_syn.json").write_text(json.dumps({
        "environment": env("python benchmarks/decode_bench.py --synthetic"),
        "copy_tb_per_s": 3.0, "rows": [
            decode_row("b1-32k", "none", [
                decode_result("default", 100.0, 1.5, {"num_splits": 64, "block_n": 64,
                                                      "num_warps": 4, "num_stages": 3}),
                decode_result("one-split", 400.0, 0.375),
                decode_result("tuned", 60.0, 2.5, {"num_splits": 32, "block_n": 32,
                                                   "num_warps": 4, "num_stages": 3},
                              "best of 5 swept"),
                decode_result("sdpa-fa2", 80.0, 1.9), decode_result("sdpa-cudnn", 66.0, 2.3)]),
            decode_row("b1-32k-paged16", "paged:16", [  # not the target's row
                decode_result("default", 200.0, 1.0), decode_result("one-split", 210.0, 0.9),
                decode_result("tuned", 200.0, 1.0)]),
        ]}))
    (directory / "masked_fwd_bwd_syn.json").write_text(json.dumps({
        "environment": env("python benchmarks/masked_fwd_bwd_bench.py --synthetic"),
        "dtype": "torch.bfloat16", "block_size": 128, "tolerance": 0.01,
        "fwd_bwd_flops_factor": 3.5, "rows": masked_rows()}))
    (directory / "masked_fwd_bwd_broken.json").write_text(json.dumps({"rows": [{"x": 1}]}))
    (directory / "fwd_compile_sweep_syn.json").write_text(json.dumps({"rows": []}))
    (directory / "blocksparse_syn.json").write_text(json.dumps({
        "device": {"name": "Synthetic GPU", "torch_version": "9.8.0", "triton_version": "9.9.0",
                   "cuda_version": "77.0", "python": "3.99"},
        "command": "python3 benchmarks/blocksparse_bench.py --synthetic", "date": "2030-01-03",
        "shape": {"B": 1, "H": 16, "N": 16384, "D": 128, "dtype": "bfloat16", "block": 128},
        "rows": blocksparse_rows()}))
    (directory / "blocksparse_broken.json").write_text(json.dumps({"rows": [{"who": "knows"}]}))
    (directory / "sweep_quick_syn.json").write_text(json.dumps({
        "sweep_id": 1, "name": "quick", "status": "done", "device": DEVICE,
        "sampler": "tpe", "workers": 1, "compile_ahead": 4, "wall_s": 20.0, "problems": [
            sweep_problem("flash_fwd d64 dense", 400.0, 250.0, {"ok": 4, "invalid": 3}, 2.0,
                          0.4),
            sweep_problem("flash_fwd d128 causal", 300.0, 300.0,
                          {"ok": 3, "invalid": 1, "compile_error": 1}, 6.4, 0.8),
        ]}))
    (directory / "sweep_quick_syn.meta.json").write_text(json.dumps({
        "command": "tuner sweep quick --json --synthetic", "date": "2030-01-04",
        "gpu": "not used: the JSON names its GPU"}))
    (directory / "sweep_quick_trials_syn.json").write_text(json.dumps({
        "format": "attention-tuner/trials", "version": 1, "problems": []}))
    (directory / "orphan.meta.json").write_text("{}")
    (directory / "mystery_syn.json").write_text(json.dumps({"rows": []}))
    (directory / "fwd_quick_broken.json").write_text("{not json")
    return directory


def run(report: ModuleType, tmp_path: Path, *extra: str) -> str:
    out = tmp_path / "out" / "benchmarks.md"
    code = report.main(["--results", str(tmp_path / "results"), "--out", str(out),
                        "--img-dir", str(tmp_path / "out" / "img"), *extra])
    assert code == 0
    return out.read_text()


def targets_by_name(markdown: str) -> dict[str, list[str]]:
    start = markdown.index("| target | threshold |")
    rows = {}
    for line in markdown[start:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0]] = cells[1:]
    return rows


# ----------------------------------------------------------------------------- tests
def test_tables_and_targets(report: ModuleType, tmp_path: Path) -> None:
    write_results(tmp_path / "results")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "benchmarks_notes.md").write_text("Hand-written *analysis*.\n")
    md = run(report, tmp_path, "--no-plots")

    # provenance, per file
    assert "| `fwd_quick_syn.json` | forward | Synthetic GPU | 999.1 | 9.8.0 | 9.9.0 | 77.0 | " \
           "2030-01-01 | `python3 benchmarks/fwd_quick.py --synthetic` |" in md
    assert ("| `fwd_bwd_syn.json` | forward + backward | Synthetic GPU | 999.1 | 9.8.0+cu77 | "
            "9.9.0 | 77.0 | 2030-01-02 03:04 UTC | "
            "`python benchmarks/fwd_bwd_bench.py --synthetic` |") in md
    assert "`python benchmarks/decode_bench.py --synthetic`" in md
    assert "python benchmarks/report.py" in md
    # files left out, with the reason
    assert "`mystery_syn.json`: format not known to report.py, skipped" in md
    assert "`blocksparse_broken.json`: not a blocksparse_bench.py result (" in md
    assert ("`sweep_quick_trials_syn.json`: recorded sweep trials (`tuner replay` input) data, "
            "not part of this report") in md
    assert "`orphan.meta.json`: sidecar of `orphan.json`, which is missing" in md
    assert "sweep_quick_syn.meta.json`:" not in md  # a sidecar is not a result file
    assert ("| `blocksparse_syn.json` | block-sparse | Synthetic GPU | - | 9.8.0 | 9.9.0 | 77.0 | "
            "2030-01-03 | `python3 benchmarks/blocksparse_bench.py --synthetic` |") in md
    # the sidecar states what the sweep's JSON lacks (command, date), not what it has (GPU)
    assert ("| `sweep_quick_syn.json` | tuner sweep | Synthetic GPU | 999.1 | 9.8.0 | 9.9.0 | "
            "77.0 | 2030-01-04 (from `sweep_quick_syn.meta.json`) | "
            "`tuner sweep quick --json --synthetic` (from `sweep_quick_syn.meta.json`) |") in md
    assert "`fwd_compile_sweep_syn.json`: compile sweep data, not part of this report" in md
    assert "`fwd_quick_broken.json`: not a fwd_quick.py result (" in md

    # forward: best of default/grid/variant, its config, the ratios; failed configs not counted
    assert ("| 128 | 4k | dense | 4 x 16 | 400 | 500 | 128x64 w4 s2 tma (grid, of 3) | 300 | 480 "
            "| 1.04x | 1.67x | 1.25x |") in md
    assert ("| 128 | 4k | causal-top_left | 4 x 16 | 300 | 330 | 128x128 w8 s2 tma lf (grid, of 2) "
            "| 200 | 360 | 0.92x | 1.65x | 1.10x |") in md
    assert ("| 64 | 4k | dense | 4 x 32 | 440 | 440 | 64x128 w4 s2 tma (default, of 2) | 250 | 380 "
            "| 1.16x | 1.76x | 1.00x |") in md
    # fwd+bwd: best by time; Flex present, its failure listed
    assert ("| 128 | 4k | no | 4 x 16 | 450 | 520 | 32/128/128/32 w4 s2 separate (grid, of 1) "
            "| 300 | 500 | 350 | 1.04x | 1.73x | 1.16x |") in md
    assert ("| 128 | 16k | yes | 1 x 16 | 480 | 480 | 32/128/128/32 w4 s3 separate (default, of 1) "
            "| 320 | 500 | - | 0.96x | 1.50x | 1.00x |") in md
    assert "- d128 N16k causal flex: OutOfMemoryError: CUDA out of memory" in md
    # masked: TFLOP/s, Flex's time over ours, best of default and grid, SDPA's backend
    assert ("| `masked_fwd_bwd_syn.json` | masked forward + backward | Synthetic GPU | 999.1 | "
            "9.8.0+cu77 | 9.9.0 | 77.0 | 2030-01-02 03:04 UTC | "
            "`python benchmarks/masked_fwd_bwd_bench.py --synthetic` |") in md
    assert ("| 128 | 4k | `random:0.1` | 0.125 | 500 | 333 | 1.50x | 350 | "
            "500 (32/128/128/32 w4 s2 separate, of 2) | 438 | 1.14x | 0.80x | 50 | "
            "50 (cudnn) |") in md
    assert ("| 64 | 4k | `sliding-causal:1024` | 0.125 | 400 | 500 | 0.80x | 700 | "
            "700 (default, of 0) | 636 | 1.10x | 1.10x | 40 | 44 (efficient) |") in md
    assert ("- Forward, ours/Flex: 0.80x (d64 N4k sliding-causal:1024) to 1.50x (d128 N4k "
            "random:0.1) over 2 rows, ours slower on 1 (d64 N4k sliding-causal:1024).") in md
    assert ("- Forward + backward, best/Flex: 1.10x (d64 N4k sliding-causal:1024) to 1.14x "
            "(d128 N4k random:0.1) over 2 rows, ours slower on 0.") in md
    assert ("- Forward + backward, default configs/Flex: 0.80x (d128 N4k random:0.1) to 1.10x "
            "(d64 N4k sliding-causal:1024) over 2 rows, ours slower on 1 (d128 N4k "
            "random:0.1).") in md
    assert "- d128 N4k random:0.1 ours-grid fwd+bwd (wrong): dq: relative error 0.3 > 0.01" in md
    assert "`masked_fwd_bwd_broken.json`: not a masked_fwd_bwd_bench.py result (" in md
    # block-sparse: default, best (of the timed; failed and uncompiled counted apart), Flex
    assert ("| `random:0.1` | 0.100 | 0.800 | 0.500 | 128x64 w4 s2 tma (grid, of 2, 2 failed) | "
            "0.700 | 1.40x | 0.125x | 4000 |") in md
    assert ("| `document:8` | 0.125 | 0.400 | 0.400 | default (of 2) | 0.600 | 1.50x | 0.100x "
            "| 5000 |") in md
    assert "our dense kernel's (no mask: 4.000 ms)" in md
    # sweep: per problem, failures by kind, overhead = s per trial - bench s per trial
    assert ("| flash_fwd d64 dense | 400 | 250 | 1.60x | 4 / invalid 3 | 0.50 | 0.10 | 0.40 |"
            in md)
    assert ("| flash_fwd d128 causal | 300 | 300 | 1.00x | 3 / compile_error 1, invalid 1 | "
            "1.60 | 0.20 | 1.40 |") in md
    assert "4 trials per problem, sampler tpe, 1 worker, compile ahead 4, wall 20.0 s" in md
    # decode: us (TB/s, % of copy), speed-up over one split
    assert ("| b1-32k | 1 | 32k | 32/8 | none | 100.0 (1.50, 50%) | 4.00x | 60.0 (2.50, 83%) | "
            "6.67x | splits 32 bn32 w4 s3 (best of 5 swept) | 80.0 (1.90, 63%) | "
            "66.0 (2.30, 77%) | 1.10x |") in md

    targets = targets_by_name(md)
    verdict = {name: cells[2] for name, cells in targets.items()}
    assert verdict == {
        "forward best vs cuDNN, d=128, N >= 2k, dense": "**met**",
        "forward best vs cuDNN, d=128, N >= 2k, causal": "**not met**",
        "forward best vs cuDNN, d=64": "**met**",
        "forward best vs FA2, every row": "**met**",
        "forward tuned (best) vs default, geomean over problems": "**not met**",
        "fwd+bwd best vs cuDNN, d=128, N >= 4k": "**not met**",
        "decode B=1, 32k cache: best's K+V bandwidth vs copy": "**met**",
        "decode B=1, 32k cache: best vs one split": "**met**",
        "block-sparse `random:0.1`: best time vs our dense kernel": "**met**",
        "block-sparse `random:0.1`: best vs FlexAttention (Flex time / ours)": "**met**",
        "tuner sweep `quick`: tuned vs default, geomean over the suite "
        "(only 4 trials per problem)": "**met**",
        "tuner sweep `quick`: seconds per trial beyond the benchmark, worst problem":
            "**not met**",
    }
    causal = targets["forward best vs cuDNN, d=128, N >= 2k, causal"]
    assert causal[1] == "worst 0.92x (d128 N4k causal)" and causal[3].startswith("worst row 8% short")
    geomean = targets["forward tuned (best) vs default, geomean over problems"]
    assert geomean[1] == "1.112x over 3 problems" and geomean[3] == "7% short"
    assert targets["forward best vs FA2, every row"][1] == "worst 1.65x (d128 N4k causal)"
    fwd_bwd = targets["fwd+bwd best vs cuDNN, d=128, N >= 4k"]
    assert fwd_bwd[1] == "worst 0.96x (d128 N16k causal)"
    assert fwd_bwd[3] == "worst row 4% short; 1 of 2 rows meet it"
    assert targets["decode B=1, 32k cache: best's K+V bandwidth vs copy"][1:4:2] == [
        "83.3% (2.50 of 3.00 TB/s)", "3.3 points above"]
    assert targets["decode B=1, 32k cache: best vs one split"][1] == "6.67x"
    vs_dense = targets["block-sparse `random:0.1`: best time vs our dense kernel"]
    assert vs_dense[:4] == ["<= 0.15x", "0.125x (0.500 of 4.000 ms)", "**met**",
                             "17% under the limit"]
    vs_flex = targets["block-sparse `random:0.1`: best vs FlexAttention (Flex time / ours)"]
    assert vs_flex[:4] == [">= 1.30x", "1.40x (0.700 / 0.500 ms)", "**met**", "8% above"]
    assert "- block-sparse `random:0.1`: best vs FlexAttention (Flex time / ours): default " \
           "0.87x" in md
    tuned = targets["tuner sweep `quick`: tuned vs default, geomean over the suite "
                    "(only 4 trials per problem)"]
    assert tuned[1:4] == ["1.265x over 2 problems", "**met**", "5% above"]
    overhead = targets["tuner sweep `quick`: seconds per trial beyond the benchmark, "
                       "worst problem"]
    assert overhead[:4] == ["<= 1.00 s", "1.40 s (flash_fwd d128 causal)", "**not met**",
                            "40% over the limit"]

    # the hand-written notes, verbatim, under their heading
    assert md.rstrip().endswith("## Why targets are missed\n\n"
                                "<!-- included verbatim from benchmarks_notes.md, written by hand "
                                "-->\nHand-written *analysis*.")
    assert "![" not in md  # --no-plots


def test_missing_files_and_notes(report: ModuleType, tmp_path: Path) -> None:
    (tmp_path / "results").mkdir()
    md = run(report, tmp_path, "--no-plots")
    assert "No result files were found." in md
    assert "No data for any target." in md
    assert "(no `benchmarks_notes.md` beside this file)" in md


def test_missing_matplotlib_is_a_clear_error(report: ModuleType, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    write_results(tmp_path / "results")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    with pytest.raises(SystemExit) as exc:
        run(report, tmp_path)
    assert "pip install -e '.[report]'" in str(exc.value.code)
    assert not (tmp_path / "out" / "benchmarks.md").exists()


def test_plots(report: ModuleType, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="the plots need matplotlib (the report extra); "
                                             "CI installs only the dev extra")
    write_results(tmp_path / "results")
    md = run(report, tmp_path)
    img = tmp_path / "out" / "img"
    names = ["blocksparse_syn", "decode_syn", "fwd_bwd_syn", "fwd_quick_syn"]
    for name in names:
        assert (img / f"{name}.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
        assert f"(img/{name}.png)" in md
    assert sorted(p.name for p in img.iterdir()) == [f"{n}.png" for n in names]
