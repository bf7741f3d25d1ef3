"""Replay: the real search loop on recorded results, offline (samplers, dedupe, budgets)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import optuna
import pytest

from db.models import TrialStatus
from templates import Problem, current_device, get_template
from tuner.errors import TunerError
from tuner.tuning.replay import (
    NOT_RECORDED,
    RecordedProblem,
    ReplayRunner,
    compare_samplers,
    dump_recorded,
    load_recorded_file,
    replay,
)
from tuner.tuning.runner.outcome import TrialRequest
from tuner.tuning.search.loop import ProblemSearch, SearchSettings
from tuner.tuning.search.samplers import make_sampler
from tuner.tuning.search.store import MemoryStore

optuna.logging.set_verbosity(optuna.logging.WARNING)


def test_grid_replay_runs_every_config_once_and_finds_the_best(
        landscape: RecordedProblem) -> None:
    template = get_template("toy_tiles")
    valid = [c for c in template.config_cls.grid()
             if not template.constraint(Problem.from_dict(landscape.problem), c, current_device())]
    result = replay(landscape, sampler="grid", budget=10_000, seed=0)
    assert result.measured == len(valid) == 352  # recorded or not, each asked once
    assert result.repeated == 0
    assert result.best_found_tflops == result.best_recorded_tflops == 100.0


def test_tpe_with_a_quarter_of_the_trials_finds_the_grids_best(
        landscape: RecordedProblem) -> None:
    budget = round(0.25 * len(landscape.trials))
    tpe, rand = compare_samplers(landscape, samplers=["tpe", "random"], budget=budget,
                                 seeds=[0, 1])
    for run in tpe.runs:
        assert run.measured == budget and run.repeated == 0
        assert run.fraction_of_best is not None and run.fraction_of_best >= 0.99
        # The default config is enqueued first: a sweep never ends below it.
        assert run.default_tflops is not None and run.best_found_tflops >= run.default_tflops
    assert tpe.mean_fraction is not None and rand.mean_fraction is not None
    assert tpe.mean_fraction > rand.mean_fraction  # on this smooth landscape, TPE learns


def test_unrecorded_configs_fail_as_runtime_errors(landscape: RecordedProblem) -> None:
    template = get_template("toy_tiles")
    runner = ReplayRunner(template, landscape.trials)
    missing = template.config_cls(BLOCK_N=16, num_stages=1)
    request = TrialRequest(template="toy_tiles", template_module="x",
                           problem=landscape.problem, config=missing.to_dict())
    outcome = runner.measure(request, timeout_s=1)
    assert outcome.status == TrialStatus.RUNTIME_ERROR and outcome.reason == NOT_RECORDED
    failing = template.config_cls(num_warps=8, num_stages=4)
    outcome = runner.measure(TrialRequest("toy_tiles", "x", landscape.problem,
                                          failing.to_dict()), timeout_s=1)
    assert outcome.status == TrialStatus.COMPILE_ERROR


def test_concurrent_searches_share_the_study_without_duplicates(
        landscape: RecordedProblem) -> None:
    """Two workers on one study and one store: every config is run by exactly one of them."""
    template = get_template("toy_tiles")
    problem = Problem.from_dict(landscape.problem)
    storage = optuna.storages.InMemoryStorage()
    optuna.create_study(study_name="shared", storage=storage, direction="maximize")
    store = MemoryStore()
    runner = ReplayRunner(template, landscape.trials, delay_s=0.002)
    budget = 60
    searches = [ProblemSearch(
        template=template, problem=problem, device=current_device(),
        study=optuna.load_study(study_name="shared", storage=storage,
                                sampler=make_sampler("tpe", template.config_cls, budget=budget,
                                                     seed=seed)),
        store=store, runner=runner, settings=SearchSettings(budget=budget, seed=seed,
                                                            lookahead=1, finalists=0))
        for seed in (0, 1)]
    threads = [threading.Thread(target=s.run) for s in searches]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert max(runner.calls.values()) == 1, "a config was measured twice"
    measured = sum(s.stats.measured for s in searches)
    assert measured == sum(runner.calls.values())
    results = [r for r in store.known(template.problem_key(problem)).values()
               if r.status != TrialStatus.INVALID]
    assert budget <= len(results) <= budget + 2  # at most one in flight per worker at the end
    assert all(s.stats.measured > 0 for s in searches)


def test_recordings_round_trip_through_json(landscape: RecordedProblem, tmp_path: Path) -> None:
    path = tmp_path / "trials.json"
    path.write_text(json.dumps(dump_recorded([landscape])))
    (loaded,) = load_recorded_file(path)
    assert loaded.trials == landscape.trials
    assert loaded.problem_key == landscape.problem_key
    assert replay(loaded, sampler="random", budget=20, seed=0).measured == 20

    path.write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(TunerError, match="not a trials file"):
        load_recorded_file(path)
    bad = dump_recorded([landscape])
    bad["problems"][0]["trials"][0]["config"] = {"BLOCK_M": 17}
    path.write_text(json.dumps(bad))
    with pytest.raises(TunerError, match=r"problems\[0\] is malformed"):
        load_recorded_file(path)
