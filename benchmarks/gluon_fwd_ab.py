"""A/B of one gluon_fwd timing switch in one process: the template's default config as it
ships (A) against the same config (B) with ``--diag N`` (templates/gluon/fwd_kernel.py,
``_softmax_block``'s list; 3 = a persistent consumer waits for its O store at once) and/or
with ``--kernel-order`` (a persistent causal grid walks the kernel's own longest-first order,
two rounds per head group, instead of the host's ``lpt_schedule``) and/or with
``--tile-overhead N`` (the schedule's cost of a tile beyond its KV blocks) and/or with
``--combine X`` (the split schedules' cost of a piece, ``COMBINE_BLOCKS_PER_PIECE``), beside
cuDNN, on the PROTOCOL shapes (bf16, 16k tokens per batch, H = 2048 / D). Every output is checked against
an fp32 reference first, and a problem where one is wrong (beyond the template's tolerance)
is not timed (``--allow-wrong`` times a B that is wrong by design, a DIAG that drops work;
``--past-constraint`` times a B config the template's constraint refuses, e.g. one that
spills, to learn what the refusal costs);
readings rotate over the candidates.

    python3 benchmarks/gluon_fwd_ab.py (--diag 3 [--diag-meaning TEXT] | --kernel-order
                                        | --tile-overhead 2 | --combine 1.5
                                        | --config kv_stages=3 ...)
        [--head-dims 128,64]
        [--seqlens 512,...] [--shapes BxHxNxD|BxHqxHkvxNqxNkvxD,...]
        [--causal none,top_left,bottom_right] [--rounds 5]
        [--allow-wrong] [--past-constraint] [--json DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402


def config_overrides(pairs: list[str]) -> dict[str, str]:
    """``KNOB=VALUE`` strings as a dict (values are parsed by ``changed_config``)."""
    out = {}
    for pair in pairs:
        knob, sep, value = pair.partition("=")
        if not sep or not knob or not value:
            raise ValueError(f"--config takes KNOB=VALUE, got {pair!r}")
        out[knob] = value
    return out


def shapes(text: str) -> list[tuple[int, int, int, int]]:
    """``BxHxNxD,...`` as (B, H, N, D) tuples."""
    out = []
    for item in text.split(","):
        parts = item.strip().lower().split("x")
        if len(parts) != 4 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ValueError(f"--shapes takes BxHxNxD items of positive integers, got {item!r}")
        b, h, n, d = (int(p) for p in parts)
        out.append((b, h, n, d))
    return out


def problem_shapes(text: str) -> list[tuple[int, int, int, int, int, int]]:
    """``--shapes`` items as (B, H_q, H_kv, N_q, N_kv, D): ``BxHxNxD`` (self-attention, one
    K/V head per query head) or ``BxHqxHkvxNqxNkvxD`` (GQA, N_q != N_kv)."""
    out = []
    for item in text.split(","):
        parts = item.strip().lower().split("x")
        if len(parts) == 4:
            out.extend((b, h, h, n, n, d) for b, h, n, d in shapes(item))
            continue
        if len(parts) != 6 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ValueError(f"--shapes takes BxHxNxD or BxHqxHkvxNqxNkvxD items of positive "
                             f"integers, got {item!r}")
        b, hq, hkv, nq, nkv, d = (int(p) for p in parts)
        if hq % hkv:
            raise ValueError(f"--shapes item {item!r}: H_q = {hq} is not a multiple of "
                             f"H_kv = {hkv}")
        out.append((b, hq, hkv, nq, nkv, d))
    return out


def changed_config(cfg: Any, overrides: dict[str, str]) -> Any:
    """``cfg`` with ``overrides``' knobs set (booleans as true/false/1/0, else integers)."""
    values = cfg.to_dict()
    for knob, text in overrides.items():
        if knob not in values:
            raise ValueError(f"unknown knob {knob!r}; the knobs: {sorted(values)}")
        if isinstance(values[knob], bool):
            if text.lower() not in ("true", "false", "1", "0"):
                raise ValueError(f"{knob} is a boolean knob: true/false/1/0, got {text!r}")
            values[knob] = text.lower() in ("true", "1")
        else:
            values[knob] = int(text)
    return type(cfg)(**values)


def result_name(diag: int, kernel_order: bool, tile_overhead: int | None,
                overrides: dict[str, str], combine: float | None = None) -> str:
    """The JSON file's name, after the B side's switch, so that A/Bs of different switches
    written to one folder do not overwrite each other."""
    parts = [f"diag{diag}"] if diag else []
    parts += ["kernel_order"] if kernel_order else []
    parts += [f"tile_overhead{tile_overhead}"] if tile_overhead is not None else []
    parts += [f"combine{combine:g}"] if combine is not None else []
    parts += [f"{knob}{value}" for knob, value in sorted(overrides.items())]
    return "gluon_fwd_ab_" + "_".join(parts) + ".json"


