"""What a stored best rests on, through the service: how many readings its median is of, and
their spread, on /v1/configs, /v1/best and the dashboard."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from templates.base import Problem
from tests.api.readings_data import SPREAD, seed_bests
from tests.api.serving_data import FWD, H100, problem


def test_configs_and_best_say_how_many_readings_and_their_spread(client: TestClient,
                                                                  db_url: str) -> None:
    seeded = seed_bests(db_url)
    rows = {row["problem_key"]: row for row in client.get("/v1/configs").json()["items"]}
    once = rows[FWD.problem_key(seeded.once)]
    assert once["readings"] == 1 and once["spread"] is None
    again = rows[FWD.problem_key(seeded.again)]
    assert again["readings"] == 3 and again["spread"] == pytest.approx(SPREAD)

    def best(p: Problem) -> dict[str, object]:
        params = {"device": H100.key, "template": FWD.name, **p.to_dict()}
        r = client.get("/v1/best", params=params)
        assert r.status_code == 200, r.text
        return dict(r.json())

    exact = best(seeded.again)
    assert exact["match"] == "exact"
    assert exact["readings"] == 3 and exact["spread"] == pytest.approx(SPREAD)
    alone = best(seeded.once)
    assert alone["readings"] == 1 and alone["spread"] is None
    default = best(problem(1024, head_dim=64))  # nothing tuned of that family
    assert default["match"] == "default"
    assert default["readings"] is None and default["spread"] is None


def test_the_dashboard_shows_the_readings_and_their_spread(client: TestClient,
                                                           db_url: str) -> None:
    seed_bests(db_url)
    html = client.get("/dashboard").text
    table = html[html.index("<h2>Best configs</h2>"):html.index("<h2>Devices</h2>")]
    assert "readings (spread)" in table
    assert f"<td>3 ({SPREAD * 100:.1f}%)</td>" in table and "<td>1</td>" in table

