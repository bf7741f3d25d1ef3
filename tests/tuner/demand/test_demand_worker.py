"""``tuner worker`` on the toy templates (the interpreter, demand rows written straight into
the database): a worker SIGKILLed mid-trial loses nothing and its claim is taken over once its
lease passes; a stopped worker gives its claim back; what cannot be tuned is failed with the
reason; the options are checked."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from db import demand
from db.demand import DemandCount
from db.models import Trial, TrialStatus
from db.session import dispose_engine, run_in_transaction, session_scope
from templates import Problem, current_device, get_template
from tests.tuner.cli.test_sweep_cli import cli
from tests.tuner.toy_templates import MEASURE_LOG_ENV, SLOW_ENV, launches, measurements
from tuner.demand.worker import JobClaimed, JobFinished, WorkerOptions, run_worker
from tuner.tuning.sweep import SweepOptions

ROOT = Path(__file__).resolve().parents[3]
TOY = get_template("toy_add")
PROBLEM = Problem(1, 1, 1, 64, 64, 32, "float16")
TOY_MODULES = '["tests.tuner.toy_templates"]'


def add_demand(db: str, problem: Problem = PROBLEM, *, template: Any = TOY,
               problem_dict: dict[str, Any] | None = None, reports: int = 5) -> None:
    count = DemandCount(current_device().key, template.name, template.version(),
                        template.problem_key(problem), problem_dict or problem.to_dict(),
                        reports)
    run_in_transaction(db, lambda s: demand.add_demand(s, counts=[count]))


def queue(db: str) -> list[Any]:
    with session_scope(db, write=False) as s:
        return demand.list_demand(s)


def trials(db: str) -> dict[str, tuple[int, str, float | None, str]]:
    """config key -> (id, status, TFLOP/s, worker) of every stored trial."""
    with session_scope(db, write=False) as s:
        return {t.config_key: (t.id, t.status.value, t.tflops, t.worker)
                for t in s.scalars(select(Trial))}


@pytest.mark.slow
def test_a_worker_killed_mid_trial_loses_nothing_and_its_claim_is_taken_over(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    db = f"sqlite:///{tmp_path / 'tuner.db'}"
    log = tmp_path / "measured.log"
    add_demand(db)
    # Trials sleep 0.5 s after their first launch is logged: a window to kill one mid-trial.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [
        str(ROOT), os.environ.get("PYTHONPATH")])), "TUNER_TEMPLATE_MODULES": TOY_MODULES,
        MEASURE_LOG_ENV: str(log), SLOW_ENV: "0.5"}
    args = ["--db", db, "--trials", "4", "--finalists", "0", "--timeout", "20",
            "--heartbeat", "1", "--lease", "3", "--seed", "3", "--until-idle", "--json"]
    first = subprocess.Popen([sys.executable, "-m", "tuner.cli.app", "worker", *args],
                             env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while True:  # one measurement stored, the next one in flight
            assert first.poll() is None, first.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the worker never got mid-trial"
            counts = launches(log)
            if len(counts) >= 2 and list(counts.values())[-1] == 1:
                break
            time.sleep(0.02)
    finally:
        os.killpg(first.pid, signal.SIGKILL)  # the worker and its trial process
        first.wait()
    dispose_engine(db)
    kept = trials(db)
    [row] = queue(db)
    assert (row.status.value, row.worker.split(":")[-1], row.attempts) == (
        "claimed", str(first.pid), 1)
    assert kept and all(t[3].split(":")[1] == str(first.pid) for t in kept.values())
    killed_token = list(launches(log))[-1]

    # A second worker: nothing to claim while the dead one's lease holds, then it takes over.
    monkeypatch.setenv("TUNER_TEMPLATE_MODULES", TOY_MODULES)
    monkeypatch.setenv(MEASURE_LOG_ENV, str(log))
    code, out, err = cli("worker", *args)
    assert code == 0, err
    assert [line for line in map(json.loads, out.splitlines())
            if line["event"] == "finished"] == [], "claimed a row whose lease still held"
    while queue(db)[0].lease_until.timestamp() > time.time():  # type: ignore[union-attr]
        time.sleep(0.2)
    code, out, err = cli("worker", *args)
    assert code == 0, err
    [finished] = [line for line in map(json.loads, out.splitlines())
                  if line["event"] == "finished"]
    assert (finished["status"], finished["attempt"]) == ("done", 2)
    [row] = queue(db)
    assert (row.status.value, row.attempts) == ("done", 2)
    assert row.worker.split(":")[-1] != str(first.pid)
    assert row.note.startswith("best ")

    # Nothing the killed worker stored was lost or measured again; its cut trial was.
    after = trials(db)
    assert {k: after[k] for k in kept} == kept
    assert sum(t[1] == TrialStatus.OK.value for t in after.values()) == 4
    runs = measurements(log)
    for key, tokens in runs.items():
        cut = killed_token in tokens
        assert len(tokens) == 1 + cut, key
        assert key[2] in after
        if cut:
            assert after[key[2]][3].split(":")[1] != str(first.pid)


def run_in_process(db: str, *, stop_when_claimed: bool = False,
                   templates: tuple[str, ...] = ()) -> list[JobFinished]:
    stop = threading.Event()

    def on_event(event: Any) -> None:
        if isinstance(event, JobClaimed) and stop_when_claimed:
            stop.set()  # as a caller stopping the worker would, as it claims

    options = WorkerOptions(sweep=SweepOptions(trials=2, finalists=0, timeout_s=20),
                            until_idle=True, templates=templates)
    return run_worker(options, db_url=db, on_event=on_event, stop=stop)


def test_a_stopped_worker_gives_its_claim_back(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 'tuner.db'}"
    add_demand(db)
    [result] = run_in_process(db, stop_when_claimed=True)
    assert (result.status, result.job.attempt) == ("released", 1)
    [row] = queue(db)
    assert (row.status.value, row.worker, row.attempts, row.lease_until) == (
        "open", "", 0, None)
    assert "given back" in row.note


def test_what_cannot_be_tuned_is_failed_with_the_reason_and_others_are_left(
        tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 'tuner.db'}"
    add_demand(db, problem_dict={"batch": 0}, reports=9)  # stored by hand: not valid
    decode = get_template("flash_decode")
    add_demand(db, template=decode, reports=8)  # 64 query tokens: not a decode problem
    fwd = get_template("flash_fwd")
    add_demand(db, template=fwd, reports=10)  # kept for a worker that tunes flash_fwd
    results = run_in_process(db, templates=("toy_add", "flash_decode"))
    assert [(r.job.template, r.status) for r in results] == [
        ("toy_add", "failed"), ("flash_decode", "failed")]
    assert "the stored problem is not valid" in results[0].note
    assert "no problem that its templates can run" in results[1].note
    statuses = {r.template: (r.status.value, r.note) for r in queue(db)}
    assert statuses["flash_fwd"] == ("open", "")
    assert statuses["toy_add"] == ("failed", results[0].note)
    assert statuses["flash_decode"] == ("failed", results[1].note)


def test_bad_options_say_what_is_allowed(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 'tuner.db'}"
    for args, says in ((["--lease", "1"], "--lease must be >= 3 seconds"),
                       (["--poll", "0"], "--poll must be > 0"),
                       (["--max-jobs", "-1"], "--max-jobs must be >= 0"),
                       (["--template", "nope"], "unknown template 'nope'")):
        code, out, err = cli("worker", "--db", db, "--until-idle", *args, "--json")
        assert code == 2, (args, out, err)
        assert says in json.loads(out)["error"], (args, out)
