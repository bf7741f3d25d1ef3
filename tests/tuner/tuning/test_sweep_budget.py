"""A sweep under a time budget (issue 42): spent by the problems' share of the job's time,
clearly slower implementations dropped after a probe, the transfer prior measured first, and
a budget too small for any measurement refused with nothing stored. A scripted runner stands
in for the trial workers (tests/tuner/tuning/test_head_to_head.py)."""

from __future__ import annotations

import time
from typing import Any

import pytest
from sqlalchemy import select

from db.models import Trial, TrialStatus
from db.session import dispose_engine, session_scope
from templates import Problem, current_device, get_template
from tests.tuner.tuning.test_head_to_head import ScriptedRunner
from tuner.errors import TunerError
from tuner.tuning.runner.outcome import TrialOutcome, TrialRequest
from tuner.tuning.search.budget import RIDGE_FLOP_PER_BYTE, SweepBudget, job_cost, parse_duration
from tuner.tuning.search.contenders import beaten_templates
from tuner.tuning.suites import spec_from_mapping
from tuner.tuning.sweep import SweepOptions, SweepReport, run_sweep

pytestmark = pytest.mark.usefixtures("no_tuned_configs")

SHAPE = {"B": 1, "H": 2, "N": 32, "D": 16}


def sweep(url: str, runner: Any, *, shapes: list[dict[str, Any]] | None = None,
          templates: tuple[str, ...] = ("torch_sdpa", "flash_fwd"), **options: Any
          ) -> SweepReport:
    spec = spec_from_mapping({"name": "budget", "templates": list(templates),
                              "shapes": shapes or [SHAPE], "dtypes": ["float16"]},
                             source="test")
    try:
        return run_sweep(spec, SweepOptions(seed=3, **options), db_url=url, make_runner=runner)
    finally:
        dispose_engine(url)


def stored_trials(url: str) -> list[tuple[str, dict[str, Any]]]:
    with session_scope(url, write=False) as s:
        return [(t.problem_key, dict(t.config))
                for t in s.scalars(select(Trial).order_by(Trial.id))]


def test_durations() -> None:
    assert parse_duration("5m") == 300 and parse_duration("90s") == 90
    assert parse_duration("1h30m") == 5400 and parse_duration("300") == 300
    for bad in ("", "0", "5 parsecs", "-3m", "m"):
        with pytest.raises(TunerError, match="not a positive duration"):
            parse_duration(bad)


def test_the_time_left_is_shared_by_weight_and_what_one_leaves_goes_on() -> None:
    budget = SweepBudget(100.0, [3.0, 1.0, 1.0], started=0.0)
    assert budget.allot(0, now=0.0) == pytest.approx(60.0)  # 3 of 5 weights
    assert budget.allot(0, now=30.0) == pytest.approx(60.0)  # asked again: the same
    # Task 0 ended at t=30 (30 s unused): task 1 gets half of the 70 s left.
    assert budget.allot(1, now=30.0) == pytest.approx(65.0)
    budget.observe(2.0)
    budget.reserve_readings = 5  # head-to-heads to come: 10 s at 2 s a reading
    assert budget.allot(2, now=65.0) == pytest.approx(65.0 + 25.0)
    assert not budget.spent(now=99.0) and budget.spent(now=100.0)
    # A dropped task's weight is left to the others.
    budget = SweepBudget(100.0, [1.0, 1.0, 2.0], started=0.0)
    budget.skip(1)
    assert budget.allot(0, now=0.0) == pytest.approx(100.0 / 3)


def test_a_problem_weighs_its_count_times_its_size() -> None:
    flash = get_template("flash_fwd")
    prefill = Problem(1, 8, 8, 4096, 4096, 128)
    decode = Problem(1, 8, 8, 1, 4096, 128)
    # A prefill is priced by its FLOPs, a decode step by its bytes (the KV cache read once).
    assert job_cost(flash, prefill) == flash.flops(prefill)
    assert job_cost(flash, decode) == pytest.approx(RIDGE_FLOP_PER_BYTE
                                                    * flash.bytes_moved(decode))
    assert 10 < job_cost(flash, prefill) / job_cost(flash, decode) < 20


