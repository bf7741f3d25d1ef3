"""attn_implementation="tuner" in Hugging Face transformers (skipped where it is not installed)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed here (the GPU host has it)")

import tuner  # noqa: E402
from tuner.attention import _PLANS  # noqa: E402
from tuner.hf import register_transformers  # noqa: E402


@pytest.fixture(autouse=True)
def flash_kernels() -> Any:
    """Our kernels, not the SDPA that unmeasured calls fall back to (else nothing is tested)."""
    with tuner.use_implementation("flash"):
        yield


def tiny_llama(attn: str, device: str) -> Any:
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn)
    return model.to(device).eval()


@pytest.mark.slow
def test_llama_logits_match_sdpa(device: str) -> None:
    name = register_transformers()
    ids = torch.randint(0, 64, (2, 16), device=device)
    sdpa = tiny_llama("sdpa", device)
    ours = tiny_llama(name, device)
    ours.load_state_dict(sdpa.state_dict())
    _PLANS.clear()
    with torch.no_grad():
        expected = sdpa(ids).logits
        got = ours(ids).logits
    assert _PLANS, "the model did not call tuner.attention"
    torch.testing.assert_close(got, expected, rtol=1e-3, atol=1e-3)


def test_greedy_decoding_with_a_kv_cache_matches_sdpa(device: str) -> None:
    name = register_transformers()
    sdpa = tiny_llama("sdpa", device)
    ours = tiny_llama(name, device)
    ours.load_state_dict(sdpa.state_dict())
    ids = torch.randint(0, 64, (1, 8), device=device)
    kwargs = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        expected = sdpa.generate(ids, **kwargs)
        got = ours.generate(ids, **kwargs)  # prefill (causal), then one-token steps
    assert torch.equal(got, expected)


def test_padded_batch_matches_sdpa_on_the_real_tokens(device: str) -> None:
    """A left-padded batch gets transformers' boolean mask, run by the masked kernel."""
    name = register_transformers()
    sdpa = tiny_llama("sdpa", device)
    ours = tiny_llama(name, device)
    ours.load_state_dict(sdpa.state_dict())
    ids = torch.randint(0, 64, (2, 12), device=device)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # left padding
    with torch.no_grad():
        expected = sdpa(ids, attention_mask=mask).logits
        got = ours(ids, attention_mask=mask).logits
    real = mask.bool()  # padded positions are garbage in both (SDPA may even give NaN)
    torch.testing.assert_close(got[real], expected[real], rtol=1e-3, atol=1e-3)
