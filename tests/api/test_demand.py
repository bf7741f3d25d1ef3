"""POST /v1/demand and GET /v1/demand: reports without a token, each item checked against
the templates this service knows, counted per shape bucket; the body capped, the rate limited
per client address before the body is read; the queue listed with each claim's state."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import update

from api.demand_buffer import DemandBuffer
from api.demand_check import DemandBucket
from api.main import create_app
from api.routes.demand import MAX_BODY_BYTES
from api.schemas import MAX_DEMAND_ITEMS
from db import demand
from db.models import Demand, DemandStatus, utcnow
from db.session import run_in_transaction, session_scope
from templates.registry import get_template
from tests.api.serving_data import FWD, H100, TOKEN, problem
from tuner.settings import load_settings

DECODE = get_template("flash_decode")


def demand_item(p: Any = None, *, count: int = 1, **overrides: Any) -> dict[str, Any]:
    p = p or problem(1000)
    return {"template": FWD.name, "template_version": FWD.version(), "device": H100.key,
            "problem": p.to_dict(), "count": count, **overrides}


def post(client: TestClient, *items: dict[str, Any]) -> Any:
    return client.post("/v1/demand", json={"items": list(items)})


def test_reports_are_counted_per_shape_bucket_without_a_token(client: TestClient) -> None:
    first = problem(1000)
    answer = post(client, demand_item(first, count=3), demand_item(problem(1020), count=2),
                  demand_item(problem(4096)))
    assert answer.status_code == 202, answer.text
    assert answer.json() == {"accepted": 3, "reports": 6, "rejected": [], "rejected_count": 0,
                             "dropped": 0}
    post(client, demand_item(problem(4096), count=4))
    page = client.get("/v1/demand").json()
    assert page["total"] == 2
    top, second = page["items"]
    assert (top["problem_key"], top["reports"], top["status"]) == (
        FWD.problem_key(first), 5, "open")
    assert top["problem"] == first.to_dict()  # the first reported: what a worker tunes
    assert (second["problem"]["seqlen_q"], second["reports"]) == (4096, 5)
    assert top["device"] == H100.key and top["template_version"] == FWD.version()


def test_each_item_is_checked_and_the_bad_ones_are_listed(client: TestClient) -> None:
    answer = post(
        client,
        demand_item(template="no_such_kernel"),
        demand_item(template_version="0123456789abcdef"),
        demand_item(problem={**problem(1000).to_dict(), "heads_kv": 3}),
        demand_item(problem={"batch": 1}),
        demand_item(problem={**problem(1000).to_dict(), "seqlen_q": [1]}),
        demand_item(problem(1000, heads=2, head_dim=16), template=DECODE.name,  # N_q > 16
                    template_version=DECODE.version()),
        demand_item(),
    )
    assert answer.status_code == 202
    body = answer.json()
    assert (body["accepted"], body["reports"], body["rejected_count"]) == (1, 1, 6)
    reasons = {r["index"]: r["reason"] for r in body["rejected"]}
    assert "unknown template 'no_such_kernel'" in reasons[0] and "flash_fwd" in reasons[0]
    assert "at version" in reasons[1] and "0123456789abcdef" in reasons[1]
    assert "multiple of heads_kv" in reasons[2]
    assert reasons[3].startswith("problem.heads_q: Field required")
    assert reasons[4].startswith("problem.seqlen_q:")
    assert reasons[5].startswith(f"template '{DECODE.name}' cannot run this problem")
    assert client.get("/v1/demand").json()["total"] == 1


@pytest.mark.parametrize(("body", "says"), [
    ({"items": [demand_item(device="H100")]}, "items.0.device: String should match pattern"),
    ({"items": [demand_item(count=0)]}, "items.0.count: Input should be greater than or equal"),
    ({"items": [demand_item(count="3")]}, "items.0.count: Input should be a valid integer"),
    ({"items": [{**demand_item(), "token": "x"}]}, "items.0.token: Extra inputs"),
    ({"items": []}, "items: List should have at least 1 item"),
    ({"items": [demand_item()] * (MAX_DEMAND_ITEMS + 1)}, "items: List should have at most 500"),
    ([demand_item()], "Input should be an object"),
], ids=["device-key", "count-0", "count-text", "unknown-field", "empty", "too-many", "a-list"])
def test_a_body_that_breaks_the_schema_is_refused_whole(client: TestClient, body: Any,
                                                       says: str) -> None:
    answer = client.post("/v1/demand", json=body)
    assert answer.status_code == 422
    assert says in answer.json()["detail"]
    assert client.get("/v1/demand").json()["total"] == 0


def test_not_json_is_refused(client: TestClient) -> None:
    answer = client.post("/v1/demand", content=b"\xff{not json",
                         headers={"Content-Type": "application/json"})
    assert answer.status_code == 422 and "JSON" in answer.json()["detail"]


def test_the_body_is_capped_far_below_uploads(client: TestClient) -> None:
    big = b'{"items": [' + b" " * MAX_BODY_BYTES + b"]}"
    answer = client.post("/v1/demand", content=big, headers={"Content-Type": "application/json"})
    assert answer.status_code == 413
    assert f"limit of {MAX_BODY_BYTES} bytes (set for /v1/demand)" in answer.json()["detail"]

    def chunks() -> Any:  # no Content-Length: counted while read
        yield b'{"items": ['
        for _ in range(MAX_BODY_BYTES // 1024 + 1):
            yield b" " * 1024
    assert client.post("/v1/demand", content=chunks()).status_code == 413
    # Uploads keep their own limit (TUNER_MAX_BODY_BYTES, 8 MiB).
    assert client.post("/v1/results", content=big, headers={
        "Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}).status_code == 422


def limited_app(db_url: str, rate: float) -> FastAPI:
    return create_app(load_settings(database_url=db_url, token=TOKEN, url=None,
                                    demand_rate_limit=rate))


def test_a_client_address_over_its_rate_is_refused_before_its_body_is_read(
        db_url: str) -> None:
    with TestClient(limited_app(db_url, 1.0)) as client:
        assert [post(client, demand_item()).status_code for _ in range(2)] == [202, 202]
        refused = client.post("/v1/demand", content=b"not even JSON")  # read: it would be 422
        assert refused.status_code == 429
        assert refused.headers["Retry-After"] == "1"
        assert "TUNER_DEMAND_RATE_LIMIT" in refused.json()["detail"]
        assert client.get("/v1/demand").status_code == 200  # reads are not limited
        page = client.get("/v1/demand").json()
        assert page["items"][0]["reports"] == 2


def test_a_full_buffer_drops_new_buckets_and_says_so(app: FastAPI, client: TestClient) -> None:
    app.state.demand_buffer.max_buckets = 1
    answer = post(client, demand_item(problem(1000), count=2), demand_item(problem(4096)),
                  demand_item(problem(1000)))
    assert answer.json()["accepted"] == 2 and answer.json()["dropped"] == 1
    assert [r["reports"] for r in client.get("/v1/demand").json()["items"]] == [3]
    assert app.state.demand_buffer.dropped == 1


def claim(db_url: str, worker: str, lease_s: float) -> int:
    row = run_in_transaction(db_url, lambda s: demand.claim_demand(
        s, device_key=H100.key, versions={FWD.name: FWD.version()}, worker=worker,
        lease_s=lease_s, max_attempts=3))
    assert row is not None
    return row.id


def test_the_queue_shows_claims_leases_and_results(client: TestClient, db_url: str) -> None:
    post(client, demand_item(problem(1000), count=9), demand_item(problem(2048), count=5),
         demand_item(problem(4096), count=1))
    client.get("/v1/demand")  # stored
    claim(db_url, "gpu-7:123", lease_s=600)
    gone = claim(db_url, "gpu-8:456", lease_s=600)
    run_in_transaction(db_url, lambda s: s.execute(  # its worker died a while ago
        update(Demand).where(Demand.id == gone)
        .values(lease_until=utcnow() - timedelta(seconds=1))))
    by_status = {s: client.get("/v1/demand", params={"status": s}).json()
                 for s in ("open", "claimed", "expired", "done", "failed")}
    assert [(i["reports"], i["worker"]) for i in by_status["claimed"]["items"]] == [
        (9, "gpu-7:123")]
    assert [(i["reports"], i["worker"]) for i in by_status["expired"]["items"]] == [
        (5, "gpu-8:456")]
    assert [i["reports"] for i in by_status["open"]["items"]] == [1]
    assert by_status["done"]["total"] == by_status["failed"]["total"] == 0
    held = by_status["claimed"]["items"][0]
    assert held["claimed_at"] and held["lease_until"] > held["claimed_at"]
    assert held["attempts"] == 1
    run_in_transaction(db_url, lambda s: demand.finish_demand(
        s, demand_id=1, worker="gpu-7:123", status=DemandStatus.DONE, note="best 412 TFLOP/s"))
    [done] = client.get("/v1/demand", params={"status": "done"}).json()["items"]
    assert done["note"] == "best 412 TFLOP/s" and done["finished_at"] and not done["lease_until"]
    page = client.get("/v1/demand", params={"device": H100.key, "template": FWD.name,
                                            "offset": 1, "limit": 1}).json()
    assert (page["total"], [i["reports"] for i in page["items"]]) == (3, [5])
    assert client.get("/v1/demand", params={"device": "other"}).json()["total"] == 0
    assert client.get("/v1/demand", params={"status": "busy"}).status_code == 422

    html = client.get("/dashboard").text
    assert "Demand" in html and "gpu-7:123" in html and "gpu-8:456" in html
    assert "lease passed" in html and "best 412 TFLOP/s" in html


def test_counts_the_database_could_not_take_are_kept_for_the_next_store(
        tmp_path: Path, db_url: str) -> None:
    bucket = DemandBucket(H100.key, FWD.name, FWD.version(), FWD.problem_key(problem(1000)))
    buffer = DemandBuffer(f"sqlite:///{tmp_path / 'no-such-folder' / 'x.db'}",
                          flush_after_s=3600)

    async def store_twice() -> None:
        buffer.add(bucket, problem(1000).to_dict(), 3)
        await buffer.flush()  # the database cannot be opened: kept
        assert buffer.held == 1
        buffer.add(bucket, problem(1000).to_dict(), 1)
        buffer.database_url = db_url  # it is back
        await buffer.flush()
        assert buffer.held == 0

    asyncio.run(store_twice())
    with session_scope(db_url, write=False) as s:
        [row] = demand.list_demand(s)
        assert (row.problem_key, row.reports) == (bucket.problem_key, 4)
