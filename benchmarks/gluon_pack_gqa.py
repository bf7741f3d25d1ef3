"""Packed GQA (gluon_fwd's ``pack_gqa``) against the same kernel unpacked and torch SDPA, in one
process, on GQA shapes of few queries per head (decoding several tokens, short prompt chunks)
and a long one for contrast. Every output is checked against the template's fp32 reference
first; readings rotate over the candidates (``benchmarks.paired.round_orders``).

    python3 benchmarks/gluon_pack_gqa.py [--shapes B,Hq,Hkv,Nq,Nkv,D;...]
        [--causal none,bottom_right] [--rounds 5] [--json FILE]

SDPA runs as a model calls it: ``enable_gqa=True`` with torch's default backend choice
(``sdpa``), and on K/V expanded to every query head beforehand (``sdpa_expanded``, the
expansion untimed: what a model that repeats K/V itself pays at least). Bottom-right causal
(queries at the end of the cache) goes to SDPA as ``causal_lower_right``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

# Llama-3-8B's attention (32 query heads, 8 KV heads, D 128) at a few new tokens on a 4k and
# a 16k cache, MQA decode, and a prompt long enough that packing has nothing to fill.
DEFAULT_SHAPES = ("1,32,8,1,4096,128;1,32,8,4,4096,128;1,32,8,16,4096,128;"
                  "8,32,8,16,4096,128;1,32,8,64,16384,128;4,32,8,200,2048,128;"
                  "1,16,1,16,8192,64;1,32,8,4096,4096,128")


def parse_shapes(text: str) -> list[tuple[int, int, int, int, int, int]]:
    """``B,Hq,Hkv,Nq,Nkv,D;...`` as tuples; ValueError naming a bad item."""
    out = []
    for item in text.split(";"):
        parts = item.strip().split(",")
        if len(parts) != 6 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
            raise ValueError(f"--shapes takes B,Hq,Hkv,Nq,Nkv,D items of positive integers "
                             f"separated by ';', got {item!r}")
        b, hq, hkv, nq, nkv, d = (int(p) for p in parts)
        if hq % hkv:
            raise ValueError(f"Hq ({hq}) must be a multiple of Hkv ({hkv}) in {item!r}")
        out.append((b, hq, hkv, nq, nkv, d))
    return out


def candidates(problem: Any, inputs: dict[str, Any], device: Any, cfg: Any) -> dict[str, Any]:
    """name -> a function returning the output, for one problem (``cfg``: gluon_fwd's default
    config for it, run unpacked and packed)."""
    import torch.nn.functional as F
    from torch.nn.attention.bias import causal_lower_right

    from templates.gluon.fwd import TEMPLATE

    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    group = problem.heads_q // problem.heads_kv
    is_causal = problem.causal == "top_left"
    mask = (causal_lower_right(problem.seqlen_q, problem.seqlen_kv)
            if problem.causal == "bottom_right" else None)
    k_all, v_all = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    fns: dict[str, Any] = {
        "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                       is_causal=is_causal, enable_gqa=True),
        "sdpa_expanded": lambda: F.scaled_dot_product_attention(
            q, k_all, v_all, attn_mask=mask, is_causal=is_causal),
    }
    for name, packed in (("gluon", False), ("gluon_packed", True)):
        side = dataclasses.replace(cfg, pack_gqa=packed)
        if TEMPLATE.constraint(problem, side, device) is None:
            fns[name] = lambda side=side: TEMPLATE.run(inputs, side)[0]
    return fns


def time_problem(problem: Any, rounds: int, device: Any) -> dict[str, Any]:
    from benchmarks.gluon_fwd_bench import bench_ms
    from benchmarks.paired import round_orders
    from templates.base import relative_error
    from templates.gluon.fwd import TEMPLATE

    inputs = TEMPLATE.make_inputs(problem, "cuda", seed=0)
    ref = TEMPLATE.reference(inputs)[0]
    cfg = TEMPLATE.default_config(problem, device)
    fns = candidates(problem, inputs, device, cfg)
    errors: dict[str, float] = {}
    refused: dict[str, str] = {}
    for name, fn in list(fns.items()):
        try:
            errors[name] = relative_error(fn(), ref)
        except RuntimeError as exc:  # an SDPA backend choice that refuses the call
            refused[name] = str(exc).splitlines()[0][:300]
            del fns[name]
            continue
        if not errors[name] <= TEMPLATE.tolerance(problem):
            raise RuntimeError(f"{name} is wrong on {problem.key()}: error "
                               f"{errors[name]:.2e}")
    readings: dict[str, list[float]] = {name: [] for name in fns}
    for order in round_orders(list(fns), rounds):
        for name in order:
            readings[name].append(bench_ms(fns[name]))
    ms = {name: statistics.median(r) for name, r in readings.items()}
    return {"problem": problem.key(), "default_packs": cfg.pack_gqa, "config": cfg.key(),
            "ms": ms, "readings_ms": readings, "errors": errors, "refused": refused}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=DEFAULT_SHAPES)
    parser.add_argument("--causal", default="none,bottom_right")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", default="", help="write the rows here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a Hopper GPU")
    try:
        shape_list = parse_shapes(args.shapes)
    except ValueError as exc:
        parser.error(str(exc))

    from benchmarks.gluon_fwd_bench import environment
    from templates.base import Problem
    from templates.device import current_device

    device = current_device()
    rows = []
    for b, hq, hkv, nq, nkv, d in shape_list:
        for causal in args.causal.split(","):
            problem = Problem(b, hq, hkv, nq, nkv, d, "bfloat16", causal)
            row = time_problem(problem, args.rounds, device)
            rows.append(row)
            ms = {name: row["ms"].get(name, float("nan"))
                  for name in ("sdpa", "sdpa_expanded", "gluon", "gluon_packed")}
            best_sdpa = min(ms["sdpa"], ms["sdpa_expanded"])
            refused = f" refused: {row['refused']}" if row["refused"] else ""
            print(f"{problem.key():58s} us: sdpa {1e3 * ms['sdpa']:8.1f} expanded "
                  f"{1e3 * ms['sdpa_expanded']:8.1f} gluon {1e3 * ms['gluon']:8.1f} packed "
                  f"{1e3 * ms['gluon_packed']:8.1f}   unpacked/packed "
                  f"{ms['gluon'] / ms['gluon_packed']:.2f}x  best sdpa/packed "
                  f"{best_sdpa / ms['gluon_packed']:.2f}x  (default packs: "
                  f"{row['default_packs']}){refused}", flush=True)
    if args.json:
        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"environment": environment(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
