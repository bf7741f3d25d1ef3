"""Per-tile and per-block costs of each implementation, fitted from stored winners.

    python benchmarks/tile_cost_fit.py benchmarks/results/winners_standard_h200_s16.json ...

An attention forward of query tiles of 128 rows runs in about ``waves * (o + n * c)``: ``waves``
rounds of tiles over the SMs, each tile paying a fixed cost ``o`` (its prologue and epilogue,
the pipeline filling and draining) and ``c`` per 128-key block of its ``n``. `standard`'s
PROTOCOL shapes keep the tiles fixed as N grows (B x N constant), so a line through the
times per wave of one head dim and mask, against n, splits them into ``o`` and ``c``: an
implementation ahead per block but behind per tile wins long sequences and loses short
ones. Causal tiles (top-left, square) hold N / 256 + 1/2 blocks on average, the diagonal
one counted whole. Times are the files' medians (head-to-heads where the sweep ran them).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

BLOCK = 128  # rows per query tile and keys per KV block of the model


def tile_terms(problem: dict[str, Any], sm_count: int) -> tuple[float, float]:
    """(waves, mean KV blocks per tile) of a square self-attention problem."""
    n = int(problem["seqlen_q"])
    tiles = int(problem["batch"]) * int(problem["heads_q"]) * -(-n // BLOCK)
    blocks = n / BLOCK
    if problem["causal"] != "none":
        blocks = blocks / 2 + 0.5
    return tiles / sm_count, blocks


def fit(rows: list[dict[str, Any]], sm_count: int) -> dict[tuple[int, str, str], dict[str, float]]:
    """Per (head dim, "dense"/"causal", implementation): o and c in microseconds, and the
    number of problems the line went through (at least 3 lengths, or it is left out)."""
    points: dict[tuple[int, str, str], list[tuple[float, float]]] = defaultdict(list)
    for row in rows:
        problem = row["problem"]
        if problem["seqlen_q"] != problem["seqlen_kv"] or problem.get("mask", "none") != "none":
            continue
        waves, blocks = tile_terms(problem, sm_count)
        kind = "dense" if problem["causal"] == "none" else "causal"
        for impl, ms in row["median_ms"].items():
            if ms is not None:
                points[(int(problem["head_dim"]), kind, impl)].append(
                    (blocks, float(ms) * 1e3 / waves))
    out = {}
    for key, pts in sorted(points.items()):
        if len({b for b, _ in pts}) < 3:
            continue
        x = np.array([b for b, _ in pts])
        y = np.array([t for _, t in pts])
        (o, c), *_ = np.linalg.lstsq(np.vstack([np.ones_like(x), x]).T, y, rcond=None)
        out[key] = {"per_tile_us": float(o), "per_block_us": float(c), "problems": len(pts)}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", type=Path, help="tuner winners --json files")
    parser.add_argument("--sm-count", type=int, default=132, help="SMs of the GPU (H100/H200: 132)")
    args = parser.parse_args()
    for path in args.files:
        rows = json.loads(path.read_text())
        print(f"{path.name}: o (us per tile) / c (us per 128-key block), per wave of "
              f"{args.sm_count} SMs")
        for (d, kind, impl), f in fit(rows, args.sm_count).items():
            print(f"  d{d:<4} {kind:<7} {impl:<6} o {f['per_tile_us']:6.2f}   "
                  f"c {f['per_block_us']:6.3f}   ({f['problems']} problems)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
