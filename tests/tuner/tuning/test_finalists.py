"""The finalists' round at the end of a search: the best chosen by the median of its readings.

A fake runner answers each config with times from a script read one per call, so a config can
read lucky the first time and slower after (the winner's curse of issue 6), without a GPU.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence

import optuna
import pytest

from db import crud
from db.models import TrialStatus
from db.session import session_scope
from templates import current_device, get_template
from tests.tuner.conftest import TOY_PROBLEM
from tuner.tuning.runner.outcome import TrialOutcome, TrialRequest
from tuner.tuning.search.loop import ProblemSearch, SearchSettings, TrialEvent, inputs_seed
from tuner.tuning.search.samplers import make_sampler
from tuner.tuning.search.store import DbStore, MemoryStore, ResultStore

optuna.logging.set_verbosity(optuna.logging.WARNING)

TEMPLATE = get_template("toy_add")
KEY = TEMPLATE.problem_key(TOY_PROBLEM)
CONFIGS = TEMPLATE.config_cls
LUCKY = CONFIGS(BLOCK=16, num_warps=2).key()  # 0.5 ms once, 1.5 ms after
STEADY = CONFIGS(BLOCK=128, num_warps=2).key()  # 0.8 ms every time
THIRD = CONFIGS(BLOCK=64, num_warps=2).key()  # 0.9 ms
DEFAULT = CONFIGS().key()  # BLOCK 32 x 1 warp: 1.2 ms first, then 1.0
NEXT = CONFIGS(BLOCK=32, num_warps=2).key()  # the fourth fastest first reading: 1.05 ms
TIMES: dict[str, Sequence[float | None]] = {
    LUCKY: [0.5, 1.5], STEADY: [0.8], THIRD: [0.9], DEFAULT: [1.2, 1.0], NEXT: [1.05],
    CONFIGS(BLOCK=16, num_warps=1).key(): [1.1], CONFIGS(BLOCK=64, num_warps=1).key(): [1.3],
}  # BLOCK 128 x 1 warp: rejected by the constraint, never run


class Killed(BaseException):
    """Stands in for SIGKILL: the measurement in flight is lost, nothing after it runs."""


class ScriptedRunner:
    """Answers config K's n-th measurement with ``times[K][n]`` ms (the last one repeats); None
    is a wrong result. ``kill_at``: the call (counting from 1) that raises Killed."""

    def __init__(self, times: dict[str, Sequence[float | None]], kill_at: int | None = None):
        self.times = times
        self.kill_at = kill_at
        self.calls: Counter[str] = Counter()
        self.seeds: list[int] = []

    def measure(self, request: TrialRequest, timeout_s: float) -> TrialOutcome:
        if self.kill_at is not None and len(self.seeds) + 1 == self.kill_at:
            raise Killed()
        key = TEMPLATE.config(request.config).key()
        script = self.times[key]
        ms = script[min(self.calls[key], len(script) - 1)]
        self.calls[key] += 1
        self.seeds.append(request.seed)
        if ms is None:
            return TrialOutcome.failed(TrialStatus.WRONG_RESULT, "relative error 0.5 > 0.01")
        return TrialOutcome(TrialStatus.OK, median_ms=ms,
                            tflops=TEMPLATE.flops(TOY_PROBLEM) / (ms * 1e9))


def search(store: ResultStore, runner: ScriptedRunner, *, study: optuna.Study | None = None,
           events: list[TrialEvent] | None = None, **settings: int) -> ProblemSearch:
    """A grid search over toy_add's 7 valid configs (all of them)."""
    study = study or optuna.create_study(
        direction="maximize", sampler=make_sampler("grid", CONFIGS, budget=7, seed=0))
    return ProblemSearch(template=TEMPLATE, problem=TOY_PROBLEM, device=current_device(),
                         study=study, store=store, runner=runner,
                         settings=SearchSettings(budget=7, seed=0, **settings),
                         on_trial=events.append if events is not None else None)


def ms_of(tflops: float) -> float:
    return TEMPLATE.flops(TOY_PROBLEM) / (tflops * 1e9)


