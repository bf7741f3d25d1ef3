"""One cuDNN backward and one Gluon backward inside a profiler range, for Nsight Compute.

    ncu --profile-from-start off --set full --clock-control none --import-source yes \
        -o bwd python benchmarks/gluon_bwd_profile.py [--causal top_left] [--head-dim 128] \
        [--config '{"warp_specialize": true}']
    ncu -i bwd.ncu-rep --page details                      # both kernels' sections
    ncu -i bwd.ncu-rep --page source --csv --print-source sass -k regex:gluon_bwd_ws

A diagnostic, not a benchmark: the two backwards (cuDNN's through torch's SDPA, ours through
``gluon_attention_bwd``) run three times each to compile and warm up, then once each between
``cudaProfilerStart`` and ``cudaProfilerStop``, so ``--profile-from-start off`` profiles
exactly those launches (cuDNN's dO.O preprocess, main and dQ conversion kernels; our
preprocess, main kernel and dq cast). bf16, 16k tokens, H = 2048 / D (docs/PROTOCOL.md's
shapes). The gradients are checked against cuDNN's before the profiled run.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from templates.base import Problem, relative_error  # noqa: E402

TOLERANCE = 2e-2
WARM_RUNS = 3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--causal", default="none", choices=("none", "top_left", "bottom_right"))
    parser.add_argument("--head-dim", type=int, default=128, choices=(64, 128))
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--config", default='{"warp_specialize": true}',
                        help="GluonBwdConfig fields as JSON")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gluon_bwd_profile.py needs a CUDA GPU (Hopper) and ncu around it",
              file=sys.stderr)
        return 2
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from templates.flash.bwd import TEMPLATE as FLASH_BWD
    from templates.gluon.bwd import GluonBwdConfig, gluon_attention_bwd

    heads = 2048 // args.head_dim
    problem = Problem(1, heads, heads, args.tokens, args.tokens, args.head_dim, "bfloat16",
                      args.causal)
    inputs = FLASH_BWD.make_inputs(problem, "cuda")
    q, k, v, do, o, lse = (inputs[x] for x in ("q", "k", "v", "do", "o", "lse"))
    qr, kr, vr = (t.detach().requires_grad_() for t in (q, k, v))
    config = GluonBwdConfig(**json.loads(args.config))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        out = torch.nn.functional.scaled_dot_product_attention(
            qr, kr, vr, is_causal=args.causal != "none")

        def cudnn() -> tuple[torch.Tensor, ...]:
            return torch.autograd.grad(out, (qr, kr, vr), do, retain_graph=True)

        def ours() -> tuple[torch.Tensor, ...]:
            return gluon_attention_bwd(do, q, k, v, o, lse, causal=args.causal, config=config)

        for _ in range(WARM_RUNS):
            ref, got = cudnn(), ours()
        errors = [relative_error(g, r) for g, r in zip(got, ref, strict=True)]
        if max(errors) > TOLERANCE:
            print(f"{problem.key()} {config.key()}: gradients off cuDNN's by {errors} "
                  f"(tolerance {TOLERANCE}): not profiled", file=sys.stderr)
            return 1
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        cudnn()
        ours()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
    print(f"profiled {problem.key()} {config.key()} (relative errors {errors})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
