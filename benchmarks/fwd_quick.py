"""Quick forward benchmark on one GPU, following docs/PROTOCOL.md.

For bf16, 16k tokens per batch, hidden 2048 (H = 2048 / D), D in 64 and 128, N in 4k and 16k,
causal and not: the flash_fwd template's default config, a small grid of configs (TMA on and
off) and torch SDPA's FLASH_ATTENTION / CUDNN_ATTENTION / EFFICIENT_ATTENTION backends, side by
side in one process, each output checked against SDPA before its time counts.

    python3 benchmarks/fwd_quick.py [--json rows.json] [--budget-s 240]
    python3 benchmarks/fwd_quick.py --compile-sweep [--json sweep.json]

``--compile-sweep`` compiles a wide grid without the template's constraints (in parallel) and
prints, per config, Triton's shared memory, registers and spills next to the constraint's
estimates: the data the constraints are calibrated on.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import itertools
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from templates.base import Problem, relative_error  # noqa: E402
from templates.device import current_device  # noqa: E402
from templates.flash.fwd import (  # noqa: E402
    TEMPLATE,
    FwdConfig,
    compile_for,
    live_fp32_per_thread,
    shared_memory_estimate,
)

SDPA_BACKENDS = {"FA2": SDPBackend.FLASH_ATTENTION, "cuDNN": SDPBackend.CUDNN_ATTENTION,
                 "EFF": SDPBackend.EFFICIENT_ATTENTION}
TOKENS, HIDDEN = 16384, 2048


def problems(head_dims: list[int]) -> list[Problem]:
    out = []
    for head_dim in head_dims:
        for seqlen in (4096, 16384):
            for causal in ("none", "top_left"):
                out.append(Problem(TOKENS // seqlen, HIDDEN // head_dim, HIDDEN // head_dim,
                                   seqlen, seqlen, head_dim, "bfloat16", causal))
    return out


def bench_grid(problem: Problem) -> list[FwdConfig]:
    """Tiles x warps x stages x TMA, with the constraints applied (~24-32 configs)."""
    device = current_device()
    block_ns = (32, 64) if problem.head_dim > 128 else (64, 128)
    out = []
    for bm, bn, warps, stages, tma in itertools.product((64, 128), block_ns, (4, 8), (2, 3),
                                                        (False, True)):
        cfg = FwdConfig(BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages, use_tma=tma,
                        longest_first=problem.causal != "none")
        if TEMPLATE.constraint(problem, cfg, device) is None:
            out.append(cfg)
    return out


def variants(problem: Problem, best: list[FwdConfig]) -> list[FwdConfig]:
    """The secondary knobs toggled one at a time on the best grid configs."""
    device = current_device()
    out = []
    for cfg in best:
        for change in ({"longest_first": not cfg.longest_first},
                       {"grid_order": "heads_inner"}, {"pipeline_masked_loop": False},
                       {"loop_unroll": 2}, {"num_stages": cfg.num_stages + 1}):
            try:
                new = dataclasses.replace(cfg, **change)
            except ValueError:
                continue
            if TEMPLATE.constraint(problem, new, device) is None and new not in out:
                out.append(new)
    return out


# ----------------------------------------------------------------------------- compiling
def _compile_job(problem: dict[str, Any], config: dict[str, Any], load: bool) -> dict[str, Any]:
    start = time.perf_counter()
    try:
        compiled = compile_for(Problem.from_dict(problem), FwdConfig.from_dict(config))
        row: dict[str, Any] = {"shared": int(compiled.metadata.shared)}
        if load:
            compiled._init_handles()
            row.update(n_regs=int(compiled.n_regs), n_spills=int(compiled.n_spills))
    except Exception as exc:  # a failed compile is a result here
        row = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"}
    row["compile_s"] = round(time.perf_counter() - start, 2)
    return row


def compile_all(jobs: list[tuple[Problem, FwdConfig]], *, load: bool, budget_s: float
                ) -> list[dict[str, Any] | None]:
    """Compile in parallel processes (Triton caches on disk); None where the budget ran out."""
    results: list[dict[str, Any] | None] = [None] * len(jobs)
    workers = min(16, os.cpu_count() or 4)
    deadline = time.monotonic() + budget_s
    pool = ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn"))
    futures = {pool.submit(_compile_job, p.to_dict(), c.to_dict(), load): i
               for i, (p, c) in enumerate(jobs)}
    try:
        for future in as_completed(futures, timeout=max(1.0, deadline - time.monotonic())):
            try:
                results[futures[future]] = future.result()
            except Exception as exc:  # a compiler crash takes its worker (and the pool) down
                results[futures[future]] = {"error": f"{type(exc).__name__}: {exc}"[:200]}
    except TimeoutError:
        print(f"compile budget of {budget_s:.0f} s ran out", flush=True)
    pool.shutdown(wait=False, cancel_futures=True)
    return results


def compile_sweep(args: argparse.Namespace) -> list[dict[str, Any]]:
    device = current_device()
    jobs = []
    for head_dim in (64, 128, 256):
        problem = Problem(4, 16, 16, 4096, 4096, head_dim, "bfloat16", "none")
        for bm, bn, warps, stages, tma in itertools.product(
                (64, 128, 256), (32, 64, 128, 256), (4, 8), (1, 2, 3, 4), (False, True)):
            jobs.append((problem, FwdConfig(BLOCK_M=bm, BLOCK_N=bn, num_warps=warps,
                                            num_stages=stages, use_tma=tma)))
    start = time.perf_counter()
    results = compile_all(jobs, load=True, budget_s=args.budget_s)
    print(f"compiled {sum(r is not None for r in results)}/{len(jobs)} configs in "
          f"{time.perf_counter() - start:.0f} s", flush=True)
    rows = []
    for (problem, cfg), res in zip(jobs, results, strict=True):
        if res is None:
            continue
        rows.append({"head_dim": problem.head_dim, **cfg.to_dict(), **res,
                     "smem_estimate": shared_memory_estimate(problem, cfg),
                     "live_estimate": live_fp32_per_thread(problem, cfg),
                     "constraint": TEMPLATE.constraint(problem, cfg, device)})
    print("D   BM  BN  w s tma | shared  est    | regs spills live | constraint")
    for r in rows:
        print(f"{r['head_dim']:<3} {r['BLOCK_M']:<3} {r['BLOCK_N']:<3} {r['num_warps']} "
              f"{r['num_stages']} {int(r['use_tma'])}   | {r.get('shared', '-')!s:>6} "
              f"{r['smem_estimate']:>6} | {r.get('n_regs', '-')!s:>4} {r.get('n_spills', '-')!s:>5} "
              f"{r['live_estimate']:>4} | {'ok' if r['constraint'] is None else 'rejected'} "
              f"{r.get('error', '')}")
    limit = device.smem_per_block
    runnable = [r for r in rows if "error" not in r and r.get("n_spills") == 0
                and r["shared"] <= limit]
    kept = [r for r in rows if r["constraint"] is None]
    bad_kept = [r for r in kept if r not in runnable]
    good_rejected = [r for r in rows if r in runnable and r["constraint"] is not None]
    print(f"runnable without spills: {len(runnable)}/{len(rows)}; constraint keeps "
          f"{len(kept)}, of which {len(bad_kept)} fail or spill; it rejects {len(good_rejected)} "
          f"runnable ones")
    return rows


# ----------------------------------------------------------------------------- timing
def tflops(problem: Problem, ms: float) -> float:
    return TEMPLATE.flops(problem) / (ms * 1e-3) / 1e12


def time_fn(fn: Any) -> float:
    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def time_config(problem: Problem, inputs: dict[str, Any], cfg: FwdConfig, o_ref: torch.Tensor,
                label: str) -> dict[str, Any]:
    row: dict[str, Any] = {"problem": problem.key(), "kernel": f"flash_fwd-{label}",
                           "config": cfg.to_dict()}
    try:
        o, _ = TEMPLATE.run(inputs, cfg)
        row["error"] = relative_error(o, o_ref)
        if not row["error"] <= 1e-2:
            row["failed"] = f"relative error {row['error']:.3g} vs SDPA"
        else:
            row["ms"] = time_fn(lambda i=inputs, c=cfg: TEMPLATE.run(i, c))
            row["tflops"] = tflops(problem, row["ms"])
    except Exception as exc:
        row["failed"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    return row


def time_sdpa(problem: Problem, inputs: dict[str, Any]) -> tuple[list[dict[str, Any]],
                                                                 torch.Tensor]:
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    causal = problem.causal != "none"
    with sdpa_kernel(SDPA_BACKENDS["FA2"]):
        o_ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    rows = []
    for name, backend in SDPA_BACKENDS.items():
        row: dict[str, Any] = {"problem": problem.key(), "kernel": f"sdpa-{name}"}
        try:
            with sdpa_kernel(backend):
                row["error"] = relative_error(
                    F.scaled_dot_product_attention(q, k, v, is_causal=causal), o_ref)
                row["ms"] = time_fn(lambda q=q, k=k, v=v, c=causal:
                                    F.scaled_dot_product_attention(q, k, v, is_causal=c))
            row["tflops"] = tflops(problem, row["ms"])
        except RuntimeError as exc:
            row["failed"] = str(exc).splitlines()[0][:160]
        rows.append(row)
    return rows, o_ref


def bench(args: argparse.Namespace) -> list[dict[str, Any]]:
    device = current_device()
    probs = problems(args.head_dims)
    deadline = time.monotonic() + args.budget_s
    grids = {p.key(): bench_grid(p) for p in probs}
    defaults = {p.key(): TEMPLATE.default_config(p, device) for p in probs}
    precompile([(p, c) for p in probs for c in [defaults[p.key()], *grids[p.key()]]],
               budget_s=args.budget_s / 4)

    rows: list[dict[str, Any]] = []
    refs: dict[str, tuple[dict[str, Any], torch.Tensor]] = {}
    for problem in probs:  # phase 1: SDPA, the default, the grid
        inputs = TEMPLATE.make_inputs(problem, "cuda", seed=0)
        sdpa_rows, o_ref = time_sdpa(problem, inputs)
        refs[problem.key()] = (inputs, o_ref)
        rows += sdpa_rows
        for label, cfg in [("default", defaults[problem.key()]),
                           *(("grid", c) for c in grids[problem.key()])]:
            if time.monotonic() > deadline:
                break
            rows.append(time_config(problem, inputs, cfg, o_ref, label))
        print(f"{problem.key()}: {summary(rows, problem)}", flush=True)

    extra = {p.key(): variants(p, best_configs(rows, p, 3)) for p in probs}  # phase 2
    precompile([(p, c) for p in probs for c in extra[p.key()]], budget_s=args.budget_s / 8)
    for problem in probs:
        inputs, o_ref = refs[problem.key()]
        for cfg in extra[problem.key()]:
            if time.monotonic() > deadline:
                print("timing budget ran out", flush=True)
                break
            rows.append(time_config(problem, inputs, cfg, o_ref, "variant"))
        for r in [r for r in rows if r["problem"] == problem.key() and "failed" in r][:6]:
            print(f"  failed {r['kernel']} {r.get('config', '')}: {r['failed']}")

    print(f"\n{device.name}, torch {torch.__version__}, triton {triton.__version__}, "
          f"{datetime.date.today()}; TFLOP/s (forward, causal counted as half)")
    print("D    N      causal   | default  best  median  worst (n)  | FA2  cuDNN  EFF | best")
    for problem in probs:
        mine = [r for r in rows if r["problem"] == problem.key() and "tflops" in r]
        tuned = sorted((r["tflops"] for r in mine if "default" not in r["kernel"]
                        and "sdpa" not in r["kernel"]), reverse=True)
        by_kernel = {r["kernel"]: r["tflops"] for r in mine}
        best = best_configs(rows, problem, 1)
        nan = float("nan")
        print(f"{problem.head_dim:<4} {problem.seqlen_q:<6} {problem.causal:<8} | "
              f"{by_kernel.get('flash_fwd-default', nan):7.0f} {tuned[0] if tuned else nan:5.0f} "
              f"{statistics.median(tuned) if tuned else nan:7.0f} "
              f"{tuned[-1] if tuned else nan:6.0f} ({len(tuned):2d}) | "
              f"{by_kernel.get('sdpa-FA2', nan):4.0f} {by_kernel.get('sdpa-cuDNN', nan):5.0f} "
              f"{by_kernel.get('sdpa-EFF', nan):4.0f} | {_short(best[0]) if best else '-'}")
    return rows


def precompile(jobs: list[tuple[Problem, FwdConfig]], *, budget_s: float) -> None:
    unique = list({(p.key(), c.key()): (p, c) for p, c in jobs}.values())
    start = time.perf_counter()
    compile_all(unique, load=False, budget_s=budget_s)
    print(f"precompiled {len(unique)} kernels in {time.perf_counter() - start:.0f} s", flush=True)


def best_configs(rows: list[dict[str, Any]], problem: Problem, n: int) -> list[FwdConfig]:
    timed = sorted((r for r in rows if r["problem"] == problem.key() and "tflops" in r
                    and "config" in r), key=lambda r: -r["tflops"])
    out: list[FwdConfig] = []
    for r in timed:
        cfg = FwdConfig.from_dict(r["config"])
        if cfg not in out:
            out.append(cfg)
    return out[:n]


def summary(rows: list[dict[str, Any]], problem: Problem) -> str:
    mine = sorted((r for r in rows if r["problem"] == problem.key() and "tflops" in r),
                  key=lambda r: -r["tflops"])
    return "; ".join(f"{r['tflops']:.0f} {r['kernel'].split('-')[-1]}"
                     f"{' ' + _short(FwdConfig.from_dict(r['config'])) if 'config' in r else ''}"
                     for r in mine[:6])


def _short(cfg: FwdConfig) -> str:
    return (f"{cfg.BLOCK_M}x{cfg.BLOCK_N} w{cfg.num_warps} s{cfg.num_stages}"
            f"{' tma' if cfg.use_tma else ''}{' lf' if cfg.longest_first else ''}"
            f"{' heads' if cfg.grid_order == 'heads_inner' else ''}"
            f"{' nopipe-masked' if not cfg.pipeline_masked_loop else ''}"
            f"{' unroll2' if cfg.loop_unroll > 1 else ''}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write every row here")
    parser.add_argument("--compile-sweep", action="store_true",
                        help="compile a wide grid and report shared memory, registers, spills")
    parser.add_argument("--head-dims", type=lambda t: [int(x) for x in t.split(",")],
                        default=[64, 128], help="comma-separated head dims (default 64,128)")
    parser.add_argument("--budget-s", type=float, default=240.0,
                        help="stop compiling/timing new configs after this many seconds")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("fwd_quick.py needs a CUDA GPU")
    rows = compile_sweep(args) if args.compile_sweep else bench(args)
    if args.json:
        args.json.write_text(json.dumps({"device": current_device().to_dict(), "rows": rows},
                                        indent=1, default=str))


if __name__ == "__main__":
    main()
