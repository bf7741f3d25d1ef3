"""A grid of flash_decode configs beside cuDNN on the decode rows: the GPU's time alone.

Each config of the grid (the launch knobs of ``FlashDecodeConfig``) runs PROTOCOL.md's decode
rows (bf16, 32 query / 8 KV heads, d128, one new token, a full cache) and is checked against
torch SDPA's output first; then 50 calls are captured in a CUDA graph and replayed, so the
host's launch time is out of the reading (``decode_loop.py`` measures the loop with it). With
``--split-only`` the split kernel of the fastest separate-combine config is also timed alone:
what the combine costs. This is how the known-good configs of ``flash_decode`` were found
(docs/DISPATCH.md).

    python benchmarks/decode_grid.py [--rows b1-32k,b8-32k] [--grid small|full]
        [--budget-s 70] [--split-only] [--json out.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode_loop import HEAD_DIM, HEADS_KV, HEADS_Q, ROWS, TOLERANCE, graph_us  # noqa: E402

# Knob values per grid: "small" around the measured winners, "full" the probe of 2026-11-24.
GRIDS: dict[str, dict[str, tuple[Any, ...]]] = {
    "small": {"block_n": (64, 128), "num_stages": (2, 3), "combine": ("separate", "fused"),
              "kv_load": ("default",), "num_warps": (4,), "num_splits": (1, 2, 8, 16, 32)},
    "full": {"block_n": (64, 128, 256), "num_stages": (2, 3, 4),
             "combine": ("separate", "fused"), "kv_load": ("default", "evict_first"),
             "num_warps": (4, 8), "num_splits": (1, 2, 4, 8, 16, 32, 64, 128)},
}
CALLS = 50


def grid_configs(grid: dict[str, tuple[Any, ...]]) -> list[dict[str, Any]]:
    """Every combination of the grid's knobs, without the fused combine of one split (there is
    nothing to combine: it would repeat the separate one)."""
    names = list(grid)
    out = []
    for values in itertools.product(*(grid[n] for n in names)):
        knobs = dict(zip(names, values, strict=True))
        if knobs["num_splits"] == 1 and knobs["combine"] == "fused":
            continue
        out.append(knobs)
    return out


def row_grid(batch: int, seqlen: int, configs: list[dict[str, Any]], budget_s: float,
             split_only: bool) -> dict[str, Any]:
    from templates.decode import kernel

    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(batch, h, n, HEAD_DIM, device="cuda", dtype=torch.bfloat16,
                           generator=gen)
               for h, n in ((HEADS_Q, 1), (HEADS_KV, seqlen), (HEADS_KV, seqlen)))
    lengths = torch.full((batch,), seqlen, dtype=torch.int32, device="cuda")
    shape = kernel.check_decode_inputs(q, k, v, lengths)
    reference = F.scaled_dot_product_attention(q, k, v, enable_gqa=True).float()
    result: dict[str, Any] = {
        "cudnn_us": graph_us(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
                             CALLS), "configs": [], "skipped": []}
    started = time.monotonic()
    for knobs in configs:
        if time.monotonic() - started > budget_s:
            result["skipped"].append(knobs)
            continue

        def run(knobs: dict[str, Any] = knobs) -> tuple[torch.Tensor, torch.Tensor]:
            return kernel.launch_decode(q, k, v, lengths, None, None, shape, **knobs,
                                        want_lse=False)
        try:
            error = float((run()[0].float() - reference).abs().max())
        except Exception as exc:  # a config that cannot compile or launch: recorded, not fatal
            result["configs"].append({"knobs": knobs, "us": None, "error": repr(exc)[:200]})
            continue
        us = graph_us(run, CALLS) if error <= TOLERANCE else None
        result["configs"].append({"knobs": knobs, "us": us, "max_abs_error": error})
    timed = sorted((c for c in result["configs"] if c["us"] is not None),
                   key=lambda c: c["us"])
    separate = [c for c in timed if c["knobs"]["combine"] == "separate"
                and c["knobs"]["num_splits"] > 1]
    if split_only and separate:
        knobs = separate[0]["knobs"]
        plan = kernel.decode_launch_plan(q, k, v, lengths, None, shape, **knobs)

        def split_kernel() -> None:
            stream = kernel.current_stream(q.device.index)
            o = torch.empty(plan.out_shape, dtype=q.dtype, device=q.device)
            o_part, lse_part, lse = kernel._scratch(plan, q, stream)
            split_args, _ = kernel.launch_args(plan, q, k, v, lengths, None, o, lse,
                                               (o_part, lse_part), None,
                                               plan.default_scale * kernel.LOG2E)
            plan.split.launch_on(stream, *split_args)  # and not the combine
        result["split_only"] = {"knobs": knobs, "us": graph_us(split_kernel, CALLS),
                                "with_combine_us": separate[0]["us"]}
    result["fastest"] = timed[:10]
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="b1-32k,b8-32k,b1-128k", help=f"of {', '.join(ROWS)}")
    parser.add_argument("--grid", default="small", choices=sorted(GRIDS))
    parser.add_argument("--budget-s", type=float, default=70.0,
                        help="seconds per row; the configs left are listed as skipped")
    parser.add_argument("--split-only", action="store_true",
                        help="also time the split kernel of the fastest separate config alone")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU: the grid is timed on the GPU")
    unknown = [r for r in args.rows.split(",") if r not in ROWS]
    if unknown:
        parser.error(f"unknown rows {unknown}; known: {', '.join(ROWS)}")
    configs = grid_configs(GRIDS[args.grid])
    results = {}
    for name in args.rows.split(","):
        row = row_grid(*ROWS[name], configs, args.budget_s, args.split_only)
        results[name] = row
        print(f"{name}: cuDNN {row['cudnn_us']:.1f} us; {len(row['configs'])} configs run, "
              f"{len(row['skipped'])} skipped")
        for c in row["fastest"]:
            print(f"  {c['us']:8.1f} us  {row['cudnn_us'] / c['us']:.3f}x cuDNN  {c['knobs']}")
        if "split_only" in row:
            s = row["split_only"]
            print(f"  split kernel alone {s['us']:.1f} us (with its combine "
                  f"{s['with_combine_us']:.1f})")
    if args.json:
        args.json.write_text(json.dumps({
            "device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "cudnn": torch.backends.cudnn.version(), "grid": args.grid, "rows": results},
            indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
