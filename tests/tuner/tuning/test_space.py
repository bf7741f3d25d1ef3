"""Search spaces narrowed by a sweep spec's [space] table: checked, searched, replayed."""

from __future__ import annotations

from pathlib import Path

import optuna
import pytest

from db.models import TrialStatus
from templates import Problem, current_device, get_template
from tests.tuner.conftest import TOY_PROBLEM
from tuner.errors import TunerError
from tuner.tuning.replay import RecordedProblem, ReplayRunner, replay
from tuner.tuning.search.loop import ProblemSearch, SearchSettings
from tuner.tuning.search.samplers import make_sampler
from tuner.tuning.search.space import SearchSpace, check_restriction, problem_space, valid_configs
from tuner.tuning.search.store import DbStore, MemoryStore
from tuner.tuning.suites import load_spec_file, spec_from_mapping
from tuner.tuning.sweep import SweepOptions, run_sweep

optuna.logging.set_verbosity(optuna.logging.WARNING)


def test_a_restriction_narrows_knobs_and_pins_default_ones() -> None:
    template = get_template("toy_tiles")
    default = template.default_config(TOY_PROBLEM, current_device())
    space = problem_space(template, TOY_PROBLEM, current_device(),
                          {"BLOCK_M": (128, 64), "num_stages": "default"})
    assert space.choices["BLOCK_M"] == (64, 128)  # the knob's order, not the spec's
    assert space.choices["num_stages"] == (default.num_stages,)
    assert space.choices["num_warps"] == (1, 2, 4, 8)  # not named: every choice
    assert space.size() == 2 * 5 * 4 * 1 == len(list(space.configs()))
    assert space.contains(default.to_dict())
    assert not space.contains(template.config_cls(BLOCK_M=32).to_dict())
    full = SearchSpace.full(template.config_cls)
    assert full.is_full and full.tag() == "" and not space.is_full
    assert space.tag().startswith("space-") and space.tag() == problem_space(
        template, TOY_PROBLEM, current_device(), {"num_stages": "default",
                                                  "BLOCK_M": [64, 128]}).tag()
    assert problem_space(template, TOY_PROBLEM, current_device(), None) == full


