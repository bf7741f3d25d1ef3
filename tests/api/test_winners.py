"""GET /v1/winners: per stored problem of a device, the implementation tuner.attention runs,
the runner-up, the margin and each implementation's stored best, through the TestClient."""

from __future__ import annotations

import dataclasses
from typing import Any

from fastapi.testclient import TestClient
from sqlalchemy import update

from api.dashboard_html import winners_table
from db.models import Template
from db.session import session_scope
from templates.base import Problem
from templates.device import DeviceInfo
from templates.registry import get_template
from tests.api.serving_data import H100, item, problem
from tests.api.test_api import assert_json_error, upload
from tuner.wire import ProblemWinner, WinnersOut


def measured(template: str, p: Problem, tflops: float, config: dict[str, Any],
             device: DeviceInfo = H100) -> dict[str, Any]:
    """A bundle item: ``template``'s best for ``p`` on ``device`` at ``tflops``."""
    t = get_template(template)
    return item(p, device=device, template=t.name, template_version=t.version(),
                config=config, tflops=tflops, median_ms=t.flops(p) / (tflops * 1e9),
                default_tflops=None)


def winners(client: TestClient, **params: Any) -> Any:
    r = client.get("/v1/winners", params=params)
    assert r.status_code == 200, r.text
    return r.json()


def test_winner_runner_up_margin_and_each_implementation(client: TestClient,
                                                          auth: dict[str, str]) -> None:
    shared, ours_only = problem(4096), problem(1024)
    flash = get_template("flash_fwd").default_config(shared, H100).to_dict()
    assert upload(client, auth,
                  measured("torch_sdpa", shared, 600.0, {"backend": "cudnn"}),
                  measured("flash_fwd", shared, 480.0, flash),
                  measured("flash_fwd", ours_only, 500.0, flash)).status_code == 201
    answer = winners(client, device=H100.key)
    assert (answer["device"], answer["device_name"], answer["stale"]) == (H100.key, H100.name, 0)
    by_seqlen = {it["problem"]["seqlen_q"]: it for it in answer["items"]}
    won = by_seqlen[4096]
    assert (won["winner"], won["runner_up"], won["margin"]) == ("sdpa", "flash", 1.25)
    assert won["tflops"] == {"sdpa": 600.0, "flash": 480.0}
    assert won["configs"]["sdpa"] == {"backend": "cudnn"}
    assert won["median_ms"]["flash"] > won["median_ms"]["sdpa"]
    # Ours alone: torch SDPA runs by rule (nothing says ours beats it), no margin.
    alone = by_seqlen[1024]
    assert (alone["winner"], alone["runner_up"], alone["margin"]) == ("sdpa", "flash", None)
    assert "torch_sdpa not measured" in alone["why"]
    # By name, and only one dtype.
    assert winners(client, device=H100.name)["items"] == answer["items"]
    assert winners(client, device=H100.key, dtype="float16")["items"] == []


def test_bests_of_other_kernel_versions_are_counted_not_ranked(client: TestClient,
                                                              auth: dict[str, str]) -> None:
    p = problem(2048)
    old = measured("flash_fwd", p, 900.0, get_template("flash_fwd").default_config(p, H100)
                   .to_dict())
    # The service refuses uploads for other kernel versions; a database filled by an older
    # install holds them. Rewrite the stored version as such an install would have left it.
    assert upload(client, auth, old, measured("torch_sdpa", p, 600.0,
                                              {"backend": "cudnn"})).status_code == 201
    with session_scope(client.app.state.settings.database_url) as s:  # type: ignore[attr-defined]
        s.execute(update(Template).where(Template.name == "flash_fwd").values(version="old"))
    answer = winners(client, device=H100.key)
    assert answer["stale"] == 1
    [only] = answer["items"]
    assert only["tflops"] == {"sdpa": 600.0} and only["runner_up"] is None


