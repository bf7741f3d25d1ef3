"""Under ``torch.use_deterministic_algorithms(True)`` a training call gets bitwise-repeatable
gradients: implementations whose backward sums dQ in no fixed order (gluon with cuDNN's
backward; gluon_train's tuned backward with its atomics, except on dense calls that are not
causal, where it runs its deterministic backward) serve no call that needs a gradient, and
flash's backward sums dQ per query tile (dq_mode "separate") whatever config was tuned."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import tuner
import tuner.dispatch.implementations.flash as flash_impl
import tuner.dispatch.implementations.gluon as gluon_impl
import tuner.dispatch.implementations.gluon_train as gluon_train_impl
from templates.flash.bwd import BwdConfig
from tests.api.serving_data import H100
from tests.tuner.dispatch.test_dispatch import measured as measured_on
from tests.tuner.dispatch.test_dispatch import store
from tests.tuner.dispatch.test_dispatch_gluon_training import (
    PROBLEM,
    measured,
    on_hopper,  # noqa: F401  (a fixture)
)
from tuner.dispatch.rule import Call, choose

pytestmark = pytest.mark.usefixtures("no_tuned_configs")


@pytest.fixture
def deterministic() -> Iterator[None]:
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before)


@pytest.mark.usefixtures("on_hopper")
def test_implementations_with_unordered_dq_do_not_serve_a_gradient(
        tmp_path: Path, deterministic: None) -> None:
    store(tmp_path, measured("torch_sdpa_train", 100.0), measured("gluon_cudnn_train", 110.0),
          measured("gluon_train", 120.0))
    choice = choose(Call(PROBLEM, True, H100))
    assert choice.implementation.name == "sdpa", choice.why
    for name in ("gluon", "gluon_train"):
        with tuner.use_implementation(name), pytest.raises(ValueError, match="deterministic"):
            choose(Call(PROBLEM, True, H100))
    torch.use_deterministic_algorithms(False)
    assert choose(Call(PROBLEM, True, H100)).implementation.name == "gluon_train"


def test_flash_sums_dq_per_query_tile(monkeypatch: pytest.MonkeyPatch,
                                      deterministic: None) -> None:
    atomic = dataclasses.replace(BwdConfig(), dq_mode="atomic")
    monkeypatch.setattr(flash_impl, "_backward_config",
                        lambda q, k, is_causal, softcap=0.0: atomic)
    seen: list[Any] = []
    real = flash_impl.flash_attention_bwd

    def spy(*args: Any, **kwargs: Any) -> Any:
        seen.append(kwargs["config"])
        return real(*args, **kwargs)

    monkeypatch.setattr(flash_impl, "flash_attention_bwd", spy)
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(1, 2, 100, 32, generator=g, dtype=torch.float16)
                   for _ in range(4))
    grads = []
    for _ in range(3):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        with tuner.use_implementation("flash"):
            tuner.attention(*leaves, is_causal=True).backward(do)
        grads.append([t.grad for t in leaves])
    assert [c.dq_mode for c in seen] == ["separate"] * 3
    for other in grads[1:]:
        assert all(torch.equal(a, b) for a, b in zip(grads[0], other, strict=True))
    torch.use_deterministic_algorithms(False)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    with tuner.use_implementation("flash"):
        tuner.attention(*leaves, is_causal=True).backward(do)
    assert seen[-1].dq_mode == "atomic"  # the tuned config, where repeatability is not asked


DENSE = dataclasses.replace(PROBLEM, causal="none")


@pytest.mark.usefixtures("on_hopper")
def test_gluon_train_serves_a_dense_gradient_with_its_repeatable_backward(
        tmp_path: Path, deterministic: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Dense and not causal, gluon_train runs under deterministic algorithms, its backward
    given REPEATABLE_BACKWARD (dQ in KV-tile order); causal and masked calls it refuses."""
    store(tmp_path, *(measured_on(t, DENSE, tflops, None, device=H100) for t, tflops in (
        ("torch_sdpa_train", 100.0), ("gluon_cudnn_train", 110.0), ("gluon_train", 120.0))))
    choice = choose(Call(DENSE, True, H100))
    assert choice.implementation.name == "gluon_train", choice.why
    for problem in (PROBLEM, dataclasses.replace(DENSE, mask="sliding:64")):
        assert "deterministic" in (gluon_train_impl.GLUON_TRAIN.why_not(
            Call(problem, True, H100)) or "")

    seen: list[Any] = []

    def backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 o: torch.Tensor, lse: torch.Tensor, **kw: Any) -> tuple[torch.Tensor, ...]:
        seen.append(kw.get("config"))
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)

    def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: Any
                ) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.zeros_like(q), torch.zeros(q.shape[:-1])

    monkeypatch.setattr(gluon_train_impl, "gluon_attention_bwd", backward)
    monkeypatch.setattr(gluon_impl, "gluon_attention_fwd", forward)
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(s, generator=g, dtype=torch.float16) for s in (
        (DENSE.batch, DENSE.heads_q, DENSE.seqlen_q, DENSE.head_dim),
        (DENSE.batch, DENSE.heads_kv, DENSE.seqlen_kv, DENSE.head_dim),
        (DENSE.batch, DENSE.heads_kv, DENSE.seqlen_kv, DENSE.head_dim),
        (DENSE.batch, DENSE.heads_q, DENSE.seqlen_q, DENSE.head_dim)))
    leaves = [t.requires_grad_() for t in (q, k, v)]
    tuner.attention(*leaves, enable_gqa=True).backward(do)
    assert seen == [gluon_train_impl.REPEATABLE_BACKWARD]
    torch.use_deterministic_algorithms(False)
    tuner.attention(*[t.detach().requires_grad_() for t in (q, k, v)],
                    enable_gqa=True).backward(do)
    assert seen[-1] is None  # the tuned backward, where repeatability is not asked
