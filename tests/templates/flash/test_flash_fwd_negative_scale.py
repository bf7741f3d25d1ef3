"""A negative softmax scale (issue 41, item 6): the flash kernel forced on fp16 with
``scale=-1.0`` returned NaN where SDPA is finite. The unmasked blocks took the row max of the
raw scores times the scale, which is the max of the scaled scores only for a positive scale."""

from __future__ import annotations

import pytest
import torch

import tuner
from templates.attention_reference import attention_reference
from templates.base import relative_error
from templates.flash.fwd import flash_attention_fwd


def inputs(device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    # 64 keys: with the default config's blocks, whole unmasked blocks beside masked ones.
    return tuple(torch.randn(1, 2, 64, 64, generator=gen).to(device, torch.float16)
                 for _ in range(3))  # type: ignore[return-value]


@pytest.mark.parametrize("causal", ["none", "top_left", "bottom_right"])
@pytest.mark.parametrize("scale", [-1.0, -0.125])
def test_a_negative_scale_gives_the_reference(causal: str, scale: float, device: str) -> None:
    q, k, v = inputs(device)
    o, lse = flash_attention_fwd(q, k, v, causal=causal, scale=scale)
    ref_o, ref_lse = attention_reference(q, k, v, causal=causal, scale=scale)
    assert torch.isfinite(o).all() and torch.isfinite(lse).all()
    assert relative_error(o, ref_o) < 2e-2
    assert torch.allclose(lse.double(), ref_lse, atol=1e-2)


def test_tuner_attention_on_flash_is_finite_where_sdpa_is(device: str) -> None:
    q, k, v = inputs(device)
    with tuner.use_implementation("flash"):
        o = tuner.attention(q, k, v, scale=-1.0)
    assert torch.isfinite(o).all()
    if device == "cpu":  # SDPA's math backend; on the H200 its flash backend gives NaN here too
        sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=-1.0)
        assert torch.isfinite(sdpa).all()
    ref, _ = attention_reference(q, k, v, causal="none", scale=-1.0)
    assert relative_error(o, ref) < 2e-2
