"""``tuner worker --service URL``: a GPU host that reaches only the service (HTTP, the write
token) claims demand through it, tunes into a database of its own, uploads the results and
marks the demand done; on both backends of the service, with the toy template under the
interpreter. A claim whose worker died is taken over after its lease; results that cannot be
uploaded are given back (and uploaded by the next attempt without measuring again); a stopped
worker gives its claim back; a missing token, a service of other kernel versions and a service
that cannot be reached are refused with the fix."""

from __future__ import annotations

import dataclasses
import json
import threading
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import func, select, update

from api.main import create_app
from db.models import Demand, Trial, utcnow
from db.session import dispose_engine, run_in_transaction, session_scope
from templates import current_device
from tests.api.serving_data import TOKEN, free_port, live_server
from tests.tuner.cli.test_sweep_cli import cli
from tests.tuner.demand.test_demand_worker import PROBLEM, TOY
from tests.tuner.toy_templates import MEASURE_LOG_ENV, measurements
from tuner.client import TunerClient
from tuner.demand.service_queue import ServiceQueue
from tuner.demand.worker import JobClaimed, JobFinished, WorkerOptions, WorkerWaits, run_worker
from tuner.errors import ServiceError, TunerError
from tuner.settings import get_settings, load_settings
from tuner.tuning.sweep import SweepOptions


@pytest.fixture
def service(db_url: str) -> Iterator[str]:
    """The service on loopback, over ``db_url`` (both backends), holding demand for the toy
    problem on this host's device."""
    app = create_app(load_settings(database_url=db_url, token=TOKEN, url=None))
    with live_server(app) as url, TunerClient(url, token="") as client:
        item = {"template": TOY.name, "template_version": TOY.version(),
                "device": current_device().key, "problem": PROBLEM.to_dict(), "count": 5}
        assert client.report_demand([item]).accepted == 1
        assert client.demand().total == 1  # stored
        yield url


@pytest.fixture(autouse=True)
def fresh_settings() -> Iterator[None]:
    get_settings.cache_clear()  # the settings are read once per process: read this test's
    yield
    get_settings.cache_clear()


def service_row(db_url: str) -> Demand:
    with session_scope(db_url, write=False) as s:
        [row] = s.scalars(select(Demand)).all()
        return row


def stored_trials(url: str) -> int:
    with session_scope(url, write=False) as s:
        return int(s.scalar(select(func.count(Trial.id))) or 0)


def uploaded_trials(local: str) -> int:
    """The trials an upload of ``local``'s results carries (``tuner/lookup/bundle.py``): the best
    config's and the default's, one when the default is the best (the toy's timings decide:
    CI saw both)."""
    from db import crud

    with session_scope(local, write=False) as s:
        [best] = crud.list_best(s)
        default = s.scalar(select(Trial.config).where(Trial.is_default.is_(True)))
    return 2 if default is not None and default != best.config else 1


def options() -> WorkerOptions:
    return WorkerOptions(sweep=SweepOptions(trials=2, finalists=0, timeout_s=20),
                         until_idle=True, templates=(TOY.name,))


