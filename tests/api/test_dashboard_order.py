"""Problems are listed in numeric order (sequence length 512, 2048, 16384), on the dashboard and
through /v1/configs: ordered by the problem key string, "q16384" came before "q2048"."""

from __future__ import annotations

import re

from fastapi.testclient import TestClient

from tests.api.serving_data import FWD, TOKEN, bundle, item, problem

SEQLENS = (512, 2048, 16384)


def test_best_configs_are_listed_by_sequence_length_as_a_number(client: TestClient) -> None:
    shuffled = [problem(n) for n in (16384, 512, 2048)]
    r = client.post("/v1/results", json=bundle(*map(item, shuffled)),
                    headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 201, r.text
    keys = [FWD.problem_key(problem(n)) for n in SEQLENS]

    page = client.get("/v1/configs").json()
    assert [row["problem_key"] for row in page["items"]] == keys

    html = client.get("/dashboard").text
    table = html[html.index("<h2>Best configs</h2>"):html.index("<h2>Devices</h2>")]
    assert re.findall(r"<td>(b\d+-hq[^<]*)</td>", table) == keys


def test_charts_are_ordered_by_head_dim_as_a_number(client: TestClient) -> None:
    items = [item(problem(1024, head_dim=d)) for d in (128, 64)]
    r = client.post("/v1/results", json=bundle(*items),
                    headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 201, r.text
    html = client.get("/dashboard").text
    subtitles = re.findall(r'font-size="11">([^<]*)</text>', html)
    assert subtitles == ["bfloat16 · dense · d64", "bfloat16 · dense · d128"]


def test_interpreter_charts_say_they_are_not_gpu_timings_and_tuned_is_drawn_last(
        client: TestClient) -> None:
    from tests.api.serving_data import interpreter

    p = problem(64, batch=1, heads=2, head_dim=16, dtype="float16")
    r = client.post("/v1/results", json=bundle(item(p, device=interpreter(), tflops=0.001,
                                                    default_tflops=0.001)),
                    headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 201, r.text
    html = client.get("/dashboard").text
    assert "float16 · dense · d16 · Triton interpreter timings, NOT GPU timings" in html
    # Tuned equal to the default: the tuned line is drawn after (over) the default one.
    legend = re.findall(r'font-size="10">(tuned|default config)</text>', html)
    assert legend == ["default config", "tuned"]
