"""``tuner.install()`` with a library we do not edit: a transformers model built with
``attn_implementation="sdpa"`` calls torch's ``F.scaled_dot_product_attention`` itself; installed,
those calls run the dispatcher's choice; uninstalled, the model gives torch's result bit for bit
(skipped where transformers is not installed; the GPU host has it)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed here (the GPU host has it)")

import tuner  # noqa: E402
from tests.tuner.test_attention_hf import tiny_llama  # noqa: E402
from tuner.dispatch.plans import PLANS, clear_plans  # noqa: E402

pytestmark = pytest.mark.usefixtures("no_tuned_configs")


def planned() -> set[str]:
    return {plan.choice.implementation.name for plan in PLANS.values()
            if getattr(plan.choice, "implementation", None) is not None}


def test_an_unedited_transformers_model_runs_the_dispatcher_and_uninstall_restores_torch(
        device: str) -> None:
    model = tiny_llama("sdpa", device).half()  # transformers' own "sdpa" path, unmodified
    ids = torch.randint(0, 64, (2, 24), device=device)
    with torch.no_grad():
        before = model(ids).logits
        clear_plans()
        tuner.install()
        try:
            with tuner.use_implementation("flash"):  # ours, not the SDPA it would fall back to
                routed = model(ids).logits
        finally:
            tuner.uninstall()
        assert "flash" in planned(), planned()  # the model's own calls reached the dispatcher
        torch.testing.assert_close(routed.float(), before.float(), atol=2e-2, rtol=2e-2)
        clear_plans()
        after = model(ids).logits
    assert not planned()  # uninstalled: no call reaches the dispatcher
    assert torch.equal(after, before)  # torch's behaviour, bit for bit
