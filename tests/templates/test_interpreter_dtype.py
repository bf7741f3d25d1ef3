"""bfloat16 under the CPU interpreter (issue 20): the kernels compute on float32 copies and
return bfloat16, so the answers match the reference instead of being off by 1e8.

Without the upcast every check here fails by orders of magnitude: the interpreter's bf16
``tl.dot`` is wrong (templates/interpreter_dtype.py)."""

from __future__ import annotations

import pytest
import torch

import tuner
from templates.attention_reference import attention_reference, lse_error
from templates.base import TOLERANCE, Problem, relative_error
from templates.decode.template import TEMPLATE as DECODE
from templates.device import current_device, interpreter_active
from templates.flash import fwd as flash_fwd
from templates.flash.autograd import flash_attention
from templates.flash.bwd import flash_attention_bwd, reference_grads
from templates.flash.fwd import flash_attention_fwd, launch_plan
from templates.interpreter_dtype import Float32Plan
from templates.masks.block_mask import BlockMask
from templates.masks.mods import causal_mask

pytestmark = pytest.mark.skipif(not interpreter_active(),
                                reason="bf16 is upcast only under the Triton interpreter")
TOL = TOLERANCE["bfloat16"]


def bf16(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def test_forward_in_bf16_matches_the_reference() -> None:
    q, k, v = bf16(2, 4, 40, 32, seed=0), bf16(2, 2, 50, 32, seed=1), bf16(2, 2, 50, 32, seed=2)
    for causal in ("none", "bottom_right"):
        o, lse = flash_attention_fwd(q, k, v, causal=causal)
        o_ref, lse_ref = attention_reference(q.float(), k.float(), v.float(), causal=causal,
                                             scale=32 ** -0.5)
        assert o.dtype == torch.bfloat16 and lse.dtype == torch.float32
        assert relative_error(o, o_ref) <= TOL and lse_error(lse, lse_ref) <= TOL


def test_forward_masks_and_strided_views_in_bf16() -> None:
    # (B, N, H, D) storage seen as (B, H, N, D): the float32 copies keep those strides.
    q = bf16(1, 48, 2, 32, seed=3).transpose(1, 2)
    k, v = bf16(1, 48, 2, 32, seed=4).transpose(1, 2), bf16(1, 48, 2, 32, seed=5).transpose(1, 2)
    additive = bf16(1, 1, 48, 48, seed=6)
    allowed = torch.rand(1, 2, 48, 48, generator=torch.Generator().manual_seed(7)) < 0.7
    allowed[..., 0] = True  # every row sees a key
    for mask in (additive, allowed):
        o, _ = flash_attention_fwd(q, k, v, attn_mask=mask)
        ref, _ = attention_reference(q.float(), k.float(), v.float(), causal="none",
                                     scale=32 ** -0.5, mask=mask.float() if mask.is_floating_point()
                                     else mask)
        assert relative_error(o, ref) <= TOL
    block_mask = BlockMask.from_mask_mod(causal_mask(), None, None, 48, 48, 16)
    o, _ = flash_attention_fwd(q, k, v, block_mask=block_mask)
    ref, _ = attention_reference(q.float(), k.float(), v.float(), causal="top_left",
                                 scale=32 ** -0.5)
    assert relative_error(o, ref) <= TOL


def test_the_plan_is_kept_and_serves_new_values() -> None:
    q, k, v = bf16(1, 2, 33, 16, seed=8), bf16(1, 2, 33, 16, seed=9), bf16(1, 2, 33, 16, seed=10)
    plan = launch_plan(q, k, v, causal=True)
    assert isinstance(plan, Float32Plan) and launch_plan(q, k, v, causal=True) is plan
    for seed in (11, 12):  # the same layout, other values: the kept plan's float32 kernel
        q = bf16(1, 2, 33, 16, seed=seed)
        o, _ = plan(q, k, v)
        ref, _ = attention_reference(q.float(), k.float(), v.float(), causal="top_left",
                                     scale=16 ** -0.5)
        assert o.dtype == torch.bfloat16 and relative_error(o, ref) <= TOL
    assert isinstance(launch_plan(q.half(), k.half(), v.half()), flash_fwd.kernel.LaunchPlan)


def test_backward_and_autograd_in_bf16() -> None:
    q, k, v = bf16(1, 4, 40, 32, seed=13), bf16(1, 2, 40, 32, seed=14), bf16(1, 2, 40, 32, seed=15)
    do = bf16(1, 4, 40, 32, seed=16)
    o, lse = flash_attention_fwd(q, k, v, causal=True)
    grads = flash_attention_bwd(do, q, k, v, o, lse, causal=True)
    refs = reference_grads(q.float(), k.float(), v.float(), do.float(), causal="top_left",
                           scale=32 ** -0.5)
    for got, ref in zip(grads, refs, strict=True):
        assert got.dtype == torch.bfloat16 and relative_error(got, ref) <= TOL
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    flash_attention(*leaves, causal=True).backward(do)
    for leaf, ref in zip(leaves, refs, strict=True):
        assert leaf.grad is not None and relative_error(leaf.grad, ref) <= TOL


@pytest.mark.parametrize("mask", ["none", "paged:16"])
def test_decode_in_bf16(mask: str) -> None:
    problem = Problem(2, 4, 2, 1, 100, 32, dtype="bfloat16", causal="none", mask=mask)
    inputs = DECODE.make_inputs(problem, "cpu")
    out = DECODE.run(inputs, DECODE.default_config(problem, current_device()))
    assert out[0].dtype == torch.bfloat16
    assert DECODE.error(out, DECODE.reference(inputs)) <= DECODE.tolerance(problem)


def test_tuner_attention_in_bf16_on_the_cpu() -> None:
    q, k, v = bf16(1, 2, 24, 16, seed=17), bf16(1, 2, 24, 16, seed=18), bf16(1, 2, 24, 16, seed=19)
    out = tuner.attention(q, k, v, is_causal=True)
    ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(),
                                                           is_causal=True)
    assert out.dtype == torch.bfloat16 and relative_error(out, ref) <= TOL