def test_a_clearly_slower_implementation_is_beaten_and_a_close_one_is_not() -> None:
    device = current_device()
    problem = Problem(1, 2, 2, 32, 32, 16, "float16")
    readings = {"torch_sdpa": [1.0, 1.02], "flash_fwd": [1.5, 1.45]}
    beaten = beaten_templates(problem, readings, device)
    assert set(beaten) == {"flash_fwd"} and "torch_sdpa" in beaten["flash_fwd"]
    # Within noise (the ranges overlap), or apart but by less than the margin: searched on.
    assert beaten_templates(problem, {"torch_sdpa": [1.0, 1.3], "flash_fwd": [1.2, 1.25]},
                            device) == {}
    assert beaten_templates(problem, {"torch_sdpa": [1.0, 1.01], "flash_fwd": [1.05, 1.06]},
                            device) == {}


def test_a_clearly_slower_implementation_stops_being_searched(db_url: str) -> None:
    runner = ScriptedRunner({"torch_sdpa": [1.0], "flash_fwd": [2.0]})
    report = sweep(db_url, runner, trials=6, budget_s=600)
    by_template = {p.template: p for p in report.problems}
    assert by_template["flash_fwd"].pruned and "torch_sdpa" in by_template["flash_fwd"].pruned
    assert not by_template["torch_sdpa"].pruned
    # The probe only: flash's first configs (default, known good) and one re-measurement
    # of its best and its default, not its 6 trials.
    assert by_template["flash_fwd"].ok < 6
    assert report.budget_s == 600 and not report.budget_spent
    # Nothing left to compare side by side: the dropped implementation takes no rounds.
    assert report.head_to_heads == []


class SlowRunner(ScriptedRunner):
    """Every measurement takes ``delay_s`` of wall time."""

    def __init__(self, script: dict[str, Any], delay_s: float) -> None:
        super().__init__(script)
        self.delay_s = delay_s

    def measure(self, request: TrialRequest, timeout_s: float) -> TrialOutcome:
        time.sleep(self.delay_s)
        return super().measure(request, timeout_s)


def test_a_spent_budget_stops_with_every_measurement_stored_and_says_so(db_url: str) -> None:
    runner = SlowRunner({"flash_fwd": [1.0, 0.9, 1.1, 0.95]}, delay_s=1.0)
    shapes = [SHAPE, {**SHAPE, "N": 128}]  # the heavier (N 128) is searched first
    report = sweep(db_url, runner, shapes=shapes, templates=("flash_fwd",), trials=1000,
                   budget_s=15.0, finalists=0, head_to_head_rounds=0)
    assert report.budget_spent
    assert report.problems[0].problem["seqlen_q"] == 128
    assert report.problems[0].budget_spent or not report.problems[1].reached
    # Every measurement the runner made is a stored trial (none lost, none half-done);
    # the other stored trials are configs a constraint rejected (never run).
    with session_scope(db_url, write=False) as s:
        run = [t for t in s.scalars(select(Trial)) if t.status != TrialStatus.INVALID]
    assert sum(runner.calls.values()) == len(run)
    assert sum(runner.calls.values()) >= 1
    assert report.wall_s < 15.0 + 2 * 1.0 + 5  # checked before each measurement


def test_a_budget_too_small_for_any_measurement_says_so_and_stores_nothing(
        db_url: str) -> None:
    runner = SlowRunner({"flash_fwd": [1.0]}, delay_s=0.0)
    with pytest.raises(TunerError, match="too small for any measurement"):
        sweep(db_url, runner, templates=("flash_fwd",), trials=5, budget_s=1e-6)
    assert runner.calls == {} and stored_trials(db_url) == []


def test_the_best_config_of_a_neighbouring_bucket_is_measured_first(db_url: str) -> None:
    # Twice the heads (a neighbouring bucket of the same tiles): three configs, the second
    # fastest; it becomes that bucket's best.
    runner = ScriptedRunner({"flash_fwd": [2.0, 1.0, 3.0]})
    report = sweep(db_url, runner, shapes=[{**SHAPE, "H": 4}], templates=("flash_fwd",),
                   trials=3, finalists=0, head_to_head_rounds=0)
    first = stored_trials(db_url)
    neighbour_best = report.problems[0].best_config
    assert neighbour_best is not None and neighbour_best != first[0][1]  # not the default
    # H 2: after its default, the neighbour's best (before the known good configs).
    sweep(db_url, ScriptedRunner({"flash_fwd": [1.0]}), templates=("flash_fwd",), trials=2,
          finalists=0, head_to_head_rounds=0)
    here = [c for key, c in stored_trials(db_url)[len(first):]]
    assert here[1] == neighbour_best, (here, neighbour_best)