def test_the_lucky_config_loses_to_a_consistently_fast_one() -> None:
    store, runner, events = MemoryStore(), ScriptedRunner(TIMES), []
    stats = search(store, runner, events=events).run()
    assert stats.measured == 7 and stats.remeasured == 8 and stats.disqualified == 0
    best = stats.best
    assert best is not None and CONFIGS.from_dict(best.config).key() == STEADY
    assert (best.median_ms, best.runs) == (0.8, 3)
    assert best.default_tflops == pytest.approx(TEMPLATE.flops(TOY_PROBLEM) / 1.0e9)
    assert best.speedup == pytest.approx(1.0 / 0.8)  # the default at its median: 1.0 ms
    # The three fastest first readings and the default, 2 more readings each; the rest once.
    assert runner.calls == {LUCKY: 3, STEADY: 3, THIRD: 3, DEFAULT: 3, NEXT: 1,
                            CONFIGS(BLOCK=16, num_warps=1).key(): 1,
                            CONFIGS(BLOCK=64, num_warps=1).key(): 1}
    # One seed for every trial of the problem, search and finalists: the trial worker keeps
    # its reference (tuner.tuning.runner.reference_cache: the memory of a repeated seed's
    # earlier runs is poisoned, or a fresh seed stands in).
    assert set(runner.seeds) == {inputs_seed(KEY, 0)}
    finals = [e for e in events if e.source == "final"]
    assert len(finals) == 8 and finals[-1].best_tflops == pytest.approx(best.tflops)
    lucky = store.remeasurements(KEY)[LUCKY]
    assert [r.median_ms for r in lucky] == [1.5, 1.5]
    assert store.known(KEY)[LUCKY].median_ms == 0.5  # the first reading stays as measured


def test_no_finalists_keeps_the_fastest_single_reading() -> None:
    store, runner = MemoryStore(), ScriptedRunner(TIMES)
    stats = search(store, runner, finalists=0).run()
    assert stats.best is not None and CONFIGS.from_dict(stats.best.config).key() == LUCKY
    assert (stats.best.median_ms, stats.best.runs, stats.remeasured) == (0.5, 1, 0)
    assert stats.best.speedup == pytest.approx(1.2 / 0.5)
    assert set(runner.calls.values()) == {1} and store.remeasurements(KEY) == {}


def test_a_failed_remeasurement_disqualifies_the_finalist(
        caplog: pytest.LogCaptureFixture) -> None:
    store, runner = MemoryStore(), ScriptedRunner({**TIMES, STEADY: [0.8, None]})
    with caplog.at_level(logging.WARNING, logger="tuner.tuning.search.loop"):
        stats = search(store, runner).run()
    assert stats.disqualified == 1
    (warning,) = [r.getMessage() for r in caplog.records if "disqualified" in r.getMessage()]
    assert STEADY in warning and "wrong_result" in warning and "relative error" in warning
    # Once failed, never measured again; the fourth fastest first reading took its place.
    assert runner.calls[STEADY] == 2 and runner.calls[NEXT] == 3
    assert stats.best is not None and CONFIGS.from_dict(stats.best.config).key() == THIRD
    assert store.known(KEY)[STEADY].status == TrialStatus.OK  # its trial is kept as it was


def test_a_search_killed_during_the_finalists_completes_them_once_when_run_again(
        db_url: str) -> None:
    device = current_device()
    store = DbStore(db_url, device=device.to_dict() | {"key": device.key},
                    template_name=TEMPLATE.name, template_version=TEMPLATE.version(),
                    space=CONFIGS.json_schema(), worker="w")
    ids = {"problem_key": KEY, "device_id": store.device_id, "template_id": store.template_id}
    study = optuna.create_study(direction="maximize",
                                sampler=make_sampler("grid", CONFIGS, budget=7, seed=0))
    runner = ScriptedRunner(TIMES, kill_at=7 + 3)  # the third re-measurement
    with pytest.raises(Killed):
        search(store, runner, study=study).run()
    with session_scope(db_url, write=False) as s:
        before = [(r.id, key, r.median_ms) for key, r in crud.remeasurements_for(s, **ids)]
        trials = [(t.id, t.config_key, t.median_ms) for t in crud.trials_for(s, **ids)]
    assert len(before) == 2 and sum(ms is not None for _, _, ms in trials) == 7

    runner.kill_at = None
    stats = search(store, runner, study=study).run()  # the same sweep, run again
    assert stats.measured == 0 and stats.remeasured == 6  # only the missing ones
    with session_scope(db_url, write=False) as s:
        after = [(r.id, key, r.median_ms) for key, r in crud.remeasurements_for(s, **ids)]
        assert [(t.id, t.config_key, t.median_ms) for t in crud.trials_for(s, **ids)] == trials
        best = crud.best_for(s, device_key=device.key, template_name=TEMPLATE.name,
                             template_version=TEMPLATE.version(), problem_key=KEY)
    assert after[:2] == before  # nothing lost or rewritten
    assert Counter(key for _, key, _ in after) == {LUCKY: 2, STEADY: 2, THIRD: 2, DEFAULT: 2}
    assert best is not None and CONFIGS.from_dict(best.config).key() == STEADY
    assert best.median_ms == 0.8

    calls = sum(runner.calls.values())
    again = search(store, runner, study=study).run()  # complete: nothing more to do
    assert (again.measured, again.remeasured, sum(runner.calls.values())) == (0, 0, calls)
