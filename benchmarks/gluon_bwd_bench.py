"""The Gluon backward (templates.gluon.bwd) on one Hopper GPU: numerics, then speed.

    python3 benchmarks/gluon_bwd_bench.py --check [--time] [--json PATH] [--budget-s 220]
        [--variants default,ws,ws_dq2] [--head-dims 128,64]

``--check`` runs every variant (a named config) on odd shapes: bf16 and fp16, GQA/MQA, N = 1,
N not a multiple of the tiles, N_q != N_kv, causal top-left and bottom-right (rows that see
no key included), D 64/128; each variant in a child process with a timeout (a barrier bug
hangs one variant, not the run). dk/dv are poisoned with NaN first; dq, dk, dv are compared
with the float64/float32 autograd reference (flash_bwd's), max errors printed.

Variants: ``templates/gluon/bwd_variants.py``'s ``VARIANTS`` (the named configs the GPU tests
check, on that module's ``CASES``): ``default``, ``eager_dq``, the warp-specialized kernel
``ws`` with one dQ staging tile or two (``_dq2``; d64 only), ``ws_det`` (dQ added in KV-tile
order, ``deterministic``; ``--check`` runs it twice per case and requires dq bitwise equal,
``dq_bitwise_repeat`` in the row), ``ws_dqe`` (``dq_early``), ``ws_split``
(``split_warpgroups``), ``ws_split_pers`` (that on a persistent grid), ``ws_m128`` /
``ws_m128_dqe`` (128-query steps, d64), and those of one staging tile with ``_dqt``
(``dq_transposed``: the tile D-major); ``ws_d256`` / ``ws_d256_row`` / ``ws_d256_atomic`` (the d256
kernel: dQ staging D-major / row-major with a ring of one, or dQ by atomics with a ring of
two; checked on the module's ``D256_CASES``, timed with
``--head-dims 256``);
a variant whose config a problem refuses is skipped there. With ``--check`` only the variants right on every case are timed.

``--time``: bf16, 16k tokens per batch, H = 2048 / D, N 4k and 16k, dense and causal
(``--head-dims`` picks the head dims; ``--gqa G``: H / G KV heads, SDPA with enable_gqa);
backward-only and forward+backward TFLOP/s (FLOPs: 2.5x / 3.5x the forward's 4 B H N^2 D,
halved for causal) of torch SDPA's cuDNN and FLASH_ATTENTION backends, the project's Triton
flash_fwd + flash_bwd (defaults) and each gluon variant (gluon_fwd default + gluon_bwd);
median of ``--rounds`` readings taken in rotation, reversed every other round (each a
``do_bench`` median: PROTOCOL's timing, L2 flushed between launches). Every timed gradient is
checked against cuDNN's (relative error, never all zeros) before its time counts.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from templates.base import Problem, relative_error  # noqa: E402
from templates.gluon.bwd_variants import VARIANTS, cases_of  # noqa: E402


def config_for(name: str, problem: Problem) -> Any:
    from templates.device import current_device
    from templates.gluon.bwd import TEMPLATE, GluonBwdConfig

    device = current_device()
    data = VARIANTS[name]
    if data is None:
        try:
            cfg = TEMPLATE.default_config(problem, device)
        except RuntimeError:  # nothing fits
            return None
    else:
        cfg = GluonBwdConfig(**data)
    return None if TEMPLATE.constraint(problem, cfg, device) else cfg


def check_variant(name: str, queue: Any) -> None:
    """Child process: every case, one line per case onto ``queue``."""
    try:
        from templates.gluon import bwd_kernel as gluon_bwd_kernel
        from templates.gluon.bwd import TEMPLATE

        gluon_bwd_kernel.DEBUG_POISON = True
        for case in cases_of(name):
            problem = Problem(*case)
            cfg = config_for(name, problem)
            if cfg is None:
                queue.put({"variant": name, "case": problem.key(), "skipped": True})
                continue
            inputs = TEMPLATE.make_inputs(problem, "cuda", seed=3)
            ref = TEMPLATE.reference(inputs)
            out = TEMPLATE.run(inputs, cfg)
            torch.cuda.synchronize()
            err = TEMPLATE.error(out, ref)
            row = {"variant": name, "case": problem.key(), "config": cfg.key(), "error": err,
                   "ok": bool(err <= TEMPLATE.tolerance(problem)),
                   "nan": any(bool(torch.isnan(g).any()) for g in out)}
            for label, g, r in zip(("dq", "dk", "dv"), out, ref, strict=True):
                row[f"max_abs_{label}"] = float((g.double() - r.double()).abs().max())
            row["ok"] = row["ok"] and not row["nan"]
            if cfg.deterministic:
                # The point of the variant: a second run on the same inputs gives the same dq
                # bit for bit (dk and dv always do).
                again = TEMPLATE.run(inputs, cfg)
                torch.cuda.synchronize()
                row["dq_bitwise_repeat"] = bool(torch.equal(out[0], again[0]))
                row["ok"] = row["ok"] and row["dq_bitwise_repeat"]
            queue.put(row)
    except Exception:  # noqa: BLE001  (report it, the parent goes on)
        queue.put({"variant": name, "crash": traceback.format_exc()[-1500:]})
    queue.put(None)


def run_checks(names: list[str], timeout_s: float) -> tuple[list[dict[str, Any]], set[str]]:
    ctx = mp.get_context("spawn")
    rows: list[dict[str, Any]] = []
    passed = set()
    for name in names:
        queue = ctx.Queue()
        proc = ctx.Process(target=check_variant, args=(name, queue))
        proc.start()
        deadline = time.monotonic() + timeout_s
        ok = True
        while True:
            try:
                row = queue.get(timeout=max(1.0, deadline - time.monotonic()))
            except Exception:  # noqa: BLE001  (queue.Empty: a hang)
                rows.append({"variant": name, "timed_out": True})
                print(f"{name}: TIMED OUT after {timeout_s:.0f} s", flush=True)
                ok = False
                break
            if row is None:
                break
            rows.append(row)
            ok = ok and (row.get("ok", False) or row.get("skipped", False))
            print(json.dumps(row), flush=True)
        if proc.is_alive():
            proc.kill()
        proc.join()
        if ok:
            passed.add(name)
    return rows, passed


# ----------------------------------------------------------------------------- timing
def protocol_problems() -> list[Problem]:
    return [Problem(16384 // n, 2048 // d, 2048 // d // GQA[0], n, n, d, "bfloat16", causal)
            for d in HEAD_DIMS for n in (4096, 16384) for causal in ("none", "top_left")]


HEAD_DIMS = [128, 64]  # --head-dims narrows it
GQA = [1]  # --gqa: query heads per KV head


def event_ms(fn: Any) -> float:
    """One reading of ``fn``: PROTOCOL's timing (triton's do_bench: CUDA events, L2 flushed
    between launches, 25 ms of warm-up, the median over 100 ms). The bench's first readings
    (10 launches back to back, about 30 ms) put one kernel up to 7% apart from itself within a
    run (notes/gluon_notes.md)."""
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))


def candidates(problem: Problem, names: list[str]) -> dict[str, dict[str, Any]]:
    """name -> {"bwd": fn() -> (dq, dk, dv), "fwd_bwd": fn() -> same} on shared inputs."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from templates.flash.bwd import flash_attention_bwd
    from templates.flash.fwd import flash_attention_fwd
    from templates.gluon.bwd import gluon_attention_bwd
    from templates.gluon.fwd import gluon_attention_fwd

    causal = problem.causal != "none"
    gen = torch.Generator(device="cuda").manual_seed(0)
    shape = (problem.batch, problem.heads_q, problem.seqlen_q, problem.head_dim)
    kv_shape = (problem.batch, problem.heads_kv, problem.seqlen_kv, problem.head_dim)
    q, k, v, do = (torch.randn(s, generator=gen, device="cuda", dtype=torch.bfloat16)
                   for s in (shape, kv_shape, kv_shape, shape))
    gqa = problem.heads_q != problem.heads_kv
    out: dict[str, dict[str, Any]] = {}

    def sdpa_pair(backend: Any) -> dict[str, Any]:
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        with sdpa_kernel(backend):
            o = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=causal,
                                                                 enable_gqa=gqa)

        def bwd() -> Any:
            return torch.autograd.grad(o, leaves, do, retain_graph=True)

        def fwd_bwd() -> Any:
            with sdpa_kernel(backend):
                o2 = torch.nn.functional.scaled_dot_product_attention(
                    *leaves, is_causal=causal, enable_gqa=gqa)
            return torch.autograd.grad(o2, leaves, do)

        return {"bwd": bwd, "fwd_bwd": fwd_bwd}

    out["cudnn"] = sdpa_pair(SDPBackend.CUDNN_ATTENTION)
    out["fa2"] = sdpa_pair(SDPBackend.FLASH_ATTENTION)
    o_t, lse_t = flash_attention_fwd(q, k, v, causal=causal)
    out["triton"] = {
        "bwd": lambda: flash_attention_bwd(do, q, k, v, o_t, lse_t, causal=causal),
        "fwd_bwd": lambda: flash_attention_bwd(do, q, k, v,
                                               *flash_attention_fwd(q, k, v, causal=causal),
                                               causal=causal)}
    o_g, lse_g = gluon_attention_fwd(q, k, v, causal=causal)
    for name in names:
        cfg = config_for(name, problem)
        if cfg is None:
            continue
        out[f"gluon-{name}"] = {
            "bwd": lambda cfg=cfg: gluon_attention_bwd(do, q, k, v, o_g, lse_g, causal=causal,
                                                       config=cfg),
            "fwd_bwd": lambda cfg=cfg: gluon_attention_bwd(
                do, q, k, v, *gluon_attention_fwd(q, k, v, causal=causal), causal=causal,
                config=cfg)}
    return out