@pytest.mark.parametrize(("restriction", "message"), [
    ({"BLOCK_K": (64,)}, "toy_tiles has no knob 'BLOCK_K'; its knobs are BLOCK_M, BLOCK_N"),
    ({"BLOCK_M": (64, 48)}, r"space.BLOCK_M: \[48\] not among the choices of toy_tiles's"),
    ({"num_warps": (True,)}, r"space.num_warps: \[True\] not among"),  # a flag is no count
])
def test_restrictions_outside_the_template_are_refused(restriction: dict,
                                                       message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_restriction(get_template("toy_tiles").config_cls, restriction, "toy_tiles")


def test_specs_read_the_space_table(tmp_path: Path) -> None:
    path = tmp_path / "s.toml"
    path.write_text('shapes = [{B = 1, H = 2, N = 64, D = 32}]\n'
                    '[space]\nBLOCK_M = [64, 128]\nlongest_first = "default"\n')
    spec = load_spec_file(path)
    assert spec.space == {"BLOCK_M": (64, 128), "longest_first": "default"}
    assert spec.to_dict()["space"] == {"BLOCK_M": [64, 128], "longest_first": "default"}
    assert load_spec_file(path).space == spec.space
    for bad in ({"BLOCK_M": []}, {"BLOCK_M": 64}, {"BLOCK_M": "fast"}, [64]):
        with pytest.raises(TunerError, match="space"):
            spec_from_mapping({"shapes": [{"B": 1, "H": 2, "N": 64, "D": 32}], "space": bad},
                              source="test")


def test_grid_replay_over_a_subset_runs_exactly_its_valid_configs(
        landscape: RecordedProblem) -> None:
    template = get_template("toy_tiles")
    restriction = {"num_warps": (8,), "num_stages": (1, 2)}  # the default has 4 warps
    space = problem_space(template, TOY_PROBLEM, current_device(), restriction)
    valid = valid_configs(space, lambda c: template.constraint(TOY_PROBLEM, c,
                                                               current_device()))
    assert valid is not None
    result = replay(landscape, sampler="grid", budget=10_000, seed=0, space=restriction)
    assert result.measured == len(valid) and result.repeated == 0
    inside = landscape.within(space)
    assert result.best_found_tflops == result.best_recorded_tflops == inside.best_tflops
    assert inside.best_tflops is not None and inside.best_tflops < 100.0  # the best is outside
    assert result.default_tflops is None  # outside the space: neither enqueued nor counted


def test_the_default_outside_the_space_is_never_asked(landscape: RecordedProblem) -> None:
    template = get_template("toy_tiles")
    space = problem_space(template, TOY_PROBLEM, current_device(), {"num_warps": (2, 8)})
    runner = ReplayRunner(template, landscape.trials)
    search = ProblemSearch(
        template=template, problem=TOY_PROBLEM, device=current_device(),
        study=optuna.create_study(direction="maximize",
                                  sampler=make_sampler("tpe", space, budget=12, seed=1)),
        store=MemoryStore(), runner=runner,
        settings=SearchSettings(budget=12, seed=1, finalists=0),
        space=space)
    assert search.run().measured == 12
    default = template.default_config(TOY_PROBLEM, current_device())
    assert sum(runner.calls.values()) == 12 and default.key() not in runner.calls
    assert all(space.contains(template.config(key_params(key)).to_dict())
               for key in runner.calls)


def key_params(key: str) -> dict[str, int]:
    return {name: int(value) for name, value in (part.split("=") for part in key.split(","))}


def test_a_sweep_over_a_subset_has_its_own_study_and_counts_only_its_configs(
        tmp_path: Path) -> None:
    """A whole-space sweep first, then a grid over a subset on the same database: the subset's
    study cannot be the whole space's (Optuna refuses to change a categorical's choices within
    a study), and results outside the subset do not count towards its budget."""
    db = f"sqlite:///{tmp_path / 'space.db'}"
    shape = {"B": 1, "H": 2, "N": 32, "D": 16}
    base = {"templates": ["toy_add"], "template_modules": ["tests.tuner.toy_templates"],
            "dtypes": ["float16"], "shapes": [shape]}
    whole = run_sweep(spec_from_mapping({"name": "whole", **base}, source="test"),
                      SweepOptions(trials=3, timeout_s=60, seed=0, sampler="grid"), db_url=db)
    assert whole.problems[0].measured == 3
    subset = spec_from_mapping({"name": "subset", **base, "space": {"BLOCK": [64, 128]}},
                               source="test")
    report = run_sweep(subset, SweepOptions(trials=100, timeout_s=60, seed=0, sampler="grid"),
                       db_url=db)
    (problem,) = report.problems
    assert report.status == "done" and problem.budget == 3  # 64x1, 64x2, 128x2 (128x1 invalid)
    template = get_template("toy_add")
    toy = Problem(1, 2, 2, 32, 32, 16, "float16")
    space = problem_space(template, toy, current_device(), subset.space)
    studies = {s.study_name for s in optuna.get_all_study_summaries(storage=db)}
    assert len(studies) == 2 and any(name.endswith(space.tag()) for name in studies)
    device = current_device().to_dict() | {"key": current_device().key}
    known = DbStore(db, device=device, template_name="toy_add",
                    template_version=template.version(),
                    space=template.config_cls.json_schema()).known(template.problem_key(toy))
    measured = sorted((r.config["BLOCK"], r.config["num_warps"]) for r in known.values()
                      if r.status == TrialStatus.OK and space.contains(r.config))
    assert measured == [(64, 1), (64, 2), (128, 2)]

    bad = spec_from_mapping({"name": "bad", **base, "space": {"BLOCKS": [64]}}, source="test")
    with pytest.raises(TunerError, match="toy_add has no knob 'BLOCKS'"):
        run_sweep(bad, SweepOptions(trials=1, timeout_s=60), db_url=db)


@pytest.mark.parametrize("template", ["flash_fwd", "gluon_fwd", "gluon_bwd", "torch_sdpa"])
def test_a_space_enumerates_the_checked_grid(template: str) -> None:
    """``configs`` builds its configs without the per-knob check (every value is a choice by
    construction): the same configs, equal and hashing alike, in the grid's order; a
    restricted space its subset in that order."""
    cls = get_template(template).config_cls
    made = list(SearchSpace.full(cls).configs())
    checked = list(cls.grid())
    assert made == checked and [hash(c) for c in made] == [hash(c) for c in checked]
    assert [c.key() for c in made] == [c.key() for c in checked]
    first = cls.knobs()[0]
    narrowed = problem_space(get_template(template), TOY_PROBLEM, current_device(),
                             {first.name: [first.choices[-1]]})
    assert list(narrowed.configs()) == [c for c in checked
                                        if getattr(c, first.name) == first.choices[-1]]
    if len(cls.knobs()) > 1:
        with pytest.raises(ValueError, match="every knob"):
            next(SearchSpace(cls, {first.name: first.choices}).configs())


def test_a_budgeted_sweep_checks_each_tasks_space_once(db_url: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe and the search of one task share the space's valid configs (enumerating a
    Gluon space and checking every config took 1.5-2 s a search on a GPU host's CPU)."""
    from tests.tuner.tuning.test_head_to_head import ScriptedRunner
    from tuner.tuning.search import loop

    calls: list[int] = []
    counted = loop.valid_configs

    def counting(space: SearchSpace, reason: object) -> object:
        calls.append(space.size())
        return counted(space, reason)  # type: ignore[arg-type]

    monkeypatch.setattr(loop, "valid_configs", counting)
    spec = spec_from_mapping({"name": "once", "templates": ["torch_sdpa", "flash_fwd"],
                              "shapes": [{"B": 1, "H": 2, "N": 32, "D": 16},
                                         {"B": 1, "H": 2, "N": 64, "D": 16}],
                              "dtypes": ["float16"]}, source="test")
    report = run_sweep(spec, SweepOptions(seed=3, trials=3, budget_s=600.0,
                                          head_to_head_rounds=0),
                       db_url=db_url,
                       make_runner=ScriptedRunner({"torch_sdpa": [1.0], "flash_fwd": [1.1]}))
    assert all(p.reached for p in report.problems)
    assert len(calls) == 4  # one per task (2 problems x 2 templates), not per search
