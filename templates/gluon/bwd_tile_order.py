"""``longest_first``'s order of a block-masked backward grid's KV tiles, and the head groups
that order (and the persistent grid's host schedule) keeps together (gluon_bwd's warp-specialized
kernels; host side, no kernel code)."""

from __future__ import annotations

import weakref
from typing import Any

import torch

from templates.gluon.schedule import L2_KV_BYTES

# Each KV-major mask's tile orders (by ``TileOrder.key``), dropped with the mask.
_ORDERS: weakref.WeakKeyDictionary[Any, dict[tuple[Any, ...], torch.Tensor]] = (
    weakref.WeakKeyDictionary())


class TileOrder:
    """``longest_first``'s order of a block-masked grid's KV tiles (as ``tile_walk`` numbers
    them), from each call's mask: in head groups of ``rows_per_group`` (batch, kv head) rows
    (``persistent_head_group``: their Q and dO stay in L2 while they run), each group's
    tiles by decreasing walk (the query blocks the mask lists for the tile's key block,
    summed over the GQA group's heads), ties in tile order. A launch takes the programs in
    about this order and the persistent grid's rounds snake through it, so the long walks
    start first and the short ones even the end out, where the tile order leaves a long
    walk last (a document's first tiles walk all of it).

    Kept with the KV-major mask it was made from (``_ORDERS``, for as long as the mask
    lives: a training step hands one mask to every layer's backward, and a CUDA graph that
    captured the order reads it as long as it reads the mask). Any permutation of the tiles
    gives the same gradients, only in another order: a mask whose tensors were changed in
    place keeps its old order and stays right."""

    def __init__(self, *, batch: int, heads_q: int, heads_kv: int, n_kv_tiles: int,
                 block_n: int, mask_block_kv: int, strides: tuple[int, int],
                 rows_per_group: int) -> None:
        self.batch, self.heads_q, self.heads_kv = batch, heads_q, heads_kv
        self.n_kv_tiles = n_kv_tiles
        self.block_n, self.mask_block_kv = block_n, mask_block_kv
        self.strides = strides
        self.rows_per_group = rows_per_group
        self.key = (batch, heads_q, heads_kv, n_kv_tiles, block_n, mask_block_kv, strides,
                    rows_per_group)

    def __call__(self, full_counts: Any, partial_counts: Any, kv_major: Any = None) -> Any:
        """The order for the mask whose KV-major counts these are; ``kv_major``: that mask
        (a ``BlockMask``), which keeps it, or None (worked out again)."""
        if not isinstance(full_counts, torch.Tensor):  # the offline build's stand-ins
            return type(full_counts)(torch.int32, [self.batch * self.heads_kv * self.n_kv_tiles])
        if kv_major is None:
            return self.order(full_counts, partial_counts)
        kept = _ORDERS.setdefault(kv_major, {})
        order = kept.get(self.key)
        if order is None:
            order = kept[self.key] = self.order(full_counts, partial_counts)
        return order

    def order(self, full_counts: torch.Tensor, partial_counts: torch.Tensor) -> torch.Tensor:
        """The tiles' order (int32, on the counts' device; no host sync)."""
        n_blocks = -(-self.n_kv_tiles * self.block_n // self.mask_block_kv)
        shape = (self.batch, self.heads_q, n_blocks)
        strides = (*self.strides, 1)
        blocks = (torch.as_strided(full_counts, shape, strides).to(torch.int64)
                  + torch.as_strided(partial_counts, shape, strides))
        group = self.heads_q // self.heads_kv
        blocks = blocks.view(self.batch, self.heads_kv, group, n_blocks).sum(dim=2)
        tile_block = (torch.arange(self.n_kv_tiles, device=blocks.device) * self.block_n
                      // self.mask_block_kv)
        walks = blocks.index_select(2, tile_block).reshape(-1, self.n_kv_tiles)
        rows = walks.shape[0]
        head_group = (torch.arange(rows, device=walks.device) // self.rows_per_group)
        # One sort key: the head group, then the walk, longest first (a tensor's bound:
        # no wait for the device).
        longest = walks.max()
        key = head_group[:, None] * (longest + 1) + (longest - walks)
        return torch.sort(key.reshape(-1), stable=True).indices.to(torch.int32)


def persistent_head_group(rows: int, n_kv_tiles: int, programs: int, row_bytes: int) -> int:
    """(batch, kv head) rows per head group of a persistent grid's schedule: enough for two
    rounds of the grid, so that the longest-first order has tiles to even the programs out
    with, and few enough that their Q and dO (``row_bytes`` a row) stay in L2 (the forward's
    budget for the K/V its head groups keep there, ``schedule.L2_KV_BYTES``)."""
    enough = -(-2 * programs // n_kv_tiles)
    fits = max(1, L2_KV_BYTES // max(row_bytes, 1))
    return max(1, min(enough, fits, rows))
