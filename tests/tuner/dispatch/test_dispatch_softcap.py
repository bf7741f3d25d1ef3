"""Softcapped calls (``tuner.attention(..., softcap=...)``, Gemma 2): chosen between our
kernels and eager attention (what transformers runs for them), never torch SDPA, which cannot
cap scores; tiny shapes under the interpreter."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import tuner
from templates.attention_reference import attention_reference
from templates.base import Problem
from templates.flash.bwd import reference_grads
from templates.masks.block_mask import BlockMask
from templates.pytorch.eager import eager_attention
from tests.tuner.dispatch.test_dispatch import measured, store
from tuner.attention import plan_for
from tuner.dispatch.implementations import get_implementation
from tuner.dispatch.implementations.call import call_of
from tuner.dispatch.rule import choose, use_implementation

pytestmark = pytest.mark.usefixtures("no_tuned_configs")

CAP = 5.0


def qkv(device: str, lq: int = 24, lk: int = 40, heads: int = 4, heads_kv: int = 2,
        seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Scores up to ~20, so that the cap bends them."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(1, heads, lq, 16, generator=gen).to(device) * 3,
            torch.randn(1, heads_kv, lk, 16, generator=gen).to(device) * 3,
            torch.randn(1, heads_kv, lk, 16, generator=gen).to(device))


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: str = "none",
              mask: torch.Tensor | None = None) -> torch.Tensor:
    return attention_reference(q, k, v, causal=causal, scale=1 / math.sqrt(q.shape[-1]),
                               mask=mask, softcap=CAP)[0]


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.detach().double() - ref.double()).norm() / ref.double().norm())


def test_unmeasured_softcap_runs_eager_attention_never_sdpa(device: str) -> None:
    q, k, v = qkv(device)
    for needs_grad in (False, True):
        choice = plan_for(q, k, v, is_causal=True, enable_gqa=True, needs_grad=needs_grad,
                          softcap=CAP)
        assert choice.implementation.name == "eager", choice.why
        assert "sdpa" not in {e.implementation for e in choice.estimates}
    call = call_of(q, k, True, False, softcap=CAP)
    reason = get_implementation("sdpa").why_not(call)
    assert reason is not None and "softcap" in reason
    out = tuner.attention(q, k, v, is_causal=True, enable_gqa=True, softcap=CAP)
    assert rel(out, reference(q, k, v, "top_left")) < 1e-5


def test_sdpa_is_never_chosen_for_softcap_even_when_measured_fastest(tmp_path: Path,
                                                                     device: str) -> None:
    """SDPA measured blazing on the uncapped problem, ours and eager on the capped one: the
    capped call runs the faster of those two, the uncapped one SDPA."""
    q, k, v = qkv(device)
    plain = Problem(1, 4, 2, 24, 40, 16, "float32", "none")
    capped = Problem(1, 4, 2, 24, 40, 16, "float32", "none", softcap=CAP)
    store(tmp_path, measured("torch_sdpa", plain, 1000.0), measured("flash_fwd", plain, 1.0),
          measured("torch_eager", capped, 1.0), measured("flash_fwd", capped, 5.0))
    assert plan_for(q, k, v, enable_gqa=True).implementation.name == "sdpa"
    choice = plan_for(q, k, v, enable_gqa=True, softcap=CAP)
    assert choice.implementation.name == "flash" and choice.match == "exact", choice.why
    assert {e.implementation for e in choice.estimates} == {"flash", "eager"}
    out = tuner.attention(q, k, v, enable_gqa=True, softcap=CAP)
    assert rel(out, reference(q, k, v)) < 1e-5


def test_eager_measured_faster_runs_eager(tmp_path: Path, device: str) -> None:
    q, k, v = qkv(device)
    capped = Problem(1, 4, 2, 24, 40, 16, "float32", "none", softcap=CAP)
    store(tmp_path, measured("torch_eager", capped, 9.0), measured("flash_fwd", capped, 1.0))
    assert plan_for(q, k, v, enable_gqa=True, softcap=CAP).implementation.name == "eager"


@pytest.mark.parametrize("causal", [False, True])
def test_training_through_our_kernels_with_softcap(causal: bool, device: str) -> None:
    """A gradient through the training op (tuner::attention_fwd / _bwd) with the cap, against
    the float64 reference, odd lengths and GQA."""
    q, k, v = qkv(device, lq=29, lk=29 if causal else 45)
    do = torch.randn(q.shape, device=device)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    with use_implementation("flash"):
        out = tuner.attention(leaves[0], leaves[1], leaves[2], is_causal=causal,
                              enable_gqa=True, softcap=CAP)
    out.backward(do)
    mode = "top_left" if causal else "none"
    assert rel(out, reference(q, k, v, mode)) < 1e-5
    refs = reference_grads(q, k, v, do, causal=mode, scale=0.25, softcap=CAP)
    for leaf, ref in zip(leaves, refs, strict=True):
        assert leaf.grad is not None and rel(leaf.grad, ref) < 1e-4


def test_block_masks_and_dense_masks_with_softcap(device: str) -> None:
    """A block mask runs ours with the cap; an elementwise mask no pattern recognizes runs
    ours too (SDPA, which would run it uncapped, never does)."""
    q, k, v = qkv(device, lq=32, lk=32)
    dense = (torch.rand(32, 32, generator=torch.Generator().manual_seed(1)) > 0.3).to(device)
    dense[:, 0] = True
    block_mask = BlockMask.from_dense(dense, block_size=(16, 16))
    out = tuner.attention(q, k, v, enable_gqa=True, block_mask=block_mask, softcap=CAP)
    assert rel(out, reference(q, k, v, mask=dense)) < 1e-5
    out = tuner.attention(q, k, v, attn_mask=dense, enable_gqa=True, softcap=CAP)
    assert rel(out, reference(q, k, v, mask=dense)) < 1e-5


def test_dropout_or_float64_with_softcap_run_eager_attention(device: str) -> None:
    q, k, v = (t.double() for t in qkv(device))
    out = tuner.attention(q, k, v, enable_gqa=True, softcap=CAP)
    assert rel(out, reference(q, k, v)) < 1e-10
    torch.manual_seed(3)
    dropped = tuner.attention(q.float(), k.float(), v.float(), dropout_p=0.5, enable_gqa=True,
                              softcap=CAP)
    torch.manual_seed(3)
    expected = eager_attention(q.float(), k.float(), v.float(), dropout_p=0.5, softcap=CAP)
    torch.testing.assert_close(dropped, expected)
    with use_implementation("flash"), pytest.raises(NotImplementedError, match="dropout"):
        tuner.attention(q.float(), k.float(), v.float(), dropout_p=0.5, enable_gqa=True,
                        softcap=CAP)


def test_none_or_zero_softcap_is_the_plain_call(device: str) -> None:
    q, k, v = qkv(device)
    plain = tuner.attention(q, k, v, enable_gqa=True)
    for off in (None, 0, 0.0):
        torch.testing.assert_close(tuner.attention(q, k, v, enable_gqa=True, softcap=off),
                                   plain, rtol=0, atol=0)
    assert call_of(q, k, False, False, softcap=0.0).problem == call_of(q, k, False,
                                                                       False).problem


@pytest.mark.parametrize("bad,error", [(-1.0, ValueError), (float("nan"), ValueError),
                                       (float("inf"), ValueError), ("50", TypeError),
                                       (True, TypeError)])
def test_bad_softcap_is_refused_by_name(bad: object, error: type[Exception],
                                       device: str) -> None:
    q, k, v = qkv(device)
    with pytest.raises(error, match=r"softcap must be a finite number >= 0 \(0 or None"):
        tuner.attention(q, k, v, enable_gqa=True, softcap=bad)  # type: ignore[arg-type]
    with pytest.raises(error, match="softcap must be a finite number"):
        plan_for(q, k, v, enable_gqa=True, softcap=bad)  # type: ignore[arg-type]


def test_forcing_an_implementation_that_cannot_cap_says_why(device: str) -> None:
    q, k, v = qkv(device)
    with use_implementation("sdpa"), pytest.raises(ValueError, match="softcap"):
        tuner.attention(q, k, v, enable_gqa=True, softcap=CAP)
    with pytest.raises(ValueError, match="softcap"), use_implementation("sdpa"):
        choose(call_of(q, k, False, False, softcap=CAP))


def test_softcap_compiles_in_one_graph_forward_and_backward(device: str) -> None:
    """Under torch.compile the cap travels through the ops (after the mask's arguments):
    ours forward and backward, and eager attention as the torch operations it is."""
    q, k, v = qkv(device, lq=40, lk=40)

    def f(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return tuner.attention(q, k, v, is_causal=True, enable_gqa=True, softcap=CAP)

    ref = reference(q, k, v, "top_left")
    with use_implementation("flash"):
        compiled = torch.compile(f, fullgraph=True)
        assert rel(compiled(q, k, v), ref) < 1e-5
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        compiled(leaves[0], leaves[1], leaves[2]).sum().backward()
    eager_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    eager_attention(eager_leaves[0], eager_leaves[1], eager_leaves[2], causal=True,
                    softcap=CAP).sum().backward()
    for ours, theirs in zip(leaves, eager_leaves, strict=True):
        assert ours.grad is not None and theirs.grad is not None
        assert rel(ours.grad, theirs.grad) < 1e-4
    assert rel(torch.compile(f, fullgraph=True)(q, k, v), ref) < 1e-5
