"""Block-mask calls: does ``tuner.attention`` run the fastest of our block-sparse kernels,
compiled FlexAttention and (inference on Hopper) our Gluon forward? Side by side, one process.

    python benchmarks/masked_dispatch_bench.py --db sqlite:///tuner.db --json masked.json
    python benchmarks/masked_dispatch_bench.py --smoke     # one tiny row on the CPU (forward)
    python benchmarks/masked_dispatch_bench.py --spec benchmarks/specs/dispatch_sliding_hf.toml \
        --db sqlite:///tuner.db                            # the rows of another spec

Rows: ``benchmarks/specs/dispatch_masked.toml``'s problems (or ``--spec``'s), each as
inference (forward) and as a training step (forward + backward, ``torch.autograd.grad``), with
the named pattern's mask (``pattern_block_mask``: it carries ``BlockMask.pattern``, so the
dispatcher prices the call by that problem's measurements). Candidates, each checked first against a float32 reference
(SDPA on upcast inputs with the mask materialized: memory-efficient on a GPU, math on the
CPU), then timed in ``--rounds`` rounds in alternating orders (benchmarks/paired.py; median
kept):

* ``flash``: our block-sparse kernels (``use_implementation("flash")``: the configs the
  sweep measured on the mask's problem; where none, the dense problem's tuned configs fitted
  to the mask),
* ``flex``: compiled FlexAttention (``use_implementation("flex")``, its tuned config),
* ``gluon``: on a Hopper GPU with Gluon, inference rows only (it has no backward): the Gluon
  forward (``use_implementation("gluon")``, its tuned config or default),
* ``flash again``: ``flash`` timed as another candidate, the row's noise floor,
* ``tuner.attention``: the dispatcher's choice with the database ``--db`` (a sweep of
  dispatch_masked.toml; none: ours everywhere).

Verdicts per row: ``vs flash`` = flash ms / tuner ms, ``vs best`` = the fastest single
candidate's ms / tuner ms (>= 1.00: the choice cost nothing).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import tuner  # noqa: E402  (imports templates first: TRITON_INTERPRET is set without CUDA)
from benchmarks.dispatch_bench import (  # noqa: E402
    TOLERANCE,
    bench_function,
    check_and_time,
    ms_cell,
    ratio_cell,
)
from benchmarks.dispatch_bench import inputs_for as dense_inputs_for  # noqa: E402
from templates.base import Problem  # noqa: E402
from templates.device import current_device, interpreter_active  # noqa: E402
from templates.gluon.fwd import GLUON_MISSING  # noqa: E402
from templates.masks.mods import pattern_block_mask  # noqa: E402
from templates.pytorch.sdpa import sdpa  # noqa: E402
from tuner.attention import clear_plans  # noqa: E402
from tuner.dispatch.rule import Call, choose  # noqa: E402
from tuner.lookup.resolver import ConfigResolver, set_resolver  # noqa: E402
from tuner.settings import load_settings  # noqa: E402
from tuner.tuning.suites import load_spec_file  # noqa: E402

SPEC = Path(__file__).resolve().parent / "specs" / "dispatch_masked.toml"
SINGLES = ("flash", "flex", "gluon", "flash again")


@dataclass
class Row:
    problem: dict[str, Any]
    training: bool
    label: str
    chosen: str = ""
    why: str = ""
    ms: dict[str, float | None] = field(default_factory=dict)
    spread: dict[str, float] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)

    def verdicts(self) -> dict[str, float | None]:
        tuned = self.ms.get("tuner.attention")
        singles = [t for n, t in self.ms.items() if n in SINGLES and t]
        flash = self.ms.get("flash")
        return {"vs_flash": flash / tuned if flash and tuned else None,
                "vs_best": min(singles) / tuned if singles and tuned else None}


def rows_of(smoke: bool, spec: Path = SPEC) -> list[tuple[Problem, bool]]:
    if smoke:  # Flex has no backward on the CPU
        return [(Problem(batch=1, heads_q=4, heads_kv=2, seqlen_q=200, seqlen_kv=200,
                         head_dim=32, dtype="float32", causal="top_left", mask="sliding:40"),
                 False)]
    return [(p, training) for p in load_spec_file(spec).problems for training in (False, True)]


def inputs_for(p: Problem, device: str, training: bool) -> dict[str, Any]:
    """dispatch_bench's inputs (B, H, S, D) with the row's block mask."""
    t = dense_inputs_for(p, device, training)
    mask = pattern_block_mask(p.mask, p.seqlen_q, p.seqlen_kv, device=device)
    assert mask.pattern == p.mask
    t["kw"]["block_mask"] = mask
    return t


def reference(t: dict[str, Any], training: bool) -> tuple[torch.Tensor, ...]:
    q, k, v = (t[n].detach().float().requires_grad_(training) for n in ("q", "k", "v"))
    dense = t["kw"]["block_mask"].to_dense()
    if t["kw"]["is_causal"]:
        dense = dense & torch.ones(dense.shape[-2:], dtype=torch.bool, device=q.device).tril()
    group = q.shape[1] // k.shape[1]
    with torch.enable_grad():
        o = sdpa(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1),
                 backend="efficient" if q.is_cuda else "default", attn_mask=dense)
        outs = (o,) if not training else (o, *torch.autograd.grad(o, (q, k, v),
                                                                  t["do"].float()))
    # Rows that see no key: SDPA gives NaN, ours and Flex zeros.
    return tuple(torch.nan_to_num(x.detach()) for x in outs)


def _forced(name: str) -> Callable[..., torch.Tensor]:
    def call(*args: Any, **kw: Any) -> torch.Tensor:
        with tuner.use_implementation(name):
            return tuner.attention(*args, **kw)

    return call


def gluon_runs(device: str) -> bool:
    """Whether the Gluon forward can run here: a Hopper GPU and a triton with Gluon."""
    return device == "cuda" and not GLUON_MISSING and current_device().family == "hopper"


def candidates(device: str, training: bool) -> dict[str, Callable[..., torch.Tensor]]:
    """The row's candidates; Gluon only for inference rows where it runs (its backward is
    cuDNN's, which takes no block mask)."""
    gluon = {"gluon": _forced("gluon")} if not training and gluon_runs(device) else {}
    return {"flash": _forced("flash"), "flex": _forced("flex"), **gluon,
            "flash again": _forced("flash"), "tuner.attention": tuner.attention}


