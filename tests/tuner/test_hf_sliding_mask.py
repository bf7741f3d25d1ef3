"""tuner.hf's sliding-window block mask (no transformers needed)."""

from __future__ import annotations

import torch


def test_the_sliding_block_mask_holds_causality_so_its_inner_blocks_run_unmasked() -> None:
    """With causality left to the kernel, every listed block ran the elementwise causal mask;
    in the mask itself, the blocks between the diagonal and the window's edge are full."""
    from tuner.hf import sliding_block_mask

    n, window = 1024, 512
    mask = sliding_block_mask(n, window, torch.device("cpu"))
    assert mask.block_size == (128, 128)
    rows = torch.arange(n)[:, None]
    cols = torch.arange(n)[None, :]
    dense = (cols <= rows) & (cols > rows - window)
    qb, kb = mask.block_size
    blocks = dense.reshape(n // qb, qb, n // kb, kb).permute(0, 2, 1, 3).reshape(
        n // qb, n // kb, -1)
    full_expected = int(blocks.all(-1).sum())
    partial_expected = int((blocks.any(-1) & ~blocks.all(-1)).sum())
    assert full_expected > 0
    assert int(mask.full_counts.sum()) == full_expected
    assert int(mask.partial_counts.sum()) == partial_expected
