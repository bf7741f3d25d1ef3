"""End to end through the CLI: one sweep of the toy templates (every failure kind, compile
ahead, isolation), then the commands that read what it stored; and flash_fwd for real.

The sweep runs once per module (worker processes cost seconds to start); the tests read its
report, the database and the toy templates' measurement log.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
import pytest
from sqlalchemy import select

from db.models import Remeasurement, Sweep, Trial, TrialStatus
from db.models import Template as TemplateRow
from db.session import session_scope
from templates import Problem, current_device, get_template
from tests.tuner.piped_table import piped_table
from tests.tuner.toy_templates import MEASURE_LOG_ENV, PRECOMPILE_DIR_ENV, measurements
from tuner.cli.app import main
from tuner.tuning.replay import load_recorded_file
from tuner.tuning.search.study import study_name
from tuner.tuning.suites import spec_from_mapping
from tuner.tuning.sweep import SweepOptions, run_sweep

SHAPE = {"B": 1, "H": 2, "N": 32, "D": 16}
TOY_PROBLEM = Problem(1, 2, 2, 32, 32, 16, "float16")
TIMEOUT_S = 3


def cli(*args: str) -> tuple[int, str, str]:
    """Run ``tuner ARGS`` in this process: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(list(args))
        except SystemExit as exc:
            code = int(exc.code or 0)
    return code, out.getvalue(), err.getvalue()


@dataclass(frozen=True)
class Swept:
    db: str
    report: dict[str, Any]
    log: Path
    precompiled: Path
    root: Path

    def rows(self, template: str) -> list[Trial]:
        with session_scope(self.db, write=False) as s:
            return list(s.scalars(select(Trial).join(TemplateRow).where(
                TemplateRow.name == template)))

    def remeasured(self) -> Counter[str]:
        """Config key -> its stored re-measurements (every template)."""
        with session_scope(self.db, write=False) as s:
            return Counter(r.trial.config_key for r in s.scalars(select(Remeasurement)))

    def problem(self, template: str) -> dict[str, Any]:
        (found,) = [p for p in self.report["problems"]
                    if p["template"] == template and p["problem"]["head_dim"] == SHAPE["D"]]
        return found


@pytest.fixture(scope="module")
def swept(tmp_path_factory: pytest.TempPathFactory) -> Swept:
    root = tmp_path_factory.mktemp("toys")
    spec = root / "toys.toml"
    spec.write_text(
        'name = "toys"\ntemplates = ["toy_add", "toy_faulty"]\n'
        'template_modules = ["tests.tuner.toy_templates"]\ndtypes = ["float16"]\n'
        f"shapes = [{{B = {SHAPE['B']}, H = {SHAPE['H']}, N = {SHAPE['N']}, D = {SHAPE['D']}}},"
        " {B = 1, H = 2, N = 32, D = 8}]\n")  # D=8: the toys' default_config raises
    db = f"sqlite:///{root / 'tuner.db'}"
    log, pre = root / "measured.log", root / "precompiled"
    pre.mkdir()
    with pytest.MonkeyPatch.context() as mp:  # inherited by the worker processes
        mp.setenv(MEASURE_LOG_ENV, str(log))
        mp.setenv(PRECOMPILE_DIR_ENV, str(pre))
        code, out, err = cli("sweep", str(spec), "--db", db, "--trials", "7", "--timeout",
                             str(TIMEOUT_S), "--compile-ahead", "1", "--seed", "1", "--json")
    assert code == 0, err
    return Swept(db=db, report=json.loads(out), log=log, precompiled=pre, root=root)


def test_the_report_says_what_ran_and_that_cpu_timings_are_not_gpu_timings(
        swept: Swept) -> None:
    report = swept.report
    assert report["status"] == "done" and report["sampler"] == "tpe"
    if report["device"]["name"] == "cpu-interpreter":
        assert report["timings_are_gpu_timings"] is False
        assert "NOT GPU timings" in report["warning"]
    add = swept.problem("toy_add")
    assert add["budget"] == 7 == add["measured"] == add["ok"]  # 8 configs, 1 rejected
    assert add["best_tflops"] >= add["default_tflops"] > 0
    assert add["speedup"] == pytest.approx(add["best_tflops"] / add["default_tflops"])
    assert add["seconds_per_trial"] > add["bench_seconds_per_trial"] > 0
    faulty = swept.problem("toy_faulty")
    assert faulty["budget"] == 6 == faulty["measured"]  # 10 configs, 4 rejected
    failed = {k: v for k, v in faulty["failed"].items() if k != "invalid"}
    assert faulty["ok"] == 2
    assert failed == {"wrong_result": 1, "runtime_error": 2, "timeout": 1}
    assert faulty["best_config"]["fault"] == "none"
    failed_setup = [p for p in report["problems"] if p["problem"]["head_dim"] == 8]
    assert len(failed_setup) == 2 and all(
        "no default config for head_dim 8" in p["skipped"] and p["measured"] == 0
        for p in failed_setup)


