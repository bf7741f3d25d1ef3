"""Training calls on Hopper by our kernels both ways: where ``gluon_train`` (the Gluon forward
with the Gluon backward, timed together) is measured faster than ``torch_sdpa_train`` and
``gluon_cudnn_train``, ``tuner.attention`` runs the implementation ``gluon_train``: the Gluon
forward through ``tuner::gluon_train_fwd`` and the Gluon backward
(``tuner::gluon_attention_bwd``) fed that forward's o and lse. The implementation is one
module registered beside the others (issue 41's contract): nothing in ``tuner.attention``
names it.

As in test_dispatch_gluon_training.py, the CPU stands in for an H100 and the kernels are
recorders answering with the reference (their numerics are the GPU tests')."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

import tuner
import tuner.dispatch.implementations.gluon
import tuner.dispatch.implementations.gluon_train
from templates.flash.bwd import reference_grads
from templates.kernel_common import normalize_causal
from templates.registry import get_template
from tests.api.serving_data import H100
from tests.tuner.dispatch.test_dispatch import store
from tests.tuner.dispatch.test_dispatch_gluon_masks import gluon_config_not_the_default
from tests.tuner.dispatch.test_dispatch_gluon_training import (
    GPU_CASES,
    PROBLEM,
    assert_reference_grads,
    calls,  # noqa: F401  (a fixture)
    closed_form_grads,
    gpu_inputs,
    leaves,
    measured,
    on_hopper,  # noqa: F401  (a fixture)
)
from tuner.dispatch.rule import Call, choose

pytestmark = pytest.mark.usefixtures("no_tuned_configs", "on_hopper")

OWN = get_template("gluon_train")
BWD = get_template("gluon_bwd")


@pytest.fixture
def own_backward(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """The Gluon backward's calls, answered with the closed-form gradients."""
    seen: list[dict[str, Any]] = []

    def backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 o: torch.Tensor, lse: torch.Tensor, *, causal: bool, scale: float | None,
                 config: Any = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        seen.append({"o": o, "lse": lse, "causal": causal, "scale": scale, "config": config})
        grads = closed_form_grads(q, k, v, do, causal, scale or q.shape[-1] ** -0.5)
        return tuple(g.to(q.dtype) for g in grads)  # type: ignore[return-value]

    monkeypatch.setattr(tuner.dispatch.implementations.gluon_train, "gluon_attention_bwd", backward)
    return seen


def test_our_backward_measured_fastest_trains_with_both_our_kernels(
        tmp_path: Path, calls: dict[str, list[dict[str, Any]]],  # noqa: F811
        own_backward: list[dict[str, Any]]) -> None:
    cfg = gluon_config_not_the_default(OWN, PROBLEM)
    store(tmp_path, measured("torch_sdpa_train", 100.0), measured("gluon_cudnn_train", 110.0),
          measured("gluon_train", 120.0, config=cfg))
    choice = choose(Call(PROBLEM, True, H100))
    assert choice.implementation.name == "gluon_train" and choice.match == "exact", choice.why
    q, k, v, do = leaves("bnhd")
    out = tuner.attention(q, k, v, is_causal=True, enable_gqa=True)
    [fwd] = calls["fwd"]
    assert fwd["config"] == OWN.config(cfg) and fwd["causal"] == "top_left"
    out.backward(do)
    [bwd] = own_backward
    assert not calls["bwd"]  # cuDNN's backward never ran
    assert torch.equal(bwd["o"], fwd["o"]) and torch.equal(bwd["lse"], fwd["lse"])
    assert bwd["causal"] is True and bwd["scale"] is None
    assert bwd["config"] is None  # nothing measured for gluon_bwd: its default
    assert_reference_grads(q, k, v, do)
    for t in (q, k, v):
        assert t.grad is not None and t.grad.stride() == torch.empty_like(t).stride()


