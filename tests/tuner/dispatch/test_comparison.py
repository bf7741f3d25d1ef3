"""The implementations of a problem compared (tuner/dispatch/comparison.py): the winner, the
runner-up, every implementation's time, each SDPA backend's and which times a head-to-head measured;
the same from the local database (``tuner best --shape``) and from the service
(``GET /v1/best?compare=true``), on SQLite and PostgreSQL."""

from __future__ import annotations

import json
from typing import Any

import pytest
from fastapi.testclient import TestClient

from api.main import create_app
from db.session import dispose_engine, session_scope
from templates import current_device, get_template
from templates.base import Problem
from tests.api.serving_data import TOKEN, tuned_config
from tests.tuner.cli.test_sweep_cli import cli
from tests.tuner.dispatch.test_dispatch_through_service import CASES, HERE, seeded
from tests.tuner.dispatch.test_winners import (  # noqa: F401  (target: a fixture)
    SDPA,
    Target,
    side_by_side,
    small,
    target,
    trial,
)
from tuner.dispatch.comparison import compare_in_database
from tuner.settings import load_settings
from tuner.wire import BestOut, ImplementationsCompared

pytestmark = pytest.mark.usefixtures("no_tuned_configs")

FWD = get_template("flash_fwd")


def local(url: str, p: Problem) -> ImplementationsCompared:
    with session_scope(url, write=False) as s:
        return compare_in_database(s, p, current_device(),
                                   version_of=lambda name: get_template(name).version(),
                                   margin=0.03)


def served(url: str, p: Problem) -> ImplementationsCompared:
    with TestClient(create_app(load_settings(database_url=url, token=TOKEN, url=None))) as c:
        response = c.get("/v1/best", params={"template": "torch_sdpa",
                                             "device": current_device().key, "compare": "true",
                                             **p.to_dict()})
        assert response.status_code == 200, response.text
        plain = c.get("/v1/best", params={"template": "torch_sdpa",
                                          "device": current_device().key, **p.to_dict()})
        assert plain.json()["implementations"] is None  # asked for only
    answer = BestOut.model_validate(response.json())
    assert answer.implementations is not None
    return answer.implementations


@pytest.mark.parametrize("case", list(CASES))
def test_the_service_and_the_database_compare_as_the_dispatcher_chooses(
        case: str, db_url: str) -> None:
    expected = CASES[case]
    seeded(db_url, expected.stored())
    mine, theirs = local(db_url, HERE), served(db_url, HERE)
    dispose_engine(db_url)
    assert theirs == mine
    assert mine.winner == expected.implementation, mine.why
    neighbour = FWD.problem_key(expected.neighbour) if expected.neighbour else None
    assert mine.neighbour == neighbour
    if case == "exact":
        assert (mine.runner_up, mine.runner_up_ratio) == ("sdpa", pytest.approx(1.5))
        assert {t.problem_key for t in mine.times.values()} == {FWD.problem_key(HERE)}
        assert list(mine.times) == ["flash", "sdpa"]  # fastest first
    elif case == "neighbour win":
        assert (mine.runner_up, mine.runner_up_ratio) == ("sdpa", pytest.approx(1.1))
        assert {t.problem_key for t in mine.times.values()} == {neighbour}
    elif case == "neighbour within the margin":
        # SDPA runs although flash read 2% faster there: the ratio says so.
        assert (mine.runner_up, mine.runner_up_ratio) == ("flash", pytest.approx(1 / 1.02))
    else:
        assert mine.runner_up is None and mine.times == {} and "not measured" in mine.why


def test_backends_and_head_to_head_times_are_shown(target: Target) -> None:  # noqa: F811
    p = small(64)
    with session_scope(target.url) as s:
        # On the interpreter only SDPA's default backend runs: it is the best here.
        sdpa = trial(s, target, p, {"backend": "default"}, 0.8)
        trial(s, target, p, {"backend": "cudnn"}, 1.0)
        trial(s, target, p, {"backend": "efficient"}, 1.8)
        ours = trial(s, target, p, tuned_config(p, current_device()), 0.7,
                     template=target.flash)
        session = side_by_side(s, target, p, {sdpa: [0.95, 0.97, 0.96],
                                              ours: [0.9, 0.92, 0.91]})
    mine, theirs = local(target.url, p), served(target.url, p)
    assert theirs == mine
    assert (mine.winner, mine.runner_up) == ("flash", "sdpa")
    assert mine.runner_up_ratio == pytest.approx(0.96 / 0.91)
    ours_time, sdpa_time = mine.times["flash"], mine.times["sdpa"]
    assert (ours_time.head_to_head, sdpa_time.head_to_head) == (session, session)
    assert (ours_time.measured_ms, ours_time.readings) == (pytest.approx(0.91), 3)
    assert sdpa_time.config == {"backend": "default"}
    assert sdpa_time.ms == pytest.approx(0.96)
    # Each backend at its own best; the default at its head-to-head's median, as the best.
    assert {name: t.median_ms for name, t in mine.sdpa_backends.items()} == {
        "default": pytest.approx(0.96), "cudnn": 1.0, "efficient": 1.8}


def test_tuner_best_shape_prints_the_comparison(target: Target) -> None:  # noqa: F811
    p = small(64)
    with session_scope(target.url) as s:
        trial(s, target, p, {"backend": "default"}, 0.8)
        trial(s, target, p, {"backend": "efficient"}, 1.8)
        trial(s, target, p, tuned_config(p, current_device()), 0.4, template=target.flash)
    shape = "B=1,H_q=4,H_kv=2,N=64,D=16"
    code, out, err = cli("best", "--db", target.url, "--shape", shape, "--dtype", "float32",
                         "--json")
    assert code == 0, err
    [item] = json.loads(out)
    compared: dict[str, Any] = item["implementations"]
    assert (compared["winner"], compared["runner_up"]) == ("flash", "sdpa")
    assert compared["runner_up_ratio"] == pytest.approx(2.0)
    assert list(compared["sdpa_backends"]) == ["default", "efficient"]
    code, out, err = cli("best", "--db", target.url, "--shape", shape, "--dtype", "float32")
    assert code == 0, err
    assert "runs flash" in out and "2.00x" in out and "default 0.8 ms" in out
