"""Deciding on a neighbour (tuner/dispatch/neighbours.py): a problem whose own bucket has no torch
SDPA measurement runs ours only where ours beat SDPA, by the margin, on the nearest neighbouring
bucket where both were measured (tiny shapes, under the interpreter without a GPU)."""

from __future__ import annotations

import importlib
import math
from pathlib import Path
from typing import Any

import pytest
import torch.nn.functional as F

import tuner
from templates.base import Problem
from templates.device import current_device
from templates.registry import get_template
from tests.api.serving_data import tuned_config
from tests.tuner.dispatch.test_dispatch import assert_close_to, measured, problem_of, qkv, store
from tests.tuner.lookup.test_lookup import Clock, stored_db
from tuner.attention import _PLANS, plan_for
from tuner.dispatch.neighbours import Contender, decide_on_neighbour
from tuner.dispatch.rule import Call, choose, keep
from tuner.lookup.resolver import (
    UNTUNED_TTL_S,
    ConfigResolver,
    Neighbour,
    Resolved,
    resolve_config,
    set_resolver,
)
from tuner.settings import load_settings

pytestmark = pytest.mark.usefixtures("no_tuned_configs")

FWD = get_template("flash_fwd")


def shape(lq: int, lk: int) -> Problem:
    """A problem of the family of ``qkv``'s (4 query heads on 2 KV heads, d16, float32)."""
    return Problem(batch=1, heads_q=4, heads_kv=2, seqlen_q=lq, seqlen_kv=lk, head_dim=16,
                   dtype="float32")


def flash_on(p: Problem, tflops: float) -> dict[str, Any]:
    """flash_fwd measured on ``p`` with a config other than the default."""
    return measured("flash_fwd", p, tflops, tuned_config(p, current_device()))


def use_settings(tmp_path: Path, db: str = "tuned.db", **settings: Any) -> None:
    set_resolver(ConfigResolver(load_settings(database_url=f"sqlite:///{tmp_path / db}",
                                              url=None, **settings)))


