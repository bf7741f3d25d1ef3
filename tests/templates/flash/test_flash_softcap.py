"""Softcapped scores (``softcap * tanh(s / softcap)``, Gemma 2) in the flash forward and
backward, against the float64 torch reference, under the CPU interpreter (fp16/fp32).

The cap is a problem attribute: the uncapped kernels stay what they were (their tests run
unchanged), and a capped problem keys apart from an uncapped one."""

from __future__ import annotations

import math

import pytest
import torch

import templates  # noqa: F401  (registers the templates)
from templates.attention_reference import attention_reference, lse_error
from templates.base import TOLERANCE, Problem, relative_error
from templates.device import current_device
from templates.flash import bwd_kernel as flash_bwd_kernel
from templates.flash import fwd_kernel as flash_fwd_kernel
from templates.flash.autograd import flash_attention
from templates.flash.bwd import reference_grads
from templates.flash.fwd import flash_attention_fwd
from templates.masks.block_mask import BlockMask
from templates.registry import all_templates, get_template

FWD = dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1)
BWD = dict(BLOCK_M1=16, BLOCK_N1=16, BLOCK_M2=16, BLOCK_N2=16)
CAP = 5.0  # small against the scores below (|s| up to ~20), so the cap bends most of them


@pytest.fixture(autouse=True)
def poison_outputs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Outputs start as NaN: any element a kernel fails to write fails the check."""
    monkeypatch.setattr(flash_bwd_kernel, "DEBUG_POISON", True)
    monkeypatch.setattr(flash_fwd_kernel, "DEBUG_POISON", True)


def qkv(heads_q: int, heads_kv: int, seqlen_q: int, seqlen_kv: int, dtype: torch.dtype,
        device: str, head_dim: int = 32, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Scores of a few units up to ~20 (x3 inputs): uncapped and capped softmaxes differ."""
    gen = torch.Generator().manual_seed(seed)

    def randn(heads: int, n: int, mult: float) -> torch.Tensor:
        return (torch.randn(1, heads, n, head_dim, generator=gen) * mult).to(device, dtype)

    return (randn(heads_q, seqlen_q, 3.0), randn(heads_kv, seqlen_kv, 3.0),
            randn(heads_kv, seqlen_kv, 1.0), randn(heads_q, seqlen_q, 1.0))


