"""Where the Gluon backward goes wrong: per query-tile / key-tile error of dq, dk, dv for a
few small problems and configs (one process per case, so an illegal address is reported per
case). GPU only.

    python benchmarks/gluon_bwd_diag.py
"""
from __future__ import annotations

import multiprocessing as mp
import os
import sys
import traceback

CONFIGS = {
    "s2": dict(BLOCK_M=64, BLOCK_N=128, stages=2, consumers=2),
    "s3": dict(BLOCK_M=64, BLOCK_N=128, stages=3, consumers=2),
    "n64": dict(BLOCK_M=64, BLOCK_N=64, stages=2, consumers=1),
    "n64s3": dict(BLOCK_M=64, BLOCK_N=64, stages=3, consumers=1),
}
CASES = [
    (1, 1, 1, 128, 128, 128, "float16", "none"),
    (1, 1, 1, 256, 256, 128, "float16", "none"),
    (1, 1, 1, 384, 384, 128, "float16", "none"),
    (1, 2, 2, 384, 384, 128, "float16", "none"),
    (1, 1, 1, 333, 333, 128, "float16", "none"),
    (1, 1, 1, 320, 384, 128, "float16", "none"),
    (1, 1, 1, 384, 333, 128, "float16", "none"),
    (1, 1, 1, 256, 256, 64, "float16", "none"),
    (1, 1, 1, 256, 256, 128, "float16", "top_left"),
    (1, 3, 1, 300, 1100, 64, "float16", "bottom_right"),
]


def one(case, name, q):
    try:
        import torch

        from templates.base import Problem
        from templates.gluon_bwd import TEMPLATE, GluonBwdConfig
        problem = Problem(*case)
        cfg = GluonBwdConfig(**CONFIGS[name])
        why = TEMPLATE.constraint(problem, cfg, None) if False else None
        inputs = TEMPLATE.make_inputs(problem, "cuda", seed=1)
        ref = TEMPLATE.reference(inputs)
        out = TEMPLATE.run(inputs, cfg)
        torch.cuda.synchronize()
        lines = []
        for label, o, r, tile in zip(("dq", "dk", "dv"), out, ref, (64, 128, 128)):
            err = (o.float() - r.float()).abs()  # (B, H, N, D)
            n = err.shape[2]
            per = [f"{err[:, :, i:i + tile].max().item():.2g}" for i in range(0, n, tile)]
            per_head = [f"{err[:, h].max().item():.2g}" for h in range(err.shape[1])]
            lines.append(f"{label}: max {err.max().item():.3g} ref max "
                         f"{r.float().abs().max().item():.3g}; per {tile}-row tile {per}; "
                         f"per head {per_head}; nan {torch.isnan(o).any().item()}")
        q.put(f"{problem.key()} {name}: " + " | ".join(lines))
    except Exception:
        q.put(f"{case} {name}: CRASH {traceback.format_exc().splitlines()[-1]}")


def main() -> int:
    ctx = mp.get_context("spawn")
    only = sys.argv[1:] or list(CONFIGS)
    for case in CASES:
        for name in only:
            q = ctx.Queue()
            p = ctx.Process(target=one, args=(case, name, q))
            p.start()
            p.join(90)
            if p.is_alive():
                p.kill()
                print(case, name, "TIMEOUT (hang)", flush=True)
                continue
            print(q.get() if not q.empty() else f"{case} {name}: no result (exit {p.exitcode})",
                  flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("CUDA_LAUNCH_BLOCKING", "1")
    sys.exit(main())
