"""Is ``tuner.attention`` ever slower than the torch SDPA it replaces? Side by side, one process.

    python benchmarks/dispatch_bench.py --db sqlite:///tuner.db --json dispatch.json
    python benchmarks/dispatch_bench.py --shipped off   # the untuned state: every row SDPA
    python benchmarks/dispatch_bench.py                 # a fresh install: the shipped table
    python benchmarks/dispatch_bench.py --smoke      # tiny rows on the CPU interpreter (CI)

For every row (a problem of ``benchmarks/specs/dispatch_*.toml``: the standard forward shapes,
a Llama-3-8B prefill, decode rows with one query token against 4k-128k of KV, training rows;
``--specs small``: grids of fewer query tiles than SMs, where gluon_fwd cuts tiles)
it times, with fresh random inputs and after checking each output against a float32 reference:

* ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` as a user's code calls it
  (torch's own backend choice: cuDNN on an H100 with torch 2.11): what ``tuner.attention``
  replaces,
* each SDPA backend forced (cudnn, flash, efficient),
* ``flash`` (our Triton kernels), ``gluon`` (the Hopper Gluon forward) and, on decode rows,
  ``decode`` (flash_decode), each forced through ``tuner.use_implementation`` with its tuned
  config (or default),
* ``sdpa again``: the same call as ``sdpa``, timed as another candidate: the noise floor,
* ``tuner.attention``: the dispatcher's choice for this device with the database ``--db`` (a
  sweep of the same specs stored there) and, after it, the measurements shipped for this GPU
  model (``--shipped``, TUNER_SHIPPED's values: on by default, as a user's process has them).
  With no ``--db`` that is what a fresh install runs; with no ``--db`` and ``--shipped off``,
  the untuned state: every row runs SDPA. The JSON records both (``db``, ``shipped``).

Training rows time forward + backward (``out.backward(do)``) and check dq, dk, dv; there
``gluon`` is the Gluon forward with cuDNN's backward (``gluon_cudnn_train``).
Verdicts per row: ``vs sdpa`` = sdpa time / tuner time (>= 1.00 means never slower) and
``vs best`` = the fastest single candidate's time / tuner time, both of medians over rounds.
Those medians come from separate readings, so drift between them counts; ``paired`` pairs
instead tuner.attention / sdpa within each round (``--rounds``, ``--train-rounds`` for
training rows, whose sdpa read up to 4.7% apart from itself in 5 rounds), with sdpa again /
sdpa in the same rounds as the noise floor, and says faster, same within noise or slower
(benchmarks/paired.py).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import tuner  # noqa: E402  (imports templates first: TRITON_INTERPRET is set without CUDA)
from benchmarks.paired import LEVEL, VERDICTS, compare, describe, interleave  # noqa: E402
from templates.base import Problem, relative_error  # noqa: E402
from templates.device import interpreter_active  # noqa: E402
from templates.pytorch.sdpa import sdpa  # noqa: E402
from tuner.attention import clear_plans, plan_for  # noqa: E402
from tuner.lookup.resolver import ConfigResolver, set_resolver  # noqa: E402
from tuner.settings import SettingsError, load_settings  # noqa: E402
from tuner.tuning.suites import load_spec_file  # noqa: E402

SPECS = Path(__file__).resolve().parent / "specs"
TOLERANCE = {"bfloat16": 2e-2, "float16": 5e-3, "float32": 1e-3}  # o and grads vs fp32
BACKENDS = ("cudnn", "flash", "efficient")


@dataclass
class Row:
    problem: dict[str, Any]
    training: bool
    label: str
    ms: dict[str, float | None] = field(default_factory=dict)  # candidate -> median ms
    errors: dict[str, str] = field(default_factory=dict)  # candidate -> why not timed
    spread: dict[str, float] = field(default_factory=dict)  # (max - min) / median of rounds
    rounds_ms: dict[str, list[float]] = field(default_factory=dict)  # candidate -> per round
    paired: dict[str, Any] = field(default_factory=dict)  # benchmarks.paired.compare's
    chosen: str = ""
    why: str = ""

    def verdicts(self) -> dict[str, float | None]:
        mine = self.ms.get("tuner.attention")
        base, again = self.ms.get("sdpa"), self.ms.get("sdpa again")
        singles = [t for name, t in self.ms.items()
                   if name not in ("tuner.attention", "sdpa again") and t]
        return {"vs_sdpa": base / mine if base and mine else None,
                "vs_best": min(singles) / mine if singles and mine else None,
                "sdpa_vs_itself": base / again if base and again else None}


def rows_of(spec_names: list[str], smoke: bool) -> list[tuple[Problem, bool]]:
    """(problem, training) of every row; the training spec's rows time forward + backward."""
    if smoke:
        tiny = dict(batch=1, heads_q=4, heads_kv=2, head_dim=16, dtype="float16")
        return [(Problem(seqlen_q=48, seqlen_kv=48, causal="top_left", **tiny), False),
                (Problem(seqlen_q=1, seqlen_kv=300, **tiny), False),
                (Problem(seqlen_q=40, seqlen_kv=40, **tiny), True)]
    out: list[tuple[Problem, bool]] = []
    for name in spec_names:
        spec = load_spec_file(SPECS / f"dispatch_{name}.toml")
        out += [(p, name == "train") for p in spec.problems]
    return out


