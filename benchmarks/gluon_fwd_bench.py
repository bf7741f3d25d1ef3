"""The Gluon forward (templates.gluon.fwd) on one Hopper GPU: numerics, then speed.

    python3 benchmarks/gluon_fwd_bench.py --check [--time] [--json DIR] [--budget-s 300]
    python3 benchmarks/gluon_fwd_bench.py --compile-only [--json DIR]   # CPU, sm_90 offline

``--check`` runs every variant (a named config) on odd shapes: bf16 and fp16, GQA/MQA, causal
top-left and bottom-right (rows that see no key included), N_q != N_kv, D 64/128/256; each
variant in its own child process with a timeout, so a hang (a barrier bug) costs one variant,
not the run. Outputs are poisoned with NaN first (an unwritten element fails), compared with
the float64/float32 reference (o and lse, the template's error and tolerance), and computed
three times: a result that changes between runs on the same input is a race.

``--time`` follows docs/PROTOCOL.md: bf16, 16k tokens per batch, H = 2048 / D,
N 4k and 16k, dense and causal, triton.testing.do_bench(warmup=25, rep=100, median) side by
side in this process with torch SDPA's cuDNN and FA2 backends and the project's Triton
flash_fwd default. Every output is checked against an fp32 SDPA (EFFICIENT backend) before its
time counts. Only variants that passed ``--check`` are timed when both are given.

``--compile-only`` compiles each variant for sm_90 on this machine
(templates.compile.offline_target) and prints registers, spills and shared memory.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import multiprocessing as mp
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from templates.base import TOLERANCE, Problem, relative_error  # noqa: E402
from templates.gluon.fwd import TEMPLATE, GluonFwdConfig  # noqa: E402

TOKENS, HIDDEN = 16384, 2048
WARMUP_MS, REP_MS = 25, 100

# Named configs: the steps of issue 17, each kept as a variant while it is measured.
VARIANTS: dict[str, dict[str, Any]] = {
    # one warpgroup, loads issued by the consumer warps (step 1)
    "ns1": dict(BLOCK_M=64, BLOCK_N=128, kv_stages=2, consumers=1, warp_specialize=False,
                pingpong=False),
    # the same with 64-key blocks, two programs per SM
    "ns1-2cta": dict(BLOCK_M=64, BLOCK_N=64, kv_stages=2, consumers=1, warp_specialize=False,
                     pingpong=False, ctas_per_sm=2),
    # producer warp + one consumer warpgroup, two programs per SM
    "ws1-2cta": dict(BLOCK_M=64, BLOCK_N=64, kv_stages=2, consumers=1, warp_specialize=True,
                     pingpong=False, ctas_per_sm=2),
    "ws1-2cta-n128": dict(BLOCK_M=64, BLOCK_N=128, kv_stages=1, consumers=1,
                          warp_specialize=True, pingpong=False, ctas_per_sm=2),
    # two warpgroups in one partition, loads issued by the consumer warps
    "ns2": dict(BLOCK_M=128, BLOCK_N=128, kv_stages=2, consumers=2, warp_specialize=False,
                pingpong=False),
    # producer warp + two consumer warpgroups in one partition (in step)
    "ws2": dict(BLOCK_M=128, BLOCK_N=128, kv_stages=2, consumers=2, warp_specialize=True,
                pingpong=False),
    # producer warp + two ping-pong consumer warpgroups (FA3)
    "pp": dict(BLOCK_M=128, BLOCK_N=128, kv_stages=2, consumers=2, warp_specialize=True,
               pingpong=True),
    "pp-s3": dict(BLOCK_M=128, BLOCK_N=128, kv_stages=3, consumers=2, warp_specialize=True,
                  pingpong=True),
    "pp-n64": dict(BLOCK_M=128, BLOCK_N=64, kv_stages=4, consumers=2, warp_specialize=True,
                   pingpong=True),
    # ping-pong with P through shared memory (both PV operands from shared memory)
    "pp-ps": dict(BLOCK_M=128, BLOCK_N=128, kv_stages=2, consumers=2, warp_specialize=True,
                  pingpong=True, p_from_smem=True),
    # ping-pong, persistent: one program per SM walks the tiles
    "pp-pers": dict(BLOCK_M=128, BLOCK_N=128, kv_stages=2, consumers=2, warp_specialize=True,
                    pingpong=True, persistent=True),
    # two ping-pong consumers of 128 rows over 64-key blocks, persistent
    "pp-m256-pers": dict(BLOCK_M=256, BLOCK_N=64, kv_stages=2, consumers=2,
                         warp_specialize=True, pingpong=True, persistent=True),
    "pp-s3-pers": dict(BLOCK_M=128, BLOCK_N=128, kv_stages=3, consumers=2,
                       warp_specialize=True, pingpong=True, persistent=True),
}
START = time.monotonic()


def stamp() -> str:
    """Seconds since this script started (log lines carry it)."""
    return f"[{time.monotonic() - START:6.1f}s]"

# (batch, heads_q, heads_kv, N_q, N_kv, D, dtype, causal)
CHECKS: list[tuple[int, int, int, int, int, int, str, str]] = [
    (1, 2, 2, 77, 77, 128, "bfloat16", "none"),
    (2, 4, 2, 1000, 1000, 128, "bfloat16", "top_left"),          # GQA 2
    (1, 3, 1, 300, 1100, 64, "bfloat16", "bottom_right"),        # MQA, N_kv > N_q
    (1, 2, 2, 1100, 300, 128, "float16", "bottom_right"),        # 800 rows see no key
    (1, 2, 2, 700, 200, 128, "bfloat16", "top_left"),            # N_q > N_kv, top-left
    (2, 2, 2, 513, 513, 256, "bfloat16", "top_left"),
    (1, 2, 2, 1000, 1000, 64, "float16", "none"),
    (1, 2, 2, 1, 1, 128, "bfloat16", "top_left"),
    (1, 2, 1, 4096, 4096, 128, "bfloat16", "top_left"),          # many blocks, ring wraps
    (1, 2, 2, 3333, 3333, 128, "float16", "none"),
    # more tiles than SMs: persistent programs walk several tiles (ring, turn and Q phases
    # carried across them; tiles with no visible key among them)
    (4, 16, 4, 1000, 1000, 128, "bfloat16", "top_left"),
    (2, 16, 16, 1100, 300, 128, "float16", "bottom_right"),
    (1, 32, 32, 2048, 2048, 64, "bfloat16", "none"),
]


def fitted(variant: dict[str, Any], problem: Problem, device: Any) -> GluonFwdConfig | None:
    """The variant's config for this problem, or the nearest that fits (smaller key blocks,
    fewer stages) where its own does not; None when none does."""
    causal = problem.causal != "none"
    base = GluonFwdConfig(**variant, longest_first=causal)
    tries = [base]
    for block_n in (base.BLOCK_N, 64):
        for stages in range(base.kv_stages, 0, -1):
            tries.append(dataclasses.replace(base, BLOCK_N=block_n, kv_stages=stages))
    for cfg in tries:
        if TEMPLATE.constraint(problem, cfg, device) is None:
            return cfg
    return None


# ----------------------------------------------------------------------------- numerics
def check_variant(name: str, queue: Any, warm: list[Problem]) -> None:
    """Child process: every CHECKS case for one variant; puts one dict per case. Then
    compiles the variant for the ``warm`` problems (Triton's on-disk cache), so that the
    timing phase does not wait for the compiler."""
    from templates.device import current_device
    from templates.gluon import fwd_kernel as gluon_fwd_kernel

    gluon_fwd_kernel.DEBUG_POISON = True
    device = current_device()
    for case in CHECKS:
        problem = Problem(*case)
        row: dict[str, Any] = {"variant": name, "problem": problem.key()}
        try:
            cfg = fitted(VARIANTS[name], problem, device)
            if cfg is None:
                row["skipped"] = "no config of this variant fits"
                queue.put(row)
                continue
            row["config"] = cfg.key()
            errors = []
            for seed in (0, 1):
                inputs = TEMPLATE.make_inputs(problem, "cuda", seed=seed)
                ref = TEMPLATE.reference(inputs)
                outs = [TEMPLATE.run(inputs, cfg) for _ in range(3)]
                torch.cuda.synchronize()
                errors.append(TEMPLATE.error(outs[0], ref))
                same = all(torch.equal(o[0], outs[0][0]) and torch.equal(o[1], outs[0][1])
                           for o in outs[1:])
                if not same:
                    row["race"] = True
                if errors[-1] > TEMPLATE.tolerance(problem) and "where" not in row:
                    row["where"] = where_wrong(outs[0], ref)
            row["error"] = max(errors)
            row["tolerance"] = TEMPLATE.tolerance(problem)
            row["ok"] = row["error"] <= row["tolerance"] and not row.get("race", False)
        except Exception as exc:  # noqa: BLE001  (a failed case is a result)
            row["ok"] = False
            row["exception"] = f"{type(exc).__name__}: {exc}"[:1500]
            row["trace"] = traceback.format_exc(limit=4)[-1500:]
        queue.put(row)
    queue.put(None)
    for problem in warm:
        cfg = fitted(VARIANTS[name], problem, device)
        if cfg is None:
            continue
        try:
            for fn, grid, args, options in TEMPLATE.kernel_launches(problem, cfg) or []:
                fn.warmup(*args, grid=grid, **options)
        except Exception:  # noqa: BLE001  (the timing phase reports it)
            pass


def where_wrong(out: Any, ref: Any) -> dict[str, Any]:
    """Where a failing output differs from the reference: o and lse errors apart, NaN
    counts, and the (batch, head, row) of the first wrong rows (to tell a tail, a diagonal
    or a consumer's half of the tile from a wholesale error)."""
    from templates.attention_reference import lse_error

    (o, lse), (o_ref, lse_ref) = out, ref
    o64, r64 = o.double(), o_ref.to(o.device).double()
    row_err = (o64 - r64).abs().amax(-1) / r64.abs().amax(-1).clamp_min(1e-6)
    bad = (row_err > 0.05) | ~torch.isfinite(row_err)
    idx = bad.nonzero()[:8].tolist()
    rows_bad = bad.any(0).any(0).nonzero().flatten()
    return {"o_error": relative_error(o, o_ref), "lse_error": lse_error(lse, lse_ref),
            "o_nan": int(torch.isnan(o).sum()), "lse_nan": int(torch.isnan(lse).sum()),
            "bad_rows": int(bad.sum()), "rows": int(bad.numel()), "first_bad": idx,
            "bad_row_min": int(rows_bad.min()) if rows_bad.numel() else None,
            "bad_row_max": int(rows_bad.max()) if rows_bad.numel() else None,
            "bad_rows_mod128": sorted({int(r) % 128 for r in rows_bad[:4096]})[:16]}


def run_checks(names: list[str], timeout_s: float, warm: list[Problem]
               ) -> dict[str, list[dict[str, Any]]]:
    """Each variant in a child process (in parallel), killed after ``timeout_s``."""
    ctx = mp.get_context("spawn")
    queues = {n: ctx.Queue() for n in names}
    procs = {n: ctx.Process(target=check_variant, args=(n, queues[n], warm)) for n in names}
    for p in procs.values():
        p.start()
    results: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    done: set[str] = set()
    deadline = time.monotonic() + timeout_s
    while len(done) < len(names) and time.monotonic() < deadline:
        for n in names:
            if n in done:
                continue
            try:
                while True:
                    row = queues[n].get(timeout=0.2)
                    if row is None:
                        done.add(n)
                        break
                    results[n].append(row)
                    status = ("skip" if "skipped" in row else
                              "ok" if row["ok"] else "FAIL")
                    print(f"{stamp()} check {n:7s} {row['problem']:48s} {status:4s} "
                          f"err={row.get('error', float('nan')):.2e} "
                          f"{'RACE ' if row.get('race') else ''}"
                          f"{row.get('exception', '')[:300]} {row.get('where', '')}",
                          flush=True)
            except Exception:  # noqa: BLE001  (queue.Empty)
                pass
    for n in names:  # what arrived just before the deadline
        try:
            while n not in done:
                row = queues[n].get(timeout=0.5)
                if row is None:
                    done.add(n)
                else:
                    results[n].append(row)
        except Exception:  # noqa: BLE001  (queue.Empty)
            pass
    for n, p in procs.items():
        if n not in done and len(results[n]) == len(CHECKS):
            done.add(n)  # every case reported; only the end marker was late
        if p.is_alive() and n not in done:
            p.kill()
            results[n].append({"variant": n, "ok": False,
                               "exception": f"timed out after {timeout_s:.0f} s (hang?)"})
            print(f"check {n:7s} TIMED OUT (killed)", flush=True)
        if p.is_alive():
            p.join(max(1.0, deadline + 60 - time.monotonic()))  # let it finish warming
        if p.is_alive():
            p.kill()
        p.join(5)
    return results


# ----------------------------------------------------------------------------- timing
def protocol_problems(head_dims: list[int], seqlens: tuple[int, ...] = (4096, 16384)
                      ) -> list[Problem]:
    out = []
    for d in head_dims:
        for causal in ("none", "top_left"):
            for n in seqlens:
                out.append(Problem(TOKENS // n, HIDDEN // d, HIDDEN // d, n, n, d, "bfloat16",
                                   causal))
    return out


def reference_fp32(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool
                   ) -> torch.Tensor:
    """softmax(q k^T / sqrt(D)) v in fp32: SDPA's memory-efficient kernel, or by query
    chunks where it refuses the shape."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qf, kf, vf = q.float(), k.float(), v.float()
    try:
        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
            return F.scaled_dot_product_attention(qf, kf, vf, is_causal=causal)
    except RuntimeError:
        pass
    out = torch.empty_like(qf)
    n_kv = k.shape[2]
    for start in range(0, q.shape[2], 512):
        s = qf[:, :, start:start + 512] @ kf.transpose(-1, -2) / math.sqrt(q.shape[3])
        if causal:
            rows = torch.arange(start, start + s.shape[2], device=q.device)[:, None]
            s = s.masked_fill(torch.arange(n_kv, device=q.device)[None, :] > rows,
                              float("-inf"))
        out[:, :, start:start + 512] = torch.softmax(s, dim=-1) @ vf
    return out


def bench_ms(fn: Any) -> float:
    import triton

    return float(triton.testing.do_bench(fn, warmup=WARMUP_MS, rep=REP_MS,
                                         return_mode="median"))


def time_problem(problem: Problem, names: list[str], device: Any,
                 diag_names: tuple[str, ...] | list[str] = (), rounds: int = 1
                 ) -> list[dict[str, Any]]:
    """Every candidate on one problem: its output checked against the fp32 reference, then
    ``rounds`` readings each, taken in rotation (so slow drifts of the GPU touch every
    candidate alike); a row's time is the median of its readings."""
    import statistics

    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from templates.flash.fwd import TEMPLATE as TRITON_FWD

    causal = problem.causal != "none"
    inputs = TEMPLATE.make_inputs(problem, "cuda", seed=0)
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    ref = reference_fp32(q, k, v, causal)
    flops = TEMPLATE.flops(problem)
    rows: list[dict[str, Any]] = []
    timed: list[tuple[dict[str, Any], Any]] = []

    def check(what: str, fn: Any, config: str = "") -> None:
        row: dict[str, Any] = {"problem": problem.key(), "what": what, "config": config,
                               "readings_ms": []}
        try:
            out = fn()
            o = out[0] if isinstance(out, tuple) else out
            torch.cuda.synchronize()
            row["error"] = relative_error(o, ref)
            if not row["error"] <= TOLERANCE["bfloat16"]:
                row["failed"] = f"error {row['error']:.2e} vs fp32 SDPA"
            else:
                timed.append((row, fn))
        except Exception as exc:  # noqa: BLE001
            row["failed"] = f"{type(exc).__name__}: {exc}"[:500]
        rows.append(row)

    for what, backend in (("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION),
                          ("sdpa-fa2", SDPBackend.FLASH_ATTENTION)):
        def sdpa(backend: Any = backend) -> torch.Tensor:
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        check(what, sdpa)
    triton_cfg = TRITON_FWD.default_config(problem, device)
    check("triton-fwd", lambda: TRITON_FWD.run(inputs, triton_cfg), triton_cfg.key())
    for name in names:
        cfg = fitted(VARIANTS[name], problem, device)
        if cfg is None:
            continue
        check(f"gluon-{name}", lambda cfg=cfg: TEMPLATE.run(inputs, cfg), cfg.key())
    for _ in range(rounds):
        for row, fn in timed:
            try:
                row["readings_ms"].append(bench_ms(fn))
            except Exception as exc:  # noqa: BLE001
                row["failed"] = f"{type(exc).__name__}: {exc}"[:500]
    for row in rows:
        if row["readings_ms"] and "failed" not in row:
            row["ms"] = statistics.median(row["readings_ms"])
            row["tflops"] = flops / row["ms"] / 1e9
            row["tflops_readings"] = [round(flops / ms / 1e9, 1) for ms in row["readings_ms"]]
        print(f"{stamp()} time {problem.key():50s} {row['what']:14s} "
              f"{row.get('tflops', float('nan')):7.1f} TFLOP/s "
              f"{row.get('tflops_readings', '')} {row.get('failed', '')[:160]}", flush=True)
    # Diagnostics (wrong results by design, never checked nor reported as speed): the same
    # kernel without the exponentials (diag1) or without the softmax (diag2), to see what
    # the softmax costs beside the GEMMs.
    from templates.gluon import fwd_kernel as gluon_fwd_kernel

    for name in diag_names:
        cfg = fitted(VARIANTS[name], problem, device)
        if cfg is None:
            continue
        for diag in (1, 2):
            plan = gluon_fwd_kernel.LaunchPlan(q, k, causal_mode=problem.causal,
                                               scale=inputs["scale"], config=cfg.to_dict(),
                                               diag=diag)
            row = {"problem": problem.key(), "what": f"diag{diag}-{name}", "config": cfg.key(),
                   "diagnostic": True}
            try:
                plan(q, k, v)
                torch.cuda.synchronize()
                row["ms"] = bench_ms(lambda plan=plan: plan(q, k, v))
                row["tflops"] = flops / row["ms"] / 1e9
            except Exception as exc:  # noqa: BLE001
                row["failed"] = f"{type(exc).__name__}: {exc}"[:300]
            rows.append(row)
            print(f"{stamp()} time {problem.key():50s} {row['what']:16s} "
                  f"{row.get('tflops', float('nan')):7.1f} TFLOP/s (diagnostic) "
                  f"{row.get('failed', '')[:160]}", flush=True)
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    problems = list(dict.fromkeys(r["problem"] for r in rows))
    whats = list(dict.fromkeys(r["what"] for r in rows))
    print("\nTFLOP/s (x cuDNN), bf16 forward")
    print(f"{'problem':44s} " + " ".join(f"{w[:13]:>14s}" for w in whats))
    for p in problems:
        by = {r["what"]: r for r in rows if r["problem"] == p}
        cudnn = by.get("sdpa-cudnn", {}).get("tflops")
        cells = []
        for w in whats:
            t = by.get(w, {}).get("tflops")
            if t is None:
                cells.append(f"{'-':>14s}")
            elif cudnn:
                cells.append(f"{t:7.0f} ({t / cudnn:.2f})")
            else:
                cells.append(f"{t:14.0f}")
        print(f"{p[:44]:44s} " + " ".join(cells))


# ----------------------------------------------------------------------------- offline
def compile_only(names: list[str]) -> list[dict[str, Any]]:
    from templates.compile.offline_target import offline_target
    from templates.compile.report import compile_config

    rows = []
    with offline_target("h100") as device:
        for problem in protocol_problems([64, 128, 256]):
            if problem.seqlen_q != 4096:
                continue
            for name in names:
                cfg = fitted(VARIANTS[name], problem, device)
                if cfg is None:
                    continue
                out = compile_config(TEMPLATE, problem, cfg)
                k = out.kernels[0] if out.kernels else None
                row: dict[str, Any] = {"problem": problem.key(), "variant": name,
                                       "config": cfg.key(),
                       "registers": k and k.registers, "stack_bytes": k and k.stack_bytes,
                       "shared_bytes": k and k.shared_bytes, "error": out.error[:300]}
                rows.append(row)
                print(f"{problem.key():48s} {name:7s} regs={row['registers']} "
                      f"stack={row['stack_bytes']} smem={row['shared_bytes']} "
                      f"{row['error'][:120]}", flush=True)
    return rows


def environment() -> dict[str, Any]:
    import triton

    env: dict[str, Any] = {"date": datetime.datetime.now(datetime.UTC).isoformat(),
                           "argv": sys.argv, "torch": torch.__version__,
                           "triton": triton.__version__}
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
        env["cuda"] = torch.version.cuda
        try:
            import subprocess

            env["driver"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, check=False).stdout.strip()
        except OSError:
            pass
    return env


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--time", action="store_true")
    parser.add_argument("--compile-only", action="store_true")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--head-dims", default="128,64,256")
    parser.add_argument("--seqlens", default="4096,16384",
                        help="N of the timed problems (PROTOCOL.md: B = 16k / N, H = 2048 / D)")
    parser.add_argument("--json", default=os.environ.get("OUT", ""),
                        help="folder for gluon_fwd_bench.json (default $OUT)")
    parser.add_argument("--budget-s", type=float, default=300.0,
                        help="stop starting timings after this many seconds")
    parser.add_argument("--check-timeout-s", type=float, default=150.0)
    parser.add_argument("--rounds", type=int, default=1,
                        help="readings per candidate and problem (median reported)")
    parser.add_argument("--diag", default="",
                        help="variants to time without exp / without softmax (dense D=128)")
    args = parser.parse_args()
    start = time.monotonic()
    names = [n for n in args.variants.split(",") if n]
    seqlens = tuple(int(n) for n in args.seqlens.split(",") if n)
    unknown = sorted(set(names) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variants {unknown}; known: {sorted(VARIANTS)}")
    report: dict[str, Any] = {"environment": environment(), "variants": VARIANTS}
    out_file = Path(args.json) / "gluon_fwd_bench.json" if args.json else None

    def save() -> None:
        if out_file is not None:
            out_file.parent.mkdir(parents=True, exist_ok=True)
            out_file.write_text(json.dumps(report, indent=1, default=str))

    if args.compile_only:
        report["compile"] = compile_only(names)
        save()
        return 0
    print(json.dumps(report["environment"]), flush=True)
    passed = names
    if args.check:
        warm = protocol_problems([int(d) for d in args.head_dims.split(",")], seqlens) \
            if args.time else []
        checks = run_checks(names, args.check_timeout_s, warm)
        report["checks"] = checks
        save()
        passed = [n for n in names
                  if checks[n] and all(r.get("ok") or "skipped" in r for r in checks[n])]
        print(f"{stamp()} variants passing every check: {passed}", flush=True)
    if args.time:
        from templates.device import current_device

        device = current_device()
        rows: list[dict[str, Any]] = []
        report["timings"] = rows
        head_dims = [int(d) for d in args.head_dims.split(",")]
        for problem in protocol_problems(head_dims, seqlens):
            if time.monotonic() - start > args.budget_s:
                print(f"budget of {args.budget_s:.0f} s spent: {problem.key()} and later "
                      "not timed", flush=True)
                break
            diag = ([n for n in args.diag.split(",") if n] if problem.head_dim == 128
                    and problem.causal == "none" else [])
            rows.extend(time_problem(problem, passed, device, diag, args.rounds))
            save()
        print_table(rows)
    save()
    if args.check:
        bad = {n: [r.get("problem") for r in report["checks"][n] if not r.get("ok")
                   and "skipped" not in r] for n in names}
        print("\nchecks:", {n: ("ok" if not v else f"FAIL {v}") for n, v in bad.items()})
        return 1 if any(bad.values()) else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
