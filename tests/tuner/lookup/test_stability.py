"""Stable within a process (issue 18, item 5): once a kernel ran a config for a bucket, the
process keeps it, whatever is stored later; answers never run are still re-asked; and
TUNER_REFRESH=on opts in to newer answers (tiny shapes, under the interpreter)."""

from __future__ import annotations

import importlib
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import tuner
from templates.base import Problem
from tests.api.serving_data import FWD, interpreter, item, problem, tuned_config
from tests.tuner.dispatch.test_dispatch import assert_close_to, measured, problem_of, qkv
from tests.tuner.lookup.test_lookup import Clock, stored_db
from tuner.attention import _PLANS, clear_plans, plan_for
from tuner.lookup.resolver import UNTUNED_TTL_S, ConfigResolver, set_resolver
from tuner.settings import load_settings

pytestmark = pytest.mark.usefixtures("no_tuned_configs")


def resolver(path: Path, clock: Clock, *, refresh: bool = False) -> ConfigResolver:
    return ConfigResolver(load_settings(database_url=f"sqlite:///{path}", url=None,
                                        refresh=refresh), clock=clock)


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    """One clock for the resolver's answers and tuner.attention's plans."""
    clock = Clock()
    # The module, not the function ``tuner.attention`` that the package exports by its name.
    monkeypatch.setattr(importlib.import_module("tuner.attention"), "_now", clock)
    return clock


def ran_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether tuner.attention ran torch SDPA as the user's call would (bit for bit)."""
    out = tuner.attention(q, k, v, enable_gqa=True)
    return torch.equal(out, F.scaled_dot_product_attention(q, k, v, enable_gqa=True))


def test_a_config_that_ran_is_kept_for_the_process_and_one_never_run_is_asked_again(
        tmp_path: Path, clock: Clock) -> None:
    path = tmp_path / "tuner.db"
    set_resolver(resolver(path, clock))
    q, k, v = qkv("cpu")
    other = qkv("cpu", lq=100, lk=100)  # another bucket: only asked about, never run
    assert ran_sdpa(q, k, v)  # nothing tuned: torch SDPA
    assert plan_for(*other, enable_gqa=True).implementation.name == "sdpa"

    # A sweep stores measurements that make our kernel the faster one, for both problems.
    p, p_other = problem_of(q, k), problem_of(other[0], other[1])
    stored_db(path, *(measured(t, x, tflops) for x in (p, p_other)
                      for t, tflops in (("torch_sdpa", 100.0), ("flash_fwd", 150.0))))
    clock.now += 10 * UNTUNED_TTL_S

    assert plan_for(*other, enable_gqa=True).implementation.name == "flash"  # re-asked
    assert ran_sdpa(q, k, v)  # the plan that ran stands
    _PLANS.clear()  # a plan rebuilt (the cache was full): from the kept answers
    assert ran_sdpa(q, k, v)
    same_bucket = qkv("cpu", lq=20, lk=36)
    assert ran_sdpa(*same_bucket)  # another shape of the buckets that ran: kept too
    [plan, _] = _PLANS.values()
    assert plan.expires_at == math.inf

    # Asked explicitly (clear_plans), or in a process that starts now: the new answer.
    clear_plans()
    assert plan_for(q, k, v, enable_gqa=True).implementation.name == "flash"


def test_with_refresh_on_a_running_process_picks_up_newer_answers(
        tmp_path: Path, clock: Clock) -> None:
    path = tmp_path / "tuner.db"
    set_resolver(resolver(path, clock, refresh=True))
    q, k, v = qkv("cpu")
    assert ran_sdpa(q, k, v)
    p = problem_of(q, k)
    stored_db(path, measured("torch_sdpa", p, 100.0), measured("flash_fwd", p, 150.0))
    clock.now += UNTUNED_TTL_S + 0.1
    out = tuner.attention(q, k, v, enable_gqa=True)
    assert_close_to(out, F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
    [plan] = _PLANS.values()
    assert plan.choice.implementation.name == "flash"  # type: ignore[union-attr]


# ----------------------------------------------------------------------------- the resolver
def tiny(seqlen: int) -> Problem:
    return problem(seqlen, batch=1, heads=2, head_dim=16, dtype="float16")


def test_a_kept_answer_is_the_buckets_for_every_caller(tmp_path: Path) -> None:
    clock, dev = Clock(), interpreter()
    r = resolver(tmp_path / "none.db", clock)
    first = r.resolve(FWD, tiny(64), dev)
    assert first.match == "default" and first.expires_at == clock.now + UNTUNED_TTL_S
    kept = r.keep(first)
    assert kept.config == first.config and kept.expires_at == math.inf
    clock.now += 1000
    assert r.resolve(FWD, tiny(50), dev) is kept  # the bucket's answer, for good
    # A caller that resolved before the keep and runs now gets the kept answer.
    assert r.keep(first) is kept


def test_tuned_answers_are_asked_again_only_with_refresh_on(tmp_path: Path) -> None:
    dev = interpreter()
    path = tmp_path / "tuner.db"
    first = item(tiny(64), device=dev, config=tuned_config(tiny(64), dev))
    stored_db(path, first)
    clocks = {False: Clock(), True: Clock()}
    resolvers = {refresh: resolver(path, clocks[refresh], refresh=refresh)
                 for refresh in (False, True)}
    for r in resolvers.values():
        assert r.keep(r.resolve(FWD, tiny(64), dev)).config.to_dict() == first["config"]
    better = {**first["config"],
              "pipeline_masked_loop": not first["config"]["pipeline_masked_loop"]}
    stored_db(path, item(tiny(64), device=dev, config=better, tflops=999.0))
    for c in clocks.values():
        c.now += 61
    assert resolvers[False].resolve(FWD, tiny(64), dev).config.to_dict() == first["config"]
    assert resolvers[True].resolve(FWD, tiny(64), dev).config.to_dict() == better
