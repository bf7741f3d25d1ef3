"""Uploads as an attacker or a busy fleet would send them (issue 19): refused before the body is
read without a token, huge bundles refused before they are parsed, large ones stored in batches
that let other writers in, and a service that will not start with a token it would refuse."""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from api.main import create_app
from db import crud
from db.session import session_scope
from tests.api.serving_data import FWD, H100, TOKEN, bundle, item, problem
from tuner.lookup import bundle as bundle_module
from tuner.lookup.bundle import (
    MAX_BUNDLE_ITEMS,
    BundleError,
    drain,
    read_bundle,
    store_bundle,
    store_bundle_in_batches,
    validate_bundle,
)
from tuner.settings import SettingsError, load_settings


def _post_without_reading(app: Any, headers: list[tuple[bytes, bytes]], length: int = 8_000_000
                          ) -> tuple[int, int, dict[bytes, bytes]]:
    """POST /v1/results to the ASGI app directly; returns (status, body messages read, the
    answer's headers)."""
    reads = 0
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        nonlocal reads
        reads += 1
        return {"type": "http.request", "body": b'{"format": "attention-tuner/bundle"',
                "more_body": True}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/results", "raw_path": b"/v1/results",
             "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1),
             "server": ("127.0.0.1", 8000),
             "headers": [(b"content-type", b"application/json"),
                         (b"content-length", str(length).encode()), *headers]}
    asyncio.run(app(scope, receive, send))
    return sent[0]["status"], reads, dict(sent[0]["headers"])


@pytest.mark.parametrize(("token", "headers", "status"), [
    (TOKEN, [], 401),
    (TOKEN, [(b"authorization", b"Bearer not-the-token-at-all")], 403),
    (None, [(b"authorization", f"Bearer {TOKEN}".encode())], 503),
])
def test_a_write_that_will_be_refused_is_refused_before_its_body_is_read(
        db_url: str, token: str | None, headers: list[tuple[bytes, bytes]], status: int) -> None:
    app = create_app(load_settings(database_url=db_url, token=token))
    answered, reads, sent = _post_without_reading(app, headers)
    assert (answered, reads) == (status, 0)
    # Not received at all: the connection closes after the answer...
    assert sent.get(b"connection") == b"close"
    # ... unless the body is small: then it is received (and dropped), so that its sender
    # reads the answer instead of a reset.
    answered, reads, sent = _post_without_reading(app, headers, length=1000)
    assert (answered, reads) == (status, 0) and b"connection" not in sent


def test_the_4m_integer_bundle_is_refused_at_its_first_item(
        client: TestClient, auth: dict[str, str]) -> None:
    """It took 34 s and 1 GB to refuse (every one of 4M errors was built)."""
    body = (b'{"format": "attention-tuner/bundle", "version": 1, "items": ['
            + b",".join([b"1"] * 4_000_000) + b"]}")
    start = time.perf_counter()
    r = client.post("/v1/results", content=body,
                    headers={**auth, "Content-Type": "application/json"})
    took = time.perf_counter() - start
    assert r.status_code == 422
    assert r.json()["detail"] == {"index": 0, "reason": "an item must be a JSON object, but "
                                                        "got a number"}
    assert took < 5.0, f"{took:.1f} s"  # ~0.1 s of it the server's; the rest the test client


def test_a_bundle_of_too_many_items_is_refused_before_the_rest_is_parsed() -> None:
    # Text that is not JSON past the limit: had the reader gone on, it would say so instead.
    body = (b'{"format": "attention-tuner/bundle", "version": 1, "items": ['
            + b",".join([b"{}"] * MAX_BUNDLE_ITEMS) + b", {} not json at all")
    with pytest.raises(BundleError, match=f"at most {MAX_BUNDLE_ITEMS} items, but got more"):
        drain(read_bundle(body))
    # Already parsed (tuner import): refused before any item is validated.
    too_many = bundle(*([1] * (MAX_BUNDLE_ITEMS + 1)))  # type: ignore[arg-type]
    with pytest.raises(BundleError, match=f"but got {MAX_BUNDLE_ITEMS + 1}; split it"):
        validate_bundle(too_many)


@pytest.mark.parametrize(("body", "reason"), [
    (b'{"format": "attention-tuner/bundle", "version": 1, "junk": [1, 2, 3], "items": []}',
     "junk: not a field of a bundle"),
    (b'{"format": "attention-tuner/bundle", "version": 1, "host": [1, 2], "items": []}',
     "host: must be a string or a number, but got an array"),
    (b'{"format": "attention-tuner/bundle", "version": 1, "items": {"a": 1}}',
     "items: must be an array of items, but got an object"),
    (b'{"format": "attention-tuner/bundle", "version": 1, "items": [[1, 2]]}',
     "an item must be a JSON object, but got an array"),
    (b'{"format": "attention-tuner/bundle", "version": 1, "items": [], "items": []}',
     "'items' appears twice"),
    (b'{"format": "attention-tuner/bundle", "version": 1, "items": []} {}',
     "extra data"),
])
def test_large_values_where_none_belong_are_refused_unparsed(body: bytes, reason: str) -> None:
    with pytest.raises(BundleError, match=reason.replace("[", r"\[")):
        drain(read_bundle(body))


