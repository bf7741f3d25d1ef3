"""A masked or training call is priced once per problem and kind of mask, not on every step:
pricing and working out a masked call's configs took ~0.7 ms of host time per forward +
backward (this CPU, kernels stood in for), about what such a step's kernels take on an H200
at 4 x 4k tokens, so the GPU waited on Python. What is kept is dropped when the database
changes (``clear_plans``), a different implementation is forced, deterministic mode
changes, or ``tuner.record`` listens (it counts every call)."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import pytest
import torch

import tuner
from templates.flash.fwd import pattern_mask

pytestmark = pytest.mark.usefixtures("no_tuned_configs")
flash_module = importlib.import_module("tuner.dispatch.implementations.flash")
attention_module = importlib.import_module("tuner.attention")

N = 256


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts of pricing (``choose_masked``) and of working out masked configs, with the
    kernels stood in for (only the host's work is under test)."""
    counts = {"choose_masked": 0, "configs": 0}
    real_choose, real_configs = attention_module.choose_masked, flash_module._masked_configs

    def choose_masked(*args: Any) -> Any:
        counts["choose_masked"] += 1
        return real_choose(*args)

    def configs(*args: Any) -> Any:
        counts["configs"] += 1
        return real_configs(*args)

    def fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: Any
            ) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.zeros_like(q), torch.zeros(q.shape[:-1])

    def bwd(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *rest: Any,
            **kw: Any) -> tuple[torch.Tensor, ...]:
        return torch.ones_like(q), torch.ones_like(k), torch.ones_like(v)

    monkeypatch.setattr(attention_module, "choose_masked", choose_masked)
    monkeypatch.setattr(flash_module, "_masked_configs", configs)
    monkeypatch.setattr(flash_module, "flash_attention_fwd", fwd)
    monkeypatch.setattr(flash_module, "flash_attention_bwd", bwd)
    attention_module.clear_plans()
    return counts


def step(mask: object) -> tuple[torch.Tensor, ...]:
    q, k, v = (torch.randn(1, 2, N, 16, requires_grad=True) for _ in range(3))
    with tuner.use_implementation("flash"):
        o = tuner.attention(q, k, v, block_mask=mask)
    return torch.autograd.grad(o, (q, k, v), torch.randn_like(o))


def test_a_masked_training_call_is_priced_once(counted: dict[str, int]) -> None:
    mask = pattern_mask("sliding_causal:64", N, N, "cpu")
    for _ in range(3):
        grads = step(mask)
    assert all(bool((g == 1).all()) for g in grads)  # the stand-in backward ran every step
    # One pricing; the configs worked out once for the forward and backward ops together.
    assert counted == {"choose_masked": 1, "configs": 1}
    step(pattern_mask("sliding_causal:32", N, N, "cpu"))  # another kind of mask: its own
    assert counted == {"choose_masked": 2, "configs": 2}


def test_what_is_kept_is_dropped_when_it_may_have_changed(counted: dict[str, int]) -> None:
    mask = pattern_mask("sliding_causal:64", N, N, "cpu")
    step(mask)
    attention_module.clear_plans()  # a new sweep
    step(mask)
    assert counted == {"choose_masked": 2, "configs": 2}
    torch.use_deterministic_algorithms(True)
    try:
        step(mask)
    finally:
        torch.use_deterministic_algorithms(False)
    assert counted["choose_masked"] == 3


def test_while_recording_every_call_is_priced(counted: dict[str, int], tmp_path: Path) -> None:
    mask = pattern_mask("sliding_causal:64", N, N, "cpu")
    with tuner.record(tmp_path / "job.toml"):
        step(mask)
        step(mask)
    assert counted["choose_masked"] == 2


def test_a_masked_inference_call_works_out_its_configs_once(counted: dict[str, int]) -> None:
    """Without a gradient (the masked forward of prefill and of tuner.varlen_attention)."""
    mask = pattern_mask("sliding_causal:64", N, N, "cpu")
    q, k, v = (torch.randn(1, 2, N, 16) for _ in range(3))
    with tuner.use_implementation("flash"):
        for _ in range(3):
            tuner.attention(q, k, v, block_mask=mask)
        assert counted == {"choose_masked": 1, "configs": 1}
        tuner.attention(q[:, :, :128], k[:, :, :128], v[:, :, :128],
                        block_mask=pattern_mask("sliding_causal:64", 128, 128, "cpu"))
        assert counted == {"choose_masked": 2, "configs": 2}  # another shape: its own
    attention_module.clear_plans()  # a new sweep
    with tuner.use_implementation("flash"):
        tuner.attention(q, k, v, block_mask=mask)
    assert counted == {"choose_masked": 3, "configs": 3}
