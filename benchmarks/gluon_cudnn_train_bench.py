"""A training step's attention with our Gluon forward and cuDNN's backward, against torch SDPA's
cuDNN forward + backward (what a model's SDPA call runs on an H100).

The backward recomputes P from the forward's o and logsumexp, so any exact forward can feed
it: ``aten._scaled_dot_product_cudnn_attention_backward`` takes ours (its logsumexp
(B, H, N, 1) float32, natural log), as torch's own ring attention feeds it merged ones.

    python3 benchmarks/gluon_cudnn_train_bench.py [--check] [--time] [--json PATH]
        [--rounds 6] [--budget-s 300]

``--check``: odd shapes (bf16 and fp16, GQA, N_q != N_kv, causal top-left, D 64/128/256): the
hybrid's dq, dk, dv and SDPA-cuDNN's, each against the float64/float32 autograd reference
(flash_bwd's); the logsumexp of cuDNN's forward against ours. ``--time``: the protocol's
shapes (bf16, 16k tokens per batch, H = 2048 / D), paired rounds (benchmarks/paired.py
orders) of: sdpa (cuDNN forward + backward through autograd), hybrid (gluon_fwd default +
cuDNN backward), and the parts alone: cuDNN forward, Gluon forward, cuDNN backward. Each
reading is CUDA events over 10 runs after 3 warm ones. Every timed gradient is checked
against the reference first.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.gluon_bwd_bench import event_ms  # noqa: E402  (3 warm runs, then 10 timed)
from benchmarks.paired import round_orders  # noqa: E402
from templates.base import TOLERANCE, relative_error  # noqa: E402
from templates.flash.bwd import reference_grads  # noqa: E402
from templates.kernel_common import normalize_causal

# (B, H_q, H_kv, N_q, N_kv, D, dtype, causal)
CASES = [
    (2, 4, 4, 256, 256, 128, torch.bfloat16, False),
    (1, 4, 4, 333, 333, 128, torch.bfloat16, True),
    (1, 8, 2, 300, 300, 64, torch.float16, True),
    (1, 4, 4, 128, 512, 128, torch.bfloat16, True),
    (1, 4, 4, 1000, 1000, 64, torch.bfloat16, False),
    (1, 2, 2, 512, 512, 256, torch.bfloat16, True),
    (2, 8, 8, 2048, 2048, 128, torch.float16, True),
]


def cudnn_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   o: torch.Tensor, lse: torch.Tensor, causal: bool, scale: float | None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    empty = torch.empty(0, device=q.device)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        do, q, k, v, o, lse.unsqueeze(-1), empty, empty, None, None, None, q.shape[2],
        k.shape[2], 0.0, causal, scale=scale)
    return dq, dk, dv


def gluon_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    from templates.gluon.fwd import gluon_attention_fwd

    return gluon_attention_fwd(q, k, v, causal=causal)


def sdpa_train(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor,
               causal: bool) -> tuple[torch.Tensor, ...]:
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    o = torch.nn.functional.scaled_dot_product_attention(
        *leaves, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1])
    return torch.autograd.grad(o, leaves, do)


def hybrid_train(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor,
                 causal: bool) -> tuple[torch.Tensor, ...]:
    o, lse = gluon_forward(q, k, v, causal)
    return cudnn_backward(do, q, k, v, o, lse, causal, None)


def inputs(b: int, hq: int, hkv: int, nq: int, nkv: int, d: int, dtype: torch.dtype,
           seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn((b, hq, nq, d), generator=gen, device="cuda", dtype=dtype)
    k = torch.randn((b, hkv, nkv, d), generator=gen, device="cuda", dtype=dtype)
    v = torch.randn((b, hkv, nkv, d), generator=gen, device="cuda", dtype=dtype)
    do = torch.randn((b, hq, nq, d), generator=gen, device="cuda", dtype=dtype)
    return q, k, v, do


def check_case(case: tuple[Any, ...]) -> dict[str, Any]:
    b, hq, hkv, nq, nkv, d, dtype, causal = case
    q, k, v, do = inputs(b, hq, hkv, nq, nkv, d, dtype)
    row: dict[str, Any] = {"case": [b, hq, hkv, nq, nkv, d, str(dtype), causal]}
    ref = reference_grads(q, k, v, do, causal=normalize_causal(causal),
                          scale=d ** -0.5)
    for name, fn in (("sdpa", sdpa_train), ("hybrid", hybrid_train)):
        try:
            grads = fn(q, k, v, do, causal)
            row[name] = [relative_error(g, r) for g, r in zip(grads, ref, strict=True)]
        except Exception as exc:  # noqa: BLE001  (report it, go on to the next case)
            row[name] = f"{type(exc).__name__}: {str(exc)[:300]}"
    try:
        out = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, True, 0.0, causal, False, scale=None)
        lse_cudnn = out[1]
        _, lse_ours = gluon_forward(q, k, v, causal)
        row["lse_cudnn_shape"] = list(lse_cudnn.shape)
        row["lse_cudnn_stride"] = list(lse_cudnn.stride())
        row["lse_max_abs_diff"] = float((lse_cudnn.reshape(lse_ours.shape).float()
                                         - lse_ours).abs().max())
    except Exception as exc:  # noqa: BLE001
        row["lse"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    tol = TOLERANCE["bfloat16" if dtype == torch.bfloat16 else "float16"]
    hybrid = row["hybrid"]
    row["ok"] = isinstance(hybrid, list) and max(hybrid) <= 2 * tol
    print(json.dumps(row), flush=True)
    return row


def time_row(d: int, n: int, causal: bool, rounds: int) -> dict[str, Any]:
    b, h = 16384 // n, 2048 // d
    q, k, v, do = inputs(b, h, h, n, n, d, torch.bfloat16)
    ref = reference_grads(q, k, v, do, causal=normalize_causal(causal), scale=d ** -0.5)
    errors = {name: max(relative_error(g, r) for g, r in zip(fn(q, k, v, do, causal), ref,
                                                              strict=True))
              for name, fn in (("sdpa", sdpa_train), ("hybrid", hybrid_train))}
    del ref
    o, lse = gluon_forward(q, k, v, causal)
    bwd_err = max(relative_error(g, r) for g, r in zip(
        cudnn_backward(do, q, k, v, o, lse, causal, None), sdpa_train(q, k, v, do, causal),
        strict=True))
    fns = {
        "sdpa": lambda: sdpa_train(q, k, v, do, causal),
        "hybrid": lambda: hybrid_train(q, k, v, do, causal),
        "cudnn_fwd": lambda: torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=causal),
        "gluon_fwd": lambda: gluon_forward(q, k, v, causal),
        "cudnn_bwd": lambda: cudnn_backward(do, q, k, v, o, lse, causal, None),
    }
    readings: dict[str, list[float]] = {name: [] for name in fns}
    for order in round_orders(list(fns), rounds):
        for name in order:
            readings[name].append(event_ms(fns[name]))
    ratios = [s / h_ for s, h_ in zip(readings["sdpa"], readings["hybrid"], strict=True)]
    flops = 4.0 * b * h * n * n * d / (2 if causal else 1)
    row = {"d": d, "n": n, "causal": causal, "errors_vs_reference": errors,
           "cudnn_bwd_on_ours_vs_sdpa_grads": bwd_err,
           "ms": {name: statistics.median(r) for name, r in readings.items()},
           "readings_ms": readings, "sdpa_over_hybrid_per_round": ratios,
           "speedup_median": statistics.median(ratios),
           "train_tflops": {name: 3.5 * flops / (statistics.median(readings[name]) * 1e9)
                            for name in ("sdpa", "hybrid")}}
    print(f"d{d} n{n} {'causal' if causal else 'dense'}: sdpa {row['ms']['sdpa']:.3f} ms, "
          f"hybrid {row['ms']['hybrid']:.3f} ms (x{row['speedup_median']:.3f}, rounds "
          f"{min(ratios):.3f}-{max(ratios):.3f}); fwd cudnn {row['ms']['cudnn_fwd']:.3f} "
          f"gluon {row['ms']['gluon_fwd']:.3f}; cudnn bwd {row['ms']['cudnn_bwd']:.3f}; "
          f"errors {errors} bwd-vs-sdpa {bwd_err:.2e}", flush=True)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--time", action="store_true")
    parser.add_argument("--json", default="")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--budget-s", type=float, default=300.0)
    parser.add_argument("--dims", default="128,64")
    parser.add_argument("--lengths", default="4096,16384,1024")
    args = parser.parse_args()
    start = time.monotonic()
    import triton

    result: dict[str, Any] = {"torch": torch.__version__, "triton": triton.__version__,
                              "device": torch.cuda.get_device_name(),
                              "cudnn": torch.backends.cudnn.version(),
                              "date": datetime.date.today().isoformat(),
                              "command": shlex.join(["python3", *sys.argv])}

    def save() -> None:
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1))

    if args.check:
        result["check"] = [check_case(case) for case in CASES]
        save()
    if args.time:
        result["time"] = []
        for d in (int(x) for x in args.dims.split(",")):
            for n in (int(x) for x in args.lengths.split(",")):
                for causal in (False, True):
                    if time.monotonic() - start > args.budget_s:
                        print(f"budget spent: d{d} n{n} causal={causal} not timed", flush=True)
                        continue
                    try:
                        result["time"].append(time_row(d, n, causal, args.rounds))
                    except Exception:  # noqa: BLE001
                        print(traceback.format_exc()[-1500:], flush=True)
                    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
