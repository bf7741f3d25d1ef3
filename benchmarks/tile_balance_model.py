"""How evenly the masked backward's grids share its KV tiles among the SMs, without a GPU: a
model of the Gluon backward's tile orders (``gluon_bwd``'s ``longest_first`` and
``persistent``) on masked_fwd_bwd_bench.py's masks.

A tile costs its walk (the query blocks the transposed mask lists for it, two 64-row steps
each) plus ``--overhead`` steps (its K/V load and dK/dV stores). The non-persistent grid's
programs start in launch order as SMs free up (a greedy list schedule); the persistent grid
deals its tiles in static snake rounds (``bwd_ws_kernel.persistent_tile``). Printed: the
busiest SM's work over the mean, per mask and assignment (1.0 is perfect balance). It knows
nothing of L2 or of a tile's real time: it explains orders, it does not time them.

    python benchmarks/tile_balance_model.py [--seqlen 16384] [--heads 16] [--programs 132]
"""

from __future__ import annotations

import argparse
import heapq
import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.masked_fwd_bwd_bench import pattern_mod  # noqa: E402
from templates.gluon.bwd_tile_order import TileOrder, persistent_head_group  # noqa: E402
from templates.masks.block_mask import BlockMask  # noqa: E402

PATTERNS = ("document-causal:1024", "random:0.1", "sliding-causal:1024")
BLOCK = 128
STEPS_PER_BLOCK = 2  # 64-row steps per 128-row query block


def dynamic(order: Sequence[int], cost: Sequence[int], programs: int) -> float:
    """The busiest SM's work when the tiles start in ``order`` on whichever SM is free."""
    loads = [(0, p) for p in range(programs)]
    for tile in order:
        load, p = heapq.heappop(loads)
        heapq.heappush(loads, (load + cost[tile], p))
    return max(load for load, _ in loads)


def snake(order: Sequence[int], cost: Sequence[int], programs: int) -> float:
    """The busiest program's work when a persistent grid deals ``order`` in snake rounds."""
    loads = [0] * programs
    for start in range(0, len(order), programs):
        forward = (start // programs) % 2 == 0
        for p in range(programs):
            i = start + (p if forward else programs - 1 - p)
            if i < len(order):
                loads[p] += cost[order[i]]
    return max(loads)


def balance(pattern: str, seqlen: int, heads: int, programs: int, overhead: int
            ) -> dict[str, float]:
    """Busiest over mean for each assignment of ``pattern``'s tiles (one batch row, MHA)."""
    mask = BlockMask.from_mask_mod(pattern_mod(pattern, seqlen, BLOCK, "cpu"), None, None,
                                   seqlen, seqlen, BLOCK).transposed
    args = mask.kernel_args()
    n_kv = -(-seqlen // BLOCK)
    walks = ((args[0] + args[2]).reshape(-1)[:n_kv] * STEPS_PER_BLOCK).tolist() * heads
    cost = [w + overhead for w in walks]
    mean = sum(cost) / programs

    def ordered(rows_per_group: int) -> list[int]:
        make = TileOrder(batch=1, heads_q=heads, heads_kv=heads, n_kv_tiles=n_kv,
                         block_n=BLOCK, mask_block_kv=BLOCK, strides=tuple(args[6:8]),
                         rows_per_group=rows_per_group)
        return [int(t) for t in make(args[0], args[2])]

    natural = list(range(heads * n_kv))
    groups = persistent_head_group(heads, n_kv, programs, 2 * seqlen * 128 * 2)
    return {
        "launch, tile order": dynamic(natural, cost, programs) / mean,
        f"launch, longest first (groups of {groups})":
            dynamic(ordered(groups), cost, programs) / mean,
        "persistent, tile order": snake(natural, cost, programs) / mean,
        f"persistent, longest first (groups of {groups})":
            snake(ordered(groups), cost, programs) / mean,
        "persistent, longest first (one group)": snake(ordered(heads), cost, programs) / mean,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlen", type=int, default=16384)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--programs", type=int, default=132, help="SMs (H100/H200: 132)")
    parser.add_argument("--overhead", type=int, default=2, help="steps a tile costs beyond "
                        "its walk")
    args = parser.parse_args(argv)
    for pattern in PATTERNS:
        print(pattern)
        for name, ratio in balance(pattern, args.seqlen, args.heads, args.programs,
                                   args.overhead).items():
            print(f"  {name:45} {ratio:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