def inputs_for(p: Problem, device: str, training: bool, layout: str = "bhsd"
               ) -> dict[str, Any]:
    """q, k, v (B, H, S, D); ``layout`` "bshd": views of (B, S, H, D) memory, as a model's
    projections hand them over (Hugging Face transposes (B, S, H, D) to (B, H, S, D))."""
    dtype = getattr(torch, p.dtype)
    shape_q = (p.batch, p.heads_q, p.seqlen_q, p.head_dim)
    shape_kv = (p.batch, p.heads_kv, p.seqlen_kv, p.head_dim)

    def randn(shape: tuple[int, int, int, int]) -> torch.Tensor:
        if layout == "bhsd":
            return torch.randn(shape, device=device, dtype=dtype)
        b, h, n, d = shape
        return torch.randn((b, n, h, d), device=device, dtype=dtype).transpose(1, 2)

    q, k, v = (randn(s).requires_grad_(training) for s in (shape_q, shape_kv, shape_kv))
    kw = {"is_causal": p.causal != "none", "enable_gqa": p.heads_q != p.heads_kv}
    return {"q": q, "k": k, "v": v, "do": torch.randn(shape_q, device=device, dtype=dtype),
            "kw": kw}


def reference(t: dict[str, Any], training: bool) -> tuple[torch.Tensor, ...]:
    """float32 outputs (and grads) by SDPA on upcast inputs: memory-efficient on a GPU (no
    score matrix; it takes no GQA, so K/V heads are repeated here), math on the CPU."""
    q, k, v = (t[n].detach().float().requires_grad_(training) for n in ("q", "k", "v"))
    backend = "efficient" if q.is_cuda else "default"
    group = q.shape[1] // k.shape[1]
    with torch.enable_grad():
        o = sdpa(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1),
                 backend=backend, is_causal=t["kw"]["is_causal"])
        if not training:
            return (o.detach(),)
        return (o.detach(), *torch.autograd.grad(o, (q, k, v), t["do"].float()))


def candidates(p: Problem, on_gpu: bool) -> dict[str, Callable[..., torch.Tensor]]:
    def user_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: Any) -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, **kw)

    # "sdpa again" is the same call timed as a second candidate: the row's noise floor (two
    # timings of one kernel differ by this much, so smaller gaps say nothing).
    out: dict[str, Callable[..., torch.Tensor]] = {"sdpa": user_sdpa, "sdpa again": user_sdpa}
    if on_gpu:
        for backend in BACKENDS:
            out[f"sdpa {backend}"] = (lambda b: lambda q, k, v, **kw: sdpa(q, k, v, backend=b,
                                                                             **kw))(backend)
    forced = ["flash", "gluon"] + (["decode"] if p.seqlen_q == 1 and p.causal == "none"
                                   else [])
    for name in forced:
        out[name] = (lambda n: lambda q, k, v, **kw: _forced(n, q, k, v, **kw))(name)
    out["tuner.attention"] = tuner.attention
    return out


