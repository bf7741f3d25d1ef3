"""benchmarks/time_to_tuned.py: that it runs and reports correctly (not speed) — the analysis
on hand-made readings, both sweeps of a tiny recording with a scripted runner, and the replay
of strategies on synthetic grids where the transfer prior is what finds the best."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import ModuleType

import pytest

from templates import Problem
from tests.benchmarks.benchmark_scripts import load_benchmark_script
from tests.tuner.cli.test_sweep_cli import cli
from tests.tuner.tuning.test_sweep_budget import SlowRunner
from tests.tuner.tuning.test_tpe_vs_grid import SPEC, planted, recording, write
from tuner.tuning.replay import load_recorded_file
from tuner.tuning.suites import load_spec_file


@pytest.fixture(scope="module")
def ttt() -> ModuleType:
    return load_benchmark_script("time_to_tuned")


def test_the_time_to_tuned_is_when_the_last_problem_comes_within_the_target(
        ttt: ModuleType) -> None:
    R = ttt.Reading
    fast = ttt.Timed([R(1.0, "a", "torch_sdpa", 2.0), R(2.0, "a", "flash_fwd", 1.5),
                      R(3.0, "b", "torch_sdpa", 4.0), R(5.0, "a", "flash_fwd", 1.01),
                      R(9.0, "b", "flash_fwd", 3.0)],
                     {"a": 10, "b": 1}, 10.0, None)
    reference = ttt.Timed([R(1.0, "a", "flash_fwd", 1.0), R(2.0, "b", "flash_fwd", 2.9)],
                          {"a": 10, "b": 1}, 40.0, None)
    out = ttt.analyse(fast, reference)
    # a: 1.01 <= 1.02 x 1.0 at 5 s; b: 3.0 > 1.02 x 2.9 = 2.958, never.
    assert out["time_to_tuned_s"] is None and out["within_target"] == 1
    assert [r["tuned_at_s"] for r in out["per_problem"]] == [5.0, None]
    out = ttt.analyse(fast, reference, target=0.05)  # b within 5% at 9 s
    assert out["time_to_tuned_s"] == 9.0
    job = out["job"]
    assert job["sdpa_ms"] == pytest.approx(10 * 2.0 + 4.0)
    assert job["at_time_to_tuned"]["ms"] == pytest.approx(10 * 1.01 + 3.0)
    assert job["reference"]["speedup_over_sdpa"] == pytest.approx(24.0 / (10 * 1.0 + 2.9))


def test_both_sweeps_of_a_recording_run_and_report(ttt: ModuleType, tmp_path: Path) -> None:
    spec = tmp_path / "job.toml"
    spec.write_text('name = "job"\ntemplates = ["torch_sdpa", "flash_fwd"]\nshapes = [\n'
                    '  {B = 1, H = 2, N = 32, D = 16, dtype = "float16", count = 5},\n]\n')
    # flash: its default reads 1.0, every later reading 0.5 (so it is not dropped after its
    # probe and its search finds 0.5); SDPA 1.0 throughout.
    runner = SlowRunner({"torch_sdpa": [1.0], "flash_fwd": [1.0, 0.5]}, delay_s=0.2)
    result = ttt.run_sweeps(str(spec), 12.0, tmp_path / "dbs", factor=2, make_runner=runner,
                            seed=1, head_to_head_rounds=0)
    assert result["problems"] == 1 and result["within_target"] == 1
    (row,) = result["per_problem"]
    assert row["count"] == 5 and row["reference_ms"] == pytest.approx(0.5, rel=1e-6)
    assert 0 < result["time_to_tuned_s"] <= result["sweep_wall_s"]
    assert result["job"]["at_end"]["speedup_over_sdpa"] == pytest.approx(2.0, rel=1e-6)
    assert (tmp_path / "dbs" / "sweep.db").is_file()
    assert (tmp_path / "dbs" / "reference.db").is_file()


def test_replayed_strategies_and_the_prior_that_finds_a_neighbours_best(
        ttt: ModuleType, tmp_path: Path) -> None:
    # Two problems of one family; the planted best of each is the same config, neither the
    # default nor a known good one: with two measurements, only the prior finds it.
    problems = [Problem(4, 32, 32, 4096, 4096, 64, "bfloat16"),
                Problem(2, 32, 32, 8192, 8192, 64, "bfloat16")]
    path = write(tmp_path, *(recording(p, planted) for p in problems))
    recordings = load_recorded_file(path)
    space = load_spec_file(SPEC).space
    grid = min(ttt.grid_configs(r, space) for r in recordings)
    result = ttt.replay_strategies(recordings, fraction=2.5 / grid, seeds=3, space=space)
    assert {row["budget"] for row in result["problems"]} == {2}
    assert all(row["prior"] >= 1 for row in result["problems"])
    assert not any(row["default_is_best"] for row in result["problems"])
    prior = result["strategies"]["tpe+prior"]
    assert prior["mean_share_within"] == 1.0 and prior["meets_bar"]
    assert result["strategies"]["tpe"]["mean_share_within"] < 0.9
    # The whole grid: every strategy measures the planted best.
    full = ttt.replay_strategies(recordings, fraction=1.0, seeds=1, space=space)
    assert all(s["mean_share_within"] == 1.0 for s in full["strategies"].values())
    out = tmp_path / "r.json"
    assert ttt.main(["replay", str(path), "--spec", str(SPEC), "--fraction", "1.0",
                     "--seeds", "1", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["strategies"]["tpe+prior"]["meets_bar"]
    assert not math.isnan(full["strategies"]["random"]["mean_share_within"])
    # The same through `tuner replay --prior`: two measurements each, the planted best found.
    code, printed, err = cli("replay", "--from", str(path), "--spec", str(SPEC), "--prior",
                             "--sampler", "tpe", "--budget", "2", "--seeds", "2", "--json")
    assert code == 0, err
    assert [s["worst_fraction_of_best"] for s in json.loads(printed)] == [1.0, 1.0]


def test_the_reference_in_parts_then_the_sweep_under_test_against_it(
        ttt: ModuleType, tmp_path: Path) -> None:
    # A device call lasts at most 10 minutes: the reference runs in parts sharing --dir, the
    # second part going on from the first's database, and the sweep under test reads it back.
    spec = tmp_path / "job.toml"
    spec.write_text('name = "job"\ntemplates = ["torch_sdpa", "flash_fwd"]\nshapes = [\n'
                    '  {B = 1, H = 2, N = 32, D = 16, dtype = "float16", count = 3},\n]\n')
    runner = SlowRunner({"torch_sdpa": [1.0], "flash_fwd": [1.0, 0.5]}, delay_s=0.2)
    folder = tmp_path / "ttt"
    with pytest.raises(SystemExit, match="no reference readings"):
        ttt.saved_reference(folder)
    options = {"make_runner": runner, "seed": 1, "head_to_head_rounds": 0}
    first = ttt.run_reference_part(str(spec), 6.0, folder, **options)
    second = ttt.run_reference_part(str(spec), 6.0, folder, **options)
    assert (first["part"], second["part"]) == (1, 2)
    assert second["reference_budget_s"] == 12.0 and second["readings"] > first["readings"]
    result = ttt.run_against_saved_reference(str(spec), 6.0, folder, **options)
    assert result["factor"] == pytest.approx(2.0)
    (row,) = result["per_problem"]
    assert row["count"] == 3 and row["reference_ms"] == pytest.approx(0.5, rel=1e-6)
    assert result["within_target"] == 1 and result["time_to_tuned_s"] is not None
    assert (folder / "sweep.db").is_file() and (folder / "reference.db").is_file()


def test_the_dispatcher_choices_of_two_sweeps_compared(ttt: ModuleType, tmp_path: Path
                                                       ) -> None:
    """The short sweep finds flash twice as fast as SDPA, the reference reads flash 1.2x
    SDPA's time: the dispatcher runs flash with the first database and SDPA with the second,
    and flash is priced at 1.2x by the reference's own readings. Training calls (no training
    template swept) run SDPA with both."""
    spec = tmp_path / "job.toml"
    spec.write_text('name = "job"\ntemplates = ["torch_sdpa", "flash_fwd"]\nshapes = [\n'
                    '  {B = 1, H = 2, N = 32, D = 16, dtype = "float16", count = 2},\n]\n')
    options = {"seed": 1, "head_to_head_rounds": 0}
    for name, flash in (("sweep", [0.5]), ("reference", [1.2])):
        runner = SlowRunner({"torch_sdpa": [1.0], "flash_fwd": flash}, delay_s=0.05)
        ttt.timed_sweep(str(spec), 4.0, f"sqlite:///{tmp_path / name}.db", runner, **options)
    out = ttt.compare_choices(tmp_path)
    rows = {r["kind"]: r for r in out["rows"]}
    assert set(rows) == {"inference", "training"} and out["same"] == 1
    assert (rows["inference"]["test"], rows["inference"]["reference"]) == ("flash", "sdpa")
    assert not rows["inference"]["same"]
    assert rows["inference"]["test_over_reference"] == pytest.approx(1.2, rel=1e-6)
    assert rows["training"]["same"] and rows["training"]["test_over_reference"] == 1.0
    assert out["worst"] == pytest.approx(1.2, rel=1e-6)