def test_unknown_and_ambiguous_devices_and_bad_parameters(client: TestClient,
                                                         auth: dict[str, str]) -> None:
    p = problem(1024)
    other_torch = dataclasses.replace(H100, torch_version="2.12.0")
    cfg = {"backend": "cudnn"}
    assert upload(client, auth, measured("torch_sdpa", p, 600.0, cfg),
                  measured("torch_sdpa", p, 610.0, cfg, other_torch)).status_code == 201
    assert "/v1/devices" in assert_json_error(
        client.get("/v1/winners", params={"device": "TPU v9"}), 404)
    detail = assert_json_error(client.get("/v1/winners", params={"device": H100.name}), 422)
    assert set(detail["candidates"]) == {H100.key, other_torch.key}
    assert winners(client, device=other_torch.key)["items"][0]["tflops"] == {"sdpa": 610.0}
    assert "dtype" in str(assert_json_error(
        client.get("/v1/winners", params={"device": H100.key, "dtype": "int8"}), 422))
    assert "device" in str(assert_json_error(client.get("/v1/winners"), 422))
    assert "/v1/winners" in client.get("/openapi.json").json()["paths"]


def test_the_dashboard_shows_the_winner_runner_up_and_each_implementation(
        client: TestClient, auth: dict[str, str]) -> None:
    empty = client.get("/dashboard").text
    assert "Which implementation runs each problem" in empty and "put torch_sdpa" in empty
    shared, other = problem(4096), problem(8192)
    flash = get_template("flash_fwd").default_config(shared, H100).to_dict()
    assert upload(client, auth,
                  measured("torch_sdpa", shared, 600.0, {"backend": "cudnn"}),
                  measured("flash_fwd", shared, 480.0, flash),
                  measured("torch_sdpa", other, 300.0, {"backend": "flash"}),
                  measured("flash_fwd", other, 450.0, flash)).status_code == 201
    html = client.get("/dashboard").text
    section = html.split("Which implementation runs each problem")[1].split("<h2>")[0]
    shared_row = next(r for r in section.split("<tr>") if shared.bucket_key() in r)
    assert "<td>sdpa</td>" in shared_row and "1.25x flash" in shared_row
    assert "<td>600.0</td>" in shared_row and "<td>480.0</td>" in shared_row
    other_row = next(r for r in section.split("<tr>") if other.bucket_key() in r)
    assert "<td>flash</td>" in other_row and "1.50x sdpa" in other_row
    # At most the limit of rows, saying where the rest are.
    found = client.get("/v1/winners", params={"device": H100.key}).json()
    cut = winners_table([WinnersOut.model_validate(found)], limit=1)
    assert cut.count("<tr>") == 2 and "Showing 1 of 2 problems" in cut  # header + one row


def test_each_sdpa_backends_time_is_answered_beside_the_winner(client: TestClient,
                                                              auth: dict[str, str]) -> None:
    p = problem(4096)
    flash = get_template("flash_fwd").default_config(p, H100).to_dict()
    assert upload(client, auth,
                  measured("torch_sdpa", p, 600.0, {"backend": "cudnn"}),
                  measured("torch_sdpa", p, 500.0, {"backend": "flash"}),
                  measured("torch_sdpa", p, 300.0, {"backend": "efficient"}),
                  measured("flash_fwd", p, 480.0, flash)).status_code == 201
    [won] = winners(client, device=H100.key)["items"]
    assert (won["winner"], won["runner_up"]) == ("sdpa", "flash")
    backends = won["sdpa_backends"]
    assert list(backends) == ["cudnn", "flash", "efficient"]  # fastest first
    assert {name: t["tflops"] for name, t in backends.items()} == {
        "cudnn": 600.0, "flash": 500.0, "efficient": 300.0}
    assert backends["cudnn"]["median_ms"] == won["median_ms"]["sdpa"]
    assert all(t["readings"] == 1 for t in backends.values())
    # Old clients parse it (the field is additive); an older service's answer parses too.
    parsed = WinnersOut.model_validate(winners(client, device=H100.key))
    assert parsed.items[0].sdpa_backends["flash"].tflops == 500.0
    old = {k: v for k, v in won.items() if k != "sdpa_backends"}
    assert ProblemWinner.model_validate(old).sdpa_backends == {}
    schema = client.get("/openapi.json").json()["components"]["schemas"]["ProblemWinner"]
    assert "sdpa_backends" in schema["properties"]
    assert "sdpa_backends" not in schema.get("required", [])
    # And the dashboard's winners table shows them.
    html = client.get("/dashboard").text
    section = html.split("Which implementation runs each problem")[1].split("<h2>")[0]
    assert "SDPA backends" in section
    row = next(r for r in section.split("<tr>") if p.bucket_key() in r)
    assert "<td>cudnn 0.916 ms, flash 1.1 ms, efficient 1.83 ms</td>" in row
