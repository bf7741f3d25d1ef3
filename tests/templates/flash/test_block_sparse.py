"""Block-sparse attention and SDPA-style attn_mask: BlockMask construction, mask helpers, and
the forward kernel against the dense torch reference with the equivalent dense mask."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
import torch

import templates.flash.fwd_kernel as kernel
import templates.masks.block_mask as block_mask_module
from templates import BlockMask, flash_attention_fwd
from templates.attention_reference import attention_reference, lse_error
from templates.base import relative_error
from templates.masks.mods import (
    and_masks,
    causal_mask,
    document_mask,
    or_masks,
    pattern_block_mask,
    prefix_lm_mask,
    sliding_window_mask,
)

TOLERANCE = {torch.float16: 2e-3, torch.bfloat16: 1e-2}


@pytest.fixture(autouse=True)
def poison_outputs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernel, "DEBUG_POISON", True)


def dense_of(mod: Any, b: int, h: int, n_q: int, n_kv: int) -> torch.Tensor:
    idx = (torch.arange(b)[:, None, None, None], torch.arange(h)[None, :, None, None],
           torch.arange(n_q)[None, None, :, None], torch.arange(n_kv)[None, None, None, :])
    return mod(*idx).expand(b, h, n_q, n_kv)


def random_block_mask(b: int, h: int, n_q: int, n_kv: int, block: int, density: float,
                      seed: int) -> torch.Tensor:
    """A dense bool mask whose blocks are kept with probability ``density``; kept blocks are
    full or, for a third of them, random inside (partial)."""
    gen = torch.Generator().manual_seed(seed)
    nq, nk = -(-n_q // block), -(-n_kv // block)
    keep = torch.rand(b, h, nq, nk, generator=gen) < density
    inner = torch.rand(b, h, nq, nk, generator=gen) < 1 / 3
    cells = torch.rand(b, h, nq * block, nk * block, generator=gen) < 0.6
    blocks = keep.repeat_interleave(block, 2).repeat_interleave(block, 3)
    partial = (keep & inner).repeat_interleave(block, 2).repeat_interleave(block, 3)
    dense = blocks & (cells | ~partial)
    return dense[:, :, :n_q, :n_kv]


def qkv(b: int, h_q: int, h_kv: int, n_q: int, n_kv: int, d: int, dtype: torch.dtype,
        device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q = torch.randn(b, h_q, n_q, d, dtype=dtype, device=device)
    k = torch.randn(b, h_kv, n_kv, d, dtype=dtype, device=device)
    v = torch.randn(b, h_kv, n_kv, d, dtype=dtype, device=device)
    return q, k, v


def check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, dense_mask: torch.Tensor | None,
          causal: str = "none", config: dict[str, Any] | None = None,
          block_mask: BlockMask | None = None, attn_mask: torch.Tensor | None = None) -> None:
    o, lse = flash_attention_fwd(q, k, v, causal=causal, block_mask=block_mask,
                                 attn_mask=attn_mask, config=config)
    ref_o, ref_lse = attention_reference(q, k, v, causal=causal,
                                         scale=1 / math.sqrt(q.shape[-1]), mask=dense_mask)
    assert not torch.isnan(o).any(), "NaN (or an unwritten element) in o"
    err = max(relative_error(o, ref_o), lse_error(lse, ref_lse))
    assert err <= TOLERANCE[q.dtype], err
    empty_rows = torch.isinf(ref_lse)
    assert torch.all(o[empty_rows] == 0), "rows that see no key must be zeros"


# -- BlockMask ---------------------------------------------------------------------------------
@pytest.mark.parametrize("shape,block", [((2, 3, 100, 77), 16), ((1, 1, 300, 300), 32),
                                         ((2, 1, 257, 129), (32, 16))])
@pytest.mark.parametrize("chunk", [1 << 24, 2000])
def test_from_dense_round_trips(shape: tuple[int, ...], block: Any, chunk: int,
                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(block_mask_module, "_CHUNK_ELEMENTS", chunk)  # several row chunks
    mask = torch.rand(shape) < 0.5
    mask[:, :, :40] = True  # full blocks
    mask[:, :, 64:96] = False  # empty blocks and rows that see nothing
    bm = BlockMask.from_dense(mask, block)
    assert torch.equal(bm.to_dense(), mask)
    assert torch.equal(bm.to_dense(33, 90), mask[:, :, 33:90])
    assert int(bm.full_counts.sum()) > 0 and int(bm.partial_counts.sum()) > 0
    assert 0 < bm.density() < 1


def test_full_partial_and_skipped_blocks_are_classified() -> None:
    bm = BlockMask.from_mask_mod(causal_mask(), None, None, 64, 64, 16)
    assert bm.full_counts[0, 0].tolist() == [0, 1, 2, 3]
    assert bm.partial_counts[0, 0].tolist() == [1, 1, 1, 1]
    assert bm.partial_indices[0, 0, :, 0].tolist() == [0, 1, 2, 3]  # the diagonal
    assert bm.partial_tiles.shape == (4, 16, 16)
    assert bm.density() == pytest.approx(10 / 16)


@pytest.mark.parametrize("mod", [
    causal_mask(), causal_mask(offset=20), sliding_window_mask(17),
    sliding_window_mask(30, causal=True), prefix_lm_mask(40), document_mask([30, 50, 20]),
    document_mask([60, 40], causal=True),
    and_masks(sliding_window_mask(40), causal_mask()), or_masks(prefix_lm_mask(10), causal_mask()),
])
def test_from_mask_mod_matches_the_dense_mask(mod: Any) -> None:
    bm = BlockMask.from_mask_mod(mod, None, None, 100, 100, 16)
    assert torch.equal(bm.to_dense(), dense_of(mod, 1, 1, 100, 100))


def test_per_batch_and_head_mask_mod_and_combining() -> None:
    def mod(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return (k + b * 7 + h * 13) % 3 != 0

    a = BlockMask.from_mask_mod(mod, 2, 3, 90, 70, 16)
    assert torch.equal(a.to_dense(), dense_of(mod, 2, 3, 90, 70))
    c = BlockMask.from_mask_mod(causal_mask(), None, None, 90, 70, 16)
    assert torch.equal((a & c).to_dense(), a.to_dense() & c.to_dense())
    assert torch.equal((a | c).to_dense(), a.to_dense() | c.to_dense())
    with pytest.raises(ValueError, match="one geometry"):
        _ = a & BlockMask.from_mask_mod(causal_mask(), None, None, 90, 70, 32)


def test_mask_mod_is_evaluated_in_row_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(block_mask_module, "_CHUNK_ELEMENTS", 64 * 600)
    largest: list[int] = []
    inner = sliding_window_mask(50)

    def mod(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        largest.append(q.numel() * k.numel())
        return inner(b, h, q, k)

    bm = BlockMask.from_mask_mod(mod, None, None, 600, 600, 32)
    assert max(largest) <= 64 * 600  # never the whole 600 x 600
    assert torch.equal(bm.to_dense(), dense_of(inner, 1, 1, 600, 600))


def test_bad_masks_are_refused() -> None:
    with pytest.raises(ValueError, match="powers of two"):
        BlockMask.from_dense(torch.ones(8, 8, dtype=torch.bool), 24)
    with pytest.raises(TypeError, match="bool"):
        BlockMask.from_dense(torch.ones(8, 8), 16)
    with pytest.raises(TypeError, match="bool tensor"):
        BlockMask.from_mask_mod(lambda b, h, q, k: (q - k).float(), None, None, 8, 8, 16)
    bm = BlockMask.from_mask_mod(sliding_window_mask(20), None, None, 100, 100, 16)
    with pytest.raises(ValueError, match="out of range"):
        dataclasses.replace(bm, partial_indices=bm.partial_indices + 50)
    with pytest.raises(ValueError, match="out of range"):
        dataclasses.replace(bm, partial_tile_ids=bm.partial_tile_ids + 1000)
    with pytest.raises(ValueError, match="int32"):
        dataclasses.replace(bm, full_counts=bm.full_counts.long())
    with pytest.raises(ValueError, match="malformed mask pattern"):
        pattern_block_mask("random:2", 64, 64)
    padded = BlockMask.from_mask_mod(document_mask([10, 10]), None, None, 64, 64, 16)
    assert not padded.to_dense()[..., 20:, :].any() and not padded.to_dense()[..., 20:].any()


# -- the kernel with a block mask ----------------------------------------------------------------
CONFIGS = [dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1),
           dict(BLOCK_M=32, BLOCK_N=16, num_warps=4, num_stages=2),
           dict(BLOCK_M=32, BLOCK_N=32, num_warps=4, num_stages=2, use_tma=True)]


@pytest.mark.parametrize("density", [0.05, 0.3, 0.6, 0.95])
@pytest.mark.parametrize("config", CONFIGS, ids=["16x16", "32x16", "32x32-tma"])
def test_random_block_masks(density: float, config: dict[str, Any], device: str) -> None:
    torch.manual_seed(int(density * 100))
    q, k, v = qkv(2, 4, 2, 100, 77, 32, torch.float16, device)
    dense = random_block_mask(2, 4, 100, 77, 32, density, seed=int(density * 100)).to(device)
    bm = BlockMask.from_dense(dense, 32)
    check(q, k, v, dense_mask=dense, block_mask=bm, config=config)


@pytest.mark.parametrize("name,mod", [
    ("sliding", sliding_window_mask(24)), ("prefix", prefix_lm_mask(20)),
    ("document", document_mask([17, 40, 33])), ("causal", causal_mask()),
])
def test_helper_masks_with_gqa(name: str, mod: Any, device: str) -> None:
    q, k, v = qkv(1, 8, 2, 90, 90, 64, torch.float16, device)
    bm = BlockMask.from_mask_mod(mod, None, None, 90, 90, 32, device=device)
    check(q, k, v, dense_mask=bm.to_dense(), block_mask=bm, config=CONFIGS[1])


def test_block_mask_with_causal_and_attn_mask_and_default_config(device: str) -> None:
    q, k, v = qkv(2, 2, 1, 70, 100, 32, torch.float16, device)
    bm = BlockMask.from_mask_mod(sliding_window_mask(40), 2, None, 70, 100, 32, device=device)
    am = torch.rand(2, 1, 70, 100, device=device) < 0.8
    dense = bm.to_dense() & am
    check(q, k, v, dense_mask=dense, causal="bottom_right", block_mask=bm, attn_mask=am)


def test_skipped_blocks_are_never_read(device: str) -> None:
    """Head h visits only the KV blocks b with b % 2 == h (partially: an elementwise pattern
    inside them); K and V are NaN in every other block of that head: touching one would
    poison o (0 * NaN is NaN)."""
    q, k, v = qkv(1, 2, 2, 96, 128, 32, torch.float16, device)

    def mod(b: torch.Tensor, h: torch.Tensor, qi: torch.Tensor, ki: torch.Tensor) -> torch.Tensor:
        return ((ki // 32) % 2 == h) & ((qi + ki) % 5 != 0)

    bm = BlockMask.from_mask_mod(mod, None, 2, 96, 128, 32, device=device)
    assert int(bm.full_counts.sum()) == 0 and bm.density() == pytest.approx(0.5)
    k_poisoned, v_poisoned = k.clone(), v.clone()
    for head in (0, 1):
        for block in range(4):
            if block % 2 != head:
                k_poisoned[:, head, block * 32:(block + 1) * 32] = float("nan")
                v_poisoned[:, head, block * 32:(block + 1) * 32] = float("nan")
    for config in CONFIGS:
        o, _ = flash_attention_fwd(q, k_poisoned, v_poisoned, block_mask=bm, config=config)
        ref, _ = attention_reference(q, k, v, causal="none", scale=1 / math.sqrt(32),
                                     mask=bm.to_dense())
        assert relative_error(o, ref) <= TOLERANCE[torch.float16], config


def test_fully_masked_rows_give_zeros_and_minus_inf(device: str) -> None:
    q, k, v = qkv(1, 1, 1, 64, 64, 32, torch.float16, device)
    dense = torch.ones(64, 64, dtype=torch.bool, device=device)
    dense[10:40] = False
    o, lse = flash_attention_fwd(q, k, v, block_mask=BlockMask.from_dense(dense, 16),
                                 config=CONFIGS[0])
    assert torch.all(o[0, 0, 10:40] == 0) and torch.all(torch.isneginf(lse[0, 0, 10:40]))
    assert torch.isfinite(lse[0, 0, :10]).all()


# -- attn_mask ---------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("mask_shape", [(2, 4, 50, 70), (1, 4, 50, 70), (2, 1, 1, 70), (50, 70)])
def test_attn_mask_broadcasts(kind: str, mask_shape: tuple[int, ...], device: str) -> None:
    q, k, v = qkv(2, 4, 2, 50, 70, 32, torch.float16, device)
    if kind == "bool":
        am = torch.rand(mask_shape, device=device) < 0.7
    else:
        am = torch.randn(mask_shape, device=device).to(torch.float16)
    check(q, k, v, dense_mask=am, attn_mask=am, config=CONFIGS[1], causal="top_left")


def test_attn_mask_strided_view_and_all_false_rows(device: str) -> None:
    q, k, v = qkv(1, 2, 2, 40, 40, 32, torch.float16, device)
    base = torch.rand(1, 2, 40, 80, device=device) < 0.6
    am = base[..., ::2]  # a strided view: read as is
    am[:, :, 5] = False
    check(q, k, v, dense_mask=am, attn_mask=am, config=CONFIGS[0])


def test_bad_attn_and_block_masks_raise(device: str) -> None:
    q, k, v = qkv(1, 2, 2, 40, 40, 32, torch.float16, device)
    with pytest.raises(ValueError, match="does not broadcast"):
        flash_attention_fwd(q, k, v, attn_mask=torch.ones(3, 40, 40, dtype=torch.bool,
                                                          device=device))
    with pytest.raises(TypeError, match="attn_mask must be bool"):
        flash_attention_fwd(q, k, v, attn_mask=torch.ones(40, 40, dtype=torch.int32,
                                                          device=device))
    bm = BlockMask.from_mask_mod(causal_mask(), None, None, 40, 48, 16, device=device)
    with pytest.raises(ValueError, match=r"\(N_q, N_kv\)"):
        flash_attention_fwd(q, k, v, block_mask=bm)
    bm = BlockMask.from_mask_mod(causal_mask(), 3, None, 40, 40, 16, device=device)
    with pytest.raises(ValueError, match="must be 1 or match"):
        flash_attention_fwd(q, k, v, block_mask=bm)
    bm = BlockMask.from_mask_mod(causal_mask(), None, None, 40, 40, 16, device=device)
    with pytest.raises(ValueError, match="must divide the block mask's block size"):
        flash_attention_fwd(q, k, v, block_mask=bm, config=CONFIGS[1])
    with pytest.raises(TypeError, match="BlockMask"):
        flash_attention_fwd(q, k, v, block_mask=torch.ones(40, 40))  # type: ignore[arg-type]


# -- GPU: bf16, larger, every helper and several configs ---------------------------------------
GPU_CONFIGS = [dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=2, use_tma=True),
               dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=3),
               dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=2, use_tma=True)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("config", [None, *GPU_CONFIGS])
def test_gpu_block_masks(dtype: torch.dtype, config: dict[str, Any] | None) -> None:
    n = 3333
    q, k, v = qkv(2, 8, 2, n, n, 128, dtype, "cuda")
    masks = [pattern_block_mask(p, n, n, device="cuda") for p in
             ("random:0.05", "random:0.5", "random:0.95", "sliding:300", "document:3",
              "prefix:700", "causal")]
    for bm in masks:
        check(q, k, v, dense_mask=bm.to_dense(), block_mask=bm, config=config)
    dense = random_block_mask(2, 8, n, n, 128, 0.4, seed=3).cuda()
    check(q, k, v, dense_mask=dense, block_mask=BlockMask.from_dense(dense), config=config,
          causal="top_left")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_attn_masks(dtype: torch.dtype) -> None:
    q, k, v = qkv(2, 8, 8, 1000, 1500, 64, dtype, "cuda")
    for am in (torch.rand(2, 1, 1000, 1500, device="cuda") < 0.7,
               torch.randn(1, 8, 1000, 1500, device="cuda").to(dtype)):
        for config in (None, *GPU_CONFIGS[:2]):
            check(q, k, v, dense_mask=am, attn_mask=am, config=config, causal="bottom_right")
