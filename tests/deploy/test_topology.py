"""The docker-compose topology without Docker: PostgreSQL (the local server), the API under
uvicorn and three workers sharing one sweep under the Triton interpreter, each started with
the command and environment that docker-compose.yml gives its container (tests/deploy/
compose.py reads them). One worker is SIGKILLed mid-trial.

Checked: every config measured exactly once (the toy template logs each measurement), what
the killed worker stored kept and its in-flight config measured by a survivor, the best
configs right in the database and through the API, and the API answering /healthz and
/v1/best throughout.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import optuna
import pytest
from sqlalchemy import select
from sqlalchemy.engine import URL

from db.models import BestConfig, Device, Sweep, Trial, TrialStatus
from db.session import dispose_engine, session_scope
from templates import current_device
from tests.deploy.compose import ROOT, Topology, local, topology
from tests.tuner.toy_templates import MEASURE_LOG_ENV, SLOW_ENV, launches, measurements

pytestmark = [pytest.mark.postgres, pytest.mark.slow, pytest.mark.timeout(300)]

WORKERS = 3
TRIALS = 7  # every valid toy_add config: 4 BLOCKs x 2 warp counts, one rejected
SHAPES = ((32, "{B = 1, H = 2, N = 32, D = 16}"), (64, "{B = 1, H = 2, N = 64, D = 16}"))
# Each measurement sleeps this long after its first launch is logged: the window in which a
# worker is surely mid-trial. It also spreads the trials over the three workers.
SLOW_S = 1.5
HEARTBEAT_S = 1  # the killed worker's trial goes stale 3 s after its last beat
STARTUP_S = 90  # for the api and the workers to come up on a busy 2-core machine


def _elements(seqlen: int) -> str:
    return f"n={1 * 2 * seqlen * 16}"


def _spec(tmp_path: Path) -> Path:
    spec = tmp_path / "sweep.toml"
    spec.write_text('name = "deploy-test"\ntemplates = ["toy_add"]\n'
                    'template_modules = ["tests.tuner.toy_templates"]\ndtypes = ["float16"]\n'
                    # No finalist rounds: this test checks that each config is measured once
                    # across the workers and that the best is the fastest reading; finalists
                    # with several workers are tested in tests/tuner/test_resume_and_workers.py.
                    f'trials = {TRIALS}\ntimeout = 30\nfinalists = 0\n'
                    f'shapes = [{", ".join(shape for _, shape in SHAPES)}]\n')
    return spec


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _variables(server: URL, spec: Path) -> dict[str, str]:
    """What an operator would put in .env, for the local server and the toy sweep."""
    return {"POSTGRES_HOST": server.host or "127.0.0.1", "POSTGRES_PORT": str(server.port or 5432),
            "POSTGRES_USER": server.username or "postgres", "POSTGRES_DB": server.database or "",
            "POSTGRES_PASSWORD": server.password or secrets.token_hex(12),
            "TUNER_TOKEN": secrets.token_hex(16),
            "TUNER_TEMPLATE_MODULES": '["tests.tuner.toy_templates"]',
            "SWEEP_SPEC": str(spec), "SWEEP_HEARTBEAT": str(HEARTBEAT_S)}


def _base_env() -> dict[str, str]:
    # What the image gives every container; no TUNER_*/PG* setting of this shell leaks in.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TUNER_", "PG", "TOY_"))}
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**env, "PYTHONPATH": path, "TRITON_INTERPRET": "1"}


class Processes:
    """The topology's processes, each in its own process group, output in files."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.started: list[subprocess.Popen[bytes]] = []

    def start(self, name: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        with open(self.folder / f"{name}.out", "wb") as out, \
                open(self.folder / f"{name}.err", "wb") as err:
            proc = subprocess.Popen(local(argv), env=env, cwd=self.folder, stdout=out,
                                    stderr=err, start_new_session=True)
        self.started.append(proc)
        return proc

    def output(self, name: str) -> str:
        return (self.folder / f"{name}.out").read_text()

    def errors(self, name: str) -> str:
        return (self.folder / f"{name}.err").read_text()[-3000:]

    def stop_all(self) -> None:
        for proc in self.started:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.started:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


class ApiPoller(threading.Thread):
    """Asks /healthz and /v1/best over and over; every answer's time and status is kept."""

    def __init__(self, base_url: str, best_query: dict[str, Any]) -> None:
        super().__init__(name="api-poller", daemon=True)
        self.base_url, self.best_query = base_url, best_query
        self.answers: list[tuple[float, str, int | str]] = []
        self.halt = threading.Event()

    def run(self) -> None:
        with httpx.Client(base_url=self.base_url, timeout=10.0) as client:
            while not self.halt.is_set():
                for path, params in (("/healthz", None), ("/v1/best", self.best_query)):
                    at = time.monotonic()
                    try:
                        status: int | str = client.get(path, params=params).status_code
                    except httpx.HTTPError as exc:
                        status = repr(exc)
                    self.answers.append((at, path, status))
                self.halt.wait(0.2)

    def answered_since(self, since: float, timeout_s: float = 20.0) -> bool:
        """Wait until both endpoints were asked after ``since``."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.is_alive():
            if {path for at, path, _ in list(self.answers) if at > since} == {
                    "/healthz", "/v1/best"}:
                return True
            time.sleep(0.1)
        return False


@pytest.fixture
def processes(tmp_path: Path) -> Iterator[Processes]:
    procs = Processes(tmp_path)
    try:
        yield procs
    finally:
        procs.stop_all()


def _wait_healthy(base_url: str, api: subprocess.Popen[bytes], procs: Processes) -> None:
    # Compose starts the workers once the api's health check passes.
    deadline = time.monotonic() + STARTUP_S
    while time.monotonic() < deadline:
        assert api.poll() is None, f"the api exited: {procs.errors('api')}"
        try:
            if httpx.get(f"{base_url}/healthz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    pytest.fail(f"the api did not become healthy in {STARTUP_S} s: {procs.errors('api')}")


def _kill_one_mid_trial(workers: list[subprocess.Popen[bytes]], logs: list[Path],
                        procs: Processes) -> tuple[int, str]:
    """SIGKILL the first worker caught mid-trial after it finished a measurement: its newest
    measurement has exactly one launch logged (it sleeps SLOW_S right after it), so that
    trial's result is not stored yet; the one before it is (measurements run one at a time
    and are stored before the next begins). Returns (worker index, killed measurement's token)."""
    deadline = time.monotonic() + STARTUP_S
    while time.monotonic() < deadline:
        for i, (proc, log) in enumerate(zip(workers, logs, strict=True)):
            assert proc.poll() is None, (f"worker {i} ended before one could be killed: "
                                         f"{procs.errors(f'worker-{i}')}")
            counts = launches(log)
            if len(counts) >= 2:
                token, launched = list(counts.items())[-1]
                if launched == 1:
                    os.killpg(proc.pid, signal.SIGKILL)  # the sweep and its trial worker
                    proc.wait()
                    return i, token
        time.sleep(0.02)
    pytest.fail(f"no worker was caught mid-trial in {STARTUP_S} s")


def _rows(url: str) -> list[Trial]:
    with session_scope(url, write=False) as s:
        return list(s.scalars(select(Trial).order_by(Trial.id)))


def _pid_of(row: Trial) -> int:
    return int(row.worker.split(":")[-2])  # "<host>:<pid>:<thread>"


def test_compose_topology_without_docker(fresh_database: URL, tmp_path: Path,
                                         processes: Processes) -> None:
    port = _free_port()
    base_url = f"http://127.0.0.1:{port}"
    topo: Topology = topology(_variables(fresh_database, _spec(tmp_path)), host="127.0.0.1",
                              port=port, gpu_lock_dir=str(tmp_path / "gpu-locks"))
    db_url = fresh_database.render_as_string(hide_password=False)
    env = _base_env()
    device = current_device().key
    best_query = {"device": device, "template": "toy_add", "batch": 1, "heads_q": 2,
                  "seqlen_q": SHAPES[0][0], "head_dim": 16, "dtype": "float16"}

    # The api container: migrate, then serve.
    migrated = subprocess.run(local(topo.migrate), env={**env, **topo.api_env}, cwd=tmp_path,
                              capture_output=True, text=True, timeout=STARTUP_S)
    assert migrated.returncode == 0, migrated.stderr
    api = processes.start("api", topo.serve, {**env, **topo.api_env})
    _wait_healthy(base_url, api, processes)
    poller = ApiPoller(base_url, best_query)
    poller.start()
    try:
        # Three worker containers (docker compose up --scale worker=3), each logging its
        # measurements to a file of its own.
        logs = [tmp_path / f"measured-{i}.log" for i in range(WORKERS)]
        workers = [processes.start(f"worker-{i}", topo.worker,
                                   {**env, **topo.worker_env, MEASURE_LOG_ENV: str(log),
                                    SLOW_ENV: str(SLOW_S)})
                   for i, log in enumerate(logs)]
        victim, killed_token = _kill_one_mid_trial(workers, logs, processes)
        killed_at = time.monotonic()
        victim_pid = workers[victim].pid
        kept = {(r.problem_key, r.config_key): (r.id, r.status, r.tflops)
                for r in _rows(db_url) if _pid_of(r) == victim_pid}
        assert kept, "the killed worker had stored nothing"

        survivors = [i for i in range(WORKERS) if i != victim]
        for i in survivors:
            workers[i].wait(timeout=120)
            assert workers[i].returncode == 0, processes.errors(f"worker-{i}")
        reports = [json.loads(processes.output(f"worker-{i}")) for i in survivors]
        finished_at = time.monotonic()

        # The best configs: in the database, and served (the service's cache refreshes
        # within about 5 s of a change).
        rows = _rows(db_url)
        expected = _best_by_problem(rows)
        with session_scope(db_url, write=False) as s:
            stored = {b.problem_key: b for b in s.scalars(select(BestConfig))}
            assert [d.key for d in s.scalars(select(Device))] == [device]
            sweeps = {w.id: w.status.value for w in s.scalars(select(Sweep))}
        assert set(stored) == set(expected)
        for key, best in expected.items():
            assert (stored[key].config, stored[key].tflops) == (best.config, best.tflops)
        for seqlen, _ in SHAPES:
            answer = _served_best(base_url, {**best_query, "seqlen_q": seqlen}, expected)
            assert answer["match"] == "exact"
        assert poller.answered_since(finished_at), "the api was not asked after the sweep"
    finally:
        poller.halt.set()
        poller.join(timeout=15)

    # Every config measured exactly once; the killed measurement's config by a survivor.
    per_problem: dict[str, list[Trial]] = {}
    for row in rows:
        per_problem.setdefault(row.problem_key, []).append(row)
    assert len(per_problem) == len(SHAPES)
    for problem_rows in per_problem.values():
        assert sum(r.status == TrialStatus.OK for r in problem_rows) == TRIALS
        assert {r.status for r in problem_rows} <= {TrialStatus.OK, TrialStatus.INVALID}
    runs: dict[tuple[str, str, str], set[str]] = {}
    for log in logs:
        for k, tokens in measurements(log).items():
            runs.setdefault(k, set()).update(tokens)
    (killed_key,) = [k for k, tokens in measurements(logs[victim]).items()
                     if killed_token in tokens]
    for row in rows:
        logged = ("toy_add", _elements(row.problem["seqlen_q"]), row.config_key)
        want = 0 if row.status == TrialStatus.INVALID else 1 + (logged == killed_key)
        assert len(runs.get(logged, set())) == want, (row.problem_key, row.config_key)
        if logged == killed_key:
            assert _pid_of(row) != victim_pid  # measured again, to the end, by a survivor
    completed = {t for log in logs for t, n in launches(log).items() if n > 1}
    assert sum(len(t) for t in runs.values()) == len(completed) + 1  # only the killed one cut
    measured = sum(p["measured"] for r in reports for p in r["problems"])
    assert measured + len([r for r in kept.values() if r[1] != TrialStatus.INVALID]) \
        == len(SHAPES) * TRIALS

    # Nothing the killed worker stored was lost or replaced; its sweep stays "running".
    after = {(r.problem_key, r.config_key): (r.id, r.status, r.tflops)
             for r in rows if _pid_of(r) == victim_pid}
    assert after == kept
    assert sorted(sweeps.values()) == ["done", "done", "running"]
    assert {sweeps[r["sweep_id"]] for r in reports} == {"done"}
    for summary in optuna.get_all_study_summaries(storage=db_url):
        study = optuna.load_study(study_name=summary.study_name, storage=db_url)
        assert not [t.number for t in study.trials if t.state.name == "RUNNING"]

    # The API answered every question, before, during and after the kill.
    answers = poller.answers
    assert answers and all(status == 200 for _, _, status in answers), \
        [a for a in answers if a[2] != 200][:5]
    assert {path for _, path, _ in answers} == {"/healthz", "/v1/best"}
    assert {path for at, path, _ in answers if killed_at < at < finished_at} == {
        "/healthz", "/v1/best"}  # while the survivors took over the killed worker's trial
    assert api.poll() is None
    dispose_engine(db_url)


def _best_by_problem(rows: list[Trial]) -> dict[str, Trial]:
    best: dict[str, Trial] = {}
    for row in rows:
        if row.status == TrialStatus.OK and row.tflops is not None:
            current = best.get(row.problem_key)
            if current is None or row.tflops > (current.tflops or 0.0):
                best[row.problem_key] = row
    return best


def _served_best(base_url: str, query: dict[str, Any], expected: dict[str, Trial]
                 ) -> dict[str, Any]:
    deadline = time.monotonic() + 20
    answer: dict[str, Any] = {}
    while time.monotonic() < deadline:
        answer = httpx.get(f"{base_url}/v1/best", params=query, timeout=10).json()
        want = expected.get(answer.get("problem_key", ""))
        if want is not None and answer["config"] == want.config \
                and answer["tflops"] == pytest.approx(want.tflops):
            return answer
        time.sleep(0.5)
    pytest.fail(f"/v1/best never served the best config: last answer {answer}")


def test_the_compose_demand_worker_tunes_what_a_job_reported(
        fresh_database: URL, tmp_path: Path, processes: Processes) -> None:
    """The api and a demand-worker container, each from docker-compose.yml: a job's report of
    an untuned toy problem reaches the service, the worker tunes it on its own, and the
    service then answers match=exact. SIGINT (compose's stop signal) stops the waiting
    worker."""
    port = _free_port()
    base_url = f"http://127.0.0.1:{port}"
    variables = {**_variables(fresh_database, _spec(tmp_path)), "WORKER_POLL": "1",
                 "WORKER_TRIALS": "3"}
    topo = topology(variables, host="127.0.0.1", port=port,
                    gpu_lock_dir=str(tmp_path / "gpu-locks"))
    env = _base_env()
    migrated = subprocess.run(local(topo.migrate), env={**env, **topo.api_env}, cwd=tmp_path,
                              capture_output=True, text=True, timeout=STARTUP_S)
    assert migrated.returncode == 0, migrated.stderr
    api = processes.start("api", topo.serve, {**env, **topo.api_env})
    _wait_healthy(base_url, api, processes)

    from templates import Problem, get_template  # registered by the toy module (conftest)
    from tuner.client import TunerClient

    toy = get_template("toy_add")
    problem = Problem(1, 2, 2, 48, 48, 16, "float16")
    device = current_device().key
    with TunerClient(base_url, token="") as client:
        sent = client.report_demand([{"template": "toy_add", "template_version": toy.version(),
                                      "device": device, "problem": problem.to_dict(),
                                      "count": 3}])
        assert (sent.accepted, sent.reports) == (1, 3)
        worker = processes.start("demand-worker", topo.demand_worker,
                                 {**env, **topo.demand_worker_env})
        deadline = time.monotonic() + 180
        while (rows := client.demand().items)[0].status != "done":
            assert worker.poll() is None, processes.errors("demand-worker")
            assert time.monotonic() < deadline, f"not tuned in 180 s: {rows}"
            time.sleep(0.5)
        [row] = rows
        assert row.worker.split(":")[1] == str(worker.pid) and row.note.startswith("best ")
        db_url = fresh_database.render_as_string(hide_password=False)
        with session_scope(db_url, write=False) as s:
            [best] = s.scalars(select(BestConfig))
            stored = (best.config, best.tflops)
        deadline = time.monotonic() + 20  # the service re-checks its cache within 5 s
        while True:
            answer = client.best("toy_add", problem, device=device)
            if answer.match == "exact":
                break
            assert time.monotonic() < deadline, f"never served exact: {answer}"
            time.sleep(0.5)
        assert (answer.config, answer.tflops) == stored

    os.killpg(worker.pid, signal.SIGINT)  # docker compose stop: it waits for demand
    assert worker.wait(timeout=60) == 130
    lines = [json.loads(line) for line in processes.output("demand-worker").splitlines()]
    assert [line["event"] for line in lines] == ["started", "finished"]
    assert lines[0]["device"] == device and "toy_add" in lines[0]["templates"]
    assert (lines[1]["status"], lines[1]["template"], lines[1]["reports"]) == (
        "done", "toy_add", 3)
    dispose_engine(db_url)
