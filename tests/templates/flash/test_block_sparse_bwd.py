"""The backward with a block mask and with SDPA's attn_mask: BlockMask.transposed, the
flash_bwd kernels against torch autograd through the reference with the equivalent dense mask,
the autograd Function, and the template on a masked sweep problem.

Under the CPU interpreter: small shapes, fp16/fp32. ``-m gpu``: bf16 and larger shapes.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

import templates.flash.bwd_kernel as bwd_kernel
import templates.flash.fwd_kernel as fwd_kernel
from templates import BlockMask, flash_attention_fwd
from templates.base import TOLERANCE, Problem, relative_error
from templates.flash.autograd import flash_attention
from templates.flash.bwd import flash_attention_bwd, reference_grads
from templates.masks.mods import (
    causal_mask,
    document_mask,
    pattern_block_mask,
    sliding_window_mask,
)
from templates.registry import get_template
from tests.templates.flash.test_block_sparse import qkv, random_block_mask

TOL = {dtype: TOLERANCE[name] for dtype, name in (
    (torch.float16, "float16"), (torch.bfloat16, "bfloat16"), (torch.float32, "float32"))}

# Tiles smaller than the mask blocks (32), so every listed block is several kernel steps.
ATOMIC = dict(BLOCK_M1=16, BLOCK_N1=32, num_warps=4, num_stages=2, dq_mode="atomic")
SEPARATE = dict(BLOCK_M1=32, BLOCK_N1=16, BLOCK_M2=16, BLOCK_N2=32, num_warps=4,
                num_stages=1, dq_mode="separate")


@pytest.fixture(autouse=True)
def poison_outputs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Outputs start as NaN: any element a kernel fails to write fails the check."""
    monkeypatch.setattr(bwd_kernel, "DEBUG_POISON", True)
    monkeypatch.setattr(fwd_kernel, "DEBUG_POISON", True)


