"""The loop of issue 18, end to end on both backends, with no human step: a job runs a shape
nothing was tuned for through ``tuner.attention`` -> its demand reaches a real service on
loopback -> ``tuner worker`` tunes it (the interpreter, a tiny trial budget) -> a fresh client
gets ``match=exact`` for it from the service."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import tuner
from api.main import create_app
from tests.api.serving_data import live_server
from tests.tuner.cli.test_sweep_cli import cli
from tuner.attention import clear_plans, plan_for
from tuner.client import TunerClient
from tuner.dispatch.rule import Choice
from tuner.lookup.resolver import ConfigResolver, set_resolver
from tuner.settings import Settings, load_settings

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SHAPE = (1, 2, 24, 16)  # (B, H, N, D): tiny, and in no built-in suite


@pytest.fixture
def fresh_resolvers() -> Iterator[None]:
    yield
    clear_plans()
    set_resolver(None)


def job_settings(service: str, tmp_path: Path) -> Settings:
    # No local database: only the service can answer.
    return load_settings(database_url=f"sqlite:///{tmp_path / 'no-local.db'}", url=service,
                         demand_interval=0.2, lookup_timeout=5.0)


def plan(settings: Settings) -> Choice:
    """What a fresh client process would run for the shape: a new resolver, no kept plan."""
    set_resolver(ConfigResolver(settings))
    clear_plans()
    q, k, v = (torch.randn(*SHAPE, dtype=torch.float16) for _ in range(3))
    return plan_for(q, k, v, is_causal=True)


def test_a_shape_a_job_ran_untuned_is_tuned_by_a_worker_and_served_exact(
        db_url: str, tmp_path: Path, fresh_resolvers: None) -> None:
    app = create_app(load_settings(database_url=db_url, token=None, url=None))
    with live_server(app) as service:
        settings = job_settings(service, tmp_path)
        before = plan(settings)
        assert {e.implementation: [r.match for r in e.resolved] for e in before.estimates} == {
            "sdpa": ["default"], "flash": ["default"]}
        assert before.implementation.name == "sdpa"  # unmeasured: what SDPA would run

        # The job: its untuned problem is reported in the background.
        q, k, v = (torch.randn(*SHAPE, dtype=torch.float16) for _ in range(3))
        tuner.attention(q, k, v, is_causal=True)
        with TunerClient(service, token="") as client:
            # Each template's problem is reported on its own: wait for both, not the first.
            expected = {("torch_sdpa", 24, "top_left"), ("flash_fwd", 24, "top_left")}
            deadline = time.monotonic() + 20
            while True:
                queue = client.demand(status="open").items
                reported = {(r.template, r.problem["seqlen_q"], r.problem["causal"])
                            for r in queue}
                if reported == expected:
                    break
                assert not reported - expected, f"unexpected demand: {reported - expected}"
                assert time.monotonic() < deadline, f"demand reached the service: {reported}"
                time.sleep(0.2)

            # The worker: both problems, then it stops (nothing left to claim).
            code, out, err = cli("worker", "--db", db_url, "--until-idle", "--trials", "2",
                                 "--finalists", "0", "--timeout", "60", "--json")
            assert code == 0, err
            lines = [json.loads(line) for line in out.splitlines()]
            finished = [line for line in lines if line["event"] == "finished"]
            assert sorted(line["template"] for line in finished) == ["flash_fwd", "torch_sdpa"]
            assert all(line["status"] == "done" and line["best_tflops"] for line in finished)
            assert {r.status for r in client.demand().items} == {"done"}

        # A new client: exact answers from the service (its cache of this device and kernel
        # version is re-checked within 5 s of the worker's writes).
        deadline = time.monotonic() + 20
        while True:
            after = plan(settings)
            matches = {e.implementation: [r.match for r in e.resolved] for e in after.estimates}
            if matches == {"sdpa": ["exact"], "flash": ["exact"]}:
                break
            assert time.monotonic() < deadline, f"never served exact: {matches}"
            time.sleep(0.5)
        assert {r.source for e in after.estimates for r in e.resolved} == {"service"}
        assert after.why.startswith("fastest measured")