def test_every_failure_is_recorded_with_its_reason_and_the_sweep_went_on(swept: Swept) -> None:
    by_fault = {(r.config["BLOCK"], r.config["fault"]): r for r in swept.rows("toy_faulty")}
    segv, hang = by_fault[(32, "segv")], by_fault[(32, "hang")]
    assert segv.status == TrialStatus.RUNTIME_ERROR and "SIGSEGV" in segv.reason
    assert hang.status == TrialStatus.TIMEOUT and f"{TIMEOUT_S} s" in hang.reason
    raised = by_fault[(32, "raise")]
    assert raised.status == TrialStatus.RUNTIME_ERROR
    assert "toy: simulated launch failure" in raised.reason
    wrong = by_fault[(32, "wrong")]
    assert wrong.status == TrialStatus.WRONG_RESULT and wrong.error > 0.01
    assert wrong.tflops is None
    for (block, fault), row in by_fault.items():
        if block == 64 and fault != "none":
            assert row.status == TrialStatus.INVALID and row.reason == "faults need BLOCK 32"
    # Crashes replaced the worker: configs measured after them still ran fine.
    ok = [r for r in swept.rows("toy_faulty") if r.status == TrialStatus.OK]
    assert len(ok) == 2 and all(r.tflops and r.median_ms and r.compile_s for r in ok)


def test_each_config_ran_once_and_rejected_ones_never_but_finalists_again(
        swept: Swept) -> None:
    measured = measurements(swept.log)
    n = f"n={TOY_PROBLEM.batch * TOY_PROBLEM.heads_q * TOY_PROBLEM.seqlen_q * 16}"
    again = swept.remeasured()
    for template in ("toy_add", "toy_faulty"):
        for row in swept.rows(template):
            assert row.problem["head_dim"] == SHAPE["D"]  # nothing of the D=8 problems ran
            runs = len(measured.get((template, n, row.config_key), set()))
            expected = 0 if row.status == TrialStatus.INVALID else 1 + again[row.config_key]
            assert runs == expected, row.config_key


def test_the_finalists_were_measured_again_and_the_best_is_their_median(swept: Swept) -> None:
    add = swept.problem("toy_add")
    # The 3 fastest first readings and the default (unless one of them), 2 more readings each.
    assert add["remeasured"] in (3, 4) and add["remeasurements"] == 2 * add["remeasured"]
    assert add["disqualified"] == 0 and add["final_s"] > 0 and add["best_runs"] == 3
    finalists = add["finalists"]
    assert len(finalists) == add["remeasured"]
    assert sum(f["is_default"] for f in finalists) == 1
    for f in finalists:
        assert len(f["runs_ms"]) == 3 and f["status"] == "ok"
        assert f["median_ms"] == pytest.approx(sorted(f["runs_ms"])[1])
    (best,) = [f for f in finalists if f["config"] == add["best_config"]]
    assert best["median_ms"] == min(f["median_ms"] for f in finalists)
    assert add["best_median_ms"] == pytest.approx(best["median_ms"])
    assert add["best_tflops"] == pytest.approx(best["tflops"])
    (default,) = [f for f in finalists if f["is_default"]]
    assert add["default_tflops"] == pytest.approx(default["tflops"])  # median against median
    faulty = swept.problem("toy_faulty")  # only 2 configs ran correctly: both are finalists
    assert faulty["remeasured"] == 2 and faulty["remeasurements"] == 4
    # Every re-measurement is stored, beside its trial.
    assert sum(swept.remeasured().values()) == add["remeasurements"] + faulty["remeasurements"]


def test_the_default_config_goes_first_and_is_marked(swept: Swept) -> None:
    device = current_device()
    for name in ("toy_add", "toy_faulty"):
        template = get_template(name)
        default = template.default_config(TOY_PROBLEM, device)
        (row,) = [r for r in swept.rows(name) if r.is_default]
        assert row.config_key == default.key() and row.optuna_trial == 0
        assert row.status == TrialStatus.OK


