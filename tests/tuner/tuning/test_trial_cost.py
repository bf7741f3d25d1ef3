"""Where a trial's time goes, and the references a trial worker keeps between trials.

Each trial reports the seconds of its phases (inputs, first launch, reference, check,
timing), which the worker's whole time bounds. A worker keeps the last references of the
problem at hand (``tuner.tuning.runner.reference_cache``): a stand-in template counts its
reference calls. On the CPU no freed memory can be poisoned, so the tests that reuse a seed
give the cache a stand-in poisoner; without one a repeated seed is replaced by a fresh one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import re
from collections import Counter
from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from sqlalchemy import select

from db.models import Remeasurement, Trial, TrialStatus
from db.session import session_scope
from templates import current_device
from templates.base import KernelConfig, Problem, Template, knob
from templates.device import DeviceInfo
from tests.tuner.conftest import TOY_PROBLEM
from tuner.tuning.runner.isolated import IsolatedRunner
from tuner.tuning.runner.measure import measure
from tuner.tuning.runner.outcome import PHASES, PhaseTotals, TrialOutcome, TrialRequest
from tuner.tuning.runner.reference_cache import CudaPoisoner, ReferenceCache, fingerprint
from tuner.tuning.runner.trial_process import _answer
from tuner.tuning.suites import spec_from_mapping
from tuner.tuning.sweep import SweepOptions, run_sweep

OTHER_PROBLEM = dataclasses.replace(TOY_PROBLEM, seqlen_q=32)
CALLS: Counter[str] = Counter()  # "reference", "make_inputs", and the poisoner's "poison"
EVENTS: list[str] = []  # the same calls, and "run", in order


@dataclass(frozen=True)
class StandInConfig(KernelConfig):
    fault: str = knob("none", ["none", "wrong", "scribble", "oom"], "how it misbehaves")


class StandIn(Template):
    """``alpha * x + y`` in plain torch, counting its make_inputs and reference calls.
    Faults: ``wrong`` drops y; ``scribble`` also writes into the first reference computed
    (a kernel that writes outside its output); ``oom`` runs out of memory while the cache
    holds anything."""

    name = "stand_in"
    description = "alpha * x + y, counting references (tests)"
    config_cls = StandInConfig
    held: list[Any] = []  # what `scribble` writes into: set by the test

    def flops(self, problem: Problem) -> float:
        return 2.0 * _elements(problem)

    def bytes_moved(self, problem: Problem) -> float:
        return 6.0 * _elements(problem)

    def constraint(self, problem: Problem, config: KernelConfig,
                   device: DeviceInfo) -> str | None:
        return None

    def default_config(self, problem: Problem, device: DeviceInfo) -> KernelConfig:
        return StandInConfig()

    def make_inputs(self, problem: Problem, device: str, seed: int = 0) -> dict[str, Any]:
        CALLS["make_inputs"] += 1
        EVENTS.append("make_inputs")
        gen = torch.Generator().manual_seed(seed)
        n = _elements(problem)
        x = torch.randn(n, generator=gen, dtype=torch.float16).to(device)
        x[0] += sum(DRIFT)
        return {"x": x, "y": torch.randn(n, generator=gen, dtype=torch.float16).to(device),
                "alpha": 0.5 + float(torch.rand(1, generator=gen)), "seed": seed}

    def run(self, inputs: Mapping[str, Any], config: KernelConfig) -> Any:
        assert isinstance(config, StandInConfig)
        EVENTS.append("run")
        if config.fault == "oom" and OOM_WHILE_HELD and CACHES and CACHES[-1].holds():
            raise torch.OutOfMemoryError("CUDA out of memory (stand-in)")
        out = inputs["alpha"] * inputs["x"].float()
        if config.fault == "scribble" and StandIn.held:
            StandIn.held[0].add_(1.0)
        if config.fault != "wrong":
            out = out + inputs["y"].float()
        return out.to(torch.float16)

    def reference(self, inputs: Mapping[str, Any]) -> Any:
        CALLS["reference"] += 1
        ref = inputs["alpha"] * inputs["x"].double() + inputs["y"].double()
        StandIn.held.append(ref)
        return ref


class StandInTwin(StandIn):
    """Another template with the same reference and inputs functions."""

    name = "stand_in_twin"


class StandInOwnReference(StandIn):
    name = "stand_in_own"

    def reference(self, inputs: Mapping[str, Any]) -> Any:
        return super().reference(inputs)


OOM_WHILE_HELD = True
CACHES: list[ReferenceCache] = []
DRIFT: list[float] = []  # added to x[0] by make_inputs


class StandInPoisoner:
    """A poisoner that counts its calls; ``safe``: whether the freed memory is still in its
    reach (False: given back to the driver)."""

    def __init__(self) -> None:
        self.safe = True

    def mark(self) -> Hashable:
        return 0

    def safe_since(self, mark: Hashable) -> bool:
        return self.safe

    def poison(self) -> None:
        CALLS["poison"] += 1
        EVENTS.append("poison")


def _elements(problem: Problem) -> int:
    return problem.batch * problem.heads_q * problem.seqlen_q * problem.head_dim


@pytest.fixture(autouse=True)
def _fresh_counts() -> None:
    CALLS.clear()
    EVENTS.clear()
    StandIn.held.clear()
    CACHES.clear()
    DRIFT.clear()


def cache(poisoner: StandInPoisoner | None = None, **kwargs: Any) -> ReferenceCache:
    made = ReferenceCache(poisoner=poisoner if poisoner is not None else StandInPoisoner(),
                          **kwargs)
    CACHES.append(made)
    return made


def trial(template: Template, kept: ReferenceCache | None, *, seed: int = 7,
          problem: Problem = TOY_PROBLEM, fault: str = "none") -> TrialOutcome:
    return measure(template, problem, StandInConfig(fault=fault), device=current_device(),
                   seed=seed, cache=kept)


# ----------------------------------------------------------------------------- phases
def test_each_phase_is_timed_and_the_worker_time_bounds_them() -> None:
    request = TrialRequest(template="toy_add", template_module="tests.tuner.toy_templates",
                           problem=TOY_PROBLEM.to_dict(), config={"BLOCK": 64, "num_warps": 2},
                           seed=3)
    answer = TrialOutcome.from_dict(_answer(dataclasses.asdict(request), current_device(),
                                            ReferenceCache()))
    assert answer.status == TrialStatus.OK, answer.reason
    phases = answer.phases()
    assert list(phases) == list(PHASES)  # every phase, in order
    assert all(seconds > 0 for seconds in phases.values())
    assert sum(phases.values()) <= answer.runner_s
    record = answer.phase_record()
    assert record is not None and record["runner_s"] == answer.runner_s
    assert "reference_kept" not in record  # computed: nothing kept yet


def test_a_failed_trial_keeps_the_phases_it_went_through() -> None:
    wrong = trial(StandIn(), None, fault="wrong")
    assert wrong.status == TrialStatus.WRONG_RESULT
    assert set(wrong.phases()) == {"inputs_s", "compile_s", "reference_s", "check_s"}
    rejected = TrialOutcome.failed(TrialStatus.INVALID, "too big")
    assert rejected.phases() == {} and rejected.phase_record() is None  # never ran


def test_phase_totals_say_where_the_time_went() -> None:
    totals = PhaseTotals()
    totals.add(TrialOutcome(TrialStatus.OK, inputs_s=0.5, compile_s=2.0, reference_s=4.0,
                            check_s=0.5, bench_s=0.5, runner_s=8.0))
    totals.add(TrialOutcome(TrialStatus.OK, inputs_s=0.5, compile_s=1.0, reference_s=0.0,
                            check_s=0.5, bench_s=0.5, runner_s=3.0, reference_kept=True,
                            start_s=1.0))
    assert (totals.trials, totals.references_kept) == (2, 1)
    assert totals.rest_s == pytest.approx(11.0 - 10.0)
    text = totals.breakdown(wall_s=16.0, count=2)
    assert text == ("inputs 0.50 s, compile 1.50 s, reference 2.00 s, check 0.50 s, timing "
                    "0.50 s, rest of the worker 0.50 s, starting workers 0.50 s, outside the "
                    "worker 2.00 s; 1 of 2 reference(s) kept from an earlier trial")
    assert totals.merged(totals).trials == 4


# ----------------------------------------------------------------------------- kept references
def test_the_reference_is_computed_once_per_problem_and_seed() -> None:
    kept, template = cache(), StandIn()
    first, second = trial(template, kept), trial(template, kept)
    assert first.ok and second.ok, (first.reason, second.reason)
    assert CALLS["reference"] == 1 and CALLS["make_inputs"] == 2  # inputs: always afresh
    assert (first.reference_kept, second.reference_kept) == (False, True)
    # Freed memory poisoned for the repeated seed, after its inputs, before its first launch
    second_trial = EVENTS[len(EVENTS) - 1 - EVENTS[::-1].index("make_inputs"):]
    assert CALLS["poison"] == 1 and second_trial[:3] == ["make_inputs", "poison", "run"]
    assert second.phase_record() is not None and second.phase_record()["reference_kept"]
    trial(template, kept, seed=8)  # a new seed
    assert CALLS["reference"] == 2
    trial(template, kept, seed=8, problem=OTHER_PROBLEM)  # a new problem
    assert CALLS["reference"] == 3 and kept.holds() == 1  # the other problem's went
    assert trial(template, kept, seed=8, problem=OTHER_PROBLEM).reference_kept


def test_templates_of_one_reference_and_inputs_function_share_it() -> None:
    kept = cache()
    trial(StandIn(), kept)
    assert trial(StandInTwin(), kept).reference_kept and CALLS["reference"] == 1
    assert not trial(StandInOwnReference(), kept).reference_kept
    assert CALLS["reference"] == 2 and kept.holds() == 2
    trial(StandIn(), kept, seed=9)  # a third entry: the least recently used goes
    assert kept.holds() == 2 and trial(StandIn(), kept).reference_kept is False
    assert CALLS["reference"] == 4


def test_a_wrong_output_is_caught_against_a_kept_reference() -> None:
    kept, template = cache(), StandIn()
    assert trial(template, kept).ok
    wrong = trial(template, kept, fault="wrong")
    assert wrong.reference_kept and CALLS["reference"] == 1
    assert wrong.status == TrialStatus.WRONG_RESULT and "exceeds the tolerance" in wrong.reason
    assert trial(template, kept).ok  # the kept reference is untouched


def test_a_kept_reference_written_over_is_computed_again() -> None:
    kept, template = cache(), StandIn()
    assert trial(template, kept).ok
    # This config writes into the kept reference during its first launch: the trial is
    # checked against a reference computed afresh, as without the cache (it is right).
    scribbled = trial(template, kept, fault="scribble")
    assert scribbled.ok and not scribbled.reference_kept and CALLS["reference"] == 2
    assert trial(template, kept).reference_kept


def test_inputs_that_differ_from_the_kept_ones_get_their_own_reference() -> None:
    kept, template = cache(), StandIn()
    assert trial(template, kept).ok
    DRIFT.append(1.0)  # make_inputs is no longer deterministic per seed
    outcome = trial(template, kept)
    assert outcome.ok and not outcome.reference_kept and CALLS["reference"] == 2
    assert kept.holds() == 1  # in place of the other


def test_a_repeated_seed_runs_fresh_where_freed_memory_cannot_be_poisoned() -> None:
    poisoner = StandInPoisoner()
    kept, template = cache(poisoner), StandIn()
    trial(template, kept)
    poisoner.safe = False  # memory went back to the driver since the seed's first run
    outcome = trial(template, kept)
    assert not outcome.reference_kept and CALLS["poison"] == 0
    seeds = list(kept._seeds)
    assert len(seeds) == 2 and seeds[0] == 7  # a fresh seed stood in for 7
    poisoner.safe = True
    assert trial(template, kept).reference_kept  # the stand-in seed from then on


def test_without_a_poisoner_every_trial_gets_fresh_inputs() -> None:
    kept = ReferenceCache(poisoner=None)  # the CPU's and the interpreter's
    template = StandIn()
    outcomes = [trial(template, kept) for _ in range(3)]
    assert all(o.ok and not o.reference_kept for o in outcomes)
    assert CALLS["reference"] == 3 and len(kept._seeds) == 3
    assert ReferenceCache.for_device(on_gpu=False).poisoner is None


def test_a_poisoner_that_fails_costs_no_trial_only_the_kept_references() -> None:
    class Broken(StandInPoisoner):
        def poison(self) -> None:
            raise RuntimeError("no snapshot here")

    kept, template = cache(Broken()), StandIn()
    trial(template, kept)
    EVENTS.clear()
    outcome = trial(template, kept)
    assert outcome.ok and not outcome.reference_kept and kept.poisoner is None
    assert EVENTS[:3] == ["make_inputs", "make_inputs", "run"]  # again, from a fresh seed
    assert not trial(template, kept).reference_kept  # fresh seeds from then on


def test_running_out_of_memory_beside_kept_references_runs_the_trial_without_them() -> None:
    kept, template = cache(), StandIn()
    trial(template, kept)
    outcome = trial(template, kept, fault="oom")
    assert outcome.ok and not outcome.reference_kept and CALLS["reference"] == 2
    assert kept.holds() == 0  # the retry kept nothing
    assert trial(template, kept).ok and CALLS["reference"] == 3


def test_the_fingerprint_sees_every_byte_of_a_view_and_ignores_tokens() -> None:
    base = torch.randn(4, 6, dtype=torch.float16)
    view = base.t()
    printed = fingerprint({"q": view, "token": "run-1", "scale": 0.5})
    assert printed == fingerprint({"q": base.clone().t(), "token": "run-2", "scale": 0.5})
    base[3, 5] += 1
    assert fingerprint({"q": view, "token": "run-1", "scale": 0.5}) != printed
    assert fingerprint({"q": view, "scale": 0.25}) != fingerprint({"q": view, "scale": 0.5})


# ----------------------------------------------------------------------------- a worker
def test_a_worker_reports_its_phases_and_runs_a_repeated_seed_fresh_on_the_cpu() -> None:
    runner = IsolatedRunner(name="trial-cost")
    try:
        request = TrialRequest(template="toy_add", template_module="tests.tuner.toy_templates",
                               problem=TOY_PROBLEM.to_dict(),
                               config={"BLOCK": 64, "num_warps": 2}, seed=3)
        outcomes = [runner.measure(request, 120.0) for _ in range(2)]
    finally:
        runner.close()
    for outcome in outcomes:
        assert outcome.ok, outcome.reason
        assert set(outcome.phases()) == set(PHASES)
        assert sum(outcome.phases().values()) <= outcome.runner_s
    # The worker started before the first trial (IsolatedRunner.measure), not for the second.
    assert outcomes[0].start_s > 0 and outcomes[1].start_s == 0
    # The second trial's reference is the first's on a GPU (freed memory poisoned), never on
    # the CPU (no poisoner: a fresh seed).
    assert outcomes[1].reference_kept == (not current_device().is_interpreter)
    assert not outcomes[0].reference_kept


# ----------------------------------------------------------------------------- a sweep
def test_a_sweep_stores_and_reports_where_its_worker_time_went(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tuner.cli import common
    from tuner.cli.sweep import print_summary

    db = f"sqlite:///{tmp_path / 'phases.db'}"
    spec = spec_from_mapping({"name": "phases", "templates": ["toy_add"],
                              "template_modules": ["tests.tuner.toy_templates"],
                              "dtypes": ["float16"],
                              "shapes": [{"B": 1, "H": 1, "N": 16, "D": 16}]}, source="test")
    report = run_sweep(spec, SweepOptions(trials=3, timeout_s=120, seed=0, finalists=1,
                                          final_repeats=1, head_to_head_rounds=0), db_url=db)
    (problem,) = report.problems
    # The best and the default re-measured (once, where the default is the best)
    finals = problem.remeasurements
    assert problem.measured == 3 and finals in (1, 2)
    assert problem.phases.trials == 3 and problem.final_phases.trials == finals
    assert 0 < problem.phases.runner_s <= problem.wall_s
    assert 0 < problem.final_phases.runner_s <= problem.final_s
    assert problem.phases.bench_s == pytest.approx(problem.bench_s)
    assert problem.to_dict()["phases"]["trials"] == 3  # in the --json report too
    with session_scope(db) as s:
        trials = s.scalars(select(Trial)).all()
        again = s.scalars(select(Remeasurement)).all()
        assert len(trials) == 3 and len(again) == finals
        for row in [*trials, *again]:
            assert row.phases is not None and set(PHASES) <= set(row.phases)
            assert sum(row.phases[name] for name in PHASES) <= row.phases["runner_s"]

    out = io.StringIO()
    monkeypatch.setattr(common.console, "width", 400)  # the lines unfolded
    with contextlib.redirect_stdout(out):
        print_summary(report)
    text = " ".join(out.getvalue().split())
    assert re.search(r"3 config\(s\) measured by this sweep in \d+ s: [\d.]+ s per trial of "
                     r"worker time, of which [\d.]+ s timing the kernel \(compile-ahead "
                     r"processes: \d+\); per trial: inputs [\d.]+ s, compile [\d.]+ s, reference "
                     r"[\d.]+ s, check [\d.]+ s, timing [\d.]+ s, rest of the worker [\d.]+ s, "
                     r"outside the worker [\d.]+ s", text), text
    assert re.search(rf"{finals} finalist re-measurement\(s\) by this sweep: \d+ s of worker "
                     r"time; "
                     r"each: inputs [\d.]+ s, compile", text), text


# ----------------------------------------------------------------------------- the GPU
@pytest.mark.gpu
def test_poisoning_fills_every_free_block_with_nan() -> None:
    assert CudaPoisoner.available()
    poisoner = CudaPoisoner()
    mark = poisoner.mark()
    answer = torch.full((1 << 20,), 3.0, dtype=torch.float16, device="cuda")
    address = answer.data_ptr()
    del answer  # freed: back in the caching allocator's pool, 3.0 still in it
    poisoner.poison()
    again = torch.empty((1 << 20,), dtype=torch.float16, device="cuda")
    assert again.data_ptr() == address  # the same block, handed out again
    assert torch.isnan(again).all()  # no earlier answer to pass on
    assert poisoner.safe_since(mark)
    torch.cuda.empty_cache()  # back to the driver: nothing can promise the next block
    assert not poisoner.safe_since(mark)
