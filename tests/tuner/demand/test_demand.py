"""The client's demand reports (tuner.demand.reporter): what the resolver notes, and the reporter's
promises: never blocking or raising into the caller, bounded memory, nothing lost to a
service that is down for a while, off with TUNER_DEMAND=off."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn

from api.main import create_app
from db.session import dispose_engine, session_scope
from tests.api.serving_data import (
    FWD,
    TOKEN,
    bundle,
    free_port,
    interpreter,
    item,
    live_server,
    problem,
    tuned_config,
)
from tuner.client import TunerClient
from tuner.demand.reporter import DemandReporter
from tuner.lookup.bundle import store_bundle, validate_bundle
from tuner.lookup.resolver import ConfigResolver
from tuner.settings import load_settings

TINY = problem(64, batch=1, heads=2, head_dim=16, dtype="float16")
OTHER = problem(64, batch=1, heads=2, head_dim=32, dtype="float16")


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    url = f"sqlite:///{tmp_path_factory.mktemp('demand-service') / 'service.db'}"
    with live_server(create_app(load_settings(database_url=url, token=TOKEN, url=None))) as base:
        yield base
    dispose_engine(url)


def reported(service: str) -> dict[tuple[str, int], int]:
    """(template, head dim) -> reports stored by the service."""
    with TunerClient(service, token="") as client:
        return {(r.template, r.problem["head_dim"]): r.reports
                for r in client.demand(device=interpreter().key).items}


def reporter(url: str, **kwargs: Any) -> DemandReporter:
    return DemandReporter(url, interval_s=kwargs.pop("interval_s", 3600.0),
                          timeout_s=kwargs.pop("timeout_s", 2.0), **kwargs)


def note(r: DemandReporter, p: Any = TINY, times: int = 1) -> None:
    for _ in range(times):
        r.note(FWD.name, FWD.version(), interpreter().key, p)


def test_the_resolver_notes_untuned_answers_only(service: str, tmp_path: Path) -> None:
    local = tmp_path / "local.db"
    url = f"sqlite:///{local}"
    with session_scope(url) as s:
        store_bundle(s, validate_bundle(bundle(item(TINY, device=interpreter(),
                                                    config=tuned_config(TINY, interpreter())))))
    dispose_engine(url)
    resolver = ConfigResolver(load_settings(database_url=url, url=service))
    assert resolver.resolve(FWD, TINY, interpreter()).match == "exact"
    assert resolver.demand is None  # nothing untuned: no reporter, no thread
    near = problem(1024, batch=1, heads=2, head_dim=16, dtype="float16")
    assert resolver.resolve(FWD, near, interpreter()).match == "nearest"
    assert resolver.resolve(FWD, OTHER, interpreter()).match == "default"
    assert resolver.resolve(FWD, OTHER, interpreter()).match == "default"  # cached, noted
    assert resolver.demand is not None and resolver.demand.pending == 3
    resolver.demand.flush()
    assert resolver.demand.pending == 0 and resolver.demand.sent == 3
    assert reported(service)[(FWD.name, 32)] == 2


@pytest.mark.parametrize("settings", [{"demand": "off"}, {"demand": False}, {"url": None}],
                         ids=["off", "false", "no-service"])
def test_nothing_is_noted_when_off_or_without_a_service(service: str, tmp_path: Path,
                                                        settings: dict[str, Any]) -> None:
    config = {"database_url": f"sqlite:///{tmp_path / 'none.db'}", "url": service, **settings}
    resolver = ConfigResolver(load_settings(**config))
    assert resolver.resolve(FWD, TINY, interpreter()).match == "default"
    assert resolver.demand is None


def test_noting_never_waits_on_a_slow_service_and_memory_is_bounded() -> None:
    # A service that accepts the connection and never answers.
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    try:
        # No report on a timer here: which problems are pending when the third comes must not
        # depend on the scheduler (with a 50 ms timer the thread sometimes took the first two
        # away first, on a loaded machine, and the third was held).
        r = reporter(f"http://127.0.0.1:{listener.getsockname()[1]}", timeout_s=2.0,
                     max_pending=2)
        note(r, TINY, times=500)
        note(r, OTHER)
        note(r, problem(128, batch=1, heads=2, head_dim=16, dtype="float16"), times=3)
        assert r.dropped == 3  # a third distinct problem: not held, counted
        # A report in flight, waiting on the silent service: noting goes on without it.
        sending = threading.Thread(target=r.flush)
        sending.start()
        deadline = time.monotonic() + 1.5
        while r.pending and time.monotonic() < deadline:  # the report has taken them
            time.sleep(0.01)
        assert r.pending == 0 and sending.is_alive()
        note(r, TINY)
        assert sending.is_alive() and r.pending == 1  # noted while the request still waits
        sending.join(timeout=10)
        assert not sending.is_alive()
    finally:
        listener.close()


def test_reports_the_service_could_not_take_are_sent_later(tmp_path: Path) -> None:
    port = free_port()
    r = reporter(f"http://127.0.0.1:{port}", timeout_s=1.0)
    note(r, TINY, times=4)
    r.flush()  # nobody listens: held for the next report
    assert (r.pending, r.sent) == (4, 0)
    note(r, TINY)
    url = f"sqlite:///{tmp_path / 'service.db'}"
    app = create_app(load_settings(database_url=url, token=TOKEN, url=None))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error",
                                           lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.02)
        r.flush()
        assert (r.pending, r.sent) == (0, 5)
        assert reported(f"http://127.0.0.1:{port}") == {(FWD.name, 16): 5}
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        dispose_engine(url)


def test_items_the_service_refuses_are_dropped_not_retried(service: str) -> None:
    r = reporter(service)
    r.note(FWD.name, "0123456789abcdef", interpreter().key, TINY)  # another kernel's version
    r.note(FWD.name, FWD.version(), interpreter().key, OTHER)
    r.flush()
    assert (r.pending, r.sent, r.refused) == (0, 1, 1)
    bad_device = reporter(service)
    bad_device.note(FWD.name, FWD.version(), "not a device key", TINY)  # the whole report: 422
    bad_device.flush()
    assert (bad_device.pending, bad_device.sent, bad_device.refused) == (0, 0, 1)


def test_the_thread_reports_by_itself_and_close_sends_the_rest(service: str) -> None:
    p = problem(64, batch=1, heads=2, head_dim=64, dtype="float16")
    r = reporter(service, interval_s=0.1)
    note(r, p, times=2)
    deadline = time.monotonic() + 10
    while r.sent < 2:
        assert time.monotonic() < deadline, "the reporter thread sent nothing"
        time.sleep(0.05)
    note(r, p)
    r.close()
    assert (r.pending, r.sent) == (0, 3)
    assert reported(service)[(FWD.name, 64)] == 3


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="interval_s and timeout_s must be > 0"):
        DemandReporter("http://x", interval_s=0, timeout_s=1)
