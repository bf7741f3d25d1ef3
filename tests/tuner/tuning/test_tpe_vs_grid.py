"""benchmarks/tpe_vs_grid.py on a synthetic grid recording of flash_fwd on an H100, in the
format of ``tuner export --trials``; and its spec, benchmarks/specs/grid_study.toml.

The recorded landscape is flat but for one planted best: every config that runs gives 400
TFLOP/s except one at 500, so each replayed search's best is 500 (ratio 1.0) or 400 (0.8)
and the report's numbers can be checked by hand.
"""

from __future__ import annotations

import json
import re
import statistics
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from db.models import TrialStatus
from templates import DeviceInfo, Problem, get_template
from tests.benchmarks.benchmark_scripts import load_benchmark_script
from tuner.tuning.replay import ReplayResult, SamplerSummary, load_recorded_file, replay
from tuner.tuning.search.space import check_restriction, problem_space, valid_configs
from tuner.tuning.suites import load_spec_file

ROOT = Path(__file__).resolve().parents[3]
SPEC = ROOT / "benchmarks" / "specs" / "grid_study.toml"
H100 = DeviceInfo(name="NVIDIA H100 80GB HBM3", compute_capability="9.0", sm_count=132,
                  total_memory=85_520_809_984, smem_per_block=232_448, driver_version="570.86",
                  triton_version="3.6.0", torch_version="2.11.0", cuda_version="12.8")
FWD = get_template("flash_fwd")
PROBLEM = Problem(4, 32, 32, 4096, 4096, 64, "bfloat16")  # the spec's D=64 dense problem
# Neither the default config nor a known good one (the search measures those first).
PLANTED = {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 8, "num_stages": 5, "use_tma": False}
BEST, REST = 500.0, 400.0


@pytest.fixture(scope="module")
def script() -> ModuleType:
    return load_benchmark_script("tpe_vs_grid")


def grid_space(problem: Problem) -> Any:
    return problem_space(FWD, problem, H100, load_spec_file(SPEC).space)


def recording(problem: Problem, tflops: Callable[[dict[str, Any]], float | None],
              keep: Callable[[dict[str, Any]], bool] = lambda c: True) -> dict[str, Any]:
    """One problem's trials, as a grid sweep over the spec's space records them: every
    config of the space, the ones the constraints reject as invalid; ``tflops`` None: a
    compile error."""
    trials = []
    for config in grid_space(problem).configs():
        data = config.to_dict()
        if not keep(data):
            continue
        reason = FWD.constraint(problem, config, H100)
        value = None if reason else tflops(data)
        status = (TrialStatus.INVALID if reason else
                  TrialStatus.COMPILE_ERROR if value is None else TrialStatus.OK)
        trials.append({"config": data, "status": status.value, "reason": reason or "",
                       "tflops": value,
                       "median_ms": FWD.flops(problem) / value / 1e9 if value else None})
    return {"template": "flash_fwd", "template_version": FWD.version(),
            "device": H100.to_dict() | {"key": H100.key}, "problem": problem.to_dict(),
            "problem_key": FWD.problem_key(problem), "trials": trials}


def planted(config: dict[str, Any]) -> float | None:
    if config["num_stages"] == 4 and config["BLOCK_N"] == 128:
        return None  # a few compile errors: results, but no time
    return BEST if all(config[k] == v for k, v in PLANTED.items()) else REST


def write(tmp_path: Path, *problems: dict[str, Any]) -> Path:
    path = tmp_path / "grid_trials.json"
    path.write_text(json.dumps({"format": "attention-tuner/trials", "version": 1,
                                "problems": list(problems)}))
    return path


def run(script: ModuleType, tmp_path: Path, trials: Path, *flags: str) -> dict[str, Any]:
    out = tmp_path / "report.json"
    assert script.main([str(trials), "--spec", str(SPEC), "--json", str(out), *flags]) == 0
    return json.loads(out.read_text())


# ----------------------------------------------------------------------------- the spec
def test_the_spec_loads_and_its_comment_counts_the_valid_configs_on_an_h100() -> None:
    spec = load_spec_file(SPEC)
    check_restriction(FWD.config_cls, spec.space, "flash_fwd")
    assert spec.sampler == "grid" and spec.templates == ("flash_fwd",)
    assert len(spec.problems) == 4
    per_dim: dict[int, set[int]] = {}
    total = size = 0
    for problem in spec.problems:
        space = grid_space(problem)
        valid = valid_configs(space, lambda c, p=problem: FWD.constraint(p, c, H100))
        assert valid is not None
        assert FWD.default_config(problem, H100) in valid  # the default is in every grid
        per_dim.setdefault(problem.head_dim, set()).add(len(valid))
        total += len(valid)
        size += space.size()
    comment = " ".join(line.lstrip("# ") for line in SPEC.read_text().splitlines()
                       if line.startswith("#"))
    said = re.search(r"D=128 (\d+) per variant, D=64 (\d+) per variant, (\d+) in all "
                     r"\(of (\d+)", comment)
    assert said is not None, comment
    assert per_dim == {128: {int(said[1])}, 64: {int(said[2])}}
    assert (total, size) == (int(said[3]), int(said[4]))


