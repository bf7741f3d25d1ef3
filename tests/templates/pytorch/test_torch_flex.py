"""torch_flex / torch_flex_train: our BlockMask converted to Flex's exactly, and compiled
FlexAttention's numerics against the reference (the CPU: forward only, ~10 s of Inductor's
CPU codegen per shape; the GPU: bf16/fp16, odd lengths, GQA, backward)."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import pytest
import torch

from templates.attention_reference import attention_reference
from templates.base import Problem
from templates.device import CPU_INTERPRETER, cpu_device, current_device
from templates.flash.bwd import reference_grads
from templates.masks.block_mask import BlockMask
from templates.masks.mods import pattern_block_mask
from templates.pytorch.flex import FlexConfig, block_size_problem, flex, to_flex_block_mask
from templates.registry import get_template

FLEX = get_template("torch_flex")
FLEX_TRAIN = get_template("torch_flex_train")


def _blocks(counts: torch.Tensor, indices: torch.Tensor, nk: int) -> torch.Tensor:
    out = torch.zeros(*counts.shape, nk, dtype=torch.bool)
    for idx in itertools.product(*(range(n) for n in counts.shape)):
        out[idx][indices[idx][:int(counts[idx])].long()] = True
    return out


def flex_visible(flex_mask: object, batch: int, heads: int) -> torch.Tensor:
    """What Flex computes under ``flex_mask``: every pair of its full blocks, and the pairs of
    its partial blocks where its mask_mod says so (evaluated by Flex's own create_mask)."""
    from torch.nn.attention.flex_attention import create_mask

    fm: Any = flex_mask
    n_q, n_kv = fm.seq_lengths
    qb, kb = fm.BLOCK_SIZE
    nk = -(-n_kv // kb)
    partial = _blocks(fm.kv_num_blocks.cpu(), fm.kv_indices.cpu(), nk)
    full = _blocks(fm.full_kv_num_blocks.cpu(), fm.full_kv_indices.cpu(), nk)

    def elementwise(blocks: torch.Tensor) -> torch.Tensor:
        return blocks.repeat_interleave(qb, 2).repeat_interleave(kb, 3)[:, :, :n_q, :n_kv]

    pairs = create_mask(fm.mask_mod, batch, heads, n_q, n_kv, device=str(fm.kv_indices.device))
    return (elementwise(full) | (elementwise(partial) & pairs.cpu())).expand(
        batch, heads, n_q, n_kv)


def causal_pairs(causal: str, n_q: int, n_kv: int) -> torch.Tensor:
    offset = {"none": None, "top_left": 0, "bottom_right": n_kv - n_q}[causal]
    q, k = torch.arange(n_q)[:, None], torch.arange(n_kv)[None, :]
    return torch.ones(n_q, n_kv, dtype=torch.bool) if offset is None else k <= q + offset


@pytest.mark.parametrize(("shape", "block_size"), [
    ((2, 3, 200, 200), 32), ((1, 3, 96, 150), 16), ((2, 1, 130, 64), (32, 16)),
    ((1, 1, 40, 300), 128)])
@pytest.mark.parametrize("causal", ["none", "top_left", "bottom_right"])
def test_the_conversion_is_exact(shape: tuple[int, int, int, int],
                                 block_size: int | tuple[int, int], causal: str) -> None:
    torch.manual_seed(0)
    dense = torch.rand(shape) < 0.3
    dense[..., :40, :30] = True  # full blocks too
    dense[..., -5:, :] = False  # rows that see nothing
    mask = BlockMask.from_dense(dense, block_size)
    want = dense & causal_pairs(causal, shape[2], shape[3])
    flex_mask = to_flex_block_mask(mask, causal)
    assert torch.equal(flex_visible(flex_mask, shape[0], shape[1]), want.expand(*shape))
    assert to_flex_block_mask(mask, causal) is flex_mask  # kept on the mask


def test_full_blocks_stay_full_and_skipped_blocks_are_not_listed() -> None:
    mask = pattern_block_mask("sliding:100", 512, 512, block_size=64)
    flex_mask = to_flex_block_mask(mask)
    assert torch.equal(flex_mask.full_kv_num_blocks, mask.full_counts)
    assert torch.equal(flex_mask.kv_num_blocks, mask.partial_counts)
    causal = to_flex_block_mask(mask, "top_left")
    # Causal drops the blocks above the diagonal and makes the diagonal's full blocks partial.
    assert int(causal.full_kv_num_blocks.sum() + causal.kv_num_blocks.sum()) < int(
        mask.full_counts.sum() + mask.partial_counts.sum())


def test_the_pattern_names_the_mask_problem() -> None:
    mask = pattern_block_mask("sliding:16", 64, 64)
    assert mask.pattern == "sliding:16" and mask.to("cpu").pattern == "sliding:16"
    assert pattern_block_mask("sliding:16", 64, 64, block_size=64).pattern is None
    assert pattern_block_mask("random:0.5", 64, 64, seed=1).pattern is None
    with pytest.raises(ValueError, match="pattern"):
        dataclasses.replace(mask, pattern="document:100")


def test_problems_and_space() -> None:
    dense = Problem(batch=1, heads_q=2, heads_kv=2, seqlen_q=64, seqlen_kv=64, head_dim=64)
    masked = dataclasses.replace(dense, mask="sliding:16")
    for template in (FLEX, FLEX_TRAIN):
        assert "block masks" in (template.unsupported(dense) or "")
        assert template.unsupported(masked) is None
        assert "head dim" in (template.unsupported(dataclasses.replace(masked, head_dim=8))
                              or "")
        assert template.unsupported(dataclasses.replace(masked, mask="nonsense")) is not None
        assert template.constraint(masked, FlexConfig(), cpu_device()) is None
    assert "CUDA" in (FLEX.constraint(masked, FlexConfig(block_m=64), cpu_device()) or "")
    assert "own tiles" in (FLEX_TRAIN.constraint(masked, FlexConfig(block_n=64), cpu_device())
                           or "")
    assert cpu_device().name == CPU_INTERPRETER
    assert FlexConfig(block_m=64, block_n=32).kernel_options() == {"BLOCK_M": 64, "BLOCK_N": 32}
    assert FlexConfig().kernel_options() is None
    assert FLEX_TRAIN.flops(masked) == 3.5 * FLEX.flops(masked)


@pytest.mark.slow
def test_forward_on_the_cpu_matches_the_reference() -> None:
    """Inductor's CPU codegen (no backward on the CPU): odd lengths, GQA, causal, through the
    template as a sweep runs it."""
    p = Problem(batch=1, heads_q=4, heads_kv=2, seqlen_q=200, seqlen_kv=200, head_dim=32,
                dtype="float32", causal="top_left", mask="sliding:50")
    inputs = FLEX.make_inputs(p, "cpu")
    out = FLEX.run(inputs, FLEX.default_config(p, cpu_device()))
    assert FLEX.error(out, FLEX.reference(inputs)) <= FLEX.tolerance(p)


# ----------------------------------------------------------------------------- the GPU
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize(("pattern", "causal", "lengths"), [
    ("sliding:200", "top_left", (1000, 1000)), ("document:3", "none", (777, 777)),
    ("random:0.3", "none", (300, 520)), ("prefix:100", "bottom_right", (257, 700))])
def test_forward_and_backward_on_the_gpu(dtype: str, pattern: str, causal: str,
                                         lengths: tuple[int, int]) -> None:
    p = Problem(batch=2, heads_q=8, heads_kv=2, seqlen_q=lengths[0], seqlen_kv=lengths[1],
                head_dim=64, dtype=dtype, causal=causal, mask=pattern)
    device = current_device()
    for template in (FLEX, FLEX_TRAIN):
        assert template.unsupported(p) is None
        inputs = template.make_inputs(p, "cuda")
        configs = [template.default_config(p, device), FlexConfig(block_m=64, block_n=64)]
        for config in configs if template is FLEX else configs[:1]:
            assert template.constraint(p, config, device) is None
            out = template.run(inputs, config)
            assert template.error(out, template.reference(inputs)) <= template.tolerance(p)


@pytest.mark.gpu
def test_a_per_head_mask_with_gqa_on_the_gpu() -> None:
    """A (B, H_q) mask (per batch and query head) with grouped KV heads, d128, through
    ``flex`` as tuner.attention calls it, gradients included."""
    torch.manual_seed(0)
    b, hq, hkv, n, d = 2, 4, 2, 333, 128
    dense = torch.rand(b, hq, n, n, device="cuda") < 0.5
    mask = BlockMask.from_dense(dense, 128)
    q = torch.randn(b, hq, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(b, hkv, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))
    out = flex(q, k, v, mask, causal="top_left", scale=0.1, enable_gqa=True)
    do = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), do)
    full = dense & causal_pairs("top_left", n, n).cuda()
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    ref = attention_reference(q.detach(), kk.detach(), vv.detach(), causal="none", scale=0.1,
                              mask=full)[0]
    assert float((out.double() - ref.double()).norm() / ref.double().norm()) < 1e-2
    want = reference_grads(q.detach(), k.detach(), v.detach(), do, causal="none", scale=0.1,
                           mask=full)
    for got, ref_grad in zip(grads, want, strict=True):
        err = (got.double() - ref_grad.double()).norm() / ref_grad.double().norm()
        assert float(err) < 1e-2


def test_masks_of_blocks_smaller_than_flex_tiles_are_refused() -> None:
    """Flex's tiles (128) must divide the mask's blocks; with 64-blocks no backward config of
    Flex fits (seen on the H100), so flex() refuses them by name and the dispatcher runs ours."""
    dense = torch.rand(1, 1, 200, 200) < 0.5
    assert block_size_problem(BlockMask.from_dense(dense, 128)) is None
    reason = block_size_problem(BlockMask.from_dense(dense, 64))
    assert reason is not None and "64 x 64" in reason
    q = torch.randn(1, 1, 200, 16)
    with pytest.raises(ValueError, match="multiples of 128"):
        flex(q, q, q, BlockMask.from_dense(dense, 64))
