"""``tuner.install()``: a call of ``torch.nn.functional.scaled_dot_product_attention`` in code we
do not edit runs the dispatcher's choice; where that is SDPA, torch's own function runs (no
recursion, the same result); ``uninstall()`` puts torch's own function object back."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

import tuner
from templates.pytorch.sdpa import TORCH_SDPA_FUNCTION
from tuner.dispatch.plans import PLANS, clear_plans

pytestmark = pytest.mark.usefixtures("no_tuned_configs")


def third_party_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """What a library we do not own writes: the name looked up on torch at call time."""
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


@pytest.fixture
def installed() -> Iterator[None]:
    tuner.install()
    try:
        yield
    finally:
        tuner.uninstall()


def inputs() -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(1, 2, 96, 32, generator=g, dtype=torch.float16) for _ in range(3))


def test_an_unmodified_call_runs_the_dispatchers_choice(installed: None) -> None:
    q, k, v = inputs()
    clear_plans()
    with tuner.use_implementation("flash"):
        out = third_party_attention(q, k, v)
    chosen = {plan.choice.implementation.name for plan in PLANS.values()
              if getattr(plan.choice, "implementation", None) is not None}
    assert "flash" in chosen, chosen  # the dispatcher planned the call with our kernel
    ref = TORCH_SDPA_FUNCTION(q.float(), k.float(), v.float(), is_causal=True)
    torch.testing.assert_close(out.float(), ref, atol=2e-3, rtol=2e-3)


def test_where_the_dispatcher_chooses_sdpa_it_is_torchs_own_result(installed: None) -> None:
    q, k, v = inputs()
    assert tuner.installed() and F.scaled_dot_product_attention is tuner.attention
    out = third_party_attention(q, k, v)  # nothing measured: SDPA, through torch's function
    assert torch.equal(out, TORCH_SDPA_FUNCTION(q, k, v, is_causal=True))


def test_uninstall_restores_torchs_function_object() -> None:
    tuner.install()
    tuner.install()  # idempotent
    tuner.uninstall()
    assert F.scaled_dot_product_attention is TORCH_SDPA_FUNCTION and not tuner.installed()
    tuner.uninstall()  # idempotent
    assert F.scaled_dot_product_attention is TORCH_SDPA_FUNCTION


def test_install_will_not_stack_on_another_patch(monkeypatch: pytest.MonkeyPatch) -> None:
    def someone_elses(*args: object, **kwargs: object) -> torch.Tensor:
        raise AssertionError("not called")

    monkeypatch.setattr(F, "scaled_dot_product_attention", someone_elses)
    with pytest.raises(RuntimeError, match="already replaced.*someone_elses"):
        tuner.install()
    assert F.scaled_dot_product_attention is someone_elses
