"""``tuner replay``: run the samplers on recorded trials, offline, and compare them."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from tuner.cli.common import DbOption, JsonOption, database_url, print_json, print_table
from tuner.errors import TunerError

__all__ = ["replay"]


def replay(
    source: Annotated[Path | None, typer.Option(
        "--from", help="trials file from `tuner export --trials` (default: the database)",
        show_default=False)] = None,
    template: Annotated[str | None, typer.Option("--template", help="template name")] = None,
    device: Annotated[str | None, typer.Option("--device", help="device name or key")] = None,
    sampler: Annotated[list[str] | None, typer.Option(
        "--sampler", help="samplers to compare (repeatable; default tpe and random)")] = None,
    budget: Annotated[int | None, typer.Option(
        "--budget", help="configs each replayed search may measure", show_default=False)] = None,
    fraction: Annotated[float, typer.Option(
        "--fraction", help="without --budget: this fraction of the recorded configs")] = 0.25,
    seeds: Annotated[int, typer.Option("--seeds", help="runs per sampler (seeds 0..N-1)")] = 5,
    spec: Annotated[Path | None, typer.Option(
        "--spec", help="search only the \\[space] of this sweep spec (the one the recording "
                       "was swept with)", show_default=False)] = None,
    prior: Annotated[bool, typer.Option(
        "--prior", help="measure the transfer prior first, as a sweep does: the best "
                        "recorded configs of the recording's neighbouring problems")] = False,
    db: DbOption = None,
    json_out: JsonOption = False,
) -> None:
    """Compare samplers offline on recorded trials (no GPU needed).

    Each replayed search answers configs from the recording; the table says how close each
    sampler gets to the best recorded config with the budget, e.g. TPE with 25% of a grid
    sweep's trials against the grid's best.
    """
    # lazy: optuna, sqlalchemy, torch+triton +2.9 s (2-core CPU); keeps `tuner --help` < 1 s
    import templates  # noqa: F401  (registers the templates replayed)
    from tuner.tuning.replay import (
        compare_samplers,
        load_recorded_file,
        load_recorded_from_db,
        recorded_prior,
        search_space,
    )
    from tuner.tuning.suites import load_spec_file

    if budget is not None and budget < 1:
        raise TunerError(f"--budget must be >= 1, but got {budget}", "e.g. --budget 20")
    if not 0 < fraction <= 1:
        raise TunerError(f"--fraction must be in (0, 1], but got {fraction}", "e.g. 0.25")
    if seeds < 1:
        raise TunerError(f"--seeds must be >= 1, but got {seeds}", "e.g. --seeds 5")
    recorded = (load_recorded_file(source) if source is not None
                else load_recorded_from_db(database_url(db), template=template, device=device))
    if template is not None:
        recorded = [r for r in recorded if r.template == template]
    if not recorded:
        raise TunerError("no recorded trials to replay", "run a sweep first (a grid sweep "
                         "records the whole space) or pass --from FILE")
    samplers = sampler or ["tpe", "random"]
    space = load_spec_file(spec).space if spec is not None else None
    summaries = []
    for rec in recorded:
        measured = rec.within(search_space(rec, space)).results
        n = budget or max(1, round(fraction * measured))
        summaries.extend(compare_samplers(
            rec, samplers=samplers, budget=n, seeds=list(range(seeds)), space=space,
            prior=recorded_prior(rec, recorded) if prior else ()))
    if json_out:
        print_json([s.to_dict() for s in summaries])
        return
    table = Table(title="replayed searches: best found / best recorded")
    for column in ("problem", "sampler", "budget", "mean", "worst"):
        table.add_column(column, justify="left" if column in ("problem", "sampler") else "right")
    for s in summaries:
        table.add_row(s.problem_key, s.sampler, str(s.budget),
                      f"{s.mean_fraction:.3f}" if s.mean_fraction is not None else "-",
                      f"{s.worst_fraction:.3f}" if s.worst_fraction is not None else "-")
    print_table(table)