def _forced(name: str, *args: Any, **kw: Any) -> torch.Tensor:
    with tuner.use_implementation(name):
        return tuner.attention(*args, **kw)


def checked_call(fn: Callable[..., torch.Tensor], t: dict[str, Any], training: bool,
                 ref: tuple[torch.Tensor, ...], tol: float
                 ) -> tuple[Callable[[], tuple[torch.Tensor, ...]] | None, str]:
    """The timed call of ``fn``, once its outputs passed the check (else None and why)."""
    q, k, v = t["q"], t["k"], t["v"]

    def call() -> tuple[torch.Tensor, ...]:
        o = fn(q, k, v, **t["kw"])
        if not training:
            return (o,)
        grads = torch.autograd.grad(o, (q, k, v), t["do"])
        return (o.detach(), *grads)

    try:
        outs = call()
    except Exception as exc:  # a backend that cannot take the problem: a result, not a crash
        return None, f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    err = max(relative_error(o, r) for o, r in zip(outs, ref, strict=True))
    if not err <= tol:
        return None, f"error {err:.3g} > {tol:g}"
    return call, ""


def run_rows(rows: list[tuple[Problem, bool]], device: str, bench: Callable[..., float],
             rounds: int, layout: str = "bhsd", train_rounds: int | None = None) -> list[Row]:
    """Each row's candidates checked, then timed in ``rounds`` alternated rounds
    (``train_rounds`` for training rows); a candidate's time is the median of its rounds, so
    a clock or thermal drift during the row falls on every candidate alike. ``paired``:
    tuner.attention / sdpa within each round against sdpa again / sdpa (the A/A floor),
    benchmarks/paired.py's verdict."""
    train_rounds = train_rounds or rounds
    on_gpu = device == "cuda"
    out = []
    for p, training in rows:
        torch.manual_seed(0)
        t = inputs_for(p, device, training, layout)
        ref = reference(t, training)
        row = Row(p.to_dict(), training, f"{'train ' if training else ''}{p.key()}")
        choice = plan_for(t["q"], t["k"], t["v"], needs_grad=training, **t["kw"])
        row.chosen = f"{choice.implementation.name} {choice.config.key()}"
        row.why = choice.why
        fns = {name: fn for name, fn in candidates(p, on_gpu).items()
               if not (training and name == "decode")}  # it has no backward (gluon's: cuDNN's)
        row.ms, row.errors, row.spread, row.rounds_ms = check_and_time(
            fns, t, training, ref, TOLERANCE[p.dtype], bench, train_rounds if training else rounds)
        if {"sdpa", "sdpa again", "tuner.attention"} <= set(row.rounds_ms):
            row.paired = compare(row.rounds_ms, "sdpa", "tuner.attention", "sdpa again")
        out.append(row)
        del t, ref
        if on_gpu:
            torch.cuda.empty_cache()
        print(_line(row), flush=True)
    return out


def check_and_time(fns: dict[str, Callable[..., torch.Tensor]], t: dict[str, Any],
                   training: bool, ref: tuple[torch.Tensor, ...], tolerance: float,
                   bench: Callable[..., float], rounds: int
                   ) -> tuple[dict[str, float | None], dict[str, str], dict[str, float],
                              dict[str, list[float]]]:
    """(ms, errors, spread, ms per round) of a row: each candidate checked against ``ref``
    once (a failed one gets no time, its error instead), the rest timed by
    :func:`timed_rounds`."""
    ms: dict[str, float | None] = {}
    errors: dict[str, str] = {}
    calls = {}
    for name, fn in fns.items():
        call, why = checked_call(fn, t, training, ref, tolerance)
        if call is None:
            ms[name], errors[name] = None, why
        else:
            calls[name] = call
    medians, spread, times = timed_rounds(calls, bench, rounds)
    ms.update(medians)
    return ms, errors, spread, times