def test_people_are_told_what_stopped_and_that_the_budget_is_spent(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import contextlib
    import io

    from tuner.cli.common import console
    from tuner.cli.sweep import SweepDisplay, print_summary
    from tuner.tuning.search.loop import SearchStats
    from tuner.tuning.sweep import ProblemPruned, ProblemReport, ProblemStarted, SweepStarted, Task

    template = get_template("flash_fwd")
    problem = Problem(1, 2, 2, 32, 32, 16, "float16")
    task = Task(template, problem, template.problem_key(problem))
    device = current_device().to_dict() | {"key": current_device().key}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        display = SweepDisplay()
        display.handle(SweepStarted(3, device, [task], []))
        display.handle(ProblemStarted(0, 0, budget=2, results=0))
        display.handle(ProblemPruned(0, 0, "flash_fwd measured 2.00x the time of torch_sdpa",
                                     SearchStats(budget=2, measured=2)))
        display.close()
        reports = [ProblemReport(label=task.label, template="flash_fwd", template_version="v",
                                 problem=problem.to_dict(), problem_key=task.problem_key,
                                 pruned="flash_fwd measured 2.00x the time of torch_sdpa"),
                   ProblemReport(label="torch_sdpa B2", template="torch_sdpa",
                                 template_version="v", problem=problem.to_dict(),
                                 problem_key="k", budget_spent=True),
                   ProblemReport(label="torch_sdpa B4", template="torch_sdpa",
                                 template_version="v", problem=problem.to_dict(),
                                 problem_key="k4", reached=False)]
        monkeypatch.setattr(console, "width", 160)
        print_summary(SweepReport(sweep_id=3, name="job", status="done", device=device,
                                  sampler="tpe", workers=1, problems=reports, wall_s=301.0,
                                  compile_ahead=0, budget_s=300.0, budget_spent=True))
    text = " ".join(out.getvalue().split())
    assert "stopped flash_fwd B1 H2 N32 D16 float16 dense: flash_fwd measured 2.00x" in text
    assert "the --budget of 300 s is spent" in text
    assert "1 search(es) stopped at their share, 1 not started" in text
    assert "stopped searching flash_fwd" in text and "not reached: torch_sdpa B4" in text


class RecordingRunner(SlowRunner):
    """A slow runner that also records each measurement's problem (its sequence length)."""

    def __init__(self, script: dict[str, Any], delay_s: float) -> None:
        super().__init__(script, delay_s)
        self.lengths: list[int] = []

    def measure(self, request: TrialRequest, timeout_s: float) -> TrialOutcome:
        self.lengths.append(int(request.problem["seqlen_q"]))
        return super().measure(request, timeout_s)


def test_a_budgeted_sweep_run_again_measures_what_the_last_run_did_not_reach_first(
        db_url: str) -> None:
    """The heavier problem (N 128, searched first) was tuned by an earlier run, the lighter
    one never reached. Run again with a budget one measurement spends, the lighter one is
    measured first, not the finished one searched on."""
    heavy, light = {**SHAPE, "N": 128}, SHAPE
    sweep(db_url, SlowRunner({"flash_fwd": [1.0, 0.9]}, delay_s=0.0), shapes=[heavy],
          templates=("flash_fwd",), trials=2, finalists=0, head_to_head_rounds=0)
    # (A budget of seconds: a loaded machine takes one before the first measurement.)
    runner = RecordingRunner({"flash_fwd": [1.0, 0.9]}, delay_s=5.0)
    report = sweep(db_url, runner, shapes=[heavy, light], templates=("flash_fwd",),
                   trials=1000, budget_s=4.0, finalists=0, head_to_head_rounds=0)
    assert runner.lengths and runner.lengths[0] == 32, runner.lengths
    by_length = {p.problem["seqlen_q"]: p for p in report.problems}
    assert by_length[32].reached and by_length[32].best_config is not None
    assert report.budget_spent