@pytest.mark.slow
def test_a_worker_tunes_through_the_service_uploads_and_takes_a_dead_workers_claim_over(
        db_url: str, service: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A worker claimed the problem and died: its lease has passed.
    with TunerClient(service, token=TOKEN) as client:
        dead = client.claim_demand(device=current_device().key,
                                   templates={TOY.name: TOY.version()}, worker="gone:1",
                                   lease_s=60, max_attempts=3)
    assert dead is not None
    run_in_transaction(db_url, lambda s: s.execute(update(Demand).values(
        lease_until=utcnow() - timedelta(seconds=1))))

    local = f"sqlite:///{tmp_path / 'worker.db'}"
    monkeypatch.setenv("TUNER_TOKEN", TOKEN)
    code, out, err = cli("worker", "--service", service, "--db", local, "--until-idle",
                         "--trials", "2", "--finalists", "0", "--timeout", "20",
                         "--template", TOY.name, "--json")
    assert code == 0, err
    lines = [json.loads(line) for line in out.splitlines()]
    assert lines[0]["event"] == "started" and lines[0]["queue"] == f"service {service}"
    [finished] = [line for line in lines if line["event"] == "finished"]
    assert (finished["status"], finished["attempt"], finished["demand_id"]) == (
        "done", 2, dead.id)
    assert f"uploaded to service {service}" in finished["note"]

    row = service_row(db_url)
    assert (row.status.value, row.attempts, row.note) == ("done", 2, finished["note"])
    assert row.worker != "gone:1"
    # The service serves what the worker measured, exactly; its trials came with it.
    with TunerClient(service, token="") as client:
        answer = client.best(TOY.name, PROBLEM, device=current_device().key)
    with session_scope(local, write=False) as s:
        from db import crud

        [best] = crud.list_best(s)
        assert answer.match == "exact" and answer.config == best.config
        assert answer.tflops == pytest.approx(best.tflops)
    assert stored_trials(local) >= 2
    assert stored_trials(db_url) == uploaded_trials(local)
    dispose_engine(local)


@pytest.mark.slow
def test_results_that_cannot_be_uploaded_are_given_back_and_uploaded_next_time(
        db_url: str, service: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log = tmp_path / "measured.log"
    monkeypatch.setenv(MEASURE_LOG_ENV, str(log))
    local = f"sqlite:///{tmp_path / 'worker.db'}"
    down = ServiceQueue(service, TOKEN)

    def refused(_bundle: Any) -> Any:
        raise ServiceError("POST /v1/results failed after 4 attempt(s): ConnectError",
                           status=None)

    monkeypatch.setattr(down.client, "upload", refused)
    [first] = run_worker(options(), db_url=local, queue=down)
    assert first.status == "released" and "could not be uploaded" in first.note
    row = service_row(db_url)
    assert (row.status.value, row.attempts, row.worker) == ("open", 0, "")
    assert "could not be uploaded" in row.note and stored_trials(db_url) == 0
    measured = measurements(log)
    assert sum(map(len, measured.values())) >= 2

    [second] = run_worker(options(), db_url=local, queue=ServiceQueue(service, TOKEN))
    assert second.status == "done" and second.job.attempt == 1
    assert measurements(log) == measured  # nothing measured again: the trials were kept
    assert service_row(db_url).status.value == "done"
    assert stored_trials(db_url) == uploaded_trials(local)  # (CI once saw 1: the default won)
    dispose_engine(local)


def test_after_results_could_not_be_uploaded_a_worker_waits_before_claiming_again(
        db_url: str, service: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The sweep and the upload replaced by their outcome: the loop is what is tested here.
    monkeypatch.setattr("tuner.demand.worker._outcome", lambda *a, **k: (
        "released", "the results could not be uploaded (service down): given back", None))
    queue = ServiceQueue(service, TOKEN)
    events: list[Any] = []
    stop = threading.Event()

    def on_event(event: Any) -> None:
        events.append(event)
        if isinstance(event, WorkerWaits):
            stop.set()  # instead of waiting poll_s

    waiting = dataclasses.replace(options(), until_idle=False, poll_s=600)
    [result] = run_worker(waiting, db_url=f"sqlite:///{tmp_path / 'w.db'}", queue=queue,
                          on_event=on_event, stop=stop)
    assert result.status == "released"
    assert [type(e).__name__ for e in events] == [
        "WorkerStarted", "JobClaimed", "JobFinished", "WorkerWaits"]
    assert events[-1].seconds == 600 and "could not be uploaded" in events[-1].why
    assert service_row(db_url).status.value == "open"
    # Told to stop when idle, it stops instead: the next claim would take the same problem.
    assert [r.status for r in run_worker(options(), db_url=f"sqlite:///{tmp_path / 'w.db'}",
                                         queue=queue)] == ["released"]


def test_a_stopped_worker_gives_its_claim_back_through_the_service(
        db_url: str, service: str, tmp_path: Path) -> None:
    stop = threading.Event()

    def on_event(event: Any) -> None:
        if isinstance(event, JobClaimed):
            stop.set()

    queue = ServiceQueue(service, TOKEN)
    [result] = run_worker(options(), db_url=f"sqlite:///{tmp_path / 'w.db'}", queue=queue,
                          on_event=on_event, stop=stop)
    assert isinstance(result, JobFinished) and result.status == "released"
    row = service_row(db_url)
    assert (row.status.value, row.worker, row.attempts) == ("open", "", 0)
    assert "given back" in row.note


def test_a_missing_or_wrong_token_is_refused_with_the_fix(
        service: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    local = f"sqlite:///{tmp_path / 'w.db'}"
    monkeypatch.delenv("TUNER_TOKEN", raising=False)
    code, out, _ = cli("worker", "--service", service, "--db", local, "--until-idle", "--json")
    assert code == 2 and "needs the service's write token" in json.loads(out)["error"]
    assert "TUNER_TOKEN" in json.loads(out)["fix"]
    monkeypatch.setenv("TUNER_TOKEN", "a-wrong-token-0123456789")
    get_settings.cache_clear()
    code, out, _ = cli("worker", "--service", service, "--db", local, "--until-idle",
                       "--template", TOY.name, "--json")
    error = json.loads(out.splitlines()[-1])  # after the "started" line: the claim is refused
    assert code == 2 and "answered 403" in error["error"] and "TUNER_TOKEN" in error["fix"]


def test_templates_at_other_versions_than_the_services_are_left_alone() -> None:
    served = [{"name": TOY.name, "version": TOY.version(), "description": "",
               "config_schema": {}, "grid_size": 8},
              {"name": "flash_fwd", "version": "0" * 16, "description": "",
               "config_schema": {}, "grid_size": 8}]
    transport = httpx.MockTransport(lambda request: httpx.Response(200, json=served))
    queue = ServiceQueue("http://tuner:8000", TOKEN,
                         client=TunerClient("http://tuner:8000", token=TOKEN,
                                            transport=transport))
    mine = {TOY.name: TOY.version(), "flash_fwd": "1" * 16, "gluon_fwd": "2" * 16}
    assert queue.accepted_versions(mine) == {TOY.name: TOY.version()}
    with pytest.raises(TunerError, match="none of this worker's templates runs at the "
                                         "version service http://tuner:8000 runs: "
                                         f"flash_fwd {'1' * 16} here, {'0' * 16} there"):
        queue.accepted_versions({"flash_fwd": "1" * 16})


def test_a_service_that_cannot_be_reached_stops_an_until_idle_worker_saying_so(
        tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    queue = ServiceQueue(url, TOKEN, retries=0, timeout_s=2)
    with pytest.raises(TunerError, match=f"service {url} cannot be reached"):
        run_worker(options(), db_url=f"sqlite:///{tmp_path / 'w.db'}", queue=queue)
