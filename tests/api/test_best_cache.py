"""What the service keeps in memory (api.answers.BestCache): refreshed per key, re-checked at
once after another process wrote (issue 18), never stale by more than its ttl where changes
cannot be watched, not flushed by made-up keys, and how it finds a device by name (issues 19
and 20)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient

from api import answers
from api.answers import BestCache
from api.main import create_app
from db import crud
from db.session import make_engine, session_scope
from tests.api.serving_data import (
    FWD,
    H100,
    TOKEN,
    bundle,
    faster,
    interpreter,
    item,
    problem,
    store,
)
from tests.db.conftest import _fresh_postgres_url, postgres_server  # noqa: F401, F811
from tuner.settings import load_settings

A100ISH = dataclasses.replace(H100, name="NVIDIA A100-SXM4-80GB", compute_capability="8.0",
                              sm_count=108, smem_per_block=166_912)
H100_OTHER_TRITON = dataclasses.replace(H100, triton_version="3.5.0")


def upload(client: TestClient, auth: dict[str, str], *items: dict[str, Any]) -> Any:
    r = client.post("/v1/results", json=bundle(*items), headers=auth)
    assert r.status_code == 201, r.text
    return r.json()


def best(client: TestClient, p: Any, device: str = H100.key) -> Any:
    return client.get("/v1/best", params={"device": device, "template": "flash_fwd",
                                          **p.to_dict()})






class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(app: Any, db_url: str) -> Clock:
    """A cache on this clock, bounded by its ttl alone: as where changes cannot be watched
    (a lost PostgreSQL notification), which the ttl is the fallback for."""
    clock = Clock()
    app.state.best_cache = BestCache(db_url, ttl_s=5.0, clock=clock, watch=False)
    return clock


def bests_of(app: Any, device: Any) -> Any:
    kept = app.state.best_cache._bests.get((device.key, FWD.name, FWD.version()))
    return None if kept is None else kept.value


@contextlib.contextmanager
def counted_queries(db_url: str) -> Iterator[list[str]]:
    """The SQL statements sent to ``db_url`` inside the block."""
    seen: list[str] = []

    def count(*args: Any) -> None:
        seen.append(str(args[2]))

    engine = make_engine(db_url)
    sa.event.listen(engine, "before_cursor_execute", count)
    try:
        yield seen
    finally:
        sa.event.remove(engine, "before_cursor_execute", count)


# ----------------------------------------------------------------------------- writes (issue 19)
def test_an_upload_refreshes_what_it_changed_and_nothing_else(
        client: TestClient, app: Any, auth: dict[str, str], db_url: str) -> None:
    p = problem(1024)
    on_h100, on_a100 = item(p), item(p, device=A100ISH)
    upload(client, auth, on_h100, on_a100)
    assert best(client, p).json()["config"] == on_h100["config"]
    assert best(client, p, A100ISH.key).json()["config"] == on_a100["config"]
    h100_before, a100_before = bests_of(app, H100), bests_of(app, A100ISH)

    better = faster(p, on_h100)
    assert upload(client, auth, better)["best_updated"] == 1
    # The uploader's next lookup sees what it stored, at once: no ttl to wait out.
    answer = best(client, p).json()
    assert answer["config"] == better["config"] and answer["tflops"] == 999.0
    assert bests_of(app, H100) is not h100_before
    assert bests_of(app, A100ISH) is a100_before  # another device's answers: untouched

    # Stored again: nothing new, so nothing is refreshed, and no best row is rewritten.
    h100_now = bests_of(app, H100)
    with session_scope(db_url, write=False) as s:
        stamps = {r.problem_key: r.updated_at for r in crud.list_best(s)}
    assert upload(client, auth, better, on_a100) == {
        "items": 2, "trials": 0, "best_updated": 0, "remeasurements": 0}
    assert bests_of(app, H100) is h100_now and bests_of(app, A100ISH) is a100_before
    with session_scope(db_url, write=False) as s:
        assert {r.problem_key: r.updated_at for r in crud.list_best(s)} == stamps


def test_reads_answer_from_the_old_entry_while_its_refresh_loads(db_url: str) -> None:
    """An upload's refresh (or a background check) never makes a lookup wait for it, unless the
    lookup knows that the database changed (the first answer after a change is no stale one:
    the next test); here, with changes not watched, it does not know."""
    p = problem(1024)
    first = item(p)
    store(db_url, first)
    cache = BestCache(db_url, watch=False)
    release, loading = threading.Event(), threading.Event()
    real_load = cache._load_bests

    def slow_load(*args: Any) -> Any:
        loading.set()
        assert release.wait(10), "the test never released the load"
        return real_load(*args)

    async def scenario() -> None:
        old = await cache.bests(FWD, FWD.version(), H100.key)
        store(db_url, faster(p, first))
        cache._load_bests = slow_load  # type: ignore[method-assign, assignment]
        refresh = asyncio.ensure_future(cache.refresh([(H100.key, FWD.name, FWD.version())]))
        while not loading.is_set():
            await asyncio.sleep(0.005)
        # The load is blocked; lookups still answer, from the entry as it was.
        for _ in range(3):
            assert await asyncio.wait_for(
                cache.bests(FWD, FWD.version(), H100.key), timeout=1.0) is old
        release.set()
        await asyncio.wait_for(refresh, timeout=10)
        new = await cache.bests(FWD, FWD.version(), H100.key)
        assert [c.config.to_dict() for c in new.candidates] == [faster(p, first)["config"]]

    asyncio.run(scenario())


def test_a_change_reparses_only_the_rows_that_changed(
        client: TestClient, clock: Clock, db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    problems = [problem(s) for s in (256, 512, 1024, 2048, 4096)]
    items = [item(p) for p in problems]
    store(db_url, *items)
    assert best(client, problems[0]).json()["match"] == "exact"
    asked: list[Any] = []
    real = crud.best_candidates

    def spy(*args: Any, **kwargs: Any) -> Any:
        asked.append(kwargs.get("problem_keys"))
        return real(*args, **kwargs)

    monkeypatch.setattr(crud, "best_candidates", spy)
    store(db_url, faster(problems[2], items[2]))
    clock.now += 6  # past the ttl: the next lookup checks the database first
    assert best(client, problems[2]).json()["tflops"] == 999.0
    assert asked == [[FWD.problem_key(problems[2])]]
    clock.now += 6  # checked again: nothing changed, nothing re-read
    assert best(client, problems[0]).json()["match"] == "exact"
    assert asked == [[FWD.problem_key(problems[2])]]


# ----------------------------------------------------------------------------- freshness (issues 18, 20)
def test_the_first_answer_after_a_sweep_wrote_is_not_stale(client: TestClient,
                                                            db_url: str) -> None:
    """Issue 18: a sweep writes straight into the database; the next lookup says what it
    wrote, with no ttl to wait out (it said ``default`` for up to 5 s)."""
    p = problem(1024)
    assert best(client, p).json()["match"] == "default"
    first = item(p)
    store(db_url, first)
    answer = best(client, p).json()
    assert answer["match"] == "exact" and answer["config"] == first["config"]
    better = faster(p, first)
    store(db_url, better)
    assert best(client, p).json()["config"] == better["config"]
    assert best(client, problem(4096)).json()["match"] == "nearest"


def test_demand_counts_stored_leave_the_cached_answers_alone(client: TestClient,
                                                             db_url: str) -> None:
    """Issue 18: the demand counts, stored once a second, are a commit like a sweep's; on
    SQLite only changes of best configs, devices and templates (counted by triggers) make
    the cached answers re-check, so reads beside the reports wait for no query."""
    p = problem(1024)
    store(db_url, item(p))
    assert best(client, p).json()["match"] == "exact"
    report = {"template": FWD.name, "template_version": FWD.version(), "device": H100.key,
              "problem": problem(3000).to_dict(), "count": 2}
    assert client.post("/v1/demand", json={"items": [report]}).status_code == 202
    assert client.get("/v1/demand").json()["total"] == 1  # stored: committed
    with counted_queries(db_url) as seen:
        assert best(client, p).json()["match"] == "exact"
    assert seen == []
    better = faster(p, item(p))
    store(db_url, better)  # a change of a best config: seen at the next lookup
    assert best(client, p).json()["config"] == better["config"]


@pytest.mark.postgres
def test_on_postgresql_a_write_is_noticed_through_notifications(
        postgres_server: Any) -> None:  # noqa: F811
    """PostgreSQL: refresh_bests notifies, the service listens; the cache's ttl (an hour
    here) is not what brings the answer."""
    fresh = _fresh_postgres_url(postgres_server)
    url = next(fresh)
    try:
        app = create_app(load_settings(database_url=url, token=TOKEN, url=None))
        app.state.best_cache = BestCache(url, ttl_s=3600.0)
        with TestClient(app) as client:
            p = problem(1024)
            assert best(client, p).json()["match"] == "default"
            store(url, item(p))
            deadline = time.monotonic() + 5.0
            while best(client, p).json()["match"] != "exact":
                assert time.monotonic() < deadline, "the write was never noticed"
                time.sleep(0.01)
    finally:
        next(fresh, None)


def test_the_first_answer_after_the_ttl_reflects_the_database(
        client: TestClient, clock: Clock, db_url: str) -> None:
    """A sweep writes while the service is idle; the first lookup more than ttl_s later says
    what was written (it was ``default`` once: served stale, then refreshed)."""
    p = problem(1024)
    assert best(client, p).json()["match"] == "default"  # nothing stored: no device known
    store(db_url, item(p))
    clock.now += 2  # under half the ttl: the cached answer stands, unchecked
    assert best(client, p).json()["match"] == "default"
    clock.now += 16
    assert best(client, p).json()["match"] == "exact"  # the first answer, not the second

    p2 = problem(4096)
    assert best(client, p2).json()["match"] == "nearest"
    better = item(p2, tflops=500.0)
    store(db_url, better)
    clock.now += 20
    answer = best(client, p2).json()
    assert answer["match"] == "exact" and answer["config"] == better["config"]


def test_an_entry_past_half_its_ttl_is_checked_in_the_background(
        client: TestClient, app: Any, clock: Clock, db_url: str) -> None:
    p = problem(1024)
    first = item(p)
    store(db_url, first)
    assert best(client, p).json()["config"] == first["config"]
    better = faster(p, first)
    store(db_url, better)
    clock.now += 3  # past ttl/2, within the ttl: answered from the entry, checked meanwhile
    assert best(client, p).json()["config"] == first["config"]
    kept = app.state.best_cache._bests[(H100.key, FWD.name, FWD.version())]
    deadline = 200
    while kept.loading is not None and deadline:
        deadline -= 1
        best(client, problem(2048))  # the loop runs the load's completion
    assert best(client, p).json()["config"] == better["config"]


# ----------------------------------------------------------------------------- made-up keys (issue 19)
def test_unknown_devices_are_answered_without_a_query_or_an_entry(
        client: TestClient, app: Any, auth: dict[str, str], db_url: str) -> None:
    p = problem(1024)
    upload(client, auth, item(p))
    assert best(client, p).json()["match"] == "exact"
    entries = len(app.state.best_cache)
    with counted_queries(db_url) as queries:
        for _ in range(50):
            made_up = f"rand-{uuid.uuid4().hex[:12]}"
            answer = best(client, p, made_up).json()
            assert answer["match"] == "default" and answer["device"] == made_up
        # An unknown kernel version of a known device: no stored results either.
        r = client.get("/v1/best", params={"device": H100.key, "template": "flash_fwd",
                                           "template_version": "0123456789abcdef",
                                           **p.to_dict()})
        assert r.json()["match"] == "default"
    assert queries == []
    assert len(app.state.best_cache) == entries
    assert best(client, p).json()["match"] == "exact"  # the real one still cached


def test_a_full_cache_evicts_the_least_recently_used_entry_only(db_url: str) -> None:
    devices = [H100, A100ISH, H100_OTHER_TRITON]
    p = problem(1024)
    store(db_url, *(item(p, device=d) for d in devices))
    cache = BestCache(db_url, max_entries=2)

    async def scenario() -> None:
        def get(d: Any) -> Any:
            return cache.bests(FWD, FWD.version(), d.key)

        h100, a100 = await get(H100), await get(A100ISH)
        assert await get(H100) is h100  # H100 used last: A100 is now the oldest
        await get(H100_OTHER_TRITON)
        assert len(cache) == 2
        assert set(cache._bests) == {(H100.key, FWD.name, FWD.version()),
                                         (H100_OTHER_TRITON.key, FWD.name, FWD.version())}
        assert await get(H100) is h100  # kept: not reloaded
        assert await get(A100ISH) is not a100  # evicted: loaded again

    asyncio.run(scenario())


# ----------------------------------------------------------------------------- device names (issue 20)
def test_a_device_is_found_by_its_name_or_a_unique_key_prefix(
        client: TestClient, auth: dict[str, str]) -> None:
    p = problem(1024)
    cpu = interpreter()
    small = problem(64, batch=1, heads=2, head_dim=16, dtype="float32")
    on_cpu = item(small, device=cpu)
    upload(client, auth, item(p), item(p, device=H100_OTHER_TRITON), item(p, device=A100ISH),
           on_cpu)

    by_name = best(client, small, cpu.name).json()  # "cpu-interpreter", as tuner best shows it
    assert by_name["match"] == "exact" and by_name["device"] == cpu.key
    assert by_name["config"] == on_cpu["config"]
    a100 = best(client, p, "NVIDIA A100").json()  # a prefix of one key
    assert a100["match"] == "exact" and a100["device"] == A100ISH.key
    source = client.get("/v1/kernels/flash_fwd/source",
                        params={"device": A100ISH.name, **p.to_dict()})
    assert source.status_code == 200 and f"# device {A100ISH.key!r}" in source.text

    for ambiguous in (H100.name, "NVIDIA H100 80GB HBM3|cc9.0|triton3.", "NVIDIA"):
        r = best(client, p, ambiguous)
        assert r.status_code == 422, r.text
        detail = r.json()["detail"]
        assert ambiguous in detail["reason"] and "one of their keys" in detail["reason"]
        expected = {H100.key, H100_OTHER_TRITON.key} | (
            {A100ISH.key} if ambiguous == "NVIDIA" else set())
        assert set(detail["candidates"]) == expected
    # A full key is that device, even where it is also a prefix of another's key.
    assert best(client, p, H100.key).json()["device"] == H100.key


def test_catalog_resolution_order() -> None:
    catalog = answers.Catalog(
        devices={"ab": H100, "abc": H100, "xyz": A100ISH},
        keys_by_name={"gpu": ["xyz"], "twin": ["ab", "abc"]},
        sorted_keys=["ab", "abc", "xyz"], template_versions=frozenset(), fingerprint=())
    assert catalog.resolve("ab") == "ab"  # a key before a prefix
    assert catalog.resolve("gpu") == "xyz"  # a name
    assert catalog.resolve("x") == "xyz"  # a unique prefix
    assert catalog.resolve("nothing") is None
    with pytest.raises(answers.AmbiguousDevice, match="name of 2"):
        catalog.resolve("twin")
    with pytest.raises(answers.AmbiguousDevice, match="key prefix of 2"):
        catalog.resolve("a")