def check_grads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                dense_mask: torch.Tensor | None, causal: str = "none",
                block_mask: BlockMask | None = None, attn_mask: torch.Tensor | None = None,
                config: dict[str, Any] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Forward and backward kernels with the masks vs autograd through the dense reference."""
    do = torch.randn_like(q)
    o, lse = flash_attention_fwd(q, k, v, causal=causal, block_mask=block_mask,
                                 attn_mask=attn_mask)
    grads = flash_attention_bwd(do, q, k, v, o, lse, causal=causal, block_mask=block_mask,
                                attn_mask=attn_mask, config=config)
    refs = reference_grads(q, k, v, do, causal=causal, scale=1 / math.sqrt(q.shape[-1]),
                           mask=dense_mask)
    for name, got, ref in zip(("dq", "dk", "dv"), grads, refs, strict=True):
        assert not torch.isnan(got).any(), f"{name}: NaN (or an unwritten element)"
        err = relative_error(got, ref)
        assert err <= TOL[q.dtype], f"{name}: relative error {err:.3g}"
    return grads


# -- BlockMask.transposed ----------------------------------------------------------------------
@pytest.mark.parametrize("shape,block", [((2, 3, 100, 77), 16), ((1, 1, 130, 257), (32, 16)),
                                         ((2, 1, 64, 64), 32)])
def test_transposed_mask_is_the_transpose(shape: tuple[int, ...], block: Any) -> None:
    dense = random_block_mask(*shape, 16, 0.5, seed=1)
    dense[..., :20, :20] = True
    mask = BlockMask.from_dense(dense, block)
    flipped = mask.transposed
    assert flipped.shape == (shape[0], shape[1], shape[3], shape[2])
    assert flipped.block_size == mask.block_size[::-1]
    assert torch.equal(flipped.to_dense(), dense.transpose(2, 3))
    assert flipped.transposed is mask and mask.transposed is flipped  # built once
    assert flipped.density() == pytest.approx(mask.density())


# -- the kernels ---------------------------------------------------------------------------------
@pytest.mark.parametrize("density", [0.1, 0.5, 0.9])
@pytest.mark.parametrize("config", [ATOMIC, SEPARATE], ids=["atomic", "separate"])
def test_random_block_masks_per_batch_and_head(density: float, config: dict[str, Any],
                                               device: str) -> None:
    torch.manual_seed(int(density * 10))
    q, k, v = qkv(2, 4, 2, 100, 77, 32, torch.float16, device)
    dense = random_block_mask(2, 4, 100, 77, 32, density, seed=int(density * 10)).to(device)
    # Mask blocks wider than tall: a transposed tile read with the wrong row stride shows.
    check_grads(q, k, v, dense_mask=dense, block_mask=BlockMask.from_dense(dense, (32, 64)),
                config=config)


@pytest.mark.parametrize("causal", ["top_left", "bottom_right"])
def test_helper_masks_with_causal_gqa_and_the_default_config(causal: str, device: str) -> None:
    torch.manual_seed(3)
    q, k, v = qkv(1, 4, 1, 70, 90, 32, torch.float16, device)
    mask = BlockMask.from_mask_mod(sliding_window_mask(30), None, None, 70, 90, 32,
                                   device=device)
    check_grads(q, k, v, dense_mask=mask.to_dense(), causal=causal, block_mask=mask)
    docs = BlockMask.from_mask_mod(document_mask([20, 30, 40]), None, None, 90, 90, 32,
                                   device=device)
    q, k, v = qkv(1, 4, 2, 90, 90, 32, torch.float16, device)
    check_grads(q, k, v, dense_mask=docs.to_dense(), block_mask=docs, config=SEPARATE)


def test_skipped_blocks_are_never_read(device: str) -> None:
    """Head h sees only the KV blocks with parity h, from the query blocks with parity h; K,
    V, Q and dO are NaN wherever that head must not look. Touching one would poison the
    gradients (0 * NaN is NaN). Keys nobody sees get exactly zero dK/dV, queries that see no
    key exactly zero dQ."""
    torch.manual_seed(4)
    q, k, v = qkv(1, 2, 2, 96, 128, 32, torch.float32, device)
    do = torch.randn_like(q)

    def mod(b: torch.Tensor, h: torch.Tensor, qi: torch.Tensor, ki: torch.Tensor) -> torch.Tensor:
        return ((ki // 32) % 2 == h) & ((qi // 32) % 2 == h) & ((qi + ki) % 5 != 0)

    mask = BlockMask.from_mask_mod(mod, None, 2, 96, 128, 32, device=device)
    o, lse = flash_attention_fwd(q, k, v, block_mask=mask)
    refs = reference_grads(q, k, v, do, causal="none", scale=1 / math.sqrt(32),
                           mask=mask.to_dense())
    hidden_keys = torch.zeros(1, 2, 128, dtype=torch.bool, device=device)
    hidden_rows = torch.zeros(1, 2, 96, dtype=torch.bool, device=device)
    for head in (0, 1):
        for block in range(4):
            hidden_keys[0, head, block * 32:(block + 1) * 32] = block % 2 != head
        for block in range(3):
            hidden_rows[0, head, block * 32:(block + 1) * 32] = block % 2 != head
    poisoned = [t.clone() for t in (q, k, v, do, o)]
    for t, hidden in zip(poisoned, (hidden_rows, hidden_keys, hidden_keys, hidden_rows,
                                    hidden_rows), strict=True):
        t[hidden] = float("nan")
    for config in (ATOMIC, SEPARATE):
        pq, pk, pv, pdo, po = poisoned
        grads = flash_attention_bwd(pdo, pq, pk, pv, po, lse, block_mask=mask, config=config)
        for got, ref, hidden in zip(grads, refs, (hidden_rows, hidden_keys, hidden_keys),
                                    strict=True):
            assert torch.all(got[hidden] == 0), config
            assert relative_error(got[~hidden], ref[~hidden]) <= TOL[torch.float32], config


@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("mask_shape", [(2, 4, 50, 70), (2, 1, 1, 70), (50, 70)])
def test_attn_masks_broadcast(kind: str, mask_shape: tuple[int, ...], device: str) -> None:
    torch.manual_seed(5)
    q, k, v = qkv(2, 4, 2, 50, 70, 32, torch.float16, device)
    if kind == "bool":
        am = torch.rand(mask_shape, device=device) < 0.7
        am[..., 0] = True  # no empty row: those are the next test's
    else:
        am = torch.randn(mask_shape, device=device).to(torch.float16)
    config = ATOMIC if kind == "bool" else SEPARATE  # both dQ paths, half the interpreter time
    check_grads(q, k, v, dense_mask=am, attn_mask=am, causal="bottom_right", config=config)


def test_attn_mask_with_a_block_mask_and_rows_that_see_nothing(device: str) -> None:
    torch.manual_seed(6)
    q, k, v = qkv(2, 2, 1, 70, 100, 32, torch.float16, device)
    mask = BlockMask.from_mask_mod(sliding_window_mask(40), 2, None, 70, 100, 32, device=device)
    am = torch.rand(2, 1, 70, 100, device=device) < 0.8
    am[:, :, 7] = False  # query 7 sees no key: zero dQ, and nothing added to dK/dV
    dq, _, _ = check_grads(q, k, v, dense_mask=mask.to_dense() & am, block_mask=mask,
                           attn_mask=am, config=SEPARATE)
    assert torch.all(dq[:, :, 7] == 0)


def test_explicit_config_must_fit_the_block_mask(device: str) -> None:
    q, k, v = qkv(1, 2, 2, 64, 64, 32, torch.float16, device)
    mask = BlockMask.from_mask_mod(causal_mask(), None, None, 64, 64, 16, device=device)
    o, lse = flash_attention_fwd(q, k, v, block_mask=mask)
    with pytest.raises(ValueError, match=r"BLOCK_N1 \(32\) must divide the block mask"):
        flash_attention_bwd(q, q, k, v, o, lse, block_mask=mask, config=ATOMIC)
    with pytest.raises(ValueError, match="block_mask is for"):
        flash_attention_bwd(q, q, k, v, o, lse, block_mask=BlockMask.from_mask_mod(
            causal_mask(), None, None, 64, 48, 16, device=device))


def test_autograd_function_with_masks(device: str) -> None:
    torch.manual_seed(7)
    q, k, v = (t.float().requires_grad_() for t in qkv(1, 4, 2, 60, 60, 32, torch.float16,
                                                          device))
    mask = BlockMask.from_mask_mod(sliding_window_mask(20), None, None, 60, 60, 32,
                                   device=device)
    am = torch.randn(60, 60, device=device)
    do = torch.randn(1, 4, 60, 32, device=device)
    flash_attention(q, k, v, causal=True, block_mask=mask, attn_mask=am).backward(do)
    dense = torch.where(mask.to_dense(), am, float("-inf"))
    refs = reference_grads(q.detach(), k.detach(), v.detach(), do, causal="top_left",
                           scale=1 / math.sqrt(32), mask=dense)
    for got, ref in zip((q.grad, k.grad, v.grad), refs, strict=True):
        assert got is not None and relative_error(got, ref) <= TOL[torch.float32]
    with pytest.raises(NotImplementedError, match="attn_mask requires grad"):
        flash_attention(q, k, v, attn_mask=am.requires_grad_())


def test_template_runs_a_masked_sweep_problem(device: str) -> None:
    """flash_bwd tunes block-sparse problems like flash_fwd: the named pattern's mask."""
    template = get_template("flash_bwd")
    problem = Problem(batch=1, heads_q=2, heads_kv=1, seqlen_q=200, seqlen_kv=200,
                      head_dim=32, dtype="float16", causal="none", mask="sliding:60")
    assert template.unsupported(problem) is None
    inputs = template.make_inputs(problem, device)
    assert isinstance(inputs["block_mask"], BlockMask)
    config = template.config({"BLOCK_M1": 32, "BLOCK_N1": 32, "num_warps": 4,
                              "num_stages": 1, "dq_mode": "atomic"})
    error = template.error(template.run(inputs, config), template.reference(inputs))
    assert error <= template.tolerance(problem)
    bad = Problem(batch=1, heads_q=2, heads_kv=1, seqlen_q=200, seqlen_kv=200, head_dim=32,
                  dtype="float16", causal="none", mask="sliding:x")
    assert "mask pattern" in (template.unsupported(bad) or "")


