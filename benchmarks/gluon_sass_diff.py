"""What a Gluon forward kernel change does to the compiled code, without a GPU: the default
config of each shape compiled for the H100 offline (``templates.compile.offline_target``) with DIAG
A and DIAG B (or the A/B's ``--config`` knobs on the B side), and per shape the instruction
count, the stack (spilled) bytes and the opcodes whose counts changed.

    TRITON_INTERPRET=0 python benchmarks/gluon_sass_diff.py --diag 1
    TRITON_INTERPRET=0 PYTHONPATH=/path/to/triton-3.6-site:$PWD \\
        python benchmarks/gluon_sass_diff.py --config tree_max=false --shapes 4x32x4096x64 \\
        --causal top_left

Counts are static (each instruction once, however often it runs): a change that removes
instructions from the masked softmax shows there, not how much time it saves; that takes
``gluon_fwd_ab.py`` on a GPU. Compile with the GPU machines' triton (3.6) for their SASS:
other versions allocate registers and schedule differently.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gluon_fwd_ab import changed_config, config_overrides, shapes  # noqa: E402

DEFAULT_SHAPES = "4x32x4096x64,4x16x4096x128"


def compiled_counts(shape: tuple[int, int, int, int], causal: str, diag: int,
                    overrides: dict[str, str]) -> dict[str, Any]:
    """The kernel of ``shape``'s default config (with ``overrides``) under ``diag``, compiled
    for the H100: {"instructions", "stack_bytes", "opcodes"}."""
    from templates.base import Problem
    from templates.compile.offline_target import offline_target
    from templates.compile.report import _cubin_resources, sass_opcodes, wgmma_serialization
    from templates.gluon.fwd import TEMPLATE, standin_launch

    b, h, n, d = shape
    problem = Problem(b, h, h, n, n, d, "bfloat16", causal)
    with offline_target("h100") as device:
        cfg = changed_config(TEMPLATE.default_config(problem, device), overrides)
        fn, grid, args, options = standin_launch(problem, cfg, diag)
        kernel = fn.warmup(*args, grid=grid, **options)
    cubin = kernel.asm["cubin"]
    opcodes = sass_opcodes(cubin)
    if opcodes is None:
        raise RuntimeError("cuobjdump was not found (triton's bundled one or on PATH)")
    return {"instructions": sum(opcodes.values()), "stack_bytes": _cubin_resources(cubin)[1],
            "opcodes": dict(opcodes),
            "wgmma_serialized": wgmma_serialization(kernel.asm.get("ptx"))}


def diff_row(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """B against A: totals and the opcodes whose counts changed (B minus A)."""
    names = sorted(set(a["opcodes"]) | set(b["opcodes"]))
    changed = {op: b["opcodes"].get(op, 0) - a["opcodes"].get(op, 0) for op in names}
    return {"instructions": (a["instructions"], b["instructions"]),
            "stack_bytes": (a["stack_bytes"], b["stack_bytes"]),
            "changed": {op: delta for op, delta in changed.items() if delta},
            # ptxas's note where it serialized a side's GEMMs (notes/gluon_notes.md)
            "wgmma_serialized": (a.get("wgmma_serialized", ""),
                                 b.get("wgmma_serialized", ""))}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--diag", type=int, default=0, help="the B side's DIAG value")
    parser.add_argument("--diag-a", type=int, default=0, help="the A side's DIAG value")
    parser.add_argument("--config", action="append", default=[], metavar="KNOB=VALUE",
                        help="the B side's config: the default with this knob changed")
    parser.add_argument("--shapes", default=DEFAULT_SHAPES, help="BxHxNxD,... (bf16)")
    parser.add_argument("--causal", default="none,top_left")
    parser.add_argument("--json", type=Path, help="write the rows here too")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        parser.error("compiling needs TRITON_INTERPRET=0 (the interpreter compiles nothing)")
    overrides = config_overrides(args.config)
    rows = []
    for shape in shapes(args.shapes):
        for causal in args.causal.split(","):
            a = compiled_counts(shape, causal, args.diag_a, {})
            b = compiled_counts(shape, causal, args.diag, overrides)
            row = {"shape": "x".join(map(str, shape)), "causal": causal, **diff_row(a, b)}
            rows.append(row)
            (ia, ib), (sa, sb) = row["instructions"], row["stack_bytes"]
            changed = ", ".join(f"{op} {delta:+d}" for op, delta in row["changed"].items())
            print(f"{row['shape']:<16} {causal:<12} instructions {ia} -> {ib}   "
                  f"stack {sa} -> {sb}   {changed}")
            for side, note in zip("AB", row["wgmma_serialized"], strict=True):
                if note:
                    print(f"    {side}: ptxas serialized its wgmma GEMMs: {note}")
    if args.json:
        args.json.write_text(json.dumps({"diag_a": args.diag_a, "diag_b": args.diag,
                                         "config_b": overrides, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
