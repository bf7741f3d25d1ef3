"""The service through FastAPI's TestClient on a temporary SQLite database."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from httpx import Response

from api.answers import BestCache
from api.main import create_app
from db.session import session_scope
from tests.api.serving_data import FWD, H100, TOKEN, bundle, item, problem
from tuner.lookup.bundle import MAX_TFLOPS, store_bundle, validate_bundle
from tuner.lookup.resolver import device_info_from_key
from tuner.settings import load_settings


def upload(client: TestClient, auth: dict[str, str], *items: dict[str, Any]) -> Response:
    return client.post("/v1/results", json=bundle(*items), headers=auth)


def best(client: TestClient, p: Any, device: str = H100.key, **extra: Any) -> Response:
    return client.get("/v1/best", params={"device": device, "template": "flash_fwd",
                                          **p.to_dict(), **extra})


def assert_json_error(r: Response, code: int) -> Any:
    assert r.status_code == code, r.text
    assert r.headers["content-type"].startswith("application/json")
    return r.json()["detail"]


# ----------------------------------------------------------------------------- read endpoints
def test_health_templates_and_openapi(client: TestClient) -> None:
    assert client.get("/healthz").json() == {"status": "ok", "database": "ok",
                                             "templates": len(client.get("/v1/templates").json())}
    templates = {t["name"]: t for t in client.get("/v1/templates").json()}
    fwd = templates["flash_fwd"]
    assert fwd["version"] == FWD.version()
    assert fwd["config_schema"]["properties"]["BLOCK_M"]["enum"] == [16, 32, 64, 128, 256]
    assert fwd["grid_size"] == FWD.config_cls.grid_size()
    paths = client.get("/openapi.json").json()["paths"]
    assert {"/v1/best", "/v1/configs", "/v1/results", "/v1/devices", "/v1/templates",
            "/v1/kernels/{template}/source", "/healthz"} <= set(paths)
    assert "swagger" in client.get("/docs").text.lower()


def test_create_app_reads_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    # `tuner serve` runs uvicorn with factory=True: create_app() takes no arguments.
    db = tmp_path / "from-env.db"
    monkeypatch.setenv("TUNER_DATABASE_URL", f"sqlite:///{db}")
    monkeypatch.setenv("TUNER_TOKEN", TOKEN)
    with TestClient(create_app()) as c:
        assert c.get("/healthz").json()["database"] == "ok"
        r = c.post("/v1/results", json=bundle(item(problem(1024))),
                   headers={"Authorization": f"Bearer {TOKEN}"})
        assert r.status_code == 201
    assert db.is_file()


def test_upload_then_list_and_page(client: TestClient, auth: dict[str, str]) -> None:
    p1, p2, p3 = problem(1024), problem(4096), problem(1024, causal="top_left")
    r = upload(client, auth, item(p1), item(p2, tflops=500.0), item(p3, default_tflops=None))
    assert r.status_code == 201, r.text
    # 3 tuned configs + 2 default-config measurements (p3 came without a default)
    assert r.json() == {"items": 3, "trials": 5, "best_updated": 3, "remeasurements": 0}
    [device] = client.get("/v1/devices").json()
    assert device["key"] == H100.key and device["sm_count"] == 132
    templates = {t["name"]: t for t in client.get("/v1/templates").json()}
    assert templates["flash_fwd"]["versions_in_database"] == [FWD.version()]

    page = client.get("/v1/configs").json()
    assert page["total"] == 3 and len(page["items"]) == 3
    assert client.get("/v1/configs", params={"variant": "causal-top_left"}).json()["total"] == 1
    assert client.get("/v1/configs", params={"dtype": "float16"}).json()["total"] == 0
    assert client.get("/v1/configs", params={"device": H100.name}).json()["total"] == 3
    assert client.get("/v1/configs", params={"template": "nope"}).json()["total"] == 0
    tail = client.get("/v1/configs", params={"limit": 2, "offset": 2}).json()
    assert (tail["total"], len(tail["items"]), tail["offset"]) == (3, 1, 2)
    keys = [row["problem_key"] for row in page["items"]]
    assert tail["items"][0]["problem_key"] == keys[2]

    # The same bundle again stores nothing new; a faster config replaces the best.
    again = upload(client, auth, item(p1), item(p2, tflops=500.0), item(p3, default_tflops=None))
    assert again.json() == {"items": 3, "trials": 0, "best_updated": 0, "remeasurements": 0}
    known = {item(p1)["config"]["num_stages"], FWD.default_config(p1, H100).to_dict()["num_stages"]}
    third = next(cfg for n in (1, 2, 3, 4) if n not in known
                 for cfg in [{**item(p1)["config"], "num_stages": n}]
                 if FWD.constraint(p1, FWD.config(cfg), H100) is None)
    faster = item(p1, tflops=450.0, default_tflops=None, config=third)
    r = upload(client, auth, faster)
    assert r.json()["best_updated"] == 1
    row = best(client, p1).json()
    assert row["tflops"] == 450.0 and row["config"] == faster["config"]


def test_best_matches_exact_bucket_nearest_default(client: TestClient,
                                                   auth: dict[str, str]) -> None:
    p1, p4 = problem(1024), problem(4096)
    i1, i4 = item(p1, tflops=400.0), item(p4, tflops=500.0)
    assert upload(client, auth, i1, i4).status_code == 201

    exact = best(client, p1).json()
    assert exact["match"] == "exact" and exact["config"] == i1["config"]
    assert exact["tflops"] == 400.0 and exact["default_tflops"] == 300.0
    assert exact["speedup"] == pytest.approx(400 / 300)
    assert exact["provenance"]["sweep_name"] == "test-sweep"
    assert exact["provenance"]["triton_version"] == "3.6.0"
    assert exact["provenance"]["measured_at"].endswith("Z")  # RFC 3339: UTC, with its offset
    assert exact["template_version"] == FWD.version()
    assert exact["problem_key"] == FWD.problem_key(p1)

    same_bucket = problem(1000)  # rounds up to the 1024 bucket
    b = best(client, same_bucket).json()
    assert b["match"] == "bucket" and b["config"] == i1["config"]
    assert b["matched_problem"] == p1.to_dict() and b["problem"] == same_bucket.to_dict()

    n = best(client, problem(1536)).json()  # bucket 2048: nothing stored; 1024 is closest
    assert n["match"] == "nearest" and n["config"] == i1["config"]
    n = best(client, problem(8192)).json()
    assert n["match"] == "nearest" and n["config"] == i4["config"]

    other_dim = problem(1024, head_dim=64)  # no tuned problem of this family
    d = best(client, other_dim).json()
    assert d["match"] == "default" and d["tflops"] is None and d["provenance"] is None
    assert d["config"] == FWD.default_config(other_dim, H100).to_dict()

    unknown = best(client, p1, device="Some Future GPU").json()
    assert unknown["match"] == "default"
    assert unknown["config"] == FWD.default_config(p1, device_info_from_key("Some Future GPU")
                                                   ).to_dict()
    old_kernel = best(client, p1, template_version="0123456789abcdef").json()
    assert old_kernel["match"] == "default" and old_kernel["template_version"] == FWD.version()


def test_writes_by_other_processes_show_up_at_the_next_lookup(app: Any, client: TestClient,
                                                              auth: dict[str, str],
                                                              db_url: str) -> None:
    now = [0.0]
    app.state.best_cache = BestCache(db_url, ttl_s=5.0, clock=lambda: now[0])
    p = problem(1024)
    first = item(p)
    assert upload(client, auth, first).status_code == 201
    assert best(client, p).json()["config"] == first["config"]
    # A sweep on this host writes a faster config straight into the database.
    faster = item(p, tflops=999.0, default_tflops=None,
                  config={**first["config"], "pipeline_masked_loop":
                          not first["config"]["pipeline_masked_loop"]})
    with session_scope(db_url) as s:
        store_bundle(s, validate_bundle(bundle(faster)))
    # Noticed at once (issue 18): no ttl to wait out, the clock has not moved.
    assert best(client, p).json()["config"] == faster["config"]


# ----------------------------------------------------------------------------- writes and auth
def test_refused_writes_past_an_addresss_rate_are_held_back(
        db_url: str, auth: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    import api.deps

    holds: list[float] = []

    async def record(seconds: float) -> None:
        holds.append(seconds)
    monkeypatch.setattr(api.deps, "_hold", record)
    app = create_app(load_settings(database_url=db_url, token=TOKEN, refused_write_rate=0.25))
    body = bundle(item(problem(1024)))
    wrong = {"Authorization": "Bearer " + "x" * 20}
    with TestClient(app) as c:
        # A burst of 1 (twice the rate, at least 1) answered at once; then each one held until
        # a token would come (4 s at 0.25/s), at most MAX_REFUSAL_DELAY_S; the same refusal.
        codes = [c.post("/v1/results", json=body, headers=h).status_code
                 for h in ({}, wrong, {})]
        assert codes == [401, 403, 401]
        assert holds == [api.deps.MAX_REFUSAL_DELAY_S] * 2
        # A valid token is never held back, whatever the address's refusals.
        assert c.post("/v1/results", json=body, headers=auth).status_code == 201
        assert len(holds) == 2
        # Past MAX_HELD_REFUSALS held at once, refusals are answered at once.
        app.state.held_refusals = api.deps.MAX_HELD_REFUSALS
        assert c.post("/v1/results", json=body, headers=wrong).status_code == 403
        assert len(holds) == 2


def test_writes_need_the_bearer_token(client: TestClient, db_url: str) -> None:
    body = bundle(item(problem(1024)))
    r = client.post("/v1/results", json=body)
    assert "Bearer" in assert_json_error(r, 401) and r.headers["www-authenticate"] == "Bearer"
    assert assert_json_error(client.post("/v1/results", json=body,
                                         headers={"Authorization": f"Basic {TOKEN}"}), 401)
    wrong = client.post("/v1/results", json=body, headers={"Authorization": "Bearer " + "x" * 20})
    assert "not valid" in assert_json_error(wrong, 403)
    assert client.get("/v1/configs").json()["total"] == 0

    no_token = create_app(load_settings(database_url=db_url, token=None))
    with TestClient(no_token) as c:
        r = c.post("/v1/results", json=body, headers={"Authorization": "Bearer None"})
        assert assert_json_error(r, 503) == ("writes are disabled on this service: "
                                             "TUNER_TOKEN is not set")


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], dict[str, Any]]:
    def mutate(it: dict[str, Any]) -> dict[str, Any]:
        out = copy.deepcopy(it)
        *parents, last = path.split(".")
        node = out
        for p in parents:
            node = node[p]
        node[last] = value
        return out
    return mutate


def _too_big_for_h100(it: dict[str, Any]) -> dict[str, Any]:
    p = problem(2048)
    for cfg in FWD.config_cls.grid():
        why = FWD.constraint(p, cfg, H100)
        if why and "shared memory" in why:
            return {**it, "config": cfg.to_dict()}
    raise AssertionError("every config fits: the test needs one that does not")


@pytest.mark.parametrize(("mutate", "needle"), [
    (_set("config.BLOCK_M", 48), "BLOCK_M must be one of"),
    (_set("config.evil", "__import__('os').system('true')"), "no field"),
    (_set("template", "flash_nope"), "unknown template"),
    (_set("template_version", "0123456789abcdef"), "re-tune"),
    (_too_big_for_h100, "shared memory"),
    (_set("problem.heads_kv", 5), "multiple of heads_kv"),
    (_set("problem.mask", "sliding:wide"), "cannot run it"),
    (_set("tflops", -1.0), "tflops: Input should be greater than 0"),
    (_set("median_ms", float("inf")), "median_ms: Input should be a finite number"),
    # Strict numbers (issue 19): no booleans, strings, non-finite or absurd values.
    (_set("tflops", True), "tflops: Input should be a valid number"),
    (_set("tflops", "400"), "tflops: Input should be a valid number"),
    (_set("tflops", 1e308), "tflops: Input should be less than or equal to 1000000"),
    (_set("error", float("inf")), "error: Input should be a finite number"),
    (_set("error", float("nan")), "error: Input should be a finite number"),
    (_set("default_tflops", float("nan")), "default_tflops: Input should be a finite number"),
    (_set("device.sm_count", "132"), "device.sm_count: Input should be a valid integer"),
    (_set("device.sm_count", 132.0), "device.sm_count: Input should be a valid integer"),
    (_set("device.total_memory", True), "device.total_memory: Input should be a valid integer"),
    (_set("problem.batch", True), "positive integer"),
    (_set("problem.batch", "4"), "positive integer"),
    (_set("device.key", "forged"), "does not match"),
    (_set("surprise", 1), "Extra inputs"),
    # Beyond the database's columns or float range: these were 500s (OverflowError, DataError).
    (_set("device.total_memory", 1 << 63), "less than or equal"),
    (_set("device.sm_count", 1 << 31), "less than or equal"),
    (_set("problem.batch", 10**40), "above the limit"),
    (_set("sweep", "a\x00b"), "sweep: String should match pattern"),  # PostgreSQL refuses NUL
])
def test_a_bad_item_rejects_the_whole_upload(
    client: TestClient, auth: dict[str, str],
    mutate: Callable[[dict[str, Any]], dict[str, Any]], needle: str,
) -> None:
    good = [item(problem(1024)), item(problem(4096))]
    r = client.post("/v1/results", headers={**auth, "Content-Type": "application/json"},
                    content=_json(bundle(*good, mutate(item(problem(2048))))))
    detail = assert_json_error(r, 422)
    assert detail["index"] == 2 and needle in detail["reason"], detail
    assert client.get("/v1/configs").json()["total"] == 0
    assert client.get("/v1/devices").json() == []


def _json(data: Any) -> bytes:
    import json

    return json.dumps(data, allow_nan=True).encode()


def test_a_body_that_is_not_json_text_is_400(client: TestClient, auth: dict[str, str]) -> None:
    r = client.post("/v1/results", content=b"\xff\xfe{",
                    headers={**auth, "Content-Type": "application/json"})
    assert assert_json_error(r, 400)


@pytest.mark.parametrize(("body", "needle"), [
    (b'{"format": "attention-tuner/bundle", "version": 1, "items": [', "json"),
    (b'[1, 2]', "dict"),
    (b'{"format": "zip", "version": 1, "items": []}', "format must be"),
    (b'{"format": "attention-tuner/bundle", "version": 3, "items": []}', "version"),
    (b'{"format": "attention-tuner/bundle", "version": 1}', "items"),
])
def test_malformed_bundles_are_422(client: TestClient, auth: dict[str, str], body: bytes,
                                   needle: str) -> None:
    r = client.post("/v1/results", content=body,
                    headers={**auth, "Content-Type": "application/json"})
    assert needle in str(assert_json_error(r, 422)).lower()


# ----------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(("url", "code", "needle"), [
    ("/v1/best?device=d&template=nope&batch=1&heads_q=2&seqlen_q=8&head_dim=16", 404, "known"),
    ("/v1/best?device=d&template=flash_fwd&batch=0&heads_q=2&seqlen_q=8&head_dim=16", 422,
     "batch"),
    ("/v1/best?device=d&template=flash_fwd&batch=x&heads_q=2&seqlen_q=8&head_dim=16", 422,
     "batch"),
    ("/v1/best?device=d&template=flash_fwd&batch=1&heads_q=3&heads_kv=2&seqlen_q=8&head_dim=16",
     422, "multiple"),
    ("/v1/best?device=d&template=flash_fwd&batch=1&heads_q=2&seqlen_q=8&head_dim=16&seq=9",
     422, "seq"),
    ("/v1/best?device=d&template=flash_fwd&batch=1&heads_q=2&seqlen_q=8&head_dim=16"
     "&dtype=int8", 422, "dtype"),
    ("/v1/best?device=d&template=flash_fwd&batch=1&heads_q=2&seqlen_q=8&head_dim=16"
     "&mask=a%0Ab", 422, "mask"),
    ("/v1/best?template=flash_fwd&batch=1&heads_q=2&seqlen_q=8&head_dim=16", 422, "device"),
    ("/v1/best?device=d&template=flash_fwd&batch=1&heads_q=2&seqlen_q=8&head_dim=512", 422,
     "head_dim"),
    ("/v1/best?device=d&template=flash_fwd&batch=99999999999999999999&heads_q=2&seqlen_q=8"
     "&head_dim=16", 422, "batch"),
    ("/v1/configs?limit=0", 422, "limit"),
    ("/v1/configs?limit=5000", 422, "limit"),
    ("/v1/configs?offset=-1", 422, "offset"),
    ("/v1/configs?variant=dense%00", 422, "variant"),
    ("/v1/best?device=a%00b&template=flash_fwd&batch=1&heads_q=2&seqlen_q=8&head_dim=16", 422,
     "device"),
    ("/v1/kernels/nope/source?device=d&batch=1&heads_q=2&seqlen_q=8&head_dim=16", 404, "known"),
    ("/v1/kernels/flash_fwd/source?device=d&batch=1&heads_q=2&seqlen_q=8&head_dim=16"
     "&mask=sliding:16", 422, "block-sparse"),
    ("/v1/kernels/flash_fwd/source?device=d&batch=1&heads_q=2&seqlen_q=8&head_dim=16"
     "&softcap=50", 422, "uncapped scores only"),
    ("/v1/best?device=d&template=flash_fwd&batch=1&heads_q=2&seqlen_q=8&head_dim=16"
     "&softcap=-1", 422, "softcap"),
    ("/v1/best?device=d&template=flash_fwd&batch=1&heads_q=2&seqlen_q=8&head_dim=16"
     "&softcap=nan", 422, "softcap"),
    ("/v1/best?device=d&template=torch_sdpa&batch=1&heads_q=2&seqlen_q=8&head_dim=16"
     "&softcap=50", 422, "softcap"),
    ("/v1/nothing", 404, "not found"),
])
def test_bad_input_is_a_json_4xx(client: TestClient, url: str, code: int, needle: str) -> None:
    assert needle in str(assert_json_error(client.get(url), code)).lower()


# ----------------------------------------------------------------------------- limits, CORS
def test_request_bodies_are_size_limited(db_url: str) -> None:
    app = create_app(load_settings(database_url=db_url, token=TOKEN, max_body_bytes=2048))
    auth = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    big = _json(bundle(item(problem(1024), sweep="x" * 200), item(problem(4096)),
                       item(problem(2048))))
    assert len(big) > 2048
    with TestClient(app) as c:
        assert "limit of 2048 bytes" in assert_json_error(
            c.post("/v1/results", content=big, headers=auth), 413)

        def chunks() -> Iterator[bytes]:  # no Content-Length: counted while reading
            for i in range(0, len(big), 500):
                yield big[i:i + 500]

        assert assert_json_error(c.post("/v1/results", content=chunks(), headers=auth), 413)
        small = _json(bundle(item(problem(1024), sweep=None, default_tflops=None), host=None))
        assert len(small) <= 2048
        assert c.post("/v1/results", content=small, headers=auth).status_code == 201


def test_cors_allows_only_configured_origins(db_url: str) -> None:
    app = create_app(load_settings(database_url=db_url, cors_origins=["https://ui.example"]))
    with TestClient(app) as c:
        pre = {"Access-Control-Request-Method": "GET"}
        ok = c.options("/v1/configs", headers={"Origin": "https://ui.example", **pre})
        assert ok.headers["access-control-allow-origin"] == "https://ui.example"
        other = c.get("/v1/configs", headers={"Origin": "https://evil.example"})
        assert "access-control-allow-origin" not in other.headers


# ----------------------------------------------------------------------------- dashboard
def test_dashboard_shows_devices_templates_configs_and_charts(client: TestClient,
                                                             auth: dict[str, str]) -> None:
    sneaky = dataclasses.replace(H100, name="<script>alert(1)</script>")
    items = [item(problem(n)) for n in (1024, 2048, 4096)]
    items.append(item(problem(1024), device=sneaky))
    assert upload(client, auth, *items).status_code == 201
    r = client.get("/")
    assert r.status_code == 200 and r.url.path == "/dashboard"
    html = r.text
    assert r.headers["content-type"].startswith("text/html")
    assert "NVIDIA H100 80GB HBM3" in html and "flash_fwd" in html and FWD.version() in html
    assert html.count("<svg") == 2  # one chart per device x template x dtype x variant x dim
    assert "tuned" in html and "default config" in html and "<polyline" in html
    assert "<script>" not in html and "&lt;script&gt;" in html
    assert "4k" in html  # sequence-length tick labels


@pytest.mark.parametrize("tflops", [MAX_TFLOPS, 5e-324])
def test_dashboard_charts_extreme_tflops(client: TestClient, auth: dict[str, str],
                                         tflops: float) -> None:
    # The extremes an upload may carry; the chart's axis once overflowed (or divided by zero).
    r = upload(client, auth, item(problem(1024), tflops=tflops, median_ms=1.0))
    assert r.status_code == 201, r.text
    r = client.get("/dashboard")
    assert r.status_code == 200 and "<polyline" in r.text


def test_dashboard_renders_an_empty_database(client: TestClient) -> None:
    html = client.get("/dashboard").text
    assert "No tuned configs stored yet" in html and "<svg" not in html


def test_docs_need_nothing_from_the_internet(client: TestClient) -> None:
    """/docs is plain HTML from the OpenAPI schema (Swagger UI, from a CDN, is /docs/swagger)."""
    page = client.get("/docs")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    html = page.text
    assert "<script" not in html and "http://" not in html and "https://" not in html
    for route in ("GET /v1/best", "POST /v1/results", "GET /healthz"):
        assert route in html
    assert "cdn" in client.get("/docs/swagger").text.lower()
