"""TPE with a quarter of a grid's trials against the grid's best, replayed on recorded trials.

The issue's quality bar: on the H100, the best config TPE finds within 25% of the grid's
trial count, against the grid's best (target: within 2%). Input: every trial of a grid sweep
over a subset of the space small enough to run exhaustively (benchmarks/specs/grid_study.toml),
as ``tuner export --trials`` writes them. For each problem, TPE (and random search, for
contrast) is replayed with a budget of that fraction of the grid's measured configs, over
many seeds: the sweep's own search loop (tuner.tuning.replay), each config answered with its
recorded measurement, so no GPU is needed here. Reported per problem: the grid's best, what
each sampler found (median and worst over the seeds), the ratios to the grid's best and the
share of seeds within the target; each sampler both as a sweep runs it (the default config
measured first) and alone (``<sampler>-alone``: only what it suggests).

    python3 benchmarks/tpe_vs_grid.py grid_trials.json \\
        [--spec benchmarks/specs/grid_study.toml] [--seeds 20] [--fraction 0.25] \\
        [--target 0.98] [--sampler tpe --sampler random] \\
        [--json benchmarks/results/tpe_vs_grid_h100.json]

Give ``--spec none`` for a recording over the whole space. A recording that is not a complete
grid (fewer measured configs than the space's valid ones, e.g. a TPE sweep) still replays,
but its "grid best" is only the best recorded, and the report says so.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import templates  # noqa: E402, F401  (registers the templates the recording names)
from templates.base import Problem  # noqa: E402
from templates.registry import get_template  # noqa: E402
from tuner.cli.common import problem_label  # noqa: E402
from tuner.errors import TunerError  # noqa: E402
from tuner.tuning.replay import (  # noqa: E402
    RecordedProblem,
    SamplerSummary,
    compare_samplers,
    load_recorded_file,
    search_space,
)
from tuner.tuning.search.space import SpaceRestriction, valid_configs  # noqa: E402
from tuner.tuning.suites import load_spec_file  # noqa: E402
from tuner.tuning.sweep import device_from_dict  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_SPEC = ROOT / "benchmarks" / "specs" / "grid_study.toml"
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "tpe_vs_grid_h100.json"
TARGET = 0.98  # the best found within 2% of the grid's best (--target)


@dataclass(frozen=True)
class ProblemStudy:
    """One recorded problem: its grid and what each sampler found with the budget."""

    recorded: RecordedProblem  # the trials inside the searched space
    grid_configs: int | None  # valid configs of the space (None: too many to enumerate)
    budget: int
    summaries: list[SamplerSummary]
    target: float = TARGET

    @property
    def complete(self) -> bool:
        return self.grid_configs is not None and self.recorded.results >= self.grid_configs

    def to_dict(self) -> dict[str, Any]:
        first = self.summaries[0].runs[0] if self.summaries and self.summaries[0].runs else None
        return {"problem_key": self.recorded.problem_key, "problem": self.recorded.problem,
                "label": problem_label(self.recorded.problem),
                "grid_configs": self.grid_configs, "recorded_configs": self.recorded.results,
                "complete_grid": self.complete,
                "grid_best_tflops": self.recorded.best_tflops,
                "default_tflops": first.default_tflops if first else None,
                "budget": self.budget,
                "samplers": {s.sampler: sampler_stats(s, self.target)
                             for s in self.summaries}}


def sampler_stats(summary: SamplerSummary, target: float = TARGET) -> dict[str, Any]:
    """Median and worst over the seeds, and the share of seeds within the target (a seed
    that found nothing that ran counts as 0)."""
    found = [r.best_found_tflops or 0.0 for r in summary.runs]
    ratios = [r.fraction_of_best or 0.0 for r in summary.runs]
    return {"seeds": len(summary.runs),
            "median_best_tflops": statistics.median(found), "worst_best_tflops": min(found),
            "median_ratio": statistics.median(ratios), "worst_ratio": min(ratios),
            "within_target": sum(r >= target for r in ratios) / len(ratios),
            "runs": [r.to_dict() for r in summary.runs]}


def grid_size(recorded: RecordedProblem, space: SpaceRestriction | None) -> int | None:
    """Valid configs of the searched space for the recorded problem and device: what a
    complete grid sweep measures."""
    template = get_template(recorded.template)
    problem = Problem.from_dict(recorded.problem)
    device = device_from_dict(recorded.device)
    valid = valid_configs(search_space(recorded, space),
                          lambda c: template.constraint(problem, c, device))
    return None if valid is None else len(valid)


def study(recorded: RecordedProblem, *, space: SpaceRestriction | None, fraction: float,
          samplers: list[str], seeds: int, target: float = TARGET) -> ProblemStudy:
    inside = recorded.within(search_space(recorded, space))
    budget = max(1, round(fraction * inside.results))
    # Each sampler twice: as a sweep runs it (the default config measured first, so it never
    # ends below the default) and alone (only what the sampler suggests). Where the default is
    # the grid's best the first is 1.0 by construction; the second says what the sampler adds.
    summaries = [*compare_samplers(recorded, samplers=samplers, budget=budget,
                                   seeds=list(range(seeds)), space=space),
                 *(dataclasses.replace(summary, sampler=f"{summary.sampler}-alone")
                   for summary in compare_samplers(recorded, samplers=samplers, budget=budget,
                                                   seeds=list(range(seeds)), space=space,
                                                   default_first=False))]
    return ProblemStudy(inside, grid_size(recorded, space), budget, summaries, target)


def environment(recordings: list[RecordedProblem]) -> dict[str, Any]:
    """The GPU that measured the trials (PROTOCOL.md's fields), and how this replay ran."""
    device = recordings[0].device if recordings else {}
    return {"gpu": device.get("name", ""), "sm_count": device.get("sm_count"),
            "driver": device.get("driver_version", ""), "torch": device.get("torch_version", ""),
            "triton": device.get("triton_version", ""), "cuda": device.get("cuda_version", ""),
            "date": datetime.datetime.now(datetime.UTC).isoformat(),
            "command": " ".join([sys.executable, *sys.argv])}


def print_table(studies: list[ProblemStudy], fraction: float, target: float = TARGET) -> None:
    samplers = [summary.sampler for summary in studies[0].summaries] if studies else []
    print(f"\nbest found with {fraction:.0%} of the grid's configs / grid best, over the seeds "
          f"(target: >= {target}; ok: share of seeds that met it); grid best in TFLOP/s")
    print(f"{'problem':44} {'grid':>9} {'best':>7} {'budget':>6}  "
          + "  ".join(f"{name + ' median/worst':>24} {'ok':>4}" for name in samplers))
    for s in studies:
        grid = f"{s.recorded.results}/{s.grid_configs if s.grid_configs is not None else '?'}"
        cells = []
        for summary in s.summaries:
            stats = sampler_stats(summary, s.target)
            cells.append(f"{stats['median_ratio']:>12.3f} / {stats['worst_ratio']:<9.3f} "
                         f"{stats['within_target']:>4.0%}")
        best = s.recorded.best_tflops
        print(f"{problem_label(s.recorded.problem):44} {grid:>9} "
              f"{'-' if best is None else round(best):>7} {s.budget:>6}  " + "  ".join(cells))
    if not all(s.complete for s in studies):
        print("grid = configs recorded / valid configs of the space: an incomplete grid's "
              "'best' is only the best recorded")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trials", type=Path, help="trials file of `tuner export --trials`")
    parser.add_argument("--spec", default=str(DEFAULT_SPEC),
                        help="the spec the grid was swept with (its [space]); 'none': the "
                             "whole space")
    parser.add_argument("--fraction", type=float, default=0.25,
                        help="budget: this fraction of the grid's measured configs")
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--target", type=float, default=TARGET,
                        help="best found / grid best that counts as within the target")
    parser.add_argument("--sampler", action="append", dest="samplers",
                        help="samplers to replay (repeatable; default tpe and random)")
    parser.add_argument("--template", default=None, help="only this template's problems")
    parser.add_argument("--json", type=Path, default=DEFAULT_OUT, help="where to write rows")
    args = parser.parse_args(argv)
    if not 0 < args.fraction <= 1:
        parser.error(f"--fraction must be in (0, 1], but got {args.fraction}")
    if args.seeds < 1:
        parser.error(f"--seeds must be >= 1, but got {args.seeds}")
    if not 0 < args.target <= 1:
        parser.error(f"--target must be in (0, 1], but got {args.target}")
    samplers = args.samplers or ["tpe", "random"]
    try:
        space = None if args.spec == "none" else load_spec_file(Path(args.spec)).space
        recordings = [r for r in load_recorded_file(args.trials)
                      if args.template is None or r.template == args.template]
        if not recordings:
            raise TunerError(f"{str(args.trials)!r} holds no recorded problem"
                             + (f" of template {args.template!r}" if args.template else ""),
                             "export the grid sweep's trials with `tuner export FILE --trials`")
        start = time.monotonic()
        studies = [study(r, space=space, fraction=args.fraction, samplers=samplers,
                         seeds=args.seeds, target=args.target) for r in recordings]
    except TunerError as exc:
        print(f"error: {exc.message}\nfix: {exc.fix}", file=sys.stderr)
        return 2
    report = {"about": __doc__.splitlines()[0], "env": environment(recordings),
              "source": str(args.trials), "spec": None if space is None else args.spec,
              "space": {k: v if isinstance(v, str) else list(v)
                        for k, v in (space or {}).items()},
              "fraction": args.fraction, "seeds": args.seeds, "target": args.target,
              "replay_s": time.monotonic() - start,
              "problems": [s.to_dict() for s in studies]}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1) + "\n")
    print_table(studies, args.fraction, args.target)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
