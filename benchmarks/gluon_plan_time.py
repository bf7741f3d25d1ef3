"""Host time to make a Gluon forward launch plan at a shape not seen before.

    python benchmarks/gluon_plan_time.py                      # the default shapes
    python benchmarks/gluon_plan_time.py --shapes 1x1x32768x128 --causal top_left --json out.json

A call of ``tuner.attention`` (or ``gluon_attention_fwd``) at a new shape makes a plan before
its launch; a persistent grid's plan walks the host's tile schedule in Python
(``templates/gluon/schedule.py``), and a causal grid of few tiles first searches where to cut
its longest ones. That cost is paid again at every new sequence length (a server's prompts), so
it belongs next to the kernel's own time. Each shape's plan is made with the default config of
an H100 (132 SMs), from stand-in tensors (no GPU needed), every schedule cache cleared before
each of ``--repeats`` makings; the minimum and the median are printed in ms.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gluon_fwd_ab import shapes as parse_shapes  # noqa: E402

# Causal grids of few heads at long lengths (where ``cut_lpt_schedule`` searches), large causal
# grids (the LPT schedule), dense grids with a partial last round (``split_schedule``).
DEFAULT_SHAPES = ("1x1x8192x128", "1x1x16384x128", "1x1x32768x128", "1x2x16384x128",
                  "1x4x8192x128", "1x8x2048x128", "1x32x4096x128", "1x32x32768x128",
                  "1x1x65536x128")
SCHEDULE_CACHES = ("_split_schedule", "_split_table", "_cut_lpt_schedule", "_cut_lpt_table",
                   "_causal_table")


def plan_times(shape: tuple[int, int, int, int], causal: str, repeats: int) -> dict[str, Any]:
    """One row: the plan's kind (TILE_ORDER, cut or not, tiles) and its making times in ms."""
    import torch

    from templates.base import Problem
    from templates.compile.offline_target import TARGETS
    from templates.compile.standin_tensor import StandinTensor
    from templates.gluon import fwd_kernel as gluon_fwd_kernel
    from templates.gluon.fwd import TEMPLATE

    b, h, n, d = shape
    config = TEMPLATE.default_config(Problem(b, h, h, n, n, d, "bfloat16", causal),
                                     TARGETS["h100"]).to_dict()
    q = StandinTensor(torch.bfloat16, [b, h, n, d])
    times = []
    for _ in range(repeats):
        for name in SCHEDULE_CACHES:
            getattr(gluon_fwd_kernel, name).cache_clear()
        start = time.perf_counter()
        plan = gluon_fwd_kernel.LaunchPlan(q, q, causal_mode=causal, scale=d ** -0.5,
                                           config=config, sm_count=TARGETS["h100"].sm_count)
        times.append(1e3 * (time.perf_counter() - start))
    return {"shape": f"{b}x{h}x{n}x{d}", "causal": causal,
            "tile_order": plan.options["TILE_ORDER"], "cut": plan.split is not None,
            "tiles": plan.scalars[6], "min_ms": min(times), "median_ms": statistics.median(times)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default=",".join(DEFAULT_SHAPES), help="BxHxNxD,...")
    parser.add_argument("--causal", default="top_left,none",
                        help="causal modes, comma-separated: none, top_left, bottom_right")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default="", help="write the rows here too")
    args = parser.parse_args(argv)
    try:
        shapes = parse_shapes(args.shapes)
    except ValueError as exc:
        parser.error(str(exc))
    modes = args.causal.split(",")
    bad = [m for m in modes if m not in ("none", "top_left", "bottom_right")]
    if bad or args.repeats < 1:
        parser.error(f"--causal takes none, top_left, bottom_right (got {bad}); "
                     f"--repeats at least 1 (got {args.repeats})")
    rows = [plan_times(shape, mode, args.repeats) for mode in modes for shape in shapes]
    print(f"{'shape':>16} {'causal':>9} {'order':>5} {'cut':>4} {'tiles':>6} "
          f"{'min ms':>8} {'median ms':>9}")
    for r in rows:
        print(f"{r['shape']:>16} {r['causal']:>9} {r['tile_order']:>5} {str(r['cut']):>4} "
              f"{r['tiles']:>6} {r['min_ms']:>8.2f} {r['median_ms']:>9.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
