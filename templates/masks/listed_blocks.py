"""Where one step of a walk over a BlockMask's listed blocks reads, shared by the kernels.

A kernel walks the blocks a BlockMask lists for its tile (KV blocks for a query tile in the
forward and the dQ pass; query blocks for a KV tile, from the transposed mask, in the dK/dV
pass) as one flat loop of kernel-sized steps, so the pipeliner overlaps loads across blocks.
Step ``t`` is sub-step ``t % SUB`` of listed slot ``t // SUB``, ``SUB = WALK_BLOCK // STEP``.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def listed_block_step(Indices, TileIds, Tiles, t, tile_row,
                      WALK_BLOCK: tl.constexpr, STEP: tl.constexpr, TILE_ELEMS: tl.constexpr,
                      TILE: tl.constexpr):
    """(first row along the walk, address of this step's elementwise tile row) of step ``t``.

    ``WALK_BLOCK``: the mask's block size along the walked dimension (also a tile row's
    length); ``STEP``: the kernel's tile along it; ``TILE_ELEMS``: elements of one partial
    block's uint8 tile. ``TILE``: partial blocks, whose tile (row ``tile_row`` first) is at
    ``Tiles`` + its id * TILE_ELEMS; otherwise the returned address is ``Tiles`` unused."""
    SUB: tl.constexpr = WALK_BLOCK // STEP
    slot = t // SUB
    sub = t % SUB
    start = tl.load(Indices + slot) * WALK_BLOCK + sub * STEP
    tile_base = Tiles
    if TILE:
        tile_id = tl.load(TileIds + slot).to(tl.int64)
        tile_base = Tiles + tile_id * TILE_ELEMS + tile_row * WALK_BLOCK + sub * STEP
    return start, tile_base