CASES = [  # (causal, heads_q, heads_kv, seqlen_q, seqlen_kv, dq_mode)
    ("none", 2, 2, 37, 53, "atomic"),
    ("top_left", 4, 2, 45, 45, "separate"),
    ("top_left", 4, 1, 30, 70, "atomic"),  # MQA, seqlen_q < seqlen_kv: top-left
    ("bottom_right", 4, 2, 30, 70, "separate"),
    ("bottom_right", 2, 1, 70, 30, "atomic"),  # rows before the diagonal see no key
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("causal,hq,hkv,nq,nkv,dq_mode", CASES)
def test_forward_and_gradients_match_the_float64_reference(
        causal: str, hq: int, hkv: int, nq: int, nkv: int, dq_mode: str,
        dtype: torch.dtype, device: str) -> None:
    q, k, v, do = qkv(hq, hkv, nq, nkv, dtype, device)
    scale = 1.0 / math.sqrt(q.shape[-1])
    o, lse = flash_attention_fwd(q, k, v, causal=causal, softcap=CAP, config=FWD)
    o_ref, lse_ref = attention_reference(q, k, v, causal=causal, scale=scale, softcap=CAP)
    uncapped, _ = attention_reference(q, k, v, causal=causal, scale=scale)
    tol = TOLERANCE[{torch.float32: "float32", torch.float16: "float16"}[dtype]]
    assert relative_error(o, o_ref) < tol
    assert lse_error(lse, lse_ref) < tol
    assert relative_error(uncapped, o_ref) > 50 * tol  # the cap matters at these scores

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = flash_attention(*leaves, causal=causal, softcap=CAP, fwd_config=FWD,
                          bwd_config=dict(BWD, dq_mode=dq_mode))
    out.backward(do)
    refs = reference_grads(q, k, v, do, causal=causal, scale=scale, softcap=CAP)
    for name, leaf, ref in zip("qkv", leaves, refs, strict=True):
        assert leaf.grad is not None
        err = relative_error(leaf.grad, ref)
        assert err < (5 if dtype == torch.float16 else 1) * tol, (name, err)


def test_a_negative_scale_and_a_large_cap_are_right(device: str) -> None:
    """The launcher runs a negative scale as -q (the unmasked step takes the max before
    scaling); capped scores are the same either way. A cap far above the scores changes
    almost nothing, and must not lose accuracy near tanh(0)."""
    q, k, v, do = qkv(2, 2, 33, 33, torch.float32, device)
    for scale, cap in ((-0.2, CAP), (0.2, 1e4)):
        o, lse = flash_attention_fwd(q, k, v, scale=scale, softcap=cap, config=FWD)
        o_ref, lse_ref = attention_reference(q, k, v, causal="none", scale=scale, softcap=cap)
        assert relative_error(o, o_ref) < 1e-5
        assert lse_error(lse, lse_ref) < 1e-5


def test_a_fully_masked_row_gives_zeros_and_zero_gradients(device: str) -> None:
    """A block mask that hides every key from some query rows: o = 0, lse = -inf, no NaN in
    any gradient (the cap runs before the mask, so hidden scores never reach the softmax)."""
    q, k, v, do = qkv(2, 2, 32, 32, torch.float32, device)
    dense = torch.ones(32, 32, dtype=torch.bool, device=device)
    dense[:16] = False  # the first query block sees nothing
    block_mask = BlockMask.from_dense(dense, block_size=(16, 16))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    o = flash_attention(*leaves, block_mask=block_mask, softcap=CAP, fwd_config=FWD,
                        bwd_config=dict(BWD, dq_mode="separate"))
    o.backward(do)
    scale = 1.0 / math.sqrt(q.shape[-1])
    o_ref, _ = attention_reference(q, k, v, causal="none", scale=scale, mask=dense,
                                   softcap=CAP)
    assert torch.equal(o[:, :, :16].detach(), torch.zeros_like(o[:, :, :16]))
    assert relative_error(o, o_ref) < 1e-5
    refs = reference_grads(q, k, v, do, causal="none", scale=scale, mask=dense, softcap=CAP)
    for leaf, ref in zip(leaves, refs, strict=True):
        assert leaf.grad is not None and torch.isfinite(leaf.grad).all()
        assert relative_error(leaf.grad, ref) < 1e-5
    _, lse = flash_attention_fwd(q, k, v, block_mask=block_mask, softcap=CAP, config=FWD)
    assert torch.isneginf(lse[:, :, :16]).all()


def test_an_additive_attn_mask_adds_after_the_cap(device: str) -> None:
    """transformers' eager Gemma 2 caps, then adds its mask: so do the kernels."""
    q, k, v, do = qkv(2, 2, 24, 40, torch.float32, device)
    additive = torch.randn(24, 40, device=device) * 2
    scale = 1.0 / math.sqrt(q.shape[-1])
    o, _ = flash_attention_fwd(q, k, v, attn_mask=additive, softcap=CAP, config=FWD)
    o_ref, _ = attention_reference(q, k, v, causal="none", scale=scale, mask=additive,
                                   softcap=CAP)
    assert relative_error(o, o_ref) < 1e-5


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf"), "50", True])
def test_bad_softcaps_are_refused_by_name(bad: object, device: str) -> None:
    q, k, v, _ = qkv(1, 1, 16, 16, torch.float32, device)
    with pytest.raises((TypeError, ValueError), match="softcap must be a finite number >= 0"):
        flash_attention_fwd(q, k, v, softcap=bad)  # type: ignore[arg-type]
    with pytest.raises((TypeError, ValueError), match="Problem.softcap must be a finite"):
        Problem(1, 1, 1, 16, 16, 32, softcap=bad)  # type: ignore[arg-type]


def test_no_softcap_keys_and_serializes_as_before() -> None:
    plain = Problem(2, 8, 2, 1000, 1000, 128, "bfloat16", "top_left")
    for off in (None, 0, 0.0):
        same = Problem(2, 8, 2, 1000, 1000, 128, "bfloat16", "top_left",
                       softcap=off)  # type: ignore[arg-type]
        assert same == plain and same.key() == plain.key()
    assert plain.key() == "b2-hq8-hkv2-q1000-kv1000-d128-bfloat16-causal-top_left"
    assert plain.bucket_key() == "b2-hq8-hkv2-q1024-kv1024-d128-bfloat16-causal-top_left"
    assert "softcap" not in plain.to_dict()
    capped = Problem(2, 8, 2, 1000, 1000, 128, "bfloat16", "top_left", softcap=50)
    assert capped.key() == plain.key() + "+softcap50"
    assert capped.bucket_key() == plain.bucket_key() + "+softcap50"
    assert capped.softcap == 50.0 and capped == Problem.from_dict(capped.to_dict())
    assert Problem(1, 1, 1, 8, 8, 16, softcap=30.5).variant == "softcap30.5"


def test_templates_without_a_cap_refuse_softcapped_problems_by_name() -> None:
    capped = Problem(1, 8, 2, 512, 512, 128, "bfloat16", "top_left", softcap=50.0)
    takes = {t.name for t in all_templates() if t.unsupported(capped) is None}
    assert {"flash_fwd", "flash_bwd"} <= takes
    for name in ("torch_sdpa", "torch_sdpa_train"):
        reason = get_template(name).unsupported(capped)
        assert reason is not None and "softcap" in reason and name in reason
    for t in all_templates():
        if t.name.startswith("gluon") or t.name == "flash_decode":
            reason = t.unsupported(capped)
            assert reason is not None and ("softcap" in reason or "gluon" in reason.lower())


def test_the_templates_run_and_check_a_softcapped_problem(device: str) -> None:
    """What a sweep trial does: make_inputs, run, reference, error, for both templates."""
    problem = Problem(1, 2, 1, 40, 40, 32, "float32", "top_left", softcap=CAP)
    info = current_device()
    for name in ("flash_fwd", "flash_bwd"):
        template = get_template(name)
        inputs = template.make_inputs(problem, device)
        assert inputs["softcap"] == CAP
        out = template.run(inputs, template.default_config(problem, info))
        assert template.error(out, template.reference(inputs)) < TOLERANCE["float32"]
