"""What each piece of the Gluon backward costs on one Hopper GPU: the kernel timed with pieces
switched off (``GLUON_BWD_DEBUG``, templates/gluon/bwd_kernel.py), beside cuDNN's backward.

    python benchmarks/gluon_bwd_price.py [--json PATH] [--debug 0,4,16,20,8] [--config JSON]

A diagnostic, not a benchmark of anything a user runs: with a piece off the gradients are
wrong by design (4: no dQ GEMM, its tile's atomics still run; 16: no dQ atomics, the GEMM and
the staging still run; 20: neither; 8: no exponentials; 12: no dQ GEMM, no exponentials), so
only ``--debug 0`` is checked against cuDNN's gradients.
bf16, 16k tokens per batch, H = 2048 / D (docs/PROTOCOL.md's shapes); median of 5 readings
of 10 runs (CUDA events, gluon_bwd_bench's timer) after 3 warm runs each; TFLOP/s count the backward's 2.5x forward FLOPs
(halved for causal) whatever is switched off, so they read as time ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.gluon_bwd_bench import event_ms  # noqa: E402
from templates.base import Problem, relative_error  # noqa: E402

SHAPES = [(1, 16, 16384, 128, "none"), (1, 16, 16384, 128, "top_left"),
          (1, 32, 16384, 64, "none")]
TOLERANCE = 2e-2


def median_ms(fn: Any, readings: int = 5) -> float:
    """The median of ``readings`` of gluon_bwd_bench's event timing (3 warm runs, 10 timed)."""
    return statistics.median(event_ms(fn) for _ in range(readings))


def main() -> int:
    from templates.flash.bwd import TEMPLATE as FLASH_BWD
    from templates.gluon import bwd_kernel as gluon_bwd_kernel
    from templates.gluon.bwd import GluonBwdConfig, gluon_attention_bwd

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default="")
    parser.add_argument("--debug", default="0,4,8,12")
    parser.add_argument("--config", default="{}",
                        help="GluonBwdConfig fields as JSON, e.g. '{\"ds_smem\": true}'")
    args = parser.parse_args()
    debugs = [int(d) for d in args.debug.split(",")]
    rows: list[dict[str, Any]] = []
    for batch, heads, n, d, causal in SHAPES:
        problem = Problem(batch, heads, heads, n, n, d, "bfloat16", causal)
        inputs = FLASH_BWD.make_inputs(problem, "cuda")
        q, k, v, do = (inputs[x] for x in ("q", "k", "v", "do"))
        o, lse = inputs["o"], inputs["lse"]
        flops = FLASH_BWD.flops(problem)
        qr, kr, vr = (t.detach().requires_grad_() for t in (q, k, v))
        from torch.nn.attention import SDPBackend, sdpa_kernel
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            out = torch.nn.functional.scaled_dot_product_attention(
                qr, kr, vr, is_causal=causal != "none")
            ref = torch.autograd.grad(out, (qr, kr, vr), do, retain_graph=True)
            cudnn_ms = median_ms(partial(torch.autograd.grad, out, (qr, kr, vr), do,
                                        retain_graph=True))
        row: dict[str, Any] = {"problem": problem.key(), "config": args.config,
                               "cudnn_ms": cudnn_ms,
                               "cudnn_tflops": flops / cudnn_ms / 1e9}
        cfg = GluonBwdConfig(**json.loads(args.config))
        for debug in debugs:
            os.environ["GLUON_BWD_DEBUG"] = str(debug)  # read when the launch is planned
            run = partial(gluon_attention_bwd, do, q, k, v, o, lse, causal=causal, config=cfg)
            grads = run()
            if debug == 0:
                errors = [relative_error(g, r) for g, r in zip(grads, ref, strict=True)]
                if max(errors) > TOLERANCE or any(g.abs().max() == 0 for g in grads):
                    row["debug0_failed"] = errors
                    continue
            ms = median_ms(run)
            row[f"debug{debug}_ms"] = ms
            row[f"debug{debug}_x_cudnn"] = cudnn_ms / ms
        os.environ.pop("GLUON_BWD_DEBUG", None)
        print(json.dumps(row), flush=True)
        rows.append(row)
    if args.json:
        Path(args.json).write_text(json.dumps({
            "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": __import__("triton").__version__, "rows": rows}, indent=1))
    del gluon_bwd_kernel
    return 0


if __name__ == "__main__":
    sys.exit(main())