def test_reading_a_bundle_yields_between_items() -> None:
    """A reader can hand the loop back between items (the service now runs it in its store
    process, api/store_process.py, at once; the pauses cost nothing there)."""
    items = [item(problem(s)) for s in (256, 512, 1024)]
    import json

    steps = read_bundle(json.dumps(bundle(*items)).encode())
    pauses = 0
    with pytest.raises(StopIteration) as done:
        while True:
            next(steps)
            pauses += 1
    assert pauses >= 2 * len(items)  # one per item parsed, one per item checked
    assert [v.config.to_dict() for v in done.value.value.items] == [i["config"] for i in items]


def test_large_uploads_are_stored_in_batches_that_let_other_writers_in(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Between two batches SQLite's write lock is free: another writer that does not wait at
    all (busy timeout 0) gets it."""
    url = f"sqlite:///{tmp_path / 'batched.db'}"
    items = validate_bundle(bundle(*(item(problem(s)) for s in (64, 128, 256, 512, 1024, 2048,
                                                                4096, 8192))))
    with session_scope(url) as s:  # the schema, and a table the other writer writes to
        crud.create_sweep(s, name="other", spec={}, host="h")
    got_in = []

    def other_writer(seconds: float) -> None:
        assert seconds == bundle_module.SQLITE_BATCH_PAUSE_S
        with sqlite3.connect(tmp_path / "batched.db", timeout=0) as other:
            other.execute("BEGIN IMMEDIATE")
            other.execute("UPDATE sweeps SET host = 'other-writer'")
            got_in.append(True)

    monkeypatch.setattr(bundle_module.time, "sleep", other_writer)
    summary = store_bundle_in_batches(url, items, host="gpu-a", batch_items=3)
    assert got_in == [True, True]  # 8 items, 3 batches, 2 pauses
    single = f"sqlite:///{tmp_path / 'single.db'}"
    with session_scope(single) as s:
        at_once = store_bundle(s, items, host="gpu-a")
    assert (summary.items, summary.trials, summary.best_updated, summary.changed) == (
        at_once.items, at_once.trials, at_once.best_updated, at_once.changed) == (
        8, 16, 8, {(H100.key, FWD.name, FWD.version())})
    with session_scope(url, write=False) as s:
        assert crud.count_best(s) == 8
        assert [sw.name for sw in crud.list_sweeps(s)] == ["test-sweep", "other"]  # one, not 3


# ----------------------------------------------------------------------------- the token at start
@pytest.mark.parametrize("token", ["changeme", "${TUNER_TOKEN}", "<your-token-here>",
                                   "aaaaaaaaaaaaaaaaaaaaaaaa", "changeme1234567890"])
def test_the_service_will_not_start_with_a_token_it_would_refuse(db_url: str,
                                                                 token: str) -> None:
    with pytest.raises(SettingsError, match="openssl rand -hex 24"):
        create_app(load_settings(database_url=db_url, token=token))


def test_without_a_token_the_service_serves_reads_and_says_so(
        db_url: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="api"):
        app = create_app(load_settings(database_url=db_url, token=""))
    assert "serving reads only" in caplog.text
    with TestClient(app) as c:
        assert c.get("/v1/devices").status_code == 200


def test_the_service_keeps_its_startup_objects_out_of_full_collections(app: Any) -> None:
    """A full collection traversed ~400,000 start-up objects and stopped every request for
    ~220 ms while a large upload allocated: frozen while the app serves."""
    import gc

    gc.unfreeze()  # as a fresh process
    with TestClient(app):
        assert gc.get_freeze_count() > 10_000
    assert gc.get_freeze_count() == 0  # the exit frees them as usual


def test_the_write_routes_are_warmed_up_at_start_without_storing_anything(app: Any) -> None:
    """The first write's one-off costs (route set-up, ORM mappers) are paid at start-up by
    requests that are refused or invalid: nothing is counted or stored."""
    with TestClient(app) as client:
        assert app.state.warmed_up == {"POST /v1/results": 401, "POST /v1/demand": 422,
                                       "GET /v1/best": 422}
        assert client.get("/v1/demand").json()["total"] == 0
        assert client.get("/v1/devices").json() == []
