"""The cap on problems waiting in the demand queue (TUNER_DEMAND_MAX_PENDING), on both
backends: beyond it a report's new problems are refused and said so (507 when nothing else
was in it), problems already queued are still counted, and a worker's claim makes room."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from api import demand_buffer
from db import demand
from db.models import DemandStatus
from db.session import run_in_transaction
from tests.api.serving_data import FWD, H100, TOKEN, problem
from tests.api.test_demand import demand_item, post
from tests.db.conftest import db_url, postgres_server  # noqa: F401  (both backends)
from tuner.settings import Settings, load_settings

CAP = 3


@pytest.fixture
def settings(db_url: str) -> Settings:  # noqa: F811
    return load_settings(database_url=db_url, token=TOKEN, url=None, demand_max_pending=CAP)


def queue(client: TestClient) -> dict[int, tuple[int, str]]:
    """seqlen_q -> (reports, status) of every row (GET /v1/demand stores what is held)."""
    return {r["problem"]["seqlen_q"]: (r["reports"], r["status"])
            for r in client.get("/v1/demand").json()["items"]}


def claim_most_reported(url: str) -> int:
    row = run_in_transaction(url, lambda s: demand.claim_demand(
        s, device_key=H100.key, versions={FWD.name: FWD.version()}, worker="gpu-1:7",
        lease_s=600, max_attempts=3))
    assert row is not None
    return row.id


def full_reason(answer: Any) -> str:
    [rejection] = answer.json()["rejected"]
    return rejection["reason"]


def test_new_problems_beyond_the_cap_are_refused_and_queued_ones_still_counted(
        client: TestClient, db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    monkeypatch.setattr(demand_buffer, "RECOUNT_AFTER_S", 0.0)  # no wait for a fresh count
    first = post(client, *(demand_item(problem(n), count=n // 512) for n in (512, 1024, 2048)))
    assert first.json()["accepted"] == 3
    assert queue(client) == {512: (1, "open"), 1024: (2, "open"), 2048: (4, "open")}

    # Full: the new problem is refused with the cap named; the queued one is counted.
    mixed = post(client, demand_item(problem(4096)), demand_item(problem(512), count=5))
    assert mixed.status_code == 202, mixed.text
    assert (mixed.json()["accepted"], mixed.json()["reports"]) == (1, 5)
    assert mixed.json()["rejected"][0]["index"] == 0
    assert "demand queue is full: 3 problems" in full_reason(mixed)
    assert "TUNER_DEMAND_MAX_PENDING" in full_reason(mixed)
    only_new = post(client, demand_item(problem(4096)), demand_item(problem(8192)))
    assert only_new.status_code == 507
    assert "demand queue is full: 3 problems" in only_new.json()["detail"]
    assert queue(client) == {512: (6, "open"), 1024: (2, "open"), 2048: (4, "open")}

    # A worker claims one: room for one new problem; the claimed one is still counted.
    claimed = claim_most_reported(db_url)
    again = post(client, demand_item(problem(8192), count=2), demand_item(problem(4096)),
                 demand_item(problem(512)))
    assert (again.status_code, again.json()["accepted"]) == (202, 2)
    assert again.json()["rejected"][0]["index"] == 1  # first come first: 8192 took the room
    assert queue(client) == {512: (7, "claimed"), 1024: (2, "open"), 2048: (4, "open"),
                             8192: (2, "open")}
    # Done, it stays a row: reported again it is counted, never refused.
    run_in_transaction(db_url, lambda s: demand.finish_demand(
        s, demand_id=claimed, worker="gpu-1:7", status=DemandStatus.DONE, note="best 1"))
    assert post(client, demand_item(problem(512))).json()["accepted"] == 1
    assert queue(client)[512] == (8, "done")


def test_a_fresh_service_learns_what_is_queued_from_the_database(
        client: TestClient, settings: Settings, db_url: str) -> None:  # noqa: F811
    post(client, *(demand_item(problem(n)) for n in (512, 1024, 2048)))
    assert len(queue(client)) == CAP
    from api.main import create_app

    # Another service process (or a restart): it knows nothing of the rows but finds them.
    with TestClient(create_app(settings)) as other:
        assert post(other, demand_item(problem(4096))).status_code == 507
        known = post(other, demand_item(problem(1024), count=3))
        assert (known.status_code, known.json()["accepted"]) == (202, 1)
        assert queue(other)[1024] == (4, "open")


def test_a_cap_of_zero_or_less_is_refused_naming_the_setting() -> None:
    from tuner.settings import SettingsError

    with pytest.raises(SettingsError, match="TUNER_DEMAND_MAX_PENDING"):
        load_settings(demand_max_pending=0)
