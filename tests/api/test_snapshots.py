"""POST/GET /v1/snapshots, the client's calls, and a job pinned through the service: it loads
the snapshot once and never asks again (issue 18, item 4)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from api.main import create_app
from tests.api.serving_data import (
    FWD,
    TOKEN,
    interpreter,
    item,
    live_server,
    problem,
    store,
    tuned_config,
)
from tuner.client import TunerClient
from tuner.errors import ServiceError
from tuner.lookup.resolver import ConfigResolver
from tuner.lookup.snapshot import snapshot_id_of
from tuner.settings import load_settings


def test_creating_needs_the_token_and_the_same_content_gives_the_same_id(
        client: TestClient, auth: dict[str, str], db_url: str) -> None:
    store(db_url, item(problem(1024)), item(problem(2048)))
    assert client.post("/v1/snapshots").status_code == 401
    bad = client.post("/v1/snapshots", headers={"Authorization": "Bearer not-the-token-123"})
    assert bad.status_code == 403
    first = client.post("/v1/snapshots", headers=auth)
    assert first.status_code == 201, first.text
    body = first.json()
    assert body["created"] is True and body["items"] == 2 and len(body["id"]) == 64
    again = client.post("/v1/snapshots", headers=auth)
    assert again.status_code == 200 and again.json()["id"] == body["id"]
    assert again.json()["created"] is False

    whole = client.get(f"/v1/snapshots/{body['id']}")
    assert whole.status_code == 200
    assert snapshot_id_of(whole.json()["bundle"]) == body["id"]  # what it holds, checkable
    assert len(whole.json()["bundle"]["items"]) == 2
    listed = client.get("/v1/snapshots").json()
    assert [s["id"] for s in listed["items"]] == [body["id"]] and listed["total"] == 1


def test_filters_and_bad_requests_are_answered_with_what_was_wrong(
        client: TestClient, auth: dict[str, str], db_url: str) -> None:
    store(db_url, item(problem(1024)), item(problem(1024), device=interpreter()))
    part = client.post("/v1/snapshots", params={"device": interpreter().key}, headers=auth)
    assert part.status_code == 201 and part.json()["items"] == 1
    nothing = client.post("/v1/snapshots", params={"template": "nope"}, headers=auth)
    assert nothing.status_code == 422
    assert "no stored best config matches {'template': 'nope'}" in nothing.json()["detail"]
    unknown_param = client.post("/v1/snapshots", params={"templat": "flash_fwd"},
                                headers=auth)
    assert unknown_param.status_code == 422
    not_an_id = client.get("/v1/snapshots/abc")
    assert not_an_id.status_code == 422 and "^[0-9a-f]{64}$" in not_an_id.text
    unknown = client.get(f"/v1/snapshots/{'e' * 64}")
    assert unknown.status_code == 404 and f"no snapshot {'e' * 64}" in unknown.text


def tiny(seqlen: int) -> Any:
    return problem(seqlen, batch=1, heads=2, head_dim=16, dtype="float16")


def test_a_job_pinned_through_the_service_asks_once_and_never_again(
        db_url: str, tmp_path: Path) -> None:
    dev = interpreter()
    config = tuned_config(tiny(64), dev)
    store(db_url, item(tiny(64), device=dev, config=config))
    settings = load_settings(database_url=db_url, token=TOKEN, url=None)
    with live_server(create_app(settings)) as url:
        with TunerClient(url, token=TOKEN) as client:
            frozen = client.create_snapshot(template=FWD.name)
            assert client.snapshot(frozen.id).id == frozen.id
            assert [s.id for s in client.snapshots().items] == [frozen.id]
            with pytest.raises(ServiceError) as info:
                client.snapshot("f" * 64)
            assert info.value.status == 404
        resolver = ConfigResolver(load_settings(
            database_url=f"sqlite:///{tmp_path / 'none.db'}", url=url, token=None,
            snapshot=frozen.id))
        got = resolver.resolve(FWD, tiny(64), dev)
        assert (got.source, got.match, got.config.to_dict()) == ("snapshot", "exact", config)
    # The service is gone: the job answers on, from what it loaded.
    assert resolver.resolve(FWD, tiny(50), dev).config.to_dict() == config
    assert resolver.resolve(FWD, tiny(1024), dev).match == "nearest"
    assert not resolver.service_down  # never asked


def test_deleting_needs_the_token_and_an_unknown_id_is_a_404(
        client: TestClient, auth: dict[str, str], db_url: str) -> None:
    store(db_url, item(problem(1024)))
    sid = client.post("/v1/snapshots", headers=auth).json()["id"]
    assert client.delete(f"/v1/snapshots/{sid}").status_code == 401
    wrong = client.delete(f"/v1/snapshots/{sid}",
                          headers={"Authorization": "Bearer not-the-token-123"})
    assert wrong.status_code == 403
    assert client.get(f"/v1/snapshots/{sid}").status_code == 200  # refused: still there

    gone = client.delete(f"/v1/snapshots/{sid}", headers=auth)
    assert gone.status_code == 200, gone.text
    assert (gone.json()["id"], gone.json()["items"]) == (sid, 1)
    assert gone.json()["created_at"].endswith("Z")
    assert client.get(f"/v1/snapshots/{sid}").status_code == 404
    assert client.get("/v1/snapshots").json()["total"] == 0
    again = client.delete(f"/v1/snapshots/{sid}", headers=auth)
    assert again.status_code == 404 and f"no snapshot {sid} on this service" in again.text
    not_an_id = client.delete("/v1/snapshots/HEAD", headers=auth)
    assert not_an_id.status_code == 422 and "^[0-9a-f]{64}$" in not_an_id.text


def test_the_dashboard_lists_snapshots_with_their_date_and_size(
        client: TestClient, auth: dict[str, str], db_url: str) -> None:
    assert "No snapshots yet" in client.get("/dashboard").text
    store(db_url, item(problem(1024)), item(problem(2048)), item(problem(4096)))
    created = client.post("/v1/snapshots", headers=auth).json()
    html = client.get("/dashboard").text
    section = html[html.index("<h2>Snapshots"):]
    section = section[:section.index("<h2>", 4)]
    day = created["created_at"][:10]
    assert f"<td>{created['id']}</td><td>{day} " in section and "<td>3</td>" in section
    assert "No snapshots yet" not in html


def test_the_client_deletes_through_the_service(db_url: str) -> None:
    store(db_url, item(problem(1024)))
    settings = load_settings(database_url=db_url, token=TOKEN, url=None)
    with live_server(create_app(settings)) as url, TunerClient(url, token=TOKEN) as client:
        frozen = client.create_snapshot()
        deleted = client.delete_snapshot(frozen.id)
        assert (deleted.id, deleted.items) == (frozen.id, 1)
        with pytest.raises(ServiceError) as info:
            client.delete_snapshot(frozen.id)
        assert info.value.status == 404 and "no snapshot" in str(info.value)
        with TunerClient(url, token="") as reader, pytest.raises(ServiceError) as info:
            reader.delete_snapshot(frozen.id)
        assert info.value.status == 401
