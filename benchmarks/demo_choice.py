"""The end of ``make demo``: what ``tuner.attention`` now runs for each problem of a suite or
spec that a sweep tuned, and, on a GPU, the time that saves against torch SDPA.

    python benchmarks/demo_choice.py quick --db sqlite:///tuner.db
    python benchmarks/demo_choice.py my-sweep.toml --db sqlite:///tuner.db --json out.json

Per problem (dense or top-left causal; masks and bottom-right causal are left out, as a plain
SDPA call cannot pose them): ``tuner.attention.plan_for`` on inputs of the problem's shape
gives the implementation, where its config comes from and why. On a GPU both the call and
``torch.nn.functional.scaled_dot_product_attention`` are timed (``tuner.tuning.runner.timing``'s
``time_gpu``: do_bench's median, L2 flushed), and the line gives both and the difference;
under the CPU interpreter only the choice is shown (its timings are not GPU timings).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

import tuner
from templates.base import Problem
from templates.device import interpreter_active
from tuner.attention import plan_for
from tuner.lookup.resolver import ConfigResolver, set_resolver
from tuner.settings import load_settings
from tuner.tuning.runner.timing import time_gpu
from tuner.tuning.suites import resolve_spec

TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def inputs(problem: Problem, device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dtype = TORCH_DTYPES[problem.dtype]
    q = torch.randn(problem.batch, problem.heads_q, problem.seqlen_q, problem.head_dim,
                    device=device, dtype=dtype)
    k, v = (torch.randn(problem.batch, problem.heads_kv, problem.seqlen_kv, problem.head_dim,
                        device=device, dtype=dtype) for _ in range(2))
    return q, k, v


def show(problem: Problem, gpu: bool) -> dict[str, Any]:
    device = "cuda" if gpu else "cpu"
    q, k, v = inputs(problem, device)
    causal, gqa = problem.causal == "top_left", problem.heads_q != problem.heads_kv
    choice = plan_for(q, k, v, is_causal=causal, enable_gqa=gqa)
    row: dict[str, Any] = {"problem": problem.to_dict(), "key": problem.key(),
                           "implementation": choice.implementation.name,
                           "source": choice.source, "why": choice.why}
    if gpu:
        row["tuner_ms"] = time_gpu(lambda: tuner.attention(q, k, v, is_causal=causal,
                                                           enable_gqa=gqa))
        row["sdpa_ms"] = time_gpu(lambda: torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=causal, enable_gqa=gqa))
        row["saved_ms"] = row["sdpa_ms"] - row["tuner_ms"]
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("spec", help="the suite or spec file the sweep tuned")
    parser.add_argument("--db", default="sqlite:///tuner.db", help="the sweep's database")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args(argv)
    gpu = torch.cuda.is_available() and not interpreter_active()
    spec, _ = resolve_spec(args.spec, interpreter=not gpu)
    set_resolver(ConfigResolver(load_settings(database_url=args.db, url=None)))
    rows = [show(p, gpu) for p in spec.problems
            if p.mask == "none" and p.causal in ("none", "top_left")]
    for row in rows:
        line = f"{row['key']}: tuner.attention runs {row['implementation']} ({row['source']})"
        if gpu:
            line += (f"; {row['tuner_ms']:.3f} ms against torch SDPA's {row['sdpa_ms']:.3f} ms"
                     f" ({row['sdpa_ms'] / row['tuner_ms']:.2f}x)")
        print(line)
        print(f"    why: {row['why']}")
    if gpu:
        saved = sum(r["saved_ms"] for r in rows)
        total = sum(r["sdpa_ms"] for r in rows)
        print(f"one call of each problem: {total - saved:.3f} ms through tuner.attention against "
              f"{total:.3f} ms through torch SDPA: {saved:.3f} ms saved "
              f"({total / (total - saved):.2f}x)")
    else:
        print("(CPU interpreter: the choice only; its timings are not GPU timings)")
    if args.json:
        args.json.write_text(json.dumps({"gpu": gpu, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