def test_the_backward_takes_gluon_bwds_config_measured_on_the_problem(
        tmp_path: Path, calls: dict[str, list[dict[str, Any]]],  # noqa: F811
        own_backward: list[dict[str, Any]]) -> None:
    """gluon_train is priced with the backward's default; a sweep that tuned gluon_bwd on
    the same problem found a config at least as fast, which the backward then runs."""
    default = BWD.default_config(PROBLEM, H100)
    tuned = dataclasses.replace(default, dq_early=not default.dq_early)
    assert BWD.constraint(PROBLEM, tuned, H100) is None
    store(tmp_path, measured("torch_sdpa_train", 100.0), measured("gluon_cudnn_train", 110.0),
          measured("gluon_train", 120.0), measured("gluon_bwd", 300.0, config=tuned.to_dict()))
    q, k, v, do = leaves()
    tuner.attention(q, k, v, is_causal=True, enable_gqa=True).backward(do)
    [bwd] = own_backward
    assert bwd["config"] == tuned
    assert_reference_grads(q, k, v, do)


def test_where_cudnns_backward_is_faster_gluon_keeps_it_and_inference_is_gluons(
        tmp_path: Path, calls: dict[str, list[dict[str, Any]]],  # noqa: F811
        own_backward: list[dict[str, Any]]) -> None:
    store(tmp_path, measured("torch_sdpa_train", 100.0), measured("gluon_cudnn_train", 110.0),
          measured("gluon_train", 70.0), measured("gluon_fwd", 500.0),
          measured("torch_sdpa", 100.0))
    assert choose(Call(PROBLEM, True, H100)).implementation.name == "gluon"
    inference = choose(Call(PROBLEM, False, H100))
    assert inference.implementation.name != "gluon_train"
    q, k, v, do = leaves()
    tuner.attention(q, k, v, is_causal=True, enable_gqa=True).backward(do)
    assert len(calls["bwd"]) == 1 and not own_backward


def test_the_ops_fakes_match_the_real_strides(calls: dict[str, list[dict[str, Any]]],  # noqa: F811
                                              own_backward: list[dict[str, Any]]) -> None:
    for layout in ("bhnd", "bnhd"):
        q, k, v, do = (t.detach() for t in leaves(layout))
        with tuner.use_implementation("gluon_train"):
            torch.library.opcheck(torch.ops.tuner.gluon_train_fwd.default, (q, k, v, True, None, True),
                                  test_utils=("test_faketensor",))
            o, lse = torch.ops.tuner.gluon_train_fwd(q, k, v, True, None, True)
        torch.library.opcheck(torch.ops.tuner.gluon_attention_bwd.default,
                              (do.contiguous(), q, k, v, o, lse, True, None, True),
                              test_utils=("test_faketensor",))


# ----------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
@pytest.mark.parametrize("case", [c for c in GPU_CASES if c[5] in (64, 128)],
                         ids=lambda c: "-".join(map(str, c)))
def test_training_through_both_gluon_kernels_matches_the_reference_on_the_gpu(
        case: tuple[Any, ...], layout: str) -> None:
    """The real kernels (no recorders), forced: dq, dk, dv against the autograd reference."""
    q, k, v, do = gpu_inputs(case, layout)
    causal, gqa = case[-1], q.shape[1] != k.shape[1]
    grads_of = [t.detach().requires_grad_() for t in (q, k, v)]
    with tuner.use_implementation("gluon_train"):
        o = tuner.attention(*grads_of, is_causal=causal, enable_gqa=gqa)
    o.backward(do)
    ref = reference_grads(q, k, v, do, causal=normalize_causal(causal),
                          scale=q.shape[-1] ** -0.5)
    tol = 2e-3 if q.dtype == torch.float16 else 1e-2
    for t, r in zip(grads_of, ref, strict=True):
        assert t.grad is not None and float(t.grad.abs().max()) > 0
        err = float((t.grad.double() - r).norm() / r.norm())
        assert err < tol, (layout, err)