def test_flash_that_beat_sdpa_on_a_neighbour_runs_with_the_neighbours_config(
        tmp_path: Path, device: str, caplog: pytest.LogCaptureFixture) -> None:
    q, k, v = qkv(device)  # L 24, S 40: the bucket (32, 64), nothing stored for it
    near = shape(48, 100)
    neighbour = FWD.problem_key(near)
    stored = flash_on(near, 110.0)
    store(tmp_path, measured("torch_sdpa", near, 100.0), stored)
    with caplog.at_level("DEBUG", logger="tuner.dispatch.rule"):
        out = tuner.attention(q, k, v, enable_gqa=True)
    choice = plan_for(q, k, v, enable_gqa=True)
    assert choice.implementation.name == "flash", choice.why
    assert choice.config.to_dict() == stored["config"] != FWD.default_config(
        problem_of(q, k), current_device()).to_dict()
    assert choice.neighbour == neighbour and choice.match == "nearest"
    assert choice.source == f"database, neighbour {neighbour}"
    assert f"decided on neighbour {neighbour}" in choice.why and "flash 1.1x" in choice.why
    assert_close_to(out, F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
    [plan] = _PLANS.values()
    assert plan.choice.implementation.name == "flash"  # type: ignore[union-attr]
    [line] = [r.getMessage() for r in caplog.records if r.name == "tuner.dispatch.rule"]
    assert f"neighbour {neighbour}" in line


def test_sdpa_and_flash_measured_on_different_neighbours_run_sdpa(
        tmp_path: Path, device: str) -> None:
    q, k, v = qkv(device)
    store(tmp_path, measured("torch_sdpa", shape(48, 100), 100.0),
          flash_on(shape(96, 300), 1000.0))
    choice = plan_for(q, k, v, enable_gqa=True)
    assert choice.implementation.name == "sdpa" and choice.neighbour is None
    assert "not measured" in choice.why
    flash = {e.implementation: e for e in choice.estimates}["flash"]
    assert flash.resolved[0].match == "nearest"  # a config to run, but nothing to compare


def test_a_neighbours_win_below_the_margin_runs_sdpa_and_the_margin_is_a_setting(
        tmp_path: Path, device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    q, k, v = qkv(device)
    near = shape(48, 100)
    store(tmp_path, measured("torch_sdpa", near, 100.0), flash_on(near, 102.0))
    choice = plan_for(q, k, v, enable_gqa=True)
    assert choice.implementation.name == "sdpa", choice.why
    assert choice.neighbour == FWD.problem_key(near)
    assert "flash 1.02x" in choice.why and "1.03x needed" in choice.why

    use_settings(tmp_path, neighbour_margin=0.01)
    assert plan_for(q, k, v, enable_gqa=True).implementation.name == "flash"
    monkeypatch.setenv("TUNER_NEIGHBOUR_MARGIN", "0.05")
    assert load_settings().neighbour_margin == 0.05


def test_the_nearest_neighbour_measured_for_both_decides(tmp_path: Path, device: str) -> None:
    q, k, v = qkv(device)
    nearest, near, far = shape(24, 80), shape(48, 100), shape(96, 300)
    # Flash alone on the nearest (no comparison there), slower than SDPA on the next, faster
    # on the farthest: the next decides.
    store(tmp_path, flash_on(nearest, 1000.0), measured("torch_sdpa", near, 100.0),
          flash_on(near, 90.0), measured("torch_sdpa", far, 100.0), flash_on(far, 200.0))
    choice = plan_for(q, k, v, enable_gqa=True)
    assert choice.implementation.name == "sdpa" and choice.neighbour == FWD.problem_key(near)
    assert "flash 0.9x" in choice.why


def test_a_problem_with_its_own_sdpa_measurement_is_decided_by_it_alone(
        tmp_path: Path, device: str) -> None:
    q, k, v = qkv(device)
    near = shape(48, 100)
    # Flash has no measurement of this problem (in a sweep, e.g. no config of it ran
    # correctly): its neighbour's win does not count against SDPA's own measurement.
    store(tmp_path, measured("torch_sdpa", problem_of(q, k), 100.0),
          measured("torch_sdpa", near, 100.0), flash_on(near, 200.0))
    choice = plan_for(q, k, v, enable_gqa=True)
    assert choice.implementation.name == "sdpa" and choice.match == "exact"
    assert choice.neighbour is None and "fastest measured" in choice.why


@pytest.mark.parametrize("refresh", [False, True])
def test_a_gradient_is_decided_on_a_neighbour_where_every_training_template_was_measured(
        tmp_path: Path, device: str, refresh: bool) -> None:
    q, k, v = qkv(device)
    p, near, far = problem_of(q, k), shape(48, 100), shape(96, 300)
    bwd = get_template("flash_bwd")
    bwd_config = next(c for c in bwd.config_cls.grid()
                      if c != bwd.default_config(far, current_device())
                      and bwd.constraint(p, c, current_device()) is None)
    # The near neighbour lacks flash_bwd: the far one, with all three, decides.
    store(tmp_path, measured("torch_sdpa_train", near, 100.0), flash_on(near, 1000.0),
          measured("torch_sdpa_train", far, 100.0), flash_on(far, 1000.0),
          measured("flash_bwd", far, 1000.0, bwd_config.to_dict()))
    use_settings(tmp_path, refresh=refresh)
    call = Call(p, needs_grad=True, device=current_device())
    choice = keep(choose(call))
    assert choice.implementation.name == "flash", choice.why
    assert choice.neighbour == FWD.problem_key(far)
    # Kept (with refresh on: until the answers expire), the custom op's own lookups (forward,
    # then backward) run the neighbour's configs.
    fwd_answer = resolve_config(FWD, p, current_device())
    bwd_answer = resolve_config(bwd, p, current_device())
    assert (fwd_answer.neighbour, bwd_answer.neighbour) == (FWD.problem_key(far),) * 2
    assert bwd_answer.config == bwd_config and fwd_answer.config == choice.config


def test_a_choice_made_on_a_neighbour_is_kept_for_its_bucket(
        tmp_path: Path, device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = Clock()
    monkeypatch.setattr(importlib.import_module("tuner.attention"), "_now", clock)
    path = tmp_path / "tuner.db"
    near, nearer = shape(48, 100), shape(24, 80)
    stored_db(path, measured("torch_sdpa", near, 100.0), flash_on(near, 110.0))
    set_resolver(ConfigResolver(load_settings(database_url=f"sqlite:///{path}", url=None),
                                clock=clock))
    q, k, v = qkv(device)
    tuner.attention(q, k, v, enable_gqa=True)
    [plan] = _PLANS.values()
    assert plan.choice.implementation.name == "flash"  # type: ignore[union-attr]
    assert plan.expires_at == math.inf

    # A nearer neighbour where SDPA wins is stored later; the untuned answers would have
    # been asked again by now, but the bucket that ran keeps its choice and config.
    stored_db(path, measured("torch_sdpa", nearer, 100.0), flash_on(nearer, 50.0))
    clock.now += 10 * UNTUNED_TTL_S
    same_bucket = qkv(device, lq=20, lk=36)
    choice = plan_for(*same_bucket, enable_gqa=True)
    assert choice.implementation.name == "flash" and choice.neighbour == FWD.problem_key(near)
    other_bucket = qkv(device, lq=20, lk=150)  # never ran: asked again, the new data decide
    assert plan_for(*other_bucket, enable_gqa=True).neighbour == FWD.problem_key(nearer)


def test_a_snapshot_decides_on_the_neighbour_the_database_did(
        tmp_path: Path, device: str) -> None:
    from tests.tuner.lookup.test_snapshot import pinned_resolver
    from tuner.lookup.snapshot import freeze

    url = f"sqlite:///{tmp_path / 'tuner.db'}"
    near = shape(48, 100)
    stored = flash_on(near, 110.0)
    stored_db(tmp_path / "tuner.db", measured("torch_sdpa", near, 100.0), stored)
    frozen = freeze(url)
    set_resolver(pinned_resolver(url, frozen.id))
    q, k, v = qkv(device)
    choice = plan_for(q, k, v, enable_gqa=True)
    assert choice.implementation.name == "flash", choice.why
    assert choice.source == f"snapshot, neighbour {FWD.problem_key(near)}"
    assert choice.config.to_dict() == stored["config"]
    assert_close_to(tuner.attention(q, k, v, enable_gqa=True),
                    F.scaled_dot_product_attention(q, k, v, enable_gqa=True))


def test_a_config_kept_from_one_neighbour_is_compared_there_alone(
        tmp_path: Path, device: str) -> None:
    q, k, v = qkv(device)
    p, nearer, near = problem_of(q, k), shape(24, 80), shape(48, 100)
    # Inference is decided on ``near`` (no torch_sdpa on ``nearer``), and flash_fwd's config
    # from there is kept for the bucket. A gradient would be decided on ``nearer`` (every
    # training template measured there), but the forward that runs is ``near``'s: so it is
    # decided on ``near``, where that config was measured.
    # flash_bwd's bests with a config that runs the call's problem here: a neighbour's own
    # default may not (on a GPU its 128-key tile is refused for 40 keys as wasted padding,
    # and the call would be priced without it).
    bwd = get_template("flash_bwd").default_config(p, current_device()).to_dict()
    store(tmp_path, measured("torch_sdpa_train", nearer, 100.0), flash_on(nearer, 1000.0),
          measured("flash_bwd", nearer, 1000.0, bwd),
          measured("torch_sdpa", near, 100.0), flash_on(near, 110.0),
          measured("torch_sdpa_train", near, 100.0), measured("flash_bwd", near, 1000.0, bwd))
    inference = keep(choose(Call(p, needs_grad=False, device=current_device())))
    assert inference.neighbour == FWD.problem_key(near), inference.why
    training = keep(choose(Call(p, needs_grad=True, device=current_device())))
    priced = [(e.implementation, e.ms, [(r.match, r.neighbour, list(r.neighbours))
                                        for r in e.resolved]) for e in training.estimates]
    assert training.implementation.name == "flash", (training.why, priced)
    assert training.neighbour == FWD.problem_key(near)
    assert training.config == inference.config


# ----------------------------------------------------------------------------- the verdict
def contender(name: str, template: str, **tflops_on: float) -> Contender:
    """``name`` priced by ``template`` with a nearest answer measured on the named shapes
    (``SHAPES``) at the given TFLOP/s, nearest first in the order given (gluon is priced by
    flash_fwd here: the interpreter has no gluon config, and the FLOPs are the same)."""
    t = get_template(template)
    neighbours = {SHAPES[s].key(): Neighbour(SHAPES[s].key(), SHAPES[s],
                                             t.default_config(SHAPES[s], current_device()), tf)
                  for s, tf in tflops_on.items()}
    answer = Resolved(t.default_config(SHAPES["here"], current_device()), "nearest", "database",
                      neighbours=neighbours)
    return Contender(name, (t,), (answer,))


SHAPES = {"here": shape(24, 40), "near": shape(48, 100), "far": shape(96, 300)}


def test_the_fastest_on_the_neighbour_wins_and_one_neighbour_serves_all() -> None:
    sdpa = contender("sdpa", "torch_sdpa", near=100.0, far=100.0)
    flash = contender("flash", "flash_fwd", near=110.0)
    gluon = contender("gluon", "flash_fwd", near=120.0, far=300.0)
    verdict = decide_on_neighbour(sdpa, [flash, gluon], margin=0.03)
    assert verdict is not None and (verdict.neighbour, verdict.winner) == (
        SHAPES["near"].key(), "gluon")
    assert verdict.ratio("gluon") == pytest.approx(1.2)
    assert verdict.ratio("flash") == pytest.approx(1.1)
    assert verdict.resolved[0].neighbour == SHAPES["near"].key()
    # Gluon measured on the far neighbour alone: one neighbour for all, the nearest that SDPA
    # shares with any of them, so gluon's 3x there is not compared with flash's 1.1x here.
    gluon_far = contender("gluon", "flash_fwd", far=300.0)
    verdict = decide_on_neighbour(sdpa, [flash, gluon_far], margin=0.03)
    assert verdict is not None and (verdict.neighbour, verdict.winner) == (
        SHAPES["near"].key(), "flash")
    assert set(verdict.ms) == {"sdpa", "flash"}
    assert decide_on_neighbour(contender("sdpa", "torch_sdpa"), [flash], margin=0.03) is None