def result_payload(env: dict[str, Any], diag: int, diag_meaning: str | None,
                   kernel_order: bool, tile_overhead: int | None, overrides: dict[str, str],
                   rows: list[dict[str, Any]], combine: float | None = None) -> dict[str, Any]:
    """The result file's content; ``diag_meaning`` (what the DIAG did, in words) only when
    given: benchmarks/report.py prefers it to its own list of DIAG values."""
    meaning = {"diag_meaning": diag_meaning} if diag_meaning else {}
    return {"environment": env, "diag": diag, **meaning, "kernel_order": kernel_order,
            "tile_overhead": tile_overhead, "combine": combine, "config": overrides,
            "rows": rows}


def result_check(errors: dict[str, float], tolerance: float,
                 allow_wrong: bool) -> tuple[str | None, list[str]]:
    """Whether a problem may be timed: (why not, or None; the sides whose results are wrong,
    timed anyway). cuDNN and A must be right; B too, unless ``allow_wrong`` (a DIAG that
    drops work by design). A NaN error counts as wrong."""
    wrong = sorted(name for name, error in errors.items() if not error <= tolerance)
    refused = [name for name in wrong if name != "B" or not allow_wrong]
    if refused:
        return (", ".join(f"{name}'s error {errors[name]:.1e}" for name in refused)
                + f" > tolerance {tolerance:.0e}"), wrong
    return None, wrong


