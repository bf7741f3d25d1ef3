"""tuner.hf passes transformers' ``softcap`` kwarg (Gemma 2's attn_logit_softcapping) on to
``tuner.attention`` on every path (no transformers needed: the hook is called as transformers
calls it; tests/tuner/test_attention_hf.py runs a Gemma 2 model where transformers is)."""

from __future__ import annotations

import pytest
import torch

from templates.attention_reference import attention_reference
from tests.tuner.dispatch.test_hf_sliding_mask import hf_mask
from tuner.dispatch.rule import use_implementation
from tuner.hf import tuner_attention_forward

pytestmark = pytest.mark.usefixtures("no_tuned_configs")

CAP = 5.0
N = 160


def layer_inputs(device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(1, 4, N, 16, generator=gen).to(device) * 3,
            torch.randn(1, 2, N, 16, generator=gen).to(device) * 3,
            torch.randn(1, 2, N, 16, generator=gen).to(device))


def assert_capped(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  causal: str, mask: torch.Tensor | None = None) -> None:
    ref = attention_reference(q, k, v, causal=causal, scale=0.25, mask=mask, softcap=CAP)[0]
    err = float((out.transpose(1, 2).double() - ref).norm() / ref.norm())
    assert err < 1e-5, err


@pytest.mark.parametrize("implementation", [None, "flash"])
def test_a_global_layer_caps_its_scores(implementation: str | None, device: str) -> None:
    """No mask (transformers' causal skip): eager where unmeasured, ours when forced."""
    q, k, v = layer_inputs(device)
    with use_implementation(implementation):
        out, _ = tuner_attention_forward(torch.nn.Module(), q, k, v, None, scaling=0.25,
                                         softcap=CAP)
    assert_capped(out, q, k, v, "top_left")


def test_a_sliding_layer_caps_its_scores_under_its_block_mask(device: str) -> None:
    q, k, v = layer_inputs(device)
    mask = hf_mask(N, 40, device)
    out, _ = tuner_attention_forward(torch.nn.Module(), q, k, v, mask, scaling=0.25,
                                     sliding_window=40, softcap=CAP)
    assert_capped(out, q, k, v, "none", mask)


def test_a_padded_mask_caps_its_scores(device: str) -> None:
    """A dense mask nothing recognizes (left padding): ours with the mask, capped; SDPA,
    which would drop the cap, never runs it."""
    q, k, v = layer_inputs(device)
    mask = hf_mask(N, N, device).clone()
    mask[..., :7] = False  # the first keys are padding
    mask[..., :7, 0] = True  # (padded rows see one key, as transformers' masks make them)
    out, _ = tuner_attention_forward(torch.nn.Module(), q, k, v, mask, scaling=0.25,
                                     softcap=CAP)
    assert_capped(out, q, k, v, "none", mask)


def test_no_softcap_kwarg_is_the_uncapped_call(device: str) -> None:
    q, k, v = layer_inputs(device)
    out, _ = tuner_attention_forward(torch.nn.Module(), q, k, v, None, scaling=0.25)
    ref = attention_reference(q, k, v, causal="top_left", scale=0.25)[0]
    assert float((out.transpose(1, 2).double() - ref).norm() / ref.norm()) < 1e-5
