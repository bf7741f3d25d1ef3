"""Where the Gluon backward goes wrong: per query-tile / key-tile error of dq, dk, dv for a
few small problems and configs. GPU only.

One child process per (config, debug variant) runs every case in order of increasing risk
(the main kernel is compiled once per distinct problem shape class, not once per case), so
an illegal address loses only the rest of that config; the parent prints which case was
running when the child died. A total wall-clock budget bounds the whole run.

    python benchmarks/gluon_bwd_diag.py [--configs s3,n64] [--debug 0,4] [--budget-s 110]

``--debug`` takes values of ``GLUON_BWD_DEBUG`` (see templates/gluon/bwd_kernel.py:
2 conservative waits/barriers, 4 no dQ GEMM). Two-stage rings are out of the config space
(wrong on the H100); to chase that bug, relax ``GluonBwdConfig.stages``' choices locally.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time
import traceback

CONFIGS = {
    "s3": dict(BLOCK_M=64, BLOCK_N=128, stages=3, consumers=2),
    "n64": dict(BLOCK_M=64, BLOCK_N=64, stages=3, consumers=1),
    "n64s4": dict(BLOCK_M=64, BLOCK_N=64, stages=4, consumers=1),
}
# Increasing risk: what ran correctly on the first GPU check first, crashes last.
CASES = [
    (1, 2, 2, 1, 1, 64, "float16", "none"),
    (1, 1, 1, 256, 256, 128, "float16", "top_left"),
    (1, 1, 1, 128, 128, 128, "float16", "none"),
    (1, 1, 1, 256, 256, 128, "float16", "none"),
    (1, 1, 1, 333, 333, 128, "float16", "none"),
    (1, 1, 1, 384, 384, 128, "float16", "none"),
    (1, 2, 2, 384, 384, 128, "float16", "none"),
    (1, 1, 1, 320, 384, 128, "float16", "none"),
    (1, 1, 1, 384, 333, 128, "float16", "none"),
    (1, 1, 1, 256, 256, 64, "float16", "top_left"),
    (1, 1, 1, 256, 256, 64, "float16", "none"),
    (1, 3, 1, 300, 1100, 64, "float16", "bottom_right"),
]
# Longer walks (--long): more steps per program than the ring has stages many times over.
LONG_CASES = [
    (1, 1, 1, 1024, 1024, 128, "float16", "none"),
    (1, 1, 1, 2048, 2048, 128, "bfloat16", "none"),
    (1, 1, 1, 2048, 2048, 128, "bfloat16", "top_left"),
    (2, 8, 8, 2048, 2048, 128, "float16", "top_left"),
    (1, 2, 2, 4096, 4096, 64, "bfloat16", "none"),
    (1, 2, 2, 8192, 8192, 128, "bfloat16", "none"),
]


def _child(name: str, debug: int, cases: list, q) -> None:
    os.environ["GLUON_BWD_DEBUG"] = str(debug)
    import torch

    from templates.base import Problem
    from templates.gluon.bwd import TEMPLATE, GluonBwdConfig
    cfg = GluonBwdConfig(**CONFIGS[name])
    for case in cases:
        q.put(("start", case))
        try:
            problem = Problem(*case)
            inputs = TEMPLATE.make_inputs(problem, "cuda", seed=1)
            ref = TEMPLATE.reference(inputs)
            out = TEMPLATE.run(inputs, cfg)
            torch.cuda.synchronize()
            lines = []
            for label, o, r, tile in zip(("dq", "dk", "dv"), out, ref, (64, 128, 128),
                                         strict=True):
                err = (o.float() - r.float()).abs()  # (B, H, N, D)
                n = err.shape[2]
                per = [f"{err[:, :, i:i + tile].max().item():.2g}" for i in range(0, n, tile)]
                lines.append(f"{label}: max {err.max().item():.3g} (ref "
                             f"{r.float().abs().max().item():.2g}) per {tile} {per}"
                             f"{' NaN' if torch.isnan(o).any().item() else ''}")
            q.put(("done", f"{problem.key()} {name} dbg{debug}: " + " | ".join(lines)))
        except Exception:
            q.put(("done", f"{case} {name} dbg{debug}: ERROR "
                           f"{traceback.format_exc().splitlines()[-1]}"))
            if "illegal" in traceback.format_exc() or "CUDA error" in traceback.format_exc():
                return  # the context is gone: the parent reports the rest as not run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--debug", default="0", help="comma-separated GLUON_BWD_DEBUG values")
    parser.add_argument("--budget-s", type=float, default=110.0)
    parser.add_argument("--long", action="store_true", help="the longer walks instead")
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    deadline = time.monotonic() + args.budget_s
    for debug in [int(x) for x in args.debug.split(",")]:
        for name in args.configs.split(","):
            left = deadline - time.monotonic()
            if left < 5:
                print(f"{name} dbg{debug}: SKIPPED (budget spent)", flush=True)
                continue
            q = ctx.Queue()
            cases = LONG_CASES if args.long else CASES
            p = ctx.Process(target=_child, args=(name, debug, cases, q))
            p.start()
            running = None
            done = 0
            while True:
                try:
                    kind, payload = q.get(timeout=min(1.0, max(0.1, deadline - time.monotonic())))
                    if kind == "start":
                        running = payload
                    else:
                        print(payload, flush=True)
                        running = None
                        done += 1
                    continue
                except Exception:  # noqa: BLE001 - queue.Empty
                    pass
                if not p.is_alive() and q.empty():
                    break
                if time.monotonic() > deadline:
                    p.kill()
                    print(f"{name} dbg{debug}: budget spent while running {running}", flush=True)
                    break
            p.join(5)
            if running is not None:
                print(f"{running} {name} dbg{debug}: CRASH (child exit {p.exitcode}) while "
                      f"running this case", flush=True)
            if done + (running is not None) < len(cases):
                print(f"{name} dbg{debug}: {len(cases) - done - (running is not None)} later "
                      f"case(s) not run", flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("CUDA_LAUNCH_BLOCKING", "1")
    sys.exit(main())