def test_studies_live_in_the_project_database(swept: Swept) -> None:
    device = current_device()
    names = {s.study_name: s for s in optuna.get_all_study_summaries(storage=swept.db)}
    for name in ("toy_add", "toy_faulty"):
        template = get_template(name)
        expected = study_name(device.key, name, template.version(),
                              template.problem_key(TOY_PROBLEM))
        assert expected in names
        study = optuna.load_study(study_name=expected, storage=swept.db)
        states = Counter(t.state.name for t in study.trials)
        assert states.get("RUNNING", 0) == 0
        sources = Counter(t.user_attrs.get("source") for t in study.trials
                          if t.state.name == "COMPLETE")
        rows = swept.rows(name)
        assert sources["measured"] == sum(r.status != TrialStatus.INVALID for r in rows)
        # The study knows first readings only; the finalists' medians are not told to it.
        assert study.best_value == pytest.approx(max(r.tflops or 0 for r in rows))


def test_compile_ahead_warmed_upcoming_configs(swept: Swept) -> None:
    assert swept.report["compile_ahead"] == 1
    warmed = {p.name.replace("+", ",") for p in swept.precompiled.iterdir()}
    assert warmed, "no config was compiled ahead"
    valid = {r.config_key for name in ("toy_add", "toy_faulty") for r in swept.rows(name)
             if r.status != TrialStatus.INVALID}
    assert warmed <= valid  # only configs that passed the constraints, and then ran


def test_best_lists_this_devices_configs(swept: Swept) -> None:
    code, out, _ = cli("best", "--db", swept.db, "--json")
    assert code == 0
    items = {it["template"]: it for it in json.loads(out)}
    assert set(items) == {"toy_add", "toy_faulty"}
    assert items["toy_add"]["tflops"] == pytest.approx(swept.problem("toy_add")["best_tflops"])
    assert items["toy_add"]["current_version"] is True
    code, out, _ = cli("best", "--db", swept.db, "--json", "--template", "toy_add",
                       "--dtype", "float16", "--shape", "B=1,H=2,N=30,D=16")  # same bucket
    assert code == 0 and [it["template"] for it in json.loads(out)] == ["toy_add"]
    code, out, _ = cli("best", "--db", swept.db)
    assert code == 0 and "toy_faulty" in out and "NOT GPU" in out


def test_list_devices_templates_and_sweeps(swept: Swept) -> None:
    code, out, _ = cli("list", "devices", "--db", swept.db, "--json")
    assert code == 0 and [d["key"] for d in json.loads(out)] == [current_device().key]
    code, out, _ = cli("list", "templates", "--db", swept.db, "--json")
    rows = {t["name"]: t for t in json.loads(out)}
    assert rows["toy_add"]["stored_versions"] == [get_template("toy_add").version()]
    assert rows["flash_fwd"]["registered"] is True
    code, out, _ = cli("list", "sweeps", "--db", swept.db, "--json")
    (sweep,) = json.loads(out)
    assert sweep["status"] == "done" and sweep["trials"]["ok"] == 9
    code, _, err = cli("list", "cats", "--db", swept.db)
    assert code != 0


def test_export_then_import_moves_the_best_configs(swept: Swept, tmp_path: Path) -> None:
    bundle = tmp_path / "bundle.json"
    assert cli("export", str(bundle), "--db", swept.db)[0] == 0
    other = f"sqlite:///{tmp_path / 'other.db'}"
    code, out, err = cli("import", str(bundle), "--db", other, "--json")
    assert code == 0, err
    assert json.loads(out)["items"] == 2
    # The finalists' readings of the best and default configs came along (bundle version 2).
    assert json.loads(bundle.read_text())["version"] == 2
    assert json.loads(out)["remeasurements"] > 0
    _, here, _ = cli("best", "--db", swept.db, "--json")
    _, there, _ = cli("best", "--db", other, "--json")
    pick = [(it["template"], it["config"], it["tflops"], it["default_tflops"], it["readings"],
             it["spread"]) for it in json.loads(here)]
    assert sorted(pick, key=str) == sorted(
        [(it["template"], it["config"], it["tflops"], it["default_tflops"], it["readings"],
          it["spread"]) for it in json.loads(there)], key=str)
    assert all(it["readings"] == 3 for it in json.loads(there))
    code, out, _ = cli("import", str(bundle), "--db", other, "--json")  # again: no change
    assert code == 0 and json.loads(out)["trials"] == json.loads(out)["remeasurements"] == 0