# ----------------------------------------------------------------------------- the report
def test_sampler_stats_by_hand(script: ModuleType) -> None:
    runs = [ReplayResult(problem_key="k", sampler="tpe", seed=i, budget=30, measured=30,
                         best_found_tflops=found, best_recorded_tflops=BEST,
                         default_tflops=REST)
            for i, found in enumerate([500.0, 490.0, 400.0, 450.0, None])]
    stats = script.sampler_stats(SamplerSummary("k", "tpe", 30, runs))
    # Ratios 1.0, 0.98, 0.8, 0.9 and 0 for the seed that found nothing that ran.
    assert stats["seeds"] == 5
    assert stats["median_ratio"] == pytest.approx(0.9)
    assert stats["worst_ratio"] == 0.0 and stats["worst_best_tflops"] == 0.0
    assert stats["median_best_tflops"] == 450.0
    assert stats["within_target"] == pytest.approx(2 / 5)  # 1.0 and 0.98 meet 0.98
    assert script.sampler_stats(SamplerSummary("k", "tpe", 30, runs[:4]), 0.9)[
        "within_target"] == pytest.approx(3 / 4)


def test_a_whole_grid_replayed_finds_the_planted_best(script: ModuleType,
                                                      tmp_path: Path) -> None:
    trials = write(tmp_path, recording(PROBLEM, planted))
    report = run(script, tmp_path, trials, "--sampler", "grid", "--fraction", "1",
                 "--seeds", "2")
    (problem,) = report["problems"]
    valid = valid_configs(grid_space(PROBLEM), lambda c: FWD.constraint(PROBLEM, c, H100))
    assert valid is not None
    assert problem["grid_configs"] == problem["recorded_configs"] == len(valid)
    assert problem["complete_grid"] is True and problem["budget"] == len(valid)
    assert problem["grid_best_tflops"] == BEST and problem["default_tflops"] == REST
    grid = problem["samplers"]["grid"]
    assert grid["median_ratio"] == grid["worst_ratio"] == grid["within_target"] == 1.0
    assert report["space"]["pipeline_masked_loop"] == "default" and report["seeds"] == 2


def test_a_quarter_of_the_grid_reports_median_worst_and_share_within(
        script: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trials = write(tmp_path, recording(PROBLEM, planted))
    report = run(script, tmp_path, trials, "--seeds", "3")
    (problem,) = report["problems"]
    assert problem["budget"] == round(0.25 * problem["recorded_configs"])
    assert set(problem["samplers"]) == {"tpe", "random", "tpe-alone", "random-alone"}
    for stats in problem["samplers"].values():
        found = [r["best_found_tflops"] for r in stats["runs"]]
        assert len(found) == 3 and set(found) <= {BEST, REST}
        assert all(r["measured"] <= problem["budget"] for r in stats["runs"])
        ratios = [f / BEST for f in found]  # 1.0 or 0.8 each
        assert stats["median_ratio"] == pytest.approx(statistics.median(ratios))
        assert stats["worst_ratio"] == pytest.approx(min(ratios))
        assert stats["within_target"] == pytest.approx(found.count(BEST) / 3)
    out = capsys.readouterr().out
    assert "B4 H32 N4096 D64 bfloat16 dense" in out and "incomplete" not in out


def test_an_incomplete_recording_says_its_best_is_only_the_best_recorded(
        script: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # The grid stopped before BLOCK_M=128: the planted best (BLOCK_M=64) is still in.
    trials = write(tmp_path, recording(PROBLEM, planted, keep=lambda c: c["BLOCK_M"] == 64))
    report = run(script, tmp_path, trials, "--seeds", "1", "--sampler", "random")
    (problem,) = report["problems"]
    assert problem["complete_grid"] is False
    assert problem["recorded_configs"] < problem["grid_configs"]
    assert problem["budget"] == round(0.25 * problem["recorded_configs"])
    assert "an incomplete grid's 'best' is only the best recorded" in capsys.readouterr().out


def test_nothing_that_ran_prints_no_best(script: ModuleType, tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    trials = write(tmp_path, recording(PROBLEM, lambda c: None))
    report = run(script, tmp_path, trials, "--seeds", "1", "--sampler", "random")
    (problem,) = report["problems"]
    assert problem["grid_best_tflops"] is None
    assert problem["samplers"]["random"]["worst_ratio"] == 0.0
    assert "B4 H32 N4096 D64 bfloat16 dense" in capsys.readouterr().out


def test_an_empty_recording_is_an_error(script: ModuleType, tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    trials = write(tmp_path)
    assert script.main([str(trials), "--json", str(tmp_path / "r.json")]) == 2
    assert "holds no recorded problem" in capsys.readouterr().err
    assert not (tmp_path / "r.json").exists()


def test_alone_the_sampler_does_not_get_the_default_measured_first(tmp_path: Path) -> None:
    default = FWD.default_config(PROBLEM, H100).to_dict()
    at_default = write(tmp_path, recording(PROBLEM, lambda c: BEST if c == default else REST))
    (recorded,) = load_recorded_file(at_default)
    space = load_spec_file(SPEC).space
    as_swept = [replay(recorded, sampler="random", budget=1, seed=seed, space=space)
                for seed in range(5)]
    alone = [replay(recorded, sampler="random", budget=1, seed=seed, space=space,
                    default_first=False) for seed in range(5)]
    assert all(r.best_found_tflops == BEST for r in as_swept)  # one trial: the default
    assert any(r.best_found_tflops == REST for r in alone)  # one trial: the sampler's pick
