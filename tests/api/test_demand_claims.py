"""The workers' side of the demand queue through the service (POST /v1/demand/claim, and
/v1/demand/{id}/lease, /finish, /release), on both backends: the token is needed, a claim
takes the most reported row of the device and versions named, a retried claim gets the same
row, a lapsed lease is taken over, and a worker that lost its claim is told so (409)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from fastapi.testclient import TestClient
from sqlalchemy import update

from db.models import Demand, utcnow
from db.session import run_in_transaction
from tests.api.serving_data import FWD, H100, problem
from tests.api.test_demand import demand_item, post
from tests.db.conftest import db_url, postgres_server  # noqa: F401  (both backends)

VERSIONS = {FWD.name: FWD.version()}


def ask(worker: str = "gpu-7:12", **overrides: Any) -> dict[str, Any]:
    return {"device": H100.key, "templates": VERSIONS, "worker": worker, "lease_s": 60,
            "max_attempts": 3, **overrides}


def claim(client: TestClient, auth: dict[str, str], **overrides: Any) -> dict[str, Any] | None:
    answer = client.post("/v1/demand/claim", json=ask(**overrides), headers=auth)
    assert answer.status_code == 200, answer.text
    return answer.json()["claim"]  # type: ignore[no-any-return]


def queued(client: TestClient) -> None:
    post(client, demand_item(problem(1000), count=9), demand_item(problem(2048), count=5))
    client.get("/v1/demand")  # stored now


def test_claims_need_the_token_and_take_the_most_reported_row_once(
        client: TestClient, auth: dict[str, str]) -> None:
    queued(client)
    assert client.post("/v1/demand/claim", json=ask()).status_code == 401
    wrong = client.post("/v1/demand/claim", json=ask(),
                        headers={"Authorization": "Bearer not-the-token-123"})
    assert wrong.status_code == 403

    first = claim(client, auth)
    assert first is not None
    assert (first["reports"], first["status"], first["worker"], first["attempts"]) == (
        9, "claimed", "gpu-7:12", 1)
    assert first["problem"] == problem(1000).to_dict() and first["lease_until"]
    # The same worker asking again (its answer lost, the request retried): the same row.
    again = claim(client, auth)
    assert again is not None and (again["id"], again["attempts"]) == (first["id"], 1)
    second = claim(client, auth, worker="gpu-8:3")
    assert second is not None and second["reports"] == 5
    assert claim(client, auth, worker="gpu-9:1") is None  # nothing left
    # Another device, or a version this service does not hold: nothing to claim.
    assert claim(client, auth, worker="x:1", device=H100.key.replace("H100", "B200")) is None
    assert claim(client, auth, worker="x:2", templates={FWD.name: "0" * 16}) is None


def test_the_holder_renews_finishes_or_gives_back_and_others_are_told_whose_it_is(
        client: TestClient, auth: dict[str, str], db_url: str) -> None:  # noqa: F811
    queued(client)
    row = claim(client, auth)
    assert row is not None
    rid = row["id"]

    def act(action: str, **body: Any) -> Any:
        return client.post(f"/v1/demand/{rid}/{action}", json=body, headers=auth)

    renewed = act("lease", worker="gpu-7:12", lease_s=600)
    assert renewed.status_code == 200 and renewed.json()["lease_until"] > row["lease_until"]
    stranger = act("finish", worker="gpu-8:3", status="done", note="")
    assert stranger.status_code == 409
    assert "'gpu-8:3' does not hold a claim" in stranger.json()["detail"]
    assert "held by 'gpu-7:12'" in stranger.json()["detail"]
    released = act("release", worker="gpu-7:12", note="stopped")
    assert released.status_code == 200
    assert (released.json()["status"], released.json()["attempts"]) == ("open", 0)

    row = claim(client, auth, worker="gpu-8:3")
    assert row is not None and row["id"] == rid
    # Its worker died: the lease passes, and the next claim takes the row over.
    run_in_transaction(db_url, lambda s: s.execute(update(Demand).where(Demand.id == rid)
                                                   .values(lease_until=utcnow() -
                                                           timedelta(seconds=1))))
    taken = claim(client, auth, worker="gpu-9:1")
    assert taken is not None and (taken["id"], taken["attempts"]) == (rid, 2)
    late = client.post(f"/v1/demand/{rid}/lease", json={"worker": "gpu-8:3", "lease_s": 60},
                       headers=auth)
    assert late.status_code == 409 and "held by 'gpu-9:1'" in late.json()["detail"]
    done = act("finish", worker="gpu-9:1", status="done", note="best 400 TFLOP/s")
    assert done.status_code == 200
    assert (done.json()["status"], done.json()["note"]) == ("done", "best 400 TFLOP/s")
    [listed] = client.get("/v1/demand", params={"status": "done"}).json()["items"]
    assert listed["id"] == rid and listed["worker"] == "gpu-9:1"


BAD_REQUESTS = [
    ("/v1/demand/claim", ask(device="not a key"), 422, "device"),
    ("/v1/demand/claim", ask(templates={}), 422, "templates"),
    ("/v1/demand/claim", ask(lease_s=1), 422, "lease_s"),
    ("/v1/demand/claim", ask(max_attempts=0), 422, "max_attempts"),
    ("/v1/demand/claim", {**ask(), "extra": 1}, 422, "extra"),
    ("/v1/demand/claim", ask(templates={"x" * 101: "v"}), 422, "at most 100 characters"),
    ("/v1/demand/claim", ask(templates={"flash_fwd": ""}), 422, "at least 1 character"),
    ("/v1/demand/1/finish", {"worker": "w", "status": "open"}, 422, "status"),
    ("/v1/demand/0/lease", {"worker": "w"}, 422, "demand_id"),
    ("/v1/demand/2147483648/release", {"worker": "w"}, 422, "demand_id"),
    ("/v1/demand/99/release", {"worker": "w"}, 404, "no demand row 99"),
]


def test_bad_requests_say_what_was_wrong(client: TestClient, auth: dict[str, str]) -> None:
    for path, body, status, says in BAD_REQUESTS:
        answer = client.post(path, json=body, headers=auth)
        assert answer.status_code == status, (path, body, answer.text)
        assert says in answer.text, (path, body, answer.text)