def timed_rounds(calls: dict[str, Callable[[], Any]], bench: Callable[..., float], rounds: int
                 ) -> tuple[dict[str, float], dict[str, float], dict[str, list[float]]]:
    """(median ms, (max - min) / median, the ms of every round) per call over ``rounds``
    rounds that time every call once, in benchmarks/paired.py's orders: rotated, and every
    second round mirrored. A kernel that runs the GPU hot (power, clocks) slows whatever is
    timed right after it, and in a fixed order that would always be the same call
    (tuner.attention after gluon read 10% slow on the H100, 2026-11-24, where the same kernel
    alone read the same as sdpa); rotation alone keeps each call's predecessor, the mirror
    gives it its other neighbour in turn."""
    times = interleave({name: (lambda c: lambda: bench(c))(call) for name, call in calls.items()},
                       rounds)
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    spread = {name: (max(ts) - min(ts)) / medians[name] for name, ts in times.items()}
    return medians, spread, times


def bench_function(on_gpu: bool, rep_ms: int) -> Callable[[Callable[[], Any]], float]:
    """Milliseconds of one call: do_bench's median on a GPU; elsewhere one wall-clock
    reading, which proves the call runs and means nothing more."""
    if on_gpu:
        import triton.testing

        def bench(fn: Callable[[], Any]) -> float:
            return float(triton.testing.do_bench(fn, warmup=25, rep=rep_ms,
                                                 return_mode="median"))
    else:
        import time

        def bench(fn: Callable[[], Any]) -> float:
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e3
    return bench


def _line(row: Row) -> str:
    v = row.verdicts()
    cells = "  ".join(f"{n}={ms_cell(t)}" for n, t in row.ms.items())
    return (f"{row.label:<58} vs sdpa {ratio_cell(v['vs_sdpa'])} "
            f"vs best {ratio_cell(v['vs_best'])}  [{row.chosen.split(' ')[0]}]  {cells}")


def ms_cell(t: float | None) -> str:
    return "-" if t is None else f"{t:.4g}"


def ratio_cell(r: float | None) -> str:
    return "  -  " if r is None else f"{r:.2f}x"