# -- GPU: bf16, larger, every helper ------------------------------------------------------------
GPU_CONFIGS = [None,
               dict(BLOCK_M1=64, BLOCK_N1=128, BLOCK_M2=128, BLOCK_N2=64, num_warps=8,
                    num_stages=2, dq_mode="separate"),
               dict(BLOCK_M1=32, BLOCK_N1=128, num_warps=8, num_stages=3, dq_mode="atomic")]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("config", GPU_CONFIGS, ids=["default", "separate", "atomic"])
def test_gpu_block_masks(dtype: torch.dtype, config: dict[str, Any] | None) -> None:
    n = 1555
    q, k, v = qkv(2, 8, 2, n, n, 128, dtype, "cuda")
    for pattern in ("random:0.3", "sliding:300", "document:3", "prefix:500", "causal"):
        mask = pattern_block_mask(pattern, n, n, device="cuda")
        check_grads(q, k, v, dense_mask=mask.to_dense(), block_mask=mask, config=config)
    mask = pattern_block_mask("sliding:200", n, n, device="cuda")
    check_grads(q, k, v, dense_mask=mask.to_dense(), causal="top_left", block_mask=mask,
                config=config)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_attn_masks(dtype: torch.dtype) -> None:
    q, k, v = qkv(2, 8, 4, 700, 1000, 64, dtype, "cuda")
    for am in (torch.rand(2, 1, 700, 1000, device="cuda") < 0.7,
               torch.randn(1, 8, 700, 1000, device="cuda").to(dtype)):
        for config in GPU_CONFIGS:
            check_grads(q, k, v, dense_mask=am, attn_mask=am, causal="bottom_right",
                        config=config)