def test_import_stores_in_batches_as_the_service_does(swept: Swept, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A large file never holds SQLite's write lock for long (issue 19, item 5)."""
    import tuner.lookup.bundle

    bundle = tmp_path / "bundle.json"
    assert cli("export", str(bundle), "--db", swept.db)[0] == 0
    real, batches = tuner.lookup.bundle.store_bundle_in_batches, []

    def one_item_batches(url: str, items: Any, **kw: Any) -> Any:
        batches.append(len(items))
        return real(url, items, **{**kw, "batch_items": 1})

    monkeypatch.setattr(tuner.lookup.bundle, "store_bundle_in_batches", one_item_batches)
    other = f"sqlite:///{tmp_path / 'batched.db'}"
    code, out, err = cli("import", str(bundle), "--db", other, "--json")
    assert code == 0, err
    assert batches == [2] and json.loads(out)["items"] == 2
    _, there, _ = cli("best", "--db", other, "--json")
    assert len(json.loads(there)) == 2


def test_a_bad_bundle_item_rejects_the_whole_import(swept: Swept, tmp_path: Path) -> None:
    bundle = tmp_path / "bundle.json"
    cli("export", str(bundle), "--db", swept.db)
    data = json.loads(bundle.read_text())
    data["items"][1]["config"] = {"BLOCK": 48}  # outside the space
    bundle.write_text(json.dumps(data))
    other = f"sqlite:///{tmp_path / 'other.db'}"
    code, _, err = cli("import", str(bundle), "--db", other)
    assert code == 2
    assert "bundle item 1" in err and "nothing stored" in err and "fix:" in err
    code, out, _ = cli("best", "--db", other, "--all", "--json")
    assert code == 0 and json.loads(out) == []


def test_replay_the_recorded_trials_offline(swept: Swept, tmp_path: Path) -> None:
    trials = tmp_path / "trials.json"
    assert cli("export", str(trials), "--trials", "--db", swept.db)[0] == 0
    # Every trial's re-measurements are recorded beside it, and read back.
    written = Counter({get_template(p["template"]).config(t["config"]).key():
                       len(t["remeasurements"])
                       for p in json.loads(trials.read_text())["problems"]
                       for t in p["trials"] if "remeasurements" in t})
    assert written == swept.remeasured() and written.total() > 0
    read = Counter({key: len(again) for p in load_recorded_file(trials)
                    for key, again in p.remeasurements.items()})
    assert read == written
    code, out, err = cli("replay", "--from", str(trials), "--template", "toy_add",
                         "--sampler", "grid", "--budget", "100", "--seeds", "1", "--json")
    assert code == 0, err
    (summary,) = json.loads(out)
    assert summary["worst_fraction_of_best"] == 1.0
    assert summary["runs"][0]["measured"] == 7 and summary["runs"][0]["repeated"] == 0
    code, out, _ = cli("replay", "--db", swept.db, "--template", "toy_faulty", "--sampler",
                       "random", "--fraction", "0.5", "--seeds", "2", "--json")
    (summary,) = json.loads(out)
    assert code == 0 and summary["budget"] == 3


def test_user_errors_exit_2_and_name_the_fix(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 'e.db'}"
    code, _, err = cli("sweep", "nope", "--db", db)
    assert code == 2 and "unknown suite 'nope'" in err and "fix:" in err
    code, out, _ = cli("sweep", "nope", "--db", db, "--json")
    assert code == 2 and json.loads(out)["fix"]
    bad = tmp_path / "bad.toml"
    bad.write_text('shapes = [{B = 1, H = 2, N = 64, D = 32, Q = 1}]\n')
    code, _, err = cli("sweep", str(bad), "--db", db)
    assert code == 2 and "unknown key 'Q'" in err
    code, _, err = cli("sweep", "cpu", "--shape", "B=1,H=2,N=64,D=32", "--db", db)
    assert code == 2 and "not both" in err
    code, _, err = cli("sweep", "--shape", "B=1,H=2,N=64,D=32", "--sampler", "anneal",
                       "--db", db)
    assert code == 2 and "unknown sampler" in err
    for flags, says in ((["--finalists", "-1"], "--finalists must be >= 0"),
                        (["--final-repeats", "0"], "--final-repeats must be >= 1")):
        code, _, err = cli("sweep", "--shape", "B=1,H=2,N=64,D=32", *flags, "--db", db)
        assert code == 2 and says in err and "--finalists" in " ".join(err.split()), flags
    code, _, err = cli("sweep", "--shape", "B=1,H=2,N=64,D=32", "--head-to-head-rounds", "-1",
                       "--db", db)
    assert code == 2 and "--head-to-head-rounds must be >= 0" in err
    assert "--head-to-head-rounds 0" in " ".join(err.split())
    code, _, err = cli("sweep", "cpu", "--db", "mysql://x/y")
    assert code == 2 and "not supported" in err
    code, _, err = cli("import", str(tmp_path / "missing.json"), "--db", db)
    assert code == 2 and "cannot read" in err


def test_flash_fwd_end_to_end_under_the_interpreter(tmp_path: Path) -> None:
    """The real forward template: a tiny causal problem, 2 trials, through the whole
    pipeline (isolated worker, reference check, storage, best config)."""
    spec = spec_from_mapping({"name": "fwd", "templates": ["flash_fwd"], "shapes": [SHAPE],
                              "dtypes": ["float16"], "causal": ["top_left"]}, source="test")
    db = f"sqlite:///{tmp_path / 'fwd.db'}"
    report = run_sweep(spec, SweepOptions(trials=2, timeout_s=120, seed=0), db_url=db)
    (problem,) = report.problems
    assert report.status == "done" and problem.measured == 2
    assert problem.ok >= 1 and problem.best_tflops and problem.default_tflops
    template = get_template("flash_fwd")
    fwd = Problem(1, 2, 2, 32, 32, 16, "float16", "top_left")
    with session_scope(db, write=False) as s:
        rows = list(s.scalars(select(Trial)))
        assert {r.problem_key for r in rows} == {template.problem_key(fwd)}
        for row in rows:
            if row.status == TrialStatus.OK:
                assert row.error is not None and row.error <= template.tolerance(fwd)
        assert [sw.status.value for sw in s.scalars(select(Sweep))] == ["done"]
    code, out, _ = cli("best", "--db", db, "--json", "--template", "flash_fwd")
    assert code == 0 and json.loads(out)[0]["config"] == problem.best_config
    assert os.environ.get(MEASURE_LOG_ENV) is None  # the fixture's variables did not leak



def test_serve_runs_the_api_app_on_the_database(monkeypatch: pytest.MonkeyPatch,
                                                tmp_path: Path) -> None:
    import uvicorn

    served: dict[str, Any] = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: served.update(app=app, **kw))
    monkeypatch.delenv("TUNER_DATABASE_URL", raising=False)  # serve sets it for its workers
    db = f"sqlite:///{tmp_path / 'api.db'}"
    code, _, err = cli("serve", "--db", db, "--host", "0.0.0.0", "--port", "8123")
    assert code == 0, err
    assert served["host"] == "0.0.0.0" and served["port"] == 8123
    # The app factory by import string (each worker builds its own), on --db's database.
    assert served["app"] == "api.main:create_app" and served["factory"] is True
    assert os.environ["TUNER_DATABASE_URL"] == db
    code, _, err = cli("serve", "--db", db, "--port", "0")
    assert code == 2 and "--port" in err


