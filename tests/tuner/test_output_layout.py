"""The forward's output layout: laid out as q where q is a (B, N, H, D) tensor viewed as
(B, H, N, D) (what transformers passes), so that its ``o.transpose(1, 2).contiguous()`` is free
(on the H100 that copy cost 90 us a layer of an 8k Llama prefill, more than our kernel gained
over cuDNN); contiguous otherwise. The custom ops' fakes must say the same strides as the real
ops, or torch.compile plans the wrong layout."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import tuner
from templates.kernel_common import output_strides
from tuner.attention import _attention_inference


@pytest.fixture(autouse=True)
def flash_kernels(no_tuned_configs: None) -> Iterator[None]:
    with tuner.use_implementation("flash"):
        yield


def bnhd(batch: int, heads: int, seqlen: int, dim: int, device: str) -> torch.Tensor:
    return torch.randn(batch, seqlen, heads, dim, device=device,
                       dtype=torch.float16).transpose(1, 2)


def test_output_strides_follow_a_bnhd_q_only() -> None:
    shape = (2, 4, 33, 64)
    assert output_strides(shape, (8448, 64, 256, 1)) == (8448, 64, 256, 1)  # (B, N, H, D) view
    assert output_strides(shape, (8448, 2112, 64, 1)) == (8448, 2112, 64, 1)  # contiguous
    # A packed qkv view ((B, N, 3, H, D) -> q): still q's row order, o's own row pitch.
    assert output_strides(shape, (3 * 8448, 64, 3 * 256, 1)) == (8448, 64, 256, 1)
    # One head or one row: both layouts hold the same bytes; o is plain contiguous.
    assert output_strides((2, 1, 33, 64), (2112, 64, 64, 1)) == (2112, 2112, 64, 1)
    assert output_strides((2, 4, 1, 64), (256, 64, 256, 1)) == (256, 64, 64, 1)


def test_attention_of_a_bnhd_q_transposes_back_for_free(device: str) -> None:
    torch.manual_seed(0)
    q, k, v = bnhd(1, 4, 40, 16, device), bnhd(1, 2, 40, 16, device), bnhd(1, 2, 40, 16, device)
    o = tuner.attention(q, k, v, is_causal=True, enable_gqa=True)
    assert o.transpose(1, 2).is_contiguous()
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), is_causal=True, enable_gqa=True)
    assert float((o.double() - ref).norm() / ref.norm()) < 2e-3


@pytest.mark.parametrize("layout", ["bnhd", "bhnd", "3d"])
def test_ops_fakes_match_the_real_strides(device: str, layout: str) -> None:
    torch.manual_seed(0)
    if layout == "bnhd":
        q, k, v = bnhd(2, 4, 24, 16, device), bnhd(2, 4, 24, 16, device), bnhd(2, 4, 24, 16,
                                                                                device)
    else:
        shape = (4, 24, 16) if layout == "3d" else (2, 4, 24, 16)
        q, k, v = (torch.randn(shape, device=device, dtype=torch.float16) for _ in range(3))
    # opcheck's fake-tensor test runs the real op and its fake and compares their outputs'
    # shapes, dtypes and strides.
    torch.library.opcheck(torch.ops.tuner.attention_fwd.default, (q, k, v, False, None, False),
                          test_utils=("test_faketensor",))
    torch.library.opcheck(_attention_inference, (q, k, v, False, None, False, "flash"),
                          test_utils=("test_faketensor",))
    # The backward op's gradients: laid out as q, k and v (``torch.empty_like``), so a packed
    # caller's need no copy; its fake says so too.
    o, lse = torch.ops.tuner.attention_fwd.default(q, k, v, False, None, False)
    grad_o = torch.randn_like(o)
    torch.library.opcheck(torch.ops.tuner.attention_bwd.default,
                          (grad_o, q, k, v, o, lse, False, None, False),
                          test_utils=("test_faketensor",))
    grads = torch.ops.tuner.attention_bwd.default(grad_o, q, k, v, o, lse, False, None, False)
    for grad, t in zip(grads, (q, k, v), strict=True):
        assert grad.stride() == torch.empty_like(t).stride()
