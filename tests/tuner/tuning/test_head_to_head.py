"""The head-to-head at the end of a sweep (tuner.tuning.head_to_head): the implementations' bests of
a problem measured side by side, and the dispatcher choosing by those readings.

A scripted runner stands in for the trial workers (no GPU, no subprocess): template T's n-th
measurement reads ``script[T][n]`` ms (the last one repeats; None is a wrong result), so the
sweep's own readings can say one thing and the side-by-side readings another.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Sequence
from typing import Any

import pytest
from sqlalchemy import select

from db.models import HeadToHead, HeadToHeadReading, TrialStatus
from db.session import dispose_engine, session_scope
from templates import Problem, current_device, get_template
from tuner.attention import clear_plans
from tuner.dispatch.rule import Call, Choice, choose
from tuner.errors import TunerError
from tuner.lookup.bundle import make_bundle, store_bundle, validate_bundle
from tuner.lookup.resolver import ConfigResolver, set_resolver
from tuner.settings import load_settings
from tuner.tuning.head_to_head import compared_templates, rotation
from tuner.tuning.runner.outcome import TrialOutcome, TrialRequest
from tuner.tuning.suites import spec_from_mapping
from tuner.tuning.sweep import SweepOptions, SweepReport, run_sweep

pytestmark = pytest.mark.usefixtures("no_tuned_configs")

PROBLEM = Problem(1, 2, 2, 32, 32, 16, "float16")
# One config per template (trials=1: the default) and finalists on: the default is re-measured
# twice, so each template's search reads it 3 times before any head-to-head reading.
SWEEP_READINGS = 3


class Killed(BaseException):
    """Stands in for SIGKILL: nothing after it runs."""


class ScriptedRunner:
    """Every worker's runner (one shared script): see the module docstring. ``fail_at``: the
    measurement (counting from 1, all templates) that raises ``fail_with``."""

    def __init__(self, script: dict[str, Sequence[float | None]], *, fail_at: int | None = None,
                 fail_with: BaseException | None = None) -> None:
        self.script = script
        self.fail_at, self.fail_with = fail_at, fail_with
        self.calls: Counter[str] = Counter()
        self.order: list[str] = []  # templates in the order they were measured
        self._lock = threading.Lock()

    def __call__(self, *, name: str, env: dict[str, str]) -> ScriptedRunner:
        return self  # the factory of run_sweep: every worker shares the script

    def device(self) -> dict[str, Any]:
        device = current_device()
        return device.to_dict() | {"key": device.key}

    def close(self) -> None:
        pass

    def measure(self, request: TrialRequest, timeout_s: float) -> TrialOutcome:
        with self._lock:
            self.order.append(request.template)
            if self.fail_at is not None and len(self.order) == self.fail_at:
                assert self.fail_with is not None
                raise self.fail_with
            script = self.script[request.template]
            ms = script[min(self.calls[request.template], len(script) - 1)]
            self.calls[request.template] += 1
        if ms is None:
            return TrialOutcome.failed(TrialStatus.WRONG_RESULT, "relative error 0.5 > 0.01")
        flops = get_template(request.template).flops(Problem.from_dict(request.problem))
        return TrialOutcome(TrialStatus.OK, median_ms=ms, tflops=flops / (ms * 1e9))


def sweep(url: str, runner: ScriptedRunner, *, templates: Sequence[str] = ("torch_sdpa",
          "flash_fwd"), **options: Any) -> SweepReport:
    spec = spec_from_mapping({"name": "h2h", "templates": list(templates),
                              "shapes": [{"B": 1, "H": 2, "N": 32, "D": 16}],
                              "dtypes": ["float16"]}, source="test")
    try:
        return run_sweep(spec, SweepOptions(trials=1, seed=3, **options), db_url=url,
                         make_runner=runner)
    finally:
        dispose_engine(url)


def chosen(url: str) -> Choice:
    """What the dispatcher runs for PROBLEM (inference) from this database."""
    set_resolver(ConfigResolver(load_settings(database_url=url, url=None)))
    clear_plans()
    return choose(Call(PROBLEM, needs_grad=False, device=current_device()))


def sessions(url: str) -> list[tuple[bool, list[tuple[int, int, str, float | None]]]]:
    """(finished, [(round, position, template, ms)]) of every stored head-to-head."""
    out = []
    with session_scope(url, write=False) as s:
        for h2h in s.scalars(select(HeadToHead).order_by(HeadToHead.id)):
            rows = s.scalars(select(HeadToHeadReading).where(
                HeadToHeadReading.head_to_head_id == h2h.id).order_by(HeadToHeadReading.id))
            out.append((h2h.finished_at is not None,
                        [(r.round, r.position, _template_of(s, r.trial_id), r.median_ms)
                         for r in rows]))
    return out


def _template_of(s: Any, trial_id: int) -> str:
    from db.models import Trial

    trial = s.get(Trial, trial_id)
    return str(trial.template.name)


# Sweep readings: SDPA 1.0 ms, flash 1.1 ms. Side by side: SDPA 1.2 ms, flash 1.0 ms.
SDPA = [1.0] * SWEEP_READINGS + [1.2]
FLASH = [1.1] * SWEEP_READINGS + [1.0]


def test_the_dispatcher_chooses_by_the_side_by_side_readings(db_url: str) -> None:
    runner = ScriptedRunner({"torch_sdpa": SDPA, "flash_fwd": FLASH})
    report = sweep(db_url, runner)
    assert report.status == "done"
    (result,) = report.head_to_heads
    assert result.finished and result.rounds == 5
    assert {c.template: (c.median_ms, len(c.runs_ms)) for c in result.candidates} == {
        "torch_sdpa": (1.2, 5), "flash_fwd": (1.0, 5)}
    assert runner.calls == {"torch_sdpa": SWEEP_READINGS + 5, "flash_fwd": SWEEP_READINGS + 5}
    choice = chosen(db_url)
    assert choice.implementation.name == "flash", choice.why
    prices = {e.implementation: e.ms for e in choice.estimates}
    assert prices["flash"] == pytest.approx(1.0) and prices["sdpa"] == pytest.approx(1.2)
    # The stored bests say so too, with the readings they rest on.
    bests = {p.template: (p.best_median_ms, p.best_runs) for p in report.problems}
    assert bests == {"torch_sdpa": (1.2, 5), "flash_fwd": (1.0, 5)}


def test_rounds_0_turns_it_off_and_the_sweep_readings_choose(db_url: str) -> None:
    runner = ScriptedRunner({"torch_sdpa": SDPA, "flash_fwd": FLASH})
    report = sweep(db_url, runner, head_to_head_rounds=0)
    assert report.head_to_heads == [] and sessions(db_url) == []
    assert runner.calls == {"torch_sdpa": SWEEP_READINGS, "flash_fwd": SWEEP_READINGS}
    assert chosen(db_url).implementation.name == "sdpa"


def test_rounds_rotate_so_no_candidate_always_runs_first() -> None:
    assert rotation(3, 4) == [[0, 1, 2], [1, 2, 0], [2, 0, 1], [0, 1, 2]]
    assert rotation(2, 3) == [[0, 1], [1, 0], [0, 1]]
    for n in (2, 3, 4):
        rounds = rotation(n, n)
        assert {r[0] for r in rounds} == set(range(n))  # each candidate first once
        for candidate in range(n):  # and in every place once
            assert sorted(r.index(candidate) for r in rounds) == list(range(n))


def test_the_stored_readings_follow_the_rotation(sqlite_url: str) -> None:
    runner = ScriptedRunner({"torch_sdpa": SDPA, "flash_fwd": FLASH})
    sweep(sqlite_url, runner, head_to_head_rounds=4)
    sdpa, flash = "torch_sdpa", "flash_fwd"
    assert runner.order[2 * SWEEP_READINGS:] == [sdpa, flash, flash, sdpa, sdpa, flash,
                                                  flash, sdpa]
    ((finished, readings),) = sessions(sqlite_url)
    assert finished and [(r, p, t) for r, p, t, _ in readings] == [
        (0, 0, sdpa), (0, 1, flash), (1, 0, flash), (1, 1, sdpa),
        (2, 0, sdpa), (2, 1, flash), (3, 0, flash), (3, 1, sdpa)]


def test_a_failing_candidate_does_not_win(db_url: str) -> None:
    # flash reads faster side by side, once; its second reading is a wrong result.
    flash = [1.1] * SWEEP_READINGS + [0.5, None]
    runner = ScriptedRunner({"torch_sdpa": SDPA, "flash_fwd": flash})
    report = sweep(db_url, runner)
    (result,) = report.head_to_heads
    by_name = {c.template: c for c in result.candidates}
    assert by_name["flash_fwd"].failed is not None and by_name["flash_fwd"].median_ms is None
    assert "wrong_result" in by_name["flash_fwd"].failed
    assert runner.calls["flash_fwd"] == SWEEP_READINGS + 2  # measured no more after it
    assert by_name["torch_sdpa"].median_ms == 1.2 and len(by_name["torch_sdpa"].runs_ms) == 5
    choice = chosen(db_url)
    assert choice.implementation.name == "sdpa", choice.why
    # flash's only config is disqualified: it has no stored best left to price it.
    assert {e.implementation: e.ms for e in choice.estimates}["flash"] is None


def test_a_problem_of_one_implementation_skips_the_step(sqlite_url: str) -> None:
    # Two templates, but both price SDPA (inference and training): nothing to compare.
    runner = ScriptedRunner({"torch_sdpa": [1.0], "torch_sdpa_train": [3.0]})
    report = sweep(sqlite_url, runner, templates=("torch_sdpa", "torch_sdpa_train"))
    assert report.status == "done" and report.head_to_heads == []
    assert sessions(sqlite_url) == []
    assert runner.calls == {"torch_sdpa": SWEEP_READINGS, "torch_sdpa_train": SWEEP_READINGS}


def test_which_templates_take_part() -> None:
    device = current_device()  # the interpreter: no Hopper, so no Gluon
    decode = Problem(1, 2, 2, 1, 64, 16, "float16")
    everything = ("torch_sdpa", "flash_fwd", "flash_decode", "gluon_fwd")
    assert compared_templates(decode, everything, device) == everything[:3]
    assert compared_templates(PROBLEM, everything, device) == everything[:2]
    assert compared_templates(PROBLEM, ("flash_fwd", "flash_bwd"), device) == ()
    # A training step compares SDPA's with flash forward + backward: all three take part.
    training = ("torch_sdpa_train", "flash_fwd", "flash_bwd")
    assert compared_templates(PROBLEM, training, device) == training
    assert compared_templates(PROBLEM, ("torch_sdpa_train", "flash_fwd"), device) == ()


def test_a_crashed_step_loses_nothing_and_the_sweep_goes_on(db_url: str) -> None:
    # The third side-by-side measurement raises (a bug, a lost database connection).
    runner = ScriptedRunner({"torch_sdpa": SDPA, "flash_fwd": FLASH},
                            fail_at=2 * SWEEP_READINGS + 3, fail_with=RuntimeError("boom"))
    report = sweep(db_url, runner)
    assert report.status == "done"
    (result,) = report.head_to_heads
    assert not result.finished and result.failed == "RuntimeError: boom"
    ((finished, readings),) = sessions(db_url)
    assert not finished and len(readings) == 2  # what was measured is kept, priced nowhere
    bests = {p.template: (p.best_median_ms, p.best_runs) for p in report.problems}
    assert bests == {"torch_sdpa": (1.0, 3), "flash_fwd": (1.1, 3)}  # the sweep's, as stored
    assert chosen(db_url).implementation.name == "sdpa"


def test_a_killed_step_leaves_the_sweeps_bests_stored(sqlite_url: str) -> None:
    runner = ScriptedRunner({"torch_sdpa": SDPA, "flash_fwd": FLASH},
                            fail_at=2 * SWEEP_READINGS + 4, fail_with=Killed())
    with pytest.raises(Killed):
        sweep(sqlite_url, runner)
    ((finished, readings),) = sessions(sqlite_url)
    assert not finished and len(readings) == 3
    choice = chosen(sqlite_url)
    assert choice.implementation.name == "sdpa"
    assert {e.implementation: e.ms for e in choice.estimates} == {
        "sdpa": pytest.approx(1.0), "flash": pytest.approx(1.1)}


def test_bundles_carry_the_sweeps_own_readings(sqlite_url: str, tmp_path: Any) -> None:
    sweep(sqlite_url, ScriptedRunner({"torch_sdpa": SDPA, "flash_fwd": FLASH}))
    with session_scope(sqlite_url, write=False) as s:
        exported = make_bundle(s)
    # Consistent with their readings (the import checks it), so they import elsewhere; the
    # side-by-side readings stay here.
    assert {i["template"]: (i["median_ms"], i["measurements"]["first_ms"])
            for i in exported["items"]} == {"torch_sdpa": (1.0, 1.0), "flash_fwd": (1.1, 1.1)}
    other = f"sqlite:///{tmp_path / 'other.db'}"
    with session_scope(other) as s:
        store_bundle(s, validate_bundle(exported))
    dispose_engine(other)
    assert chosen(other).implementation.name == "sdpa"


def stored_rounds(url: str) -> list[int]:
    with session_scope(url, write=False) as s:
        return list(s.scalars(select(HeadToHead.rounds).order_by(HeadToHead.id)))


def test_a_close_call_takes_rounds_until_its_readings_decide(sqlite_url: str) -> None:
    # Side by side, flash is faster in every round, but the readings swing more than the gap
    # (ranges overlap): 5 wins of 5 is not enough (p = 1/16), the 6th round decides.
    sdpa = [1.0] * SWEEP_READINGS + [1.02, 1.05] * 10
    flash = [1.1] * SWEEP_READINGS + [1.01, 1.04] * 10
    report = sweep(sqlite_url, ScriptedRunner({"torch_sdpa": sdpa, "flash_fwd": flash}))
    (result,) = report.head_to_heads
    assert result.finished and result.rounds == 6 and stored_rounds(sqlite_url) == [6]
    assert {c.template: len(c.runs_ms) for c in result.candidates} == {
        "torch_sdpa": 6, "flash_fwd": 6}
    ((_, readings),) = sessions(sqlite_url)
    assert [(r, p, t) for r, p, t, _ in readings[-2:]] == [(5, 0, "flash_fwd"),
                                                         (5, 1, "torch_sdpa")]
    assert chosen(sqlite_url).implementation.name == "flash"


def test_a_tie_stops_at_the_most_rounds(sqlite_url: str) -> None:
    sdpa = [1.0] * SWEEP_READINGS + [1.0, 1.1] * 10
    flash = [1.1] * SWEEP_READINGS + [1.1, 1.0] * 10
    runner = ScriptedRunner({"torch_sdpa": sdpa, "flash_fwd": flash})
    report = sweep(sqlite_url, runner, head_to_head_max_rounds=7)
    (result,) = report.head_to_heads
    assert result.rounds == 7 and stored_rounds(sqlite_url) == [7]
    assert runner.calls == {"torch_sdpa": SWEEP_READINGS + 7, "flash_fwd": SWEEP_READINGS + 7}


def test_a_clear_call_takes_the_rounds_asked_for(sqlite_url: str) -> None:
    runner = ScriptedRunner({"torch_sdpa": SDPA, "flash_fwd": FLASH})  # 1.2 against 1.0
    (result,) = sweep(sqlite_url, runner).head_to_heads
    assert result.rounds == 5 and stored_rounds(sqlite_url) == [5]


def test_a_close_call_compares_what_the_dispatcher_prices(sqlite_url: str) -> None:
    # A training step: SDPA's forward + backward in one template against flash forward plus
    # flash backward. Per round, flash's sum (2.95, 3.05) beats SDPA's (3.0, 3.1) every time,
    # the ranges overlapping: all three templates take the 6th round. The forward alone,
    # 1.0, is not a price of its own, so the two flash templates are never compared.
    script = {"torch_sdpa_train": [3.0] * SWEEP_READINGS + [3.0, 3.1] * 10,
              "flash_fwd": [1.0], "flash_bwd": [2.0] * SWEEP_READINGS + [1.95, 2.05] * 10}
    runner = ScriptedRunner(script)
    (result,) = sweep(sqlite_url, runner, templates=tuple(script)).head_to_heads
    assert result.rounds == 6
    assert runner.calls == dict.fromkeys(script, SWEEP_READINGS + 6)


def test_more_rounds_than_the_most_is_refused() -> None:
    with pytest.raises(TunerError, match=r"--head-to-head-max-rounds \(3\) must be >= "):
        SweepOptions(head_to_head_rounds=5, head_to_head_max_rounds=3)