def time_problem(problem: Problem, names: list[str], rounds: int) -> list[dict[str, Any]]:
    fns = candidates(problem, names)
    ref = [g.float() for g in fns["cudnn"]["bwd"]()]
    flops = 4.0 * problem.batch * problem.heads_q * problem.seqlen_q ** 2 * problem.head_dim
    if problem.causal != "none":
        flops /= 2
    rows = []
    valid: dict[str, float] = {}
    for name, pair in fns.items():
        grads = pair["bwd"]()
        err = max(relative_error(g, r) for g, r in zip(grads, ref, strict=True))
        zero = any(float(g.abs().max()) == 0.0 for g in grads)
        valid[name] = err
        rows.append({"problem": problem.key(), "candidate": name, "error_vs_cudnn": err,
                     "zeros": zero, "ok": bool(err < 3e-2 and not zero)})
    readings: dict[tuple[str, str], list[float]] = {}
    order = list(fns.items())
    for r in range(rounds):
        # Every candidate once per round, the order reversed every other round: a place in
        # the rotation (after which kernel, how warm the GPU) weighs on no candidate alone.
        for name, pair in (order if r % 2 == 0 else order[::-1]):
            for what in ("bwd", "fwd_bwd"):
                readings.setdefault((name, what), []).append(event_ms(pair[what]))
    for row in rows:
        for what, mult in (("bwd", 2.5), ("fwd_bwd", 3.5)):
            ms = statistics.median(readings[(row["candidate"], what)])
            row[f"{what}_ms"] = ms
            row[f"{what}_tflops"] = (mult * flops / (ms * 1e-3) / 1e12) if row["ok"] else None
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    names = list(dict.fromkeys(r["candidate"] for r in rows))
    print("TFLOP/s backward-only / forward+backward (x cuDNN); '-' = failed its check")
    print("| problem | " + " | ".join(names) + " |")
    for key in dict.fromkeys(r["problem"] for r in rows):
        mine = {r["candidate"]: r for r in rows if r["problem"] == key}
        base = mine.get("cudnn", {})
        cells = []
        for n in names:
            r = mine.get(n)
            if r is None or r["bwd_tflops"] is None:
                cells.append("-")
                continue
            rb = r["bwd_tflops"] / base["bwd_tflops"] if base.get("bwd_tflops") else 0
            rf = r["fwd_bwd_tflops"] / base["fwd_bwd_tflops"] if base.get("fwd_bwd_tflops") else 0
            cells.append(f"{r['bwd_tflops']:.0f} / {r['fwd_bwd_tflops']:.0f} "
                         f"({rb:.2f}/{rf:.2f})")
        print(f"| {key} | " + " | ".join(cells) + " |", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--time", action="store_true")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--json", default="", help="write every row here (a file path)")
    parser.add_argument("--budget-s", type=float, default=220.0)
    parser.add_argument("--check-timeout-s", type=float, default=90.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--head-dims", default="128,64",
                        help="head dims --time runs, in this order (comma-separated)")
    parser.add_argument("--gqa", type=int, default=1,
                        help="--time's query heads per KV head (1: the protocol's MHA rows)")
    args = parser.parse_args()
    HEAD_DIMS[:] = [int(d) for d in args.head_dims.split(",") if d]
    GQA[:] = [args.gqa]
    start = time.monotonic()
    names = [n for n in args.variants.split(",") if n]
    result: dict[str, Any] = {"torch": torch.__version__,
                              "device": torch.cuda.get_device_name() if torch.cuda.is_available()
                              else "none"}
    try:
        import triton

        result["triton"] = triton.__version__
    except ImportError:
        pass

    def save() -> None:
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1))

    if args.check:
        rows, passed = run_checks(names, args.check_timeout_s)
        result["check"] = rows
        save()
        print(f"passed every case: {sorted(passed)}", flush=True)
        names = [n for n in names if n in passed]
    if args.time:
        timed: list[dict[str, Any]] = []
        for problem in protocol_problems():
            if time.monotonic() - start > args.budget_s:
                print(f"budget spent: {problem.key()} and later not timed", flush=True)
                break
            try:
                timed.extend(time_problem(problem, names, args.rounds))
            except Exception:  # noqa: BLE001  (one problem's failure does not end the run)
                print(f"{problem.key()}: {traceback.format_exc()[-800:]}", flush=True)
            result["time"] = timed
            save()
        print_table(timed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
