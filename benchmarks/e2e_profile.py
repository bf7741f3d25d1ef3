"""Where a transformers prefill spends its time, SDPA against ``tuner``: the e2e_hf model
(benchmarks/e2e_hf.py) under torch.profiler, the top operations by GPU time and by host
time. GPU only.

    python benchmarks/e2e_profile.py --db sqlite:///tuner.db --kind sliding
    python benchmarks/e2e_profile.py --db sqlite:///tuner.db --kind sliding --train  # a step
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from e2e_hf import LLAMA, build  # noqa: E402

from tuner.hf import register_transformers  # noqa: E402


def step(model: torch.nn.Module, ids: torch.Tensor, train: bool) -> None:
    """A prefill, or a training step (loss backward, gradients dropped)."""
    if train:
        model(ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=True)
    else:
        with torch.no_grad():
            model(ids)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--db", help="database of tuned configs")
    parser.add_argument("--kind", default="sliding", choices=("llama", "sliding"))
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--window", type=int, default=4096)
    parser.add_argument("--top", type=int, default=14)
    parser.add_argument("--train", action="store_true",
                        help="profile a training step (loss backward) instead of a prefill")
    args = parser.parse_args()
    if args.db:
        os.environ["TUNER_DATABASE_URL"] = args.db
        from tuner.lookup import set_resolver
        set_resolver(None)
    name = register_transformers()
    ids = torch.randint(0, LLAMA["vocab_size"], (1, args.tokens), device="cuda")
    for attn in ("sdpa", name):
        model = build(args.kind, attn, LLAMA, args.window, torch.bfloat16, "cuda")
        model.train(args.train)
        for _ in range(2):
            step(model, ids, args.train)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            step(model, ids, args.train)
            torch.cuda.synchronize()
        averages = prof.key_averages()
        print(f"\n=== {attn}: by GPU time")
        print(averages.table(sort_by="cuda_time_total", row_limit=args.top, max_name_column_width=60))
        print(f"=== {attn}: by host time")
        print(averages.table(sort_by="cpu_time_total", row_limit=args.top, max_name_column_width=60))
        del model
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
