"""The search pieces: the space as Optuna distributions, samplers, study names, storage."""

from __future__ import annotations

import importlib.util
import random
import time
from pathlib import Path

import optuna
import pytest
from optuna.distributions import CategoricalDistribution
from optuna.samplers import RandomSampler, TPESampler
from optuna.trial import TrialState

from db.models import TrialStatus
from templates import get_template
from tests.tuner.conftest import TOY_PROBLEM
from tuner.errors import TunerError
from tuner.tuning.runner.outcome import TrialOutcome
from tuner.tuning.search.samplers import ExhaustiveSampler, make_sampler
from tuner.tuning.search.space import distributions, neighbours, params_of
from tuner.tuning.search.store import MemoryStore, TrialRecord
from tuner.tuning.search.study import fail_stale_trials, make_storage, open_study, study_name

optuna.logging.set_verbosity(optuna.logging.WARNING)


def _grid_space(config_cls: type) -> dict[str, list]:
    return {k.name: list(k.choices) for k in config_cls.knobs()}


def test_distributions_are_the_knobs() -> None:
    cls = get_template("toy_tiles").config_cls
    dists = distributions(cls)
    assert list(dists) == ["BLOCK_M", "BLOCK_N", "num_warps", "num_stages"]
    assert all(isinstance(d, CategoricalDistribution) for d in dists.values())
    assert list(dists["num_warps"].choices) == [1, 2, 4, 8]
    config = cls(BLOCK_M=128)
    assert cls.from_dict(params_of(config)) == config


def test_exhaustive_sampler_visits_every_point_once_default_first() -> None:
    cls = get_template("toy_tiles").config_cls
    study = optuna.create_study(direction="maximize",
                                sampler=ExhaustiveSampler(_grid_space(cls), seed=3))
    default = cls()
    study.enqueue_trial(params_of(default))
    seen = []
    for _ in range(cls.grid_size()):
        trial = study.ask(distributions(cls))
        seen.append(cls.from_dict(trial.params).key())
        study.tell(trial, 1.0)
    assert seen[0] == default.key()
    assert len(set(seen)) == cls.grid_size() == 400


def test_exhaustive_sampler_shares_the_grid_between_workers() -> None:
    cls = get_template("toy_add").config_cls
    storage = optuna.storages.InMemoryStorage()
    space = _grid_space(cls)
    a = optuna.create_study(study_name="s", storage=storage, direction="maximize",
                            sampler=ExhaustiveSampler(space, seed=1))
    b = optuna.load_study(study_name="s", storage=storage,
                          sampler=ExhaustiveSampler(space, seed=2))
    keys = []
    for _ in range(cls.grid_size() // 2):
        ta, tb = a.ask(distributions(cls)), b.ask(distributions(cls))  # both held at once
        keys += [cls.from_dict(ta.params).key(), cls.from_dict(tb.params).key()]
        a.tell(ta, 1.0)
        b.tell(tb, 1.0)
    assert len(keys) == len(set(keys)) == cls.grid_size()


def test_samplers_by_name() -> None:
    cls = get_template("toy_tiles").config_cls
    assert isinstance(make_sampler("tpe", cls, budget=20, seed=0), TPESampler)
    assert isinstance(make_sampler("random", cls, budget=20, seed=0), RandomSampler)
    assert isinstance(make_sampler("grid", cls, budget=20, seed=0), ExhaustiveSampler)
    with pytest.raises(TunerError, match="unknown sampler 'anneal'") as err:
        make_sampler("anneal", cls, budget=20)
    assert "tpe" in err.value.fix
    if importlib.util.find_spec("scipy") is None:
        with pytest.raises(TunerError, match="needs scipy"):
            make_sampler("gp", cls, budget=20)
    else:
        assert isinstance(make_sampler("gp", cls, budget=20), optuna.samplers.GPSampler)


def test_neighbours_change_one_knob_by_one_step_first() -> None:
    cls = get_template("toy_tiles").config_cls
    here = cls(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2)
    ordered = neighbours(here, list(cls.grid()), random.Random(0))
    assert here not in ordered and len(ordered) == 399
    first = ordered[:8]  # 4 knobs x (one step down, one step up)
    for c in first:
        diff = [k for k, v in c.to_dict().items() if v != here.to_dict()[k]]
        assert len(diff) == 1
    last = ordered[-1]  # every knob as far as it goes (ties broken at random)
    assert last.BLOCK_M in (16, 256) and last.BLOCK_N in (16, 256)
    assert (last.num_warps, last.num_stages) == (1, 4)


def test_study_names_fit_optunas_column() -> None:
    short = study_name("H100|cc9.0|triton3.6.0|torch2.11.0|cuda12.8", "flash_fwd", "abc",
                       "b4-hq16-hkv16-q1024-kv1024-d64-bfloat16-dense")
    assert short == ("flash_fwd@abc|b4-hq16-hkv16-q1024-kv1024-d64-bfloat16-dense|"
                     "H100|cc9.0|triton3.6.0|torch2.11.0|cuda12.8")
    long_a = study_name("x" * 600, "flash_fwd", "abc", "key")
    long_b = study_name("y" * 600, "flash_fwd", "abc", "key")
    assert len(long_a) <= 500 and long_a != long_b


def test_a_dead_workers_trial_is_failed_and_retried(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'optuna.db'}"
    storage = make_storage(url, heartbeat_interval_s=1, grace_period_s=1)
    cls = get_template("toy_add").config_cls
    study = open_study(storage, "s", RandomSampler(seed=0), {"problem_key": "k"})
    assert study.user_attrs == {"problem_key": "k"}
    with pytest.warns(UserWarning, match="Heartbeat"):  # Optuna expects optimize(); see loop.py
        beaten = study.ask(distributions(cls))
        orphan = study.ask(distributions(cls))  # its worker dies before its first beat
        alive = study.ask(distributions(cls))
    storage.record_heartbeat(beaten._trial_id)  # then that worker dies: no more beats
    time.sleep(2.2)
    storage.record_heartbeat(alive._trial_id)
    fail_stale_trials(study)
    states = {t.number: t.state for t in study.get_trials(deepcopy=False)}
    assert states[beaten.number] == states[orphan.number] == TrialState.FAIL
    assert states[alive.number] == TrialState.RUNNING
    retries = study.get_trials(deepcopy=False, states=(TrialState.WAITING,))
    assert sorted(str(t.params) for t in retries) == sorted(
        str(t.params) for t in (beaten, orphan))


def test_memory_store_keeps_the_first_result_and_the_best() -> None:
    template = get_template("toy_add")
    cls = template.config_cls
    store = MemoryStore()
    key = template.problem_key(TOY_PROBLEM)

    def record(config: object, outcome: TrialOutcome, default: bool = False) -> None:
        store.record(TrialRecord(problem=TOY_PROBLEM, problem_key=key, config=config,
                                 outcome=outcome, is_default=default))

    record(cls(), TrialOutcome(TrialStatus.OK, tflops=2.0, median_ms=1.0), default=True)
    record(cls(BLOCK=64), TrialOutcome(TrialStatus.OK, tflops=3.0, median_ms=0.7))
    record(cls(BLOCK=64), TrialOutcome(TrialStatus.TIMEOUT, "late duplicate"))
    record(cls(BLOCK=16), TrialOutcome(TrialStatus.WRONG_RESULT, "bad", error=0.5))
    assert store.find(key, cls(BLOCK=64).key()).status == TrialStatus.OK
    best = store.best(key)
    assert best is not None and best.tflops == 3.0 and best.default_tflops == 2.0
    assert best.speedup == pytest.approx(1.5)
    assert len(store.known(key)) == 3