@pytest.mark.gpu
def test_on_the_gpu_trials_are_timed_with_do_bench_and_compiled_ahead(tmp_path: Path) -> None:
    spec = spec_from_mapping({"name": "gpu", "templates": ["flash_fwd"],
                              "shapes": [{"B": 4, "H": 16, "N": 1024, "D": 64}],
                              "dtypes": ["bfloat16"], "causal": ["none"]}, source="test")
    report = run_sweep(spec, SweepOptions(trials=8, timeout_s=300, seed=0, compile_ahead=2),
                       db_url=f"sqlite:///{tmp_path / 'gpu.db'}")
    (problem,) = report.problems
    assert report.to_dict()["timings_are_gpu_timings"] is True
    assert problem.ok >= 1 and problem.best_tflops is not None and problem.best_tflops > 1.0
    assert problem.default_tflops is not None and problem.best_tflops >= problem.default_tflops
    assert problem.bench_seconds_per_trial is not None and problem.bench_seconds_per_trial < 5


def test_progress_and_summary_for_people(monkeypatch: pytest.MonkeyPatch) -> None:
    from tuner.cli.common import console
    from tuner.cli.sweep import SweepDisplay, print_summary
    from tuner.tuning.head_to_head import CandidateResult, HeadToHeadResult
    from tuner.tuning.search.loop import SearchStats, TrialEvent
    from tuner.tuning.search.store import ProblemBest
    from tuner.tuning.sweep import (
        HeadToHeadFinished,
        HeadToHeadStarted,
        ProblemFailed,
        ProblemFinished,
        ProblemReport,
        ProblemStarted,
        SweepReport,
        SweepStarted,
        Task,
        TrialDone,
    )

    template = get_template("toy_add")
    task = Task(template, TOY_PROBLEM, template.problem_key(TOY_PROBLEM))
    device = current_device().to_dict() | {"key": current_device().key}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        display = SweepDisplay()
        display.handle(SweepStarted(7, device, [task, task], [("toy_add X", "too big")]))
        display.handle(ProblemStarted(0, 0, budget=4, results=1))
        display.handle(TrialDone(0, 0, TrialEvent(task.problem_key, "measured", "BLOCK=64",
                                                  "ok", 300.0, 2, 4, 300.0)))
        best = ProblemBest({"BLOCK": 64}, 300.0, 1.0, 200.0, 1.5)
        display.handle(ProblemFinished(0, 0, SearchStats(budget=4, measured=1, best=best)))
        display.handle(ProblemStarted(0, 1, budget=4, results=4))
        display.handle(TrialDone(0, 1, TrialEvent(task.problem_key, "final", "BLOCK=64",
                                                  "ok", 280.0, 4, 4, 290.0)))
        best = ProblemBest({"BLOCK": 64}, 290.0, 1.03, 200.0, 1.45, runs=3)
        display.handle(ProblemFinished(0, 1, SearchStats(budget=4, remeasured=6, best=best)))
        display.handle(ProblemFailed(0, 1, "could not set up"))
        display.handle(HeadToHeadStarted("B1 H2 N32 D16", ("torch_sdpa", "flash_fwd"), 5))
        side_by_side = HeadToHeadResult(
            "B1 H2 N32 D16", TOY_PROBLEM.to_dict(), 5, session=1, finished=True, candidates=[
                CandidateResult("torch_sdpa", {}, dict.fromkeys(range(5), 1.2), 1.2, 1.0),
                CandidateResult("flash_fwd", {}, {0: 0.9}, failed="wrong_result: error 0.5"),
                CandidateResult("gluon_fwd", {}, dict.fromkeys(range(5), 1.1), 1.1, 1.1)])
        display.handle(HeadToHeadFinished(side_by_side))
        display.close()
        report = ProblemReport(label=task.label, template="toy_add", template_version="v",
                               problem=TOY_PROBLEM.to_dict(), problem_key=task.problem_key,
                               budget=4, counts={"ok": 2, "timeout": 1}, measured=3,
                               best_tflops=300.0, default_tflops=200.0, speedup=1.5, wall_s=3.0,
                               bench_s=1.5, remeasured=4, disqualified=1, remeasurements=8,
                               final_s=2.0, best_runs=3)
        monkeypatch.setattr(console, "width", 160)  # the lines around the table unfolded
        print_summary(SweepReport(sweep_id=7, name="toys", status="done", device=device,
                                  sampler="tpe", workers=1, problems=[report], wall_s=4.0,
                                  compile_ahead=0, head_to_heads=[side_by_side]))
    text = " ".join(out.getvalue().split())  # rich wraps lines at the console's width
    assert "sweep 7" in text and "skipped toy_add X: too big" in text
    assert "best 300.0 TFLOP/s (default 200.0, 1.50x)" in text
    assert "best 290.0 TFLOP/s (median of 3; default 200.0, 1.45x)" in text
    assert "could not set up" in text and "1 timeout" in text
    assert "finals: configs measured again at the end" in text
    header, rows = piped_table(out.getvalue(), "problem")  # stdout is no terminal here
    assert header == ["problem", "best", "default", "speedup", "finals", "ok", "failed",
                      "s/trial", "bench s"]
    assert [dict(zip(header, row, strict=True))["finals"] for row in rows] == ["4, 1 out"]
    assert "1.00 s per trial of worker time, of which 0.50 s timing the kernel" in text
    assert "8 finalist re-measurement(s) by this sweep: 2 s of worker time" in text
    assert "head-to-head B1 H2 N32 D16: torch_sdpa, flash_fwd, 5 rounds side by side" in text
    line = ("head-to-head B1 H2 N32 D16: gluon_fwd 1.1 ms, torch_sdpa 1.2 ms, flash_fwd out "
            "(wrong_result: error 0.5) (medians of 5 rounds)")
    assert text.count(line) == 2  # as it finished, and in the summary
    if device["name"] == "cpu-interpreter":
        assert "NOT GPU timings" in text
