"""TunerClient against a live uvicorn server on loopback, and its retry behaviour."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from api.main import create_app
from db.session import dispose_engine
from tests.api.serving_data import (
    FWD,
    H100,
    TOKEN,
    ScriptedServer,
    bundle,
    free_port,
    item,
    live_server,
    problem,
)
from tuner.client import TunerClient
from tuner.errors import ServiceError
from tuner.settings import load_settings


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    url = f"sqlite:///{tmp_path_factory.mktemp('svc') / 'service.db'}"
    with live_server(create_app(load_settings(database_url=url, token=TOKEN))) as base:
        yield base
    dispose_engine(url)


def test_round_trip_through_every_endpoint(service: str, tmp_path: Path) -> None:
    p1, p2 = problem(1024), problem(4096)
    with TunerClient(service, token=TOKEN, timeout=5) as client:
        assert client.health().status == "ok"
        assert FWD.name in {t.name for t in client.templates()}
        stored = client.upload(bundle(item(p1), item(p2)))
        assert (stored.items, stored.best_updated) == (2, 2)
        [device] = [d for d in client.devices() if d.key == H100.key]
        assert device.name == H100.name

        answer = client.best("flash_fwd", p1, device=H100)
        assert answer.match == "exact" and answer.config == item(p1)["config"]
        assert answer.speedup == pytest.approx(400 / 300)
        assert client.best("flash_fwd", problem(1000).to_dict(), device=H100.key).match == "bucket"

        page = client.configs(template="flash_fwd", limit=1)
        assert page.total >= 2 and len(page.items) == 1
        rows = list(client.iter_configs(page_size=1, device=H100.key))
        assert {r.problem_key for r in rows} >= {FWD.problem_key(p1), FWD.problem_key(p2)}

        source = client.kernel_source("flash_fwd", p1, device=H100)
        assert "def flash_attention_fwd" in source and "config match: exact" in source

        ranked = client.winners(device=H100)
        assert ranked.device == H100.key
        by_key = {it.problem_key: it for it in ranked.items}
        assert by_key[FWD.problem_key(p1)].tflops == {"flash": 400.0}
        assert by_key[FWD.problem_key(p1)].winner == "sdpa"  # torch_sdpa unmeasured: SDPA runs
        assert client.winners(device=H100.key, dtype="float16").items == []


def test_service_refusals_raise_tuner_error_with_the_reason(service: str) -> None:
    with TunerClient(service, token="", retries=0) as anonymous:
        with pytest.raises(ServiceError, match="known") as err:
            anonymous.best("flash_nope", problem(64), device=H100)
        assert err.value.status == 404
        with pytest.raises(ServiceError) as err:
            anonymous.upload(bundle(item(problem(64))))
        assert err.value.status == 401
    with TunerClient(service, token=TOKEN, retries=0) as client:
        with pytest.raises(ServiceError) as err:
            client.upload(bundle(item(problem(64), template_version="0" * 16)))
        assert err.value.status == 422 and err.value.detail["index"] == 0


def test_unreachable_service_fails_after_bounded_retries() -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    start = time.monotonic()
    with TunerClient(url, retries=2, backoff_s=0.01, timeout=1) as client, \
            pytest.raises(ServiceError, match="after 3 attempt") as err:
        client.devices()
    assert err.value.status is None
    assert time.monotonic() - start < 3


def test_transient_errors_are_retried_then_succeed() -> None:
    busy = {"detail": "busy"}
    # /v1/devices, not /healthz: 503 is also the health check's own "degraded" answer.
    with ScriptedServer([(503, busy, 0), (502, busy, 0), (200, [], 0)]) as server, \
            TunerClient(server.url, retries=3, backoff_s=0.01) as client:
        assert client.devices() == []
        assert len(server.requests) == 3
    with ScriptedServer([(503, busy, 0)]) as server, \
            TunerClient(server.url, retries=1, backoff_s=0.01) as client:
        with pytest.raises(ServiceError, match="503") as err:
            client.devices()
        assert err.value.status == 503 and len(server.requests) == 2


def test_answers_that_are_not_the_promised_shape_are_errors() -> None:
    with ScriptedServer([(200, {"unexpected": True}, 0)]) as server, \
            TunerClient(server.url, retries=0) as client, \
            pytest.raises(ServiceError, match="not a valid"):
        client.best("flash_fwd", problem(64), device=H100)


@pytest.mark.parametrize("url", ["localhost:8000", "ftp://host"])
def test_urls_need_a_scheme(url: str) -> None:
    with pytest.raises(ValueError, match="http"):
        TunerClient(url)


def test_the_write_token_travels_with_uploads_only() -> None:
    """Reads carry no Authorization header, whatever token the client holds (issue 19: every
    lookup of tuner.attention sent the write token); an upload carries it, stripped."""
    import httpx

    seen: list[tuple[str, str | None]] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append((request.url.path, request.headers.get("authorization")))
        if request.url.path == "/v1/results":
            return httpx.Response(201, json={"items": 0, "trials": 0, "best_updated": 0})
        return httpx.Response(200, json=[])

    with TunerClient("http://tuner.test", token=f" {TOKEN}\n", retries=0,
                     transport=httpx.MockTransport(answer)) as client:
        client.devices()
        client.templates()
        client.upload(bundle())
    assert seen == [("/v1/devices", None), ("/v1/templates", None),
                    ("/v1/results", f"Bearer {TOKEN}")]