def print_table(rows: list[Row]) -> None:
    print(f"\n{'row':<58} {'sdpa ms':>9} {'best single':>22} {'tuner ms':>9} {'chosen':>7} "
          f"{'vs sdpa':>8} {'vs best':>8} {'noise':>6}")
    for row in rows:
        singles = {n: t for n, t in row.ms.items()
                   if n not in ("tuner.attention", "sdpa again") and t}
        best = min(singles, key=singles.__getitem__) if singles else "-"
        v = row.verdicts()
        print(f"{row.label:<58} {ms_cell(row.ms.get('sdpa')):>9} "
              f"{best + ' ' + ms_cell(singles.get(best)):>22} "
              f"{ms_cell(row.ms.get('tuner.attention')):>9} {row.chosen.split(' ')[0]:>7} "
              f"{ratio_cell(v['vs_sdpa']):>8} {ratio_cell(v['vs_best']):>8} "
              f"{ratio_cell(v['sdpa_vs_itself']):>6}")
    ratios = [r.verdicts()["vs_sdpa"] for r in rows]
    noise = [abs(1 - x) for r in rows if (x := r.verdicts()["sdpa_vs_itself"])]
    worst = min((x for x in ratios if x), default=None)
    print(f"worst vs sdpa: {ratio_cell(worst)}; rows slower than sdpa (< 0.98x): "
          f"{sum(1 for x in ratios if x and x < 0.98)} of {len(rows)}; 'noise' = sdpa timed "
          f"twice (largest gap {max(noise, default=0):.1%}): the same kernel's run-to-run spread")
    geo = [x for x in ratios if x]
    if geo:
        print(f"geomean vs sdpa: {math.prod(geo) ** (1 / len(geo)):.3f}x over {len(geo)} rows")
    paired = [r for r in rows if r.paired]
    if paired:  # the medians above are of separate readings; these pair them within a round
        print(f"\npaired: tuner.attention / sdpa time within each round (< 1.00x: faster), "
              f"median [{100 * LEVEL:.0f}% interval], A/A noise floor (sdpa again / sdpa), "
              "verdict")
        for row in paired:
            print(f"{row.label:<58} {describe(row.paired)}")
        counts = {v: sum(r.paired["verdict"] == v for r in paired) for v in VERDICTS}
        print("verdicts: " + ", ".join(f"{n} {v}" for v, n in counts.items() if n)
              + f" (of {len(paired)} rows)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--db", help="database with the sweep's bests (default: none: "
                                     "tuner.attention answers from the shipped table of this "
                                     "GPU model, if one ships, else runs SDPA)")
    parser.add_argument("--shipped", help="on, off or a folder of tables: the shipped "
                                          "measurements tuner.attention consults after --db "
                                          "(default: TUNER_SHIPPED, else on); off with no --db: "
                                          "every row runs SDPA, the untuned state")
    parser.add_argument("--specs", default="fwd,decode,train",
                        help="which benchmarks/specs/dispatch_<name>.toml rows to run")
    parser.add_argument("--rep-ms", type=int, default=100, help="do_bench rep (ms)")
    parser.add_argument("--rounds", type=int, default=5,
                        help="alternated timing rounds per row (median kept)")
    parser.add_argument("--train-rounds", type=int, default=12,
                        help="the same for training rows, whose sdpa read up to 4.7%% apart "
                             "from itself in 5 rounds (estimated 1.3 s a round on an H100)")
    parser.add_argument("--layout", choices=("bhsd", "bshd"), default="bhsd",
                        help="bshd: q, k, v as transposed views of (B, S, H, D), as models "
                             "hand them over")
    parser.add_argument("--smoke", action="store_true", help="tiny rows, CPU interpreter")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args(argv)
    on_gpu = torch.cuda.is_available() and not interpreter_active()
    if not on_gpu and not args.smoke:
        parser.error("needs a CUDA GPU (or --smoke for tiny rows under the interpreter)")
    url = args.db or f"sqlite:///{Path(os.devnull)}"
    try:
        settings = load_settings(database_url=url, url=None, **(
            {"shipped": args.shipped} if args.shipped is not None else {}))
    except SettingsError as exc:  # a bad --shipped (or TUNER_*): what is allowed, no traceback
        parser.error(str(exc))
    set_resolver(ConfigResolver(settings))
    clear_plans()
    rows = run_rows(rows_of([s for s in args.specs.split(",") if s], args.smoke),
                    "cuda" if on_gpu else "cpu", bench_function(on_gpu, args.rep_ms),
                    max(1, args.rounds), args.layout, max(1, args.train_rounds))
    print_table(rows)
    if args.json:
        args.json.write_text(json.dumps({
            "device": torch.cuda.get_device_name() if on_gpu else "cpu (TRITON_INTERPRET=1)",
            "torch": torch.__version__, "triton": _triton_version(),
            "cudnn": torch.backends.cudnn.version() if on_gpu else None,
            "python": platform.python_version(), "date": datetime.date.today().isoformat(),
            "command": " ".join(["python", "benchmarks/dispatch_bench.py",
                                 *(sys.argv[1:] if argv is None else argv)]),
            "db": args.db, "shipped": settings.shipped, "layout": args.layout,
            "timings_are_gpu_timings": on_gpu,
            "rows": [{**asdict(r), **r.verdicts()} for r in rows]}, indent=2) + "\n")
    return 0


def _triton_version() -> str:
    import triton

    return str(triton.__version__)


if __name__ == "__main__":
    raise SystemExit(main())
