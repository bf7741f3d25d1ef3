"""The softcapped problems' torch templates: eager attention (the baseline, as transformers
runs Gemma 2) and FlexAttention's score_mod, against the float64 reference."""

from __future__ import annotations

import pytest
import torch

from templates.attention_reference import attention_reference
from templates.base import TOLERANCE, Problem
from templates.device import current_device
from templates.masks.mods import pattern_block_mask
from templates.pytorch.eager import eager_attention
from templates.pytorch.flex import flex
from templates.registry import get_template

CAP = 5.0


def test_eager_templates_take_softcapped_dense_problems_only() -> None:
    capped = Problem(1, 4, 2, 40, 40, 16, "float32", "top_left", softcap=CAP)
    for name in ("torch_eager", "torch_eager_train"):
        template = get_template(name)
        assert template.unsupported(capped) is None
        plain = template.unsupported(Problem(1, 4, 2, 40, 40, 16, "float32", "top_left"))
        assert plain is not None and "torch_sdpa" in plain
        masked = template.unsupported(Problem(1, 4, 2, 256, 256, 16, "float32", "none",
                                              mask="sliding_causal:64", softcap=CAP))
        assert masked is not None and "dense" in masked
        inputs = template.make_inputs(capped, "cpu")
        out = template.run(inputs, template.default_config(capped, current_device()))
        assert template.error(out, template.reference(inputs)) < TOLERANCE["float32"]


def test_eager_attention_gives_zeros_for_rows_that_see_no_key() -> None:
    q, k, v = torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16)
    mask = torch.ones(8, 8, dtype=torch.bool)
    mask[3] = False
    out = eager_attention(q, k, v, attn_mask=mask, softcap=CAP)
    assert torch.equal(out[:, :, 3], torch.zeros_like(out[:, :, 3]))
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("softcap", [0.0, CAP])
def test_flex_caps_by_a_score_mod(softcap: float) -> None:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 256, 16, generator=gen) * 3
    k, v = torch.randn(1, 2, 256, 16, generator=gen) * 3, torch.randn(1, 2, 256, 16,
                                                                       generator=gen)
    block_mask = pattern_block_mask("sliding_causal:64", 256, 256, device="cpu")
    out = flex(q, k, v, block_mask, enable_gqa=True, softcap=softcap)
    ref = attention_reference(q, k, v, causal="none", scale=0.25, mask=block_mask.to_dense(),
                              softcap=softcap)[0]
    assert float((out.double() - ref).norm() / ref.norm()) < 1e-5
