"""Kept /v1/best answers (api.answer_memo): served again only while the cache entries they were
computed from are unchanged, the same bytes the route gives, never for made-up devices or
comparisons, bounded."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi.testclient import TestClient

from api.answer_memo import AnswerMemo, KeptAnswer
from api.answers import BestCache
from tests.api.serving_data import FWD, H100, bundle, faster, item, problem, store


def best(client: TestClient, p: Any, device: str = H100.key, **extra: Any) -> Any:
    return client.get("/v1/best", params={"device": device, "template": "flash_fwd",
                                          **p.to_dict(), **extra})


def test_a_kept_answer_is_the_routes_answer_byte_for_byte(client: TestClient,
                                                          db_url: str) -> None:
    p = problem(1024)
    store(db_url, item(p), item(problem(4096)))
    queries = [p, problem(1000), problem(16384), problem(1024, head_dim=64)]  # each match kind
    first = [best(client, q) for q in queries]
    assert [r.json()["match"] for r in first] == ["exact", "bucket", "nearest", "default"]
    memo: AnswerMemo = client.app.state.answer_memo  # type: ignore[attr-defined]
    assert len(memo) == 4
    for q, before in zip(queries, first, strict=True):
        again = best(client, q)
        assert again.status_code == 200
        assert again.content == before.content
        assert again.headers["content-type"] == before.headers["content-type"]
        assert again.headers["content-length"] == before.headers["content-length"]


def test_a_kept_answer_is_served_without_the_route(client: TestClient, db_url: str,
                                                   monkeypatch: Any) -> None:
    p = problem(1024)
    store(db_url, item(p))
    before = best(client, p)

    def no_route(*_args: Any, **_kwargs: Any) -> Any:
        raise AssertionError("the route computed an answer that was kept")

    monkeypatch.setattr("api.routes.best.answer_with_sources", no_route)
    assert best(client, p).content == before.content


def test_a_change_of_what_it_was_computed_from_drops_it(client: TestClient,
                                                        db_url: str) -> None:
    """Another process writes a faster config: the next answer says so (issue 18's rule holds
    with answers kept), and is kept in its turn."""
    p = problem(1024)
    first = item(p)
    store(db_url, first)
    assert best(client, p).json()["config"] == first["config"]
    assert best(client, p).json()["config"] == first["config"]  # from the memo
    better = faster(p, first)
    store(db_url, better)
    assert best(client, p).json()["config"] == better["config"]
    assert best(client, p).json()["config"] == better["config"]
    # A default answer of a stored device depends on the catalog: a new device's upload
    # changes it, and the kept default is not served after it.
    q = problem(1024, head_dim=64)
    assert best(client, q).json()["match"] == "default"
    store(db_url, item(q))
    assert best(client, q).json()["match"] == "exact"


def test_an_upload_through_the_service_is_seen_by_the_next_read(
        client: TestClient, auth: dict[str, str]) -> None:
    p = problem(2048)
    assert best(client, p).json()["match"] == "default"
    assert best(client, p).json()["match"] == "default"  # kept
    assert client.post("/v1/results", json=bundle(item(p)), headers=auth).status_code == 201
    assert best(client, p).json()["match"] == "exact"


def test_made_up_devices_and_comparisons_are_not_kept(client: TestClient, db_url: str) -> None:
    p = problem(1024)
    store(db_url, item(p))
    memo: AnswerMemo = client.app.state.answer_memo  # type: ignore[attr-defined]
    for i in range(5):
        assert best(client, p, device=f"made-up-{i}").json()["match"] == "default"
    assert best(client, p, compare="true").json()["implementations"] is not None
    assert len(memo) == 0
    # Errors are not kept either: a 422 stays a 422.
    assert best(client, p, batch=0).status_code == 422
    assert best(client, p, batch=0).status_code == 422
    assert len(memo) == 0


def test_the_memo_keeps_the_most_recently_used_answers(db_url: str) -> None:
    store(db_url, item(problem(1024)))
    cache = BestCache(db_url, watch=False)

    async def run() -> list[bytes | None]:
        catalog = await cache.catalog()
        memo = AnswerMemo(max_entries=2)
        kept = KeptAnswer.of(b"{}", catalog, FWD, FWD.version(), "x", None)
        memo.put(b"a", kept)
        memo.put(b"b", kept)
        assert await memo.get(b"a", cache) == b"{}"  # a is now the most recently used
        memo.put(b"c", kept)
        return [await memo.get(q, cache) for q in (b"a", b"b", b"c")]

    try:
        assert asyncio.run(run()) == [b"{}", None, b"{}"]
    finally:
        cache.close()


def test_defaults_are_computed_once_per_hardware(client: TestClient, monkeypatch: Any) -> None:
    """Made-up device keys (not kept as answers) share the default of the hardware they name;
    each answer is still the template's default for it, named with its own key."""
    from api import answers

    calls: list[str] = []
    real = type(FWD).default_config

    def counted(self: Any, p: Any, device: Any) -> Any:
        calls.append(device.name)
        return real(self, p, device)

    monkeypatch.setattr(answers, "_defaults", type(answers._defaults)())
    monkeypatch.setattr(type(FWD), "default_config", counted)
    p = problem(1024)
    got = [best(client, p, device=f"made-up-{i}").json() for i in range(3)]
    assert calls == ["made-up-0"]
    assert [g["device"] for g in got] == ["made-up-0", "made-up-1", "made-up-2"]
    assert all(g["config"] == real(FWD, p, answers.device_info_from_key("x")).to_dict()
               for g in got)
    # Another shape, or hardware of another compute capability, is computed anew.
    best(client, problem(2048), device="made-up-0")
    a100ish = H100.key.replace("cc9.0", "cc8.0").replace("H100", "A100")
    best(client, p, device=a100ish)
    assert calls == ["made-up-0", "made-up-0", a100ish.split("|")[0]]


def test_a_kept_answer_does_not_keep_a_replaced_entry_alive() -> None:
    """What an answer was computed from is referenced weakly: once the cache replaced it and
    nothing else holds it, it is freed, and the answer is not valid any more."""
    import gc
    import weakref

    from api.answers import Catalog

    class Cache:  # the part of BestCache the memo asks
        def __init__(self) -> None:
            self.current = Catalog({}, {}, [], frozenset(), ("first",))

        async def catalog(self) -> Catalog:
            return self.current

    cache = Cache()
    memo = AnswerMemo()
    memo.put(b"q", KeptAnswer.of(b"{}", cache.current, FWD, FWD.version(), "x", None))
    assert asyncio.run(memo.get(b"q", cache)) == b"{}"  # type: ignore[arg-type]
    freed = weakref.ref(cache.current)
    cache.current = Catalog({}, {}, [], frozenset(), ("second",))  # a change was loaded
    gc.collect()
    assert freed() is None
    assert asyncio.run(memo.get(b"q", cache)) is None  # type: ignore[arg-type]
    assert len(memo) == 0