def ab_problem(problem: Any, diag: int, kernel_order: bool, rounds: int, device: Any,
               tile_overhead: int | None = None,
               overrides: dict[str, str] | None = None,
               combine: float | None = None, allow_wrong: bool = False,
               past_constraint: bool = False) -> dict[str, Any] | None:
    """One problem: cuDNN, the default config (A) and the same with DIAG ``diag``, (if
    ``kernel_order``) the kernel's own causal order and the knobs of ``overrides`` (B),
    checked against fp32, then ``rounds`` readings each in rotation (medians). None when the
    template refuses B's config for this problem, or when a side's results are wrong
    (``result_check``)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from benchmarks.gluon_fwd_bench import bench_ms, reference_fp32
    from benchmarks.paired import round_orders
    from templates.base import relative_error
    from templates.gluon import fwd_kernel as gluon_fwd_kernel
    from templates.gluon.fwd import TEMPLATE

    inputs = TEMPLATE.make_inputs(problem, "cuda", seed=0)
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    causal = problem.causal != "none"
    plain = problem.heads_q == problem.heads_kv and problem.seqlen_q == problem.seqlen_kv
    # GQA or N_q != N_kv: the template's own reference (every alignment, K/V heads shared).
    ref = reference_fp32(q, k, v, causal) if plain else TEMPLATE.reference(inputs)[0]
    cfg = TEMPLATE.default_config(problem, device)
    cfg_b = changed_config(cfg, overrides or {})
    refusal = TEMPLATE.constraint(problem, cfg_b, device)
    if refusal is not None:
        print(f"{problem.key():58s} B's config refused: {refusal}"
              + (" (timed anyway: --past-constraint)" if past_constraint else ""), flush=True)
        if not past_constraint:
            return None

    gqa = problem.heads_q != problem.heads_kv

    def cudnn() -> torch.Tensor:
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)

    fns: dict[str, Any] = {"cudnn": cudnn}
    # torch's is_causal is top-left, and torch hands its lower-right causal bias to other
    # backends than cuDNN (a dense mask would time cuDNN's masked kernel, 2.7-4.9x slower on
    # the H200): a bottom-right problem with N_q != N_kv gets no cuDNN column.
    lower_right = problem.causal == "bottom_right" and problem.seqlen_q != problem.seqlen_kv
    why_not = "torch gives cuDNN no bottom-right causal mask" if lower_right else None
    if why_not is None:
        try:
            cudnn()
        except RuntimeError as exc:  # (a shape cuDNN refuses: A and B are still timed)
            why_not = str(exc).splitlines()[0][:120]
    if why_not is not None:
        print(f"{problem.key():58s} no cuDNN column: {why_not}", flush=True)
        del fns["cudnn"]
    grids: dict[str, int] = {}
    default_overhead = gluon_fwd_kernel.TILE_OVERHEAD_BLOCKS
    for side, config, value, host_schedule, overhead, piece_cost in (
            ("A", cfg, 0, True, default_overhead, None),
            ("B", cfg_b, diag, not kernel_order, default_overhead if tile_overhead is None
             else tile_overhead, combine)):
        plan = gluon_fwd_kernel.LaunchPlan(q, k, causal_mode=problem.causal,
                                           scale=inputs["scale"], config=config.to_dict(),
                                           diag=value, host_schedule=host_schedule,
                                           tile_overhead=overhead, combine=piece_cost)
        fns[side] = lambda plan=plan: plan(q, k, v)[0]
        grids[side] = plan.grid[0]
    errors = {name: relative_error(fn(), ref) for name, fn in fns.items()}
    why, wrong = result_check(errors, TEMPLATE.tolerance(problem), allow_wrong)
    if why is not None:
        print(f"{problem.key():58s} not timed: {why}"
              + ("" if "B" not in why or allow_wrong else
                 " (--allow-wrong times a DIAG that is wrong by design)"), flush=True)
        return None
    readings: dict[str, list[float]] = {name: [] for name in fns}
    for order in round_orders(list(fns), rounds):  # rotated and mirrored: no fixed follower
        for name in order:
            readings[name].append(bench_ms(fns[name]))
    ms = {name: statistics.median(r) for name, r in readings.items()}
    return {"problem": problem.key(), "config": cfg.key(), "config_b": cfg_b.key(), "ms": ms,
            "readings_ms": readings,
            "errors": errors, "grid": grids, "wrong_results": wrong,
            "b_refused_by_constraint": refusal}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--diag", type=int, default=0, help="the B side's DIAG value")
    parser.add_argument("--diag-meaning", default=None,
                        help="what the DIAG value does, in words, kept in the result file "
                             "(an experiment's DIAG number is reused once it is reverted)")
    parser.add_argument("--kernel-order", action="store_true",
                        help="the B side walks the kernel's own causal order, not the host's "
                             "schedule")
    parser.add_argument("--tile-overhead", type=int, default=None,
                        help="the B side's schedule cost of a tile beyond its KV blocks")
    parser.add_argument("--combine", type=float, default=None,
                        help="the B side's split schedules' cost of a piece, in KV blocks per "
                             "piece of its tile (default: COMBINE_BLOCKS_PER_PIECE)")
    parser.add_argument("--config", action="append", default=[], metavar="KNOB=VALUE",
                        help="the B side's config: the default with this knob changed "
                             "(repeatable)")
    parser.add_argument("--past-constraint", action="store_true",
                        help="time B even where the template's constraint refuses its config "
                             "(a spilling one, say); the refusal is printed")
    parser.add_argument("--allow-wrong", action="store_true",
                        help="time B even where its results are wrong (a DIAG that drops work "
                             "by design); without it such a problem is not timed")
    parser.add_argument("--causal", default="none,top_left")
    parser.add_argument("--head-dims", default="128,64")
    parser.add_argument("--seqlens", default="512,1024,2048,4096,16384")
    parser.add_argument("--shapes", default="",
                        help="BxHxNxD or BxHqxHkvxNqxNkvxD items (bf16) instead of the "
                             "PROTOCOL shapes of --head-dims and --seqlens")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", default=os.environ.get("OUT", ""),
                        help="folder for the results, gluon_fwd_ab_<switch>.json "
                             "(default $OUT)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a Hopper GPU")
    if (not args.diag and not args.kernel_order and args.tile_overhead is None
            and args.combine is None and not args.config):
        parser.error("give the B side a switch: --diag N, --kernel-order, --tile-overhead N, "
                     "--combine X, --config KNOB=VALUE")
    try:
        overrides = config_overrides(args.config)
        shape_list = problem_shapes(args.shapes) if args.shapes else []
    except ValueError as exc:
        parser.error(str(exc))

    from benchmarks.gluon_fwd_bench import environment, protocol_problems
    from templates.base import Problem
    from templates.device import current_device

    device = current_device()
    rows: list[dict[str, Any]] = []
    head_dims = [int(d) for d in args.head_dims.split(",")]
    seqlens = tuple(int(n) for n in args.seqlens.split(","))
    causal = args.causal.split(",")
    problems = (protocol_problems(head_dims, seqlens) if not shape_list else
                [Problem(b, hq, hkv, nq, nkv, d, "bfloat16", c)
                 for b, hq, hkv, nq, nkv, d in shape_list for c in causal])
    for problem in problems:
        if problem.causal not in causal:
            continue
        row = ab_problem(problem, args.diag, args.kernel_order, args.rounds, device,
                         args.tile_overhead, overrides, args.combine, args.allow_wrong,
                         args.past_constraint)
        if row is None:
            continue
        rows.append(row)
        ms = row["ms"]
        versus = (f"x cuDNN: A {ms['cudnn'] / ms['A']:.3f}, B {ms['cudnn'] / ms['B']:.3f}"
                  if "cudnn" in ms else "no cuDNN")
        print(f"{problem.key():58s} B/A time {ms['B'] / ms['A']:.3f}x   {versus}   "
              f"max error {max(row['errors'].values()):.1e}"
              + (" (B wrong by design)" if row["wrong_results"] else ""), flush=True)
    if args.json:
        out = Path(args.json) / result_name(args.diag, args.kernel_order, args.tile_overhead,
                                            overrides, args.combine)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result_payload(
            environment(), args.diag, args.diag_meaning, args.kernel_order, args.tile_overhead,
            overrides, rows, args.combine), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
