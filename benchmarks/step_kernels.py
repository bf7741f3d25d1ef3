"""Where a masked training step's attention time goes, kernel by kernel: one forward +
backward (``o = attention(q, k, v); torch.autograd.grad(o, (q, k, v), do)``) of the masked
bench's rows (benchmarks/masked_fwd_bwd_bench.py: its shapes, masks, implementations and
reference) under torch.profiler, each kernel's GPU time per step and their sum.

    python benchmarks/step_kernels.py --rows 128:16384:sliding \
        --impls flash-gluon,gluon-split-lf,flex [--reps 10] [--json out/kernels.json]
        [--shapes 128:32768 --heads 1,32,16 --rows 128:32768:sliding]   # other rows
    TRITON_INTERPRET=1 python benchmarks/step_kernels.py --smoke   # CPU: ours, its operators

What a total ratio says, the masked bench times (do_bench); this tells its parts apart: the
main kernels, the passes every backward pays once (delta, the dQ cast), and copies no kernel
asked for (a gradient copied into its input's layout, a select's zeroed gradient). Every step
is checked against the float32 reference first; one that fails is reported and not profiled.
``--smoke`` profiles our Triton kernels under the interpreter, where the CPU operators stand
in for kernels (a check that the script runs, not a reading).
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import masked_fwd_bwd_bench as bench  # noqa: E402

from templates.base import relative_error  # noqa: E402
from templates.device import interpreter_active  # noqa: E402

NAME_CHARS = 90  # kernel names are C++ templates: their head tells them apart


# The masked bench's implementations that train (its ``implementations``, less the forward-only
# ones): the names --impls takes, checked before any row's inputs are made.
IMPLEMENTATIONS = ("ours", "flex", "flash-gluon", "gluon-train", *bench.BWD_VARIANTS,
                   "sdpa-cudnn", "sdpa-efficient")


def attention_of(name: str, case: bench.Case, setup: bench.Setup) -> bench.Attention:
    """The masked bench's implementation ``name`` for ``case``'s mask (its builders); a
    ValueError where it does not run on this setup (Gluon off Hopper, baselines off CUDA)."""
    builders = dict(bench.implementations(setup, case))
    if name not in builders or name in bench.FORWARD_ONLY:
        raise ValueError(f"--impls: {name!r} does not train here; here: "
                         f"{sorted(set(builders) - set(bench.FORWARD_ONLY))}")
    return builders[name]()


def kernel_ms(step: bench.Call, reps: int, on_gpu: bool) -> dict[str, dict[str, float]]:
    """Per kernel (on the CPU: per operator, self time): ms per step and launches per step,
    over ``reps`` profiled steps after three unprofiled ones."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        step()
    if on_gpu:
        torch.cuda.synchronize()
    activity = ProfilerActivity.CUDA if on_gpu else ProfilerActivity.CPU
    with profile(activities=[activity]) as prof:
        for _ in range(reps):
            step()
        if on_gpu:
            torch.cuda.synchronize()
    us: collections.Counter[str] = collections.Counter()
    launches: collections.Counter[str] = collections.Counter()
    for event in prof.events():
        if on_gpu and event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        name = event.name[:NAME_CHARS]
        us[name] += event.device_time_total if on_gpu else event.self_cpu_time_total
        launches[name] += 1
    return {name: {"ms": total / reps / 1e3, "per_step": launches[name] / reps}
            for name, total in us.most_common()}


def checked(case: bench.Case, step: bench.Call, tolerance: float) -> str | None:
    """Why the step's outputs fail the reference (None: they pass)."""
    outs = step()
    for name, out, ref in zip(bench.OUTPUTS, outs, case.ref, strict=True):
        err = relative_error(out, ref)
        if not err <= tolerance:  # NaN fails too
            return f"{name} error {err:.3g} over the tolerance {tolerance:g}"
    return None


def run(setup: bench.Setup, rows: list[tuple[int, int, str]], impls: list[str], reps: int,
        top: int) -> list[dict[str, Any]]:
    on_gpu = setup.device == "cuda"
    out = []
    for head_dim, seqlen, pattern in rows:
        case = bench.prepare(setup, head_dim, seqlen, pattern)
        for impl in impls:
            (_, step), = [s for s in bench.steps(attention_of(impl, case, setup), case.tensors)
                          if s[0] == "fwd+bwd"]
            result: dict[str, Any] = {"row": case.row.name, "impl": impl}
            failed = checked(case, step, setup.tolerance)
            if failed:
                result["failed"] = failed
                print(f"== {case.row.name} {impl}: {failed}; not profiled", flush=True)
            else:
                kernels = kernel_ms(step, reps, on_gpu)
                result.update(total_ms=sum(k["ms"] for k in kernels.values()), kernels=kernels)
                print(f"== {case.row.name} {impl}: {result['total_ms']:.3f} ms of "
                      f"{'kernels' if on_gpu else 'CPU operators'} a step", flush=True)
                for name, k in list(kernels.items())[:top]:
                    print(f"   {k['ms']:8.4f} ms  x{k['per_step']:g}  {name}")
            out.append(result)
        if on_gpu:
            torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="128:16384:sliding",
                        help="the masked bench's rows, D:N[:pattern prefix], comma-separated")
    parser.add_argument("--impls", default="flash-gluon,gluon-split-lf,flex",
                        help="comma-separated: ours, flex, flash-gluon, gluon-train and the "
                             "masked bench's backward variants (gluon-split-lf, ...)")
    parser.add_argument("--shapes", help="the masked bench's --shapes (D:N,...)")
    parser.add_argument("--heads", help="the masked bench's --heads (B,HQ,HKV)")
    parser.add_argument("--reps", type=int, default=10, help="profiled steps")
    parser.add_argument("--top", type=int, default=12, help="kernels printed per step")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument("--smoke", action="store_true",
                        help="CPU under TRITON_INTERPRET=1: one tiny row, ours")
    args = parser.parse_args(argv)
    if args.smoke:
        if not interpreter_active():
            parser.error("--smoke runs the kernels on the CPU: set TRITON_INTERPRET=1")
        setup, rows, impls = bench.SMOKE, "32:128", "ours"
    else:
        if not torch.cuda.is_available() or interpreter_active():
            print("step_kernels.py needs a CUDA GPU (or --smoke)", file=sys.stderr)
            return 2
        setup, rows, impls = bench.GPU, args.rows, args.impls
    try:
        setup = bench.with_shapes(setup, args.shapes, args.heads)
    except ValueError as exc:
        parser.error(str(exc))
    specs = [(d, n, p) for d, n in setup.shapes for p in setup.patterns]
    chosen = bench.selected_rows(specs, rows)
    if not chosen:
        parser.error(f"--rows {rows!r} names none of the rows "
                     f"({', '.join(f'{d}:{n}:{p}' for d, n, p in specs)})")
    names = [n.strip() for n in impls.split(",") if n.strip()]
    if unknown := [n for n in names if n not in IMPLEMENTATIONS]:
        parser.error(f"--impls: unknown {unknown}; known: {list(IMPLEMENTATIONS)}")
    results = run(setup, chosen, names, max(1, args.reps), args.top)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        env = bench.smoke_environment() if args.smoke else bench.environment()
        args.json.write_text(json.dumps({"environment": env, "reps": args.reps,
                                         "rows": results}, indent=1))
    return 1 if any("failed" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
