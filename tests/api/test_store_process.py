"""Uploads are parsed, checked and stored in a process of their own (api/store_process.py), so
that their Python work never makes the event loop wait for the GIL; what the service promises
about them stays: acknowledged means stored, a dead store process is replaced and the upload
stored again or answered 503, and a refused bundle stores nothing."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from fastapi import FastAPI
from fastapi.testclient import TestClient

from api.own_writes import COUNTER_QUERY
from api.store_process import StoreOutcome, StoreProcess, store_body
from db import crud
from db.session import init_db, session_scope
from tests.api.serving_data import H100, bundle, item, problem
from tests.api.serving_data import store as store_directly


def dies_first(flag: str, times: int, database_url: str, body: bytes,
               template_modules: list[str]) -> StoreOutcome:
    """``store_body``, after killing its own process the first ``times`` calls (counted in the
    file ``flag``: each call runs in a new process)."""
    died = Path(flag).read_text() if os.path.exists(flag) else ""
    if len(died) < times:
        Path(flag).write_text(died + "x")
        os._exit(1)  # as an out-of-memory kill would: no answer, no clean-up
    return store_body(database_url, body, template_modules)


def child_pid() -> int:
    return os.getpid()


def stored_problems(db_url: str) -> list[str]:
    with session_scope(db_url, write=False) as s:
        return sorted(r.problem_key for r in crud.list_best(s))


def test_uploads_are_stored_by_another_process_started_with_the_service(
        client: TestClient, app: FastAPI, auth: dict[str, str], db_url: str) -> None:
    store: StoreProcess = app.state.bundle_store
    # Started and warmed at start-up (the lifespan), not by the first upload.
    assert isinstance(app.state.store_pid, int) and app.state.store_pid != os.getpid()
    assert asyncio.run(store.call(child_pid)) == app.state.store_pid
    p = problem(2048)
    r = client.post("/v1/results", json=bundle(item(p)), headers=auth)
    assert r.status_code == 201, r.text
    assert r.json()["best_updated"] == 1
    assert stored_problems(db_url) == [p.bucket_key()]
    # Acknowledged means visible: the uploader's next lookup answers from it.
    answer = client.get("/v1/best", params={"device": H100.key, "template": "flash_fwd",
                                            **p.to_dict()}).json()
    assert answer["match"] == "exact"


@pytest.mark.parametrize(("body", "status", "detail"), [
    (b"\xff\xfe not text", 400, "the body is not UTF-8 text"),
    (b'{"format": "attention-tuner/bundle", "version": 1, "items": [1]}', 422,
     {"index": 0, "reason": "an item must be a JSON object, but got a number"}),
])
def test_a_refused_bundle_is_answered_as_before_and_stores_nothing(
        client: TestClient, auth: dict[str, str], db_url: str, body: bytes, status: int,
        detail: Any) -> None:
    r = client.post("/v1/results", content=body,
                    headers={**auth, "Content-Type": "application/json"})
    assert r.status_code == status, r.text
    got = r.json()["detail"]
    assert got == detail if isinstance(detail, dict) else got.startswith(detail)
    assert stored_problems(db_url) == []


def test_a_store_process_that_dies_is_replaced_and_the_upload_stored_once(
        client: TestClient, app: FastAPI, auth: dict[str, str], db_url: str,
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = StoreProcess(target=partial(dies_first, str(tmp_path / "died"), 1))
    app.state.bundle_store = store
    p = problem(4096)
    try:
        r = client.post("/v1/results", json=bundle(item(p)), headers=auth)
        assert r.status_code == 201, r.text
        assert r.json() == {"items": 1, "trials": 2, "best_updated": 1, "remeasurements": 0}
        assert store.deaths == 1
        assert "the upload store process died" in caplog.text
        # The new process goes on storing: the same bundle again adds nothing.
        again = client.post("/v1/results", json=bundle(item(p)), headers=auth)
        assert again.status_code == 201 and again.json()["trials"] == 0
        assert store.deaths == 1
    finally:
        store.close()
    assert stored_problems(db_url) == [p.bucket_key()]


def test_an_upload_whose_store_process_dies_twice_is_answered_503_never_201(
        client: TestClient, app: FastAPI, auth: dict[str, str], db_url: str,
        tmp_path: Path) -> None:
    store = StoreProcess(target=partial(dies_first, str(tmp_path / "died"), 2))
    app.state.bundle_store = store
    try:
        r = client.post("/v1/results", json=bundle(item(problem(4096))), headers=auth)
        assert r.status_code == 503, r.text
        assert "died 2 times under this upload" in r.json()["detail"]
        assert r.headers["retry-after"] == "1"
        assert store.deaths == 2
        assert stored_problems(db_url) == []
        # And the next upload gets a live process again.
        r = client.post("/v1/results", json=bundle(item(problem(4096))), headers=auth)
        assert r.status_code == 201, r.text
    finally:
        store.close()


# ------------------------------------------------------------ own writes (api/own_writes.py)
def best_changes(db_url: str) -> int:
    with session_scope(db_url, write=False) as s:
        return int(s.execute(sa.text(COUNTER_QUERY)).scalar_one())


def test_the_store_process_publishes_the_changes_it_made_and_no_one_elses(
        db_url: str, tmp_path: Path) -> None:
    init_db(db_url)
    store = StoreProcess()
    try:
        asyncio.run(store.warm_up(db_url, []))
        before = best_changes(db_url)
        body = json.dumps(bundle(item(problem(1024)), item(problem(2048)))).encode()
        outcome = asyncio.run(store.store(db_url, body, []))
        assert outcome.summary is not None and outcome.summary.best_updated == 2
        after = best_changes(db_url)
        assert after > before
        assert store.own.owns(db_url, before, after)
        assert store.own.owns(db_url, before + 1, after)  # a count seen midway: still ours
        assert not store.own.owns(f"sqlite:///{tmp_path / 'other.db'}", before, after)
        # Another process writes: from then on, a move is not the store process's alone.
        store_directly(db_url, item(problem(4096)))
        later = best_changes(db_url)
        assert later > after
        assert not store.own.owns(db_url, before, later)
        assert not store.own.owns(db_url, after, later)
        # Its next upload starts a new range, after the other writer's changes.
        outcome = asyncio.run(store.store(db_url, json.dumps(bundle(item(problem(8192)))).encode(),
                                          []))
        last = best_changes(db_url)
        assert store.own.owns(db_url, later, last)
        assert not store.own.owns(db_url, after, last)
        store.own.withdraw()
        assert not store.own.owns(db_url, later, last)
    finally:
        store.close()


def test_an_upload_through_the_service_re_checks_nothing_else_but_a_sweep_does(
        client: TestClient, app: FastAPI, auth: dict[str, str], db_url: str) -> None:
    cache = app.state.best_cache
    p, other = problem(1024), problem(2048)
    store_directly(db_url, item(other))
    assert client.get("/v1/best", params={"device": H100.key, "template": "flash_fwd",
                                          **other.to_dict()}).json()["match"] == "exact"
    seen = cache.changes_seen
    r = client.post("/v1/results", json=bundle(item(p)), headers=auth)
    assert r.status_code == 201, r.text
    answer = client.get("/v1/best", params={"device": H100.key, "template": "flash_fwd",
                                            **p.to_dict()}).json()
    assert answer["match"] == "exact"  # refreshed by the upload itself
    assert cache.changes_seen == seen  # its own change: no re-check of everything
    # A write by another process is a change: every entry re-checks before it answers.
    store_directly(db_url, item(problem(4096)))
    client.get("/v1/best", params={"device": H100.key, "template": "flash_fwd",
                                   **p.to_dict()})
    assert cache.changes_seen == seen + 1


def test_an_upload_whose_refresh_fails_leaves_every_entry_to_be_re_checked(
        client: TestClient, app: FastAPI, auth: dict[str, str], db_url: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Its change was not taken for another writer's: had the refresh failed silently, the
    cache would answer from what it held until the ttl."""
    cache = app.state.best_cache
    p = problem(1024)
    store_directly(db_url, item(p))
    client.get("/v1/best", params={"device": H100.key, "template": "flash_fwd", **p.to_dict()})
    seen = cache.changes_seen

    def fails(*_args: Any) -> Any:
        raise sa.exc.OperationalError("SELECT", {}, Exception("the database went away"))

    monkeypatch.setattr(cache, "_load_catalog", fails)
    r = client.post("/v1/results", json=bundle(item(problem(2048))), headers=auth)
    assert r.status_code == 503  # stored but not acknowledged: sent again, nothing is doubled
    assert cache.changes_seen == seen + 1


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc (Linux)")
def test_the_store_process_ends_when_the_service_process_ends_without_stopping_it(
        db_url: str) -> None:
    """A uvicorn worker ends with os._exit, and a kill runs no clean-up: the child must not
    be left behind (it was, with --workers 2)."""
    script = ("import asyncio, os, sys\n"
              "from api.store_process import StoreProcess\n"
              "pid = asyncio.run(StoreProcess().warm_up(sys.argv[1], []))\n"
              "print(pid, flush=True)\n"
              "os._exit(0)\n")
    done = subprocess.run([sys.executable, "-c", script, db_url], capture_output=True,
                          text=True, timeout=120, cwd=Path(__file__).resolve().parents[2])
    child = int(done.stdout.split()[0])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and Path(f"/proc/{child}").exists():
        if "Z" in Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[:1]:
            break  # a zombie: ended, not yet reaped
        time.sleep(0.1)
    alive = Path(f"/proc/{child}").exists() and "Z" not in Path(
        f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[:1]
    if alive:
        os.kill(child, 9)
    assert not alive, "the store process outlived the service process by 10 s"


def test_the_child_imports_every_template_module_the_service_registered() -> None:
    # A template registered by an import in the serving process (not by TUNER_TEMPLATE_MODULES)
    # must be known to the store child too, or its uploads are refused as an unknown template.
    import tests.tuner.toy_templates  # noqa: F401  registers toy_add
    from api.store_process import registered_template_modules

    modules = registered_template_modules()
    assert "tests.tuner.toy_templates" in modules
    assert "templates.flash.fwd" in modules and modules == sorted(set(modules))
