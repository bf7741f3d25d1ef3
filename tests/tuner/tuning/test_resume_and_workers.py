"""Real processes: a sweep killed with SIGKILL, mid-search or while re-measuring its
finalists, resumes without re-running anything, and three sweep processes on one SQLite file
measure every config exactly once (the finalists then again, each re-measurement stored)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import optuna
from sqlalchemy import select

from db.models import Remeasurement, Sweep, Trial, TrialStatus
from db.session import dispose_engine, session_scope
from tests.tuner.toy_templates import MEASURE_LOG_ENV, SLOW_ENV, measurements

ROOT = Path(__file__).resolve().parents[3]


def _spec(tmp_path: Path, shapes: str) -> Path:
    spec = tmp_path / "spec.toml"
    spec.write_text('templates = ["toy_add"]\ntemplate_modules = ["tests.tuner.toy_templates"]\n'
                    f'dtypes = ["float16"]\nshapes = [{shapes}]\n')
    return spec


def _command(spec: Path, db: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "tuner.cli.app", "sweep", str(spec), "--db", db,
            "--trials", "7", "--timeout", "20", "--json", *extra]


def _env(log: Path) -> dict[str, str]:
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, MEASURE_LOG_ENV: str(log)}


def _rows(db: str) -> list[Trial]:
    with session_scope(db, write=False) as s:
        return list(s.scalars(select(Trial).order_by(Trial.id)))


def _remeasurements(db: str) -> list[tuple[int, str, str, float | None]]:
    """(id, problem key, config key, ms) of every stored re-measurement, oldest first."""
    with session_scope(db, write=False) as s:
        return [(r.id, r.trial.problem_key, r.trial.config_key, r.median_ms)
                for r in s.scalars(select(Remeasurement).order_by(Remeasurement.id))]


def _kill_when(proc: subprocess.Popen[bytes], db: str, ready: Any, what: str) -> None:
    """SIGKILL the sweep ``proc`` and its trial worker once ``ready()`` holds on ``db``."""
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, f"the sweep ended before {what}"
            assert time.monotonic() < deadline, f"no {what} in 120 s"
            try:
                if ready():
                    break
            except Exception:  # tables not created yet
                pass
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the sweep and its trial worker, mid-sweep
        proc.wait()
    dispose_engine(db)


def test_a_sweep_killed_with_sigkill_resumes_without_rerunning(tmp_path: Path) -> None:
    spec = _spec(tmp_path, "{B = 1, H = 1, N = 64, D = 32}")
    db = f"sqlite:///{tmp_path / 'tuner.db'}"
    log = tmp_path / "measured.log"
    # Heartbeat 1 s: the killed worker's trial goes stale 3 s later and is retried.
    cmd = _command(spec, db, "--heartbeat", "1", "--seed", "5")
    first = subprocess.Popen(cmd, env=_env(log), cwd=tmp_path, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, start_new_session=True)
    _kill_when(first, db, lambda: sum(r.status == TrialStatus.OK for r in _rows(db)) >= 2,
               "2 stored trials")
    before = {r.config_key: (r.id, r.status, r.tflops) for r in _rows(db)}
    measured_before = measurements(log)
    assert 2 <= sum(s == TrialStatus.OK for _, s, _ in before.values()) < 7

    second = subprocess.run(cmd, env=_env(log), cwd=tmp_path, capture_output=True, text=True,
                            timeout=180)
    assert second.returncode == 0, second.stderr
    report: dict[str, Any] = json.loads(second.stdout)
    after = {r.config_key: (r.id, r.status, r.tflops) for r in _rows(db)}
    for key, row in before.items():
        assert after[key] == row  # nothing measured was lost or replaced
    assert sum(s == TrialStatus.OK for _, s, _ in after.values()) == 7
    (problem,) = report["problems"]
    done_before = sum(s != TrialStatus.INVALID for _, s, _ in before.values())
    assert problem["measured"] == 7 - done_before  # the rest, and only the rest
    new_runs = {k: runs - measured_before.get(k, set()) for k, runs in measurements(log).items()}
    again = Counter(key for _, _, key, _ in _remeasurements(db))
    assert sum(again.values()) == problem["remeasurements"] > 0  # all after the restart
    for (_, _, key), runs in new_runs.items():
        if key in before:  # not measured again, except as a finalist
            assert len(runs) == again[key], f"{key} was measured again after the restart"
    with session_scope(db, write=False) as s:
        assert [w.status.value for w in s.scalars(select(Sweep).order_by(Sweep.id))] == [
            "running", "done"]  # the killed one never finished
    (summary,) = optuna.get_all_study_summaries(storage=db)
    study = optuna.load_study(study_name=summary.study_name, storage=db)
    assert not [t for t in study.trials if t.state.name == "RUNNING"]  # failed as stale


def test_a_sweep_killed_while_remeasuring_its_finalists_completes_them_once(
        tmp_path: Path) -> None:
    spec = _spec(tmp_path, "{B = 1, H = 1, N = 64, D = 32}")
    db = f"sqlite:///{tmp_path / 'tuner.db'}"
    log = tmp_path / "measured.log"
    # 3 configs, the default first: all three are finalists, 2 re-measurements each. Each
    # measurement sleeps 0.3 s, so the kill lands between the first and the last.
    cmd = [sys.executable, "-m", "tuner.cli.app", "sweep", str(spec), "--db", db, "--trials",
           "3", "--timeout", "20", "--seed", "5", "--json"]
    env = {**_env(log), SLOW_ENV: "0.3"}
    first = subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, start_new_session=True)
    _kill_when(first, db, lambda: len(_remeasurements(db)) >= 1, "a stored re-measurement")
    before = _remeasurements(db)
    trials = [(r.id, r.config_key, r.median_ms) for r in _rows(db)]
    measured_before = measurements(log)
    assert 1 <= len(before) < 6 and len(trials) == 3

    second = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True,
                            timeout=180)
    assert second.returncode == 0, second.stderr
    (problem,) = json.loads(second.stdout)["problems"]
    after = _remeasurements(db)
    assert after[:len(before)] == before  # nothing lost or rewritten
    assert [(r.id, r.config_key, r.median_ms) for r in _rows(db)] == trials
    counts = Counter(key for _, _, key, _ in after)
    assert sorted(counts.values()) == [2, 2, 2] and set(counts) == {k for _, k, _ in trials}
    assert (problem["measured"], problem["remeasurements"]) == (0, 6 - len(before))
    assert problem["best_runs"] == 3 and problem["remeasured"] == 3
    done_before = Counter(key for _, _, key, _ in before)
    for ident, runs in measurements(log).items():  # only the missing ones ran again
        new_runs = runs - measured_before.get(ident, set())
        assert len(new_runs) == 2 - done_before[ident[2]], ident


def test_three_processes_on_one_sqlite_file_measure_each_config_once(tmp_path: Path) -> None:
    spec = _spec(tmp_path, "{B = 1, H = 2, N = 32, D = 16}, {B = 1, H = 2, N = 64, D = 16}")
    db = f"sqlite:///{tmp_path / 'shared.db'}"
    log = tmp_path / "measured.log"
    procs = [subprocess.Popen(_command(spec, db, *extra), env=_env(log), cwd=tmp_path,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for extra in ([], ["--seed", "1"], ["--workers", "2", "--seed", "2"])]
    outputs = [p.communicate(timeout=240) for p in procs]
    for p, (_, err) in zip(procs, outputs, strict=True):
        assert p.returncode == 0, (_, err)
    reports = [json.loads(out) for out, _ in outputs]
    rows = _rows(db)
    per_problem: dict[str, list[Trial]] = {}
    for row in rows:
        per_problem.setdefault(row.problem_key, []).append(row)
    assert len(per_problem) == 2
    for problem_rows in per_problem.values():
        assert sum(r.status == TrialStatus.OK for r in problem_rows) == 7
        assert {r.status for r in problem_rows} <= {TrialStatus.OK, TrialStatus.INVALID}
    runs = measurements(log)
    again = Counter((problem_key, key) for _, problem_key, key, _ in _remeasurements(db))
    # 4 workers in all, ending together: they share the finalists' re-measurements, each
    # finalist getting exactly the 2 asked (issue 19: up to 3 more each before claims).
    assert again and set(again.values()) == {2}
    for row in rows:
        n = f"n={row.problem['batch'] * row.problem['heads_q'] * row.problem['seqlen_q'] * 16}"
        count = len(runs.get(("toy_add", n, row.config_key), set()))
        expected = 0 if row.status == TrialStatus.INVALID else 1 + again[(row.problem_key,
                                                                          row.config_key)]
        assert count == expected, (row.problem_key, row.config_key, count)
    for problem_rows in per_problem.values():  # at least the 3 finalists, each 2 more times
        finalists = [r for r in problem_rows if again[(r.problem_key, r.config_key)] >= 2]
        assert len(finalists) >= 3
    measured = [p["measured"] for r in reports for p in r["problems"]]
    assert sum(measured) == 14  # every config once, over all processes
    assert len({r["sweep_id"] for r in reports}) == 3