def run_rows(rows: list[tuple[Problem, bool]], device: str, bench: Callable[..., float],
             rounds: int) -> list[Row]:
    out = []
    for p, training in rows:
        torch.manual_seed(0)
        t = inputs_for(p, device, training)
        ref = reference(t, training)
        row = Row(p.to_dict(), training, f"{'train ' if training else ''}{p.key()}")
        info = current_device() if device == "cuda" else None
        choice = choose(Call(p, training, info)) if info is not None else None
        row.chosen = (f"{choice.implementation.name} {choice.config.key()}" if choice
                      else "flash (CPU: no device to price)")
        row.why = choice.why if choice else ""
        row.ms, row.errors, row.spread, _ = check_and_time(candidates(device, training), t,
                                                           training, ref, TOLERANCE[p.dtype],
                                                           bench, rounds)
        out.append(row)
        del t, ref
        if device == "cuda":
            torch.cuda.empty_cache()
        print(_line(row), flush=True)
    return out


def _line(row: Row) -> str:
    v = row.verdicts()
    cells = "  ".join(f"{n}={ms_cell(t)}" for n, t in row.ms.items())
    errors = "".join(f"  [{n}: {e}]" for n, e in row.errors.items())
    return (f"{row.label:<72} vs flash {ratio_cell(v['vs_flash'])} "
            f"vs best {ratio_cell(v['vs_best'])}  [{row.chosen.split(' ')[0]}]  {cells}{errors}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--db", help="database with the sweep's bests (default: none, "
                                     "so every row runs ours through tuner.attention)")
    parser.add_argument("--rep-ms", type=int, default=100, help="do_bench rep (ms)")
    parser.add_argument("--rounds", type=int, default=5,
                        help="alternated timing rounds per row (median kept)")
    parser.add_argument("--smoke", action="store_true", help="one tiny row on the CPU")
    parser.add_argument("--spec", type=Path, default=SPEC,
                        help="spec whose block-mask problems are the rows (default: %(default)s)")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args(argv)
    on_gpu = torch.cuda.is_available() and not interpreter_active()
    if not on_gpu and not args.smoke:
        parser.error("needs a CUDA GPU (or --smoke for a tiny row on the CPU)")
    url = args.db or f"sqlite:///{Path(os.devnull)}"
    set_resolver(ConfigResolver(load_settings(database_url=url, url=None)))
    clear_plans()
    rows = run_rows(rows_of(args.smoke, args.spec), "cuda" if on_gpu else "cpu",
                    bench_function(on_gpu, args.rep_ms), max(1, args.rounds))
    if args.json:
        import triton

        args.json.write_text(json.dumps({
            "device": torch.cuda.get_device_name() if on_gpu else "cpu",
            "torch": torch.__version__, "triton": str(triton.__version__),
            "python": platform.python_version(), "date": datetime.date.today().isoformat(),
            "command": " ".join(["python", "benchmarks/masked_dispatch_bench.py",
                                 *(sys.argv[1:] if argv is None else argv)]),
            "db": args.db, "timings_are_gpu_timings": on_gpu,
            "rows": [{**asdict(r), **r.verdicts()} for r in rows]}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
