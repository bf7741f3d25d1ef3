"""``tuner.install()`` with a library we do not edit: a transformers model built with
``attn_implementation="sdpa"`` calls torch's ``F.scaled_dot_product_attention`` itself; installed,
those calls run the dispatcher's choice; uninstalled, the model gives torch's result bit for bit
(skipped where transformers is not installed; the GPU host has it)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed here (the GPU host has it)")

import tuner  # noqa: E402
from tuner.dispatch.plans import PLANS, clear_plans  # noqa: E402

pytestmark = pytest.mark.usefixtures("no_tuned_configs")


def sdpa_llama(device: str) -> Any:
    """transformers' own "sdpa" path: code we do not own, unmodified."""
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    return model.to(device=device, dtype=torch.float16).eval()


def planned() -> set[str]:
    return {plan.choice.implementation.name for plan in PLANS.values()
            if getattr(plan.choice, "implementation", None) is not None}


def test_an_unedited_transformers_model_runs_the_dispatcher_and_uninstall_restores_torch(
        device: str) -> None:
    model = sdpa_llama(device)
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
