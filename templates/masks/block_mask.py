"""``BlockMask``: which KV blocks each query block visits, in the form the kernel reads.

The (N_q, N_kv) score matrix is cut into blocks of ``block_size = (Q_BLOCK, KV_BLOCK)``. Per
batch (or 1 for all) and per query head (or 1 for all), each query block lists

  * its *full* KV blocks: every (query, key) pair visible, so the kernel runs them without any
    elementwise mask, and
  * its *partial* KV blocks: some pairs visible; the kernel applies the block's elementwise
    mask, kept here as one (Q_BLOCK, KV_BLOCK) uint8 tile per partial block.

Blocks in neither list are never loaded or computed: time scales with the visited blocks.
Partial tiles are the only element-level storage, so a banded mask (causal, sliding window,
documents) costs O(N * block) bytes, never O(N^2). As in FlexAttention, the lists are counts
plus ascending indices per query block.

Constructors: ``from_dense`` (a boolean mask), ``from_mask_mod`` (a function of tensor indices,
evaluated a few query blocks at a time), ``from_block_kinds`` (the same function evaluated only
on the blocks a known block structure leaves open), and the helpers of ``templates.masks.mods``
through it. ``a & b`` and ``a | b`` combine two masks of one geometry.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from templates.masks.document_offsets import DocumentOffsets
from templates.masks.patterns import pattern_problem

__all__ = ["DEFAULT_BLOCK_SIZE", "EMPTY", "EVALUATE", "FULL", "BlockMask", "MaskMod"]

# FlexAttention's default; the kernel's BLOCK_M and BLOCK_N must divide it.
DEFAULT_BLOCK_SIZE = 128
# Elements of a dense chunk built at once by from_mask_mod / combining (16 MiB of bools).
_CHUNK_ELEMENTS = 1 << 24

# Block kinds for ``BlockMask.from_block_kinds``.
EMPTY, FULL, EVALUATE = 0, 1, 2

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _block_sizes(block_size: int | tuple[int, int]) -> tuple[int, int]:
    sizes = (block_size, block_size) if isinstance(block_size, int) else tuple(block_size)
    if len(sizes) != 2 or any(isinstance(s, bool) or not isinstance(s, int) for s in sizes):
        raise ValueError(f"block_size must be an int or a pair of ints, but got {block_size!r}")
    for s in sizes:
        if s < 16 or s & (s - 1):
            raise ValueError(f"block_size must be powers of two >= 16 (the kernel's tiles "
                             f"divide them), but got {block_size!r}")
    return sizes[0], sizes[1]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True, eq=False)
class BlockMask:
    """Block-sparse structure of an (N_q, N_kv) attention, per batch and head (or broadcast).

    Shapes, with Bm in {1, B}, Hm in {1, H_q}, nq = cdiv(N_q, Q_BLOCK), nk = cdiv(N_kv,
    KV_BLOCK): ``full_counts``/``partial_counts`` (Bm, Hm, nq) int32; ``full_indices``/
    ``partial_indices`` (Bm, Hm, nq, nk) int32, the first ``count`` entries of each row valid
    and ascending; ``partial_tile_ids`` (Bm, Hm, nq, nk) int32, aligned with
    ``partial_indices``, rows of ``partial_tiles`` (P, Q_BLOCK, KV_BLOCK) uint8 (1 = visible).
    """

    seqlen_q: int
    seqlen_kv: int
    block_size: tuple[int, int]
    full_counts: torch.Tensor
    full_indices: torch.Tensor
    partial_counts: torch.Tensor
    partial_indices: torch.Tensor
    partial_tile_ids: torch.Tensor
    partial_tiles: torch.Tensor
    # The named pattern (``Problem.mask``, e.g. ``sliding:1024``) this mask is, if any: the
    # dispatcher prices a block-mask call by the stored measurements of that problem (ours
    # against FlexAttention); None (any other mask) runs our block-sparse kernels.
    pattern: str | None = None
    # The packed documents this mask is exactly, where it was built from them (one row's
    # offsets, every batch row alike): an implementation that runs documents by their
    # offsets (torch's varlen_attn) needs them; None for any other mask.
    documents: DocumentOffsets | None = None

    def __post_init__(self) -> None:
        """Check everything the kernel trusts (once, at construction): shapes, dtypes, and
        that every count, index and tile id is in range (the kernel reads through them)."""
        qb, kb = _block_sizes(self.block_size)
        nq, nk = _cdiv(self.seqlen_q, qb), _cdiv(self.seqlen_kv, kb)
        counts = (("full_counts", self.full_counts), ("partial_counts", self.partial_counts))
        lists = (("full_indices", self.full_indices), ("partial_indices", self.partial_indices),
                 ("partial_tile_ids", self.partial_tile_ids))
        bh = tuple(self.full_counts.shape[:2])
        for name, t in counts + lists:
            if t.dtype != torch.int32 or not t.is_contiguous():
                raise ValueError(f"BlockMask.{name} must be a contiguous int32 tensor, but got "
                                 f"{t.dtype}{'' if t.is_contiguous() else ' (not contiguous)'}")
        for name, t in counts:
            if tuple(t.shape) != (*bh, nq):
                raise ValueError(f"BlockMask.{name} must have shape (Bm, Hm, {nq}) for N_q="
                                 f"{self.seqlen_q} in blocks of {qb}, but got {tuple(t.shape)}")
        for name, t in lists:
            if tuple(t.shape) != (*bh, nq, nk):
                raise ValueError(f"BlockMask.{name} must have shape (Bm, Hm, {nq}, {nk}), but "
                                 f"got {tuple(t.shape)}")
        if (self.partial_tiles.dtype != torch.uint8 or self.partial_tiles.dim() != 3
                or tuple(self.partial_tiles.shape[1:]) != (qb, kb)
                or not self.partial_tiles.is_contiguous()):
            raise ValueError(f"BlockMask.partial_tiles must be a contiguous uint8 tensor (P, "
                             f"{qb}, {kb}), but got {self.partial_tiles.dtype} "
                             f"{tuple(self.partial_tiles.shape)}")
        n_tiles = self.partial_tiles.shape[0]
        checks = (("full_counts", self.full_counts, "full_indices", self.full_indices, nk),
                  ("partial_counts", self.partial_counts, "partial_indices",
                   self.partial_indices, nk),
                  ("partial_counts", self.partial_counts, "partial_tile_ids",
                   self.partial_tile_ids, n_tiles))
        for count_name, c, list_name, entries, bound in checks:
            if c.numel() and (int(c.min()) < 0 or int(c.max()) > nk):
                raise ValueError(f"BlockMask.{count_name} must lie in [0, {nk}]")
            used = entries[listed_slots(c, nk)]
            if used.numel() and (int(used.min()) < 0 or int(used.max()) >= bound):
                raise ValueError(f"BlockMask.{list_name} has an entry out of range [0, {bound})")
        devices = {t.device for _, t in counts + lists} | {self.partial_tiles.device}
        if len(devices) > 1:
            raise ValueError(f"BlockMask tensors must be on one device, but got {devices}")
        if self.pattern is not None:
            reason = pattern_problem(self.pattern, self.seqlen_q, self.seqlen_kv)
            if reason:
                raise ValueError(f"BlockMask.pattern: {reason}")
        docs = self.documents
        if docs is not None and self.full_counts.shape[0] != 1:
            raise ValueError(f"BlockMask.documents describes one row packed alike in every "
                             f"batch row, but the mask has {self.full_counts.shape[0]} rows")
        if docs is not None and (docs.offsets_q[-1], docs.offsets_k[-1]) != (
                self.seqlen_q, self.seqlen_kv):
            raise ValueError(f"BlockMask.documents must cover the mask's {self.seqlen_q} x "
                             f"{self.seqlen_kv} scores, but its offsets end at "
                             f"{docs.offsets_q[-1]} x {docs.offsets_k[-1]}")

    # -- constructors ---------------------------------------------------------------------
    @classmethod
    def from_dense(cls, mask: torch.Tensor, block_size: int | tuple[int, int] = DEFAULT_BLOCK_SIZE
                   ) -> BlockMask:
        """From a boolean mask (B|1, H|1, N_q, N_kv), True = attend (2-D and 3-D broadcast)."""
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
            raise TypeError(f"mask must be a torch.bool tensor, but got "
                            f"{getattr(mask, 'dtype', type(mask).__name__)}")
        if not 2 <= mask.dim() <= 4 or mask.numel() == 0:
            raise ValueError(f"mask must be (B|1, H|1, N_q, N_kv), non-empty, but got shape "
                             f"{tuple(mask.shape)}")
        while mask.dim() < 4:
            mask = mask.unsqueeze(0)
        return cls._build(lambda lo, hi: mask[:, :, lo:hi], mask.shape[0], mask.shape[1],
                          mask.shape[2], mask.shape[3], block_size, mask.device)

    @classmethod
    def from_mask_mod(cls, mask_mod: MaskMod, B: int | None, H: int | None, N_q: int,
                      N_kv: int, block_size: int | tuple[int, int] = DEFAULT_BLOCK_SIZE,
                      device: torch.device | str = "cpu", *, pattern: str | None = None,
                      documents: DocumentOffsets | None = None) -> BlockMask:
        """From ``mask_mod(b, h, q_idx, kv_idx) -> bool tensor`` (broadcasting index tensors,
        as FlexAttention's). B or H None (or 1) means the mask is the same for all of them.
        ``pattern``: the named pattern (``Problem.mask``) ``mask_mod`` is, if it is one, so
        that the dispatcher can price the mask (``BlockMask.pattern``); not checked against
        ``mask_mod``. ``documents``: the packed documents it is, if it is their mask
        (``BlockMask.documents``; not checked against ``mask_mod`` either).

        Evaluated a few query blocks at a time (at most ~16M elements at once), so an N x N
        mask is never held, whatever N.
        """
        for name, value in (("N_q", N_q), ("N_kv", N_kv), ("B", B or 1), ("H", H or 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, but got {value!r}")
        bm, hm = B or 1, H or 1
        b_idx = torch.arange(bm, device=device)[:, None, None, None]
        h_idx = torch.arange(hm, device=device)[None, :, None, None]
        kv_idx = torch.arange(N_kv, device=device)[None, None, None, :]

        def rows(lo: int, hi: int) -> torch.Tensor:
            q_idx = torch.arange(lo, hi, device=device)[None, None, :, None]
            out = torch.as_tensor(mask_mod(b_idx, h_idx, q_idx, kv_idx), device=device)
            if out.dtype != torch.bool:
                raise TypeError(f"mask_mod must return a bool tensor, but returned {out.dtype}")
            return out.expand(bm, hm, hi - lo, N_kv)

        return cls._build(rows, bm, hm, N_q, N_kv, block_size, torch.device(device),
                          pattern=pattern, documents=documents)

    @classmethod
    def _build(cls, rows: Callable[[int, int], torch.Tensor], bm: int, hm: int, n_q: int,
               n_kv: int, block_size: int | tuple[int, int], device: torch.device, *,
               pattern: str | None = None, documents: DocumentOffsets | None = None
               ) -> BlockMask:
        """Classify every block from dense row chunks ``rows(lo, hi)`` (Bm, Hm, hi-lo, N_kv),
        whole query blocks of at most ~_CHUNK_ELEMENTS elements at a time."""
        qb, kb = _block_sizes(block_size)
        chunk_rows = max(qb, (_CHUNK_ELEMENTS // (n_kv * bm * hm)) // qb * qb)
        nq, nk = _cdiv(n_q, qb), _cdiv(n_kv, kb)
        full = torch.zeros(bm, hm, nq, nk, dtype=torch.bool, device=device)
        partial = torch.zeros_like(full)
        tile_of_block = torch.zeros(bm, hm, nq, nk, dtype=torch.int64, device=device)
        tiles: list[torch.Tensor] = []
        n_tiles = 0
        for lo in range(0, n_q, chunk_rows):
            hi = min(n_q, lo + chunk_rows)
            dense = rows(lo, hi)
            blocks = _cdiv(hi - lo, qb)
            # Keys past N_kv are never visible (the ragged last KV block is at most partial);
            # rows past N_q are never stored: they neither make a block partial nor visible.
            padded = torch.zeros(bm, hm, blocks * qb, nk * kb, dtype=torch.bool, device=device)
            padded[:, :, :hi - lo, :n_kv] = dense
            cells = padded.view(bm, hm, blocks, qb, nk, kb).transpose(3, 4)  # (.., nk, qb, kb)
            visible = cells.sum(dim=(-1, -2))
            real_rows = min(qb, hi - lo - (blocks - 1) * qb)  # rows of the last query block
            per_block = torch.full((blocks,), qb * kb, device=device)
            per_block[-1] = real_rows * kb
            is_full = (visible == per_block[:, None]) & _keys_complete(nk, kb, n_kv, device)
            is_partial = (visible > 0) & ~is_full
            qs = slice(lo // qb, lo // qb + blocks)
            full[:, :, qs] = is_full
            partial[:, :, qs] = is_partial
            # Tiles are numbered in the order boolean indexing takes them, chunk by chunk.
            tile_of_block[:, :, qs] = n_tiles + torch.cumsum(
                is_partial.flatten(), 0).view(is_partial.shape) - 1
            tiles.append(cells[is_partial].to(torch.uint8))
            n_tiles += tiles[-1].shape[0]
        return cls._from_blocks(full, partial, tile_of_block, tiles, n_q, n_kv, (qb, kb),
                                pattern, documents)

    @classmethod
    def from_block_kinds(cls, kinds: torch.Tensor, mask_mod: MaskMod, N_q: int, N_kv: int,
                         block_size: int | tuple[int, int] = DEFAULT_BLOCK_SIZE, *,
                         pattern: str | None = None, documents: DocumentOffsets | None = None
                         ) -> BlockMask:
        """From a block-level classification known beforehand: ``kinds`` (Bm, Hm, nq, nk)
        integer, per block ``EMPTY`` (0: nothing visible), ``FULL`` (1: all visible) or
        ``EVALUATE`` (2: ``mask_mod`` decides each element; the block may turn out empty,
        partial or full). Only the EVALUATE blocks are evaluated, a few thousand at a time:
        O(their count x block area) work, not O(N_q x N_kv), which is what a document or
        window mask built per training step needs (a 16k row of packed documents evaluates
        a few hundred of its 16k blocks). ``mask_mod`` gets index tensors of shape (P, 1, 1)
        for b and h and (P, Q_BLOCK, 1), (P, 1, KV_BLOCK) for q and kv, clamped into range
        (elements past N_q or N_kv are not visible, as in ``from_mask_mod``). A FULL block
        reaching past N_kv is evaluated (a ragged last KV block is never full).
        The caller vouches for the EMPTY and FULL blocks: they are not checked, nor are
        ``documents`` (``BlockMask.documents``)."""
        qb, kb = _block_sizes(block_size)
        nq, nk = _cdiv(N_q, qb), _cdiv(N_kv, kb)
        if (not isinstance(kinds, torch.Tensor) or kinds.dim() != 4
                or tuple(kinds.shape[2:]) != (nq, nk) or kinds.dtype.is_floating_point):
            raise ValueError(f"kinds must be an integer tensor (Bm, Hm, {nq}, {nk}) for "
                             f"(N_q, N_kv) = {(N_q, N_kv)} in blocks of {(qb, kb)}, but got "
                             f"{getattr(kinds, 'dtype', type(kinds).__name__)} "
                             f"{tuple(getattr(kinds, 'shape', ()))}")
        if kinds.numel() and (int(kinds.min()) < EMPTY or int(kinds.max()) > EVALUATE):
            raise ValueError(f"kinds must hold EMPTY ({EMPTY}), FULL ({FULL}) or EVALUATE "
                             f"({EVALUATE}) per block")
        device = kinds.device
        complete = _keys_complete(nk, kb, N_kv, device)
        full = (kinds == FULL) & complete
        evaluate = (kinds == EVALUATE) | ((kinds == FULL) & ~complete)
        partial = torch.zeros_like(full)
        tile_of_block = torch.zeros(kinds.shape, dtype=torch.int64, device=device)
        b, h, qi, kj = evaluate.nonzero(as_tuple=True)
        rows = torch.arange(qb, device=device)[None, :, None]
        cols = torch.arange(kb, device=device)[None, None, :]
        tiles: list[torch.Tensor] = []
        n_tiles = 0
        per_chunk = max(1, _CHUNK_ELEMENTS // (qb * kb))
        for lo in range(0, b.numel(), per_chunk):
            cb, ch, cq, ck = (t[lo:lo + per_chunk] for t in (b, h, qi, kj))
            q_idx = cq[:, None, None] * qb + rows
            k_idx = ck[:, None, None] * kb + cols
            out = torch.as_tensor(mask_mod(cb[:, None, None], ch[:, None, None],
                                           q_idx.clamp(max=N_q - 1), k_idx.clamp(max=N_kv - 1)),
                                  device=device)
            if out.dtype != torch.bool:
                raise TypeError(f"mask_mod must return a bool tensor, but returned {out.dtype}")
            real_row = q_idx < N_q
            out = out & real_row & (k_idx < N_kv)
            # any / all, not a count: a bool sum converts to int64 (3x slower on the CPU).
            is_full = (out | ~real_row).flatten(1).all(1) & complete[ck]
            is_partial = out.flatten(1).any(1) & ~is_full
            full[cb[is_full], ch[is_full], cq[is_full], ck[is_full]] = True
            where = (cb[is_partial], ch[is_partial], cq[is_partial], ck[is_partial])
            partial[where] = True
            tiles.append(out[is_partial].to(torch.uint8))
            tile_of_block[where] = n_tiles + torch.arange(tiles[-1].shape[0], device=device)
            n_tiles += tiles[-1].shape[0]
        return cls._from_blocks(full, partial, tile_of_block, tiles, N_q, N_kv, (qb, kb),
                                pattern, documents)

    @classmethod
    def _from_blocks(cls, full: torch.Tensor, partial: torch.Tensor,
                     tile_of_block: torch.Tensor, tiles: list[torch.Tensor], n_q: int,
                     n_kv: int, block_size: tuple[int, int], pattern: str | None,
                     documents: DocumentOffsets | None = None) -> BlockMask:
        """The lists of classified blocks: ``full`` and ``partial`` (Bm, Hm, nq, nk) bool,
        ``tile_of_block`` the row of the concatenated ``tiles`` each partial block uses."""
        qb, kb = block_size
        nk = full.shape[3]
        partial_tiles = (torch.cat(tiles) if tiles else
                         torch.zeros(0, qb, kb, dtype=torch.uint8, device=full.device))
        full_counts, full_indices = block_lists(full)
        partial_counts, partial_indices = block_lists(partial)
        tile_ids = torch.gather(tile_of_block, 3, partial_indices.long()).to(torch.int32)
        tile_ids = torch.where(listed_slots(partial_counts, nk), tile_ids, 0)
        return cls(n_q, n_kv, (qb, kb), full_counts, full_indices, partial_counts,
                   partial_indices, tile_ids, partial_tiles.contiguous(), pattern, documents)

    # -- views ----------------------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, int, int, int]:
        """(Bm, Hm, N_q, N_kv): the dense mask this describes."""
        return (self.full_counts.shape[0], self.full_counts.shape[1], self.seqlen_q,
                self.seqlen_kv)

    @property
    def device(self) -> torch.device:
        return self.full_counts.device

    def density(self) -> float:
        """Fraction of the (Bm, Hm, nq, nk) blocks visited (full or partial)."""
        nq, nk = self.full_indices.shape[2], self.full_indices.shape[3]
        total = self.full_counts.shape[0] * self.full_counts.shape[1] * nq * nk
        visited = int(self.full_counts.sum()) + int(self.partial_counts.sum())
        return visited / total

    @functools.cached_property
    def transposed(self) -> BlockMask:
        """The same mask seen from the keys: a BlockMask of (N_kv, N_q) in blocks of
        (KV_BLOCK, Q_BLOCK), listing per KV block the query blocks that see it (full or
        partial, with transposed tiles). The backward's dK/dV pass walks it. Built once per
        mask from the block lists (O(blocks) work plus a copy of the partial tiles)."""
        bm, hm, nq, nk = self.full_indices.shape
        kind = torch.zeros(bm, hm, nq, nk, dtype=torch.int8, device=self.device)
        tile_of_block = torch.zeros(bm, hm, nq, nk, dtype=torch.int32, device=self.device)
        kind[self._scatter_index(self.full_counts, self.full_indices, 0, nq)] = 1
        where = self._scatter_index(self.partial_counts, self.partial_indices, 0, nq)
        kind[where] = 2
        tile_of_block[where] = self.partial_tile_ids[listed_slots(self.partial_counts, nk)]
        kind_t, tiles_t = kind.transpose(2, 3), tile_of_block.transpose(2, 3)
        full_counts, full_indices = block_lists(kind_t == 1)
        partial_counts, partial_indices = block_lists(kind_t == 2)
        tile_ids = torch.gather(tiles_t, 3, partial_indices.long())
        tile_ids = torch.where(listed_slots(partial_counts, nq), tile_ids, 0).to(torch.int32)
        out = BlockMask(self.seqlen_kv, self.seqlen_q, (self.block_size[1], self.block_size[0]),
                        full_counts, full_indices, partial_counts, partial_indices,
                        tile_ids.contiguous(), self.partial_tiles.transpose(1, 2).contiguous())
        out.__dict__["transposed"] = self  # transposing back gives this mask, not a copy
        return out

    def to(self, device: torch.device | str) -> BlockMask:
        (full_counts, full_indices, partial_counts, partial_indices, partial_tile_ids,
         partial_tiles) = (t.to(device) for t in self._tensors())
        return BlockMask(self.seqlen_q, self.seqlen_kv, self.block_size, full_counts,
                         full_indices, partial_counts, partial_indices, partial_tile_ids,
                         partial_tiles, self.pattern, self.documents)

    def to_dense(self, row_lo: int = 0, row_hi: int | None = None) -> torch.Tensor:
        """The bool mask (Bm, Hm, rows, N_kv) of rows [row_lo, row_hi): for references and
        tests; O(rows x N_kv) memory."""
        row_hi = self.seqlen_q if row_hi is None else min(row_hi, self.seqlen_q)
        qb, kb = self.block_size
        bm, hm, nq, nk = self.full_indices.shape
        q_lo, q_hi = row_lo // qb, _cdiv(row_hi, qb)
        cells = torch.zeros(bm, hm, q_hi - q_lo, nk, qb, kb, dtype=torch.bool,
                            device=self.device)
        cells[self._scatter_index(self.full_counts, self.full_indices, q_lo, q_hi)] = True
        where = self._scatter_index(self.partial_counts, self.partial_indices, q_lo, q_hi)
        valid = listed_slots(self.partial_counts, nk)[:, :, q_lo:q_hi]
        tiles = self.partial_tiles[self.partial_tile_ids[:, :, q_lo:q_hi][valid].long()]
        cells[where] = tiles.bool()
        dense = cells.transpose(3, 4).reshape(bm, hm, (q_hi - q_lo) * qb, nk * kb)
        start = row_lo - q_lo * qb
        return dense[:, :, start:start + row_hi - row_lo, :self.seqlen_kv]

    def _scatter_index(self, counts: torch.Tensor, indices: torch.Tensor, q_lo: int,
                       q_hi: int) -> tuple[torch.Tensor, ...]:
        nk = indices.shape[3]
        valid = listed_slots(counts, nk)[:, :, q_lo:q_hi]
        b, h, q, slot = valid.nonzero(as_tuple=True)
        return b, h, q, indices[:, :, q_lo:q_hi][b, h, q, slot].long()

    def kernel_args(self) -> list[torch.Tensor | int]:
        """The lists as the kernels take them: full and partial counts, indices, tile ids,
        tiles, then the (batch, head) strides of the counts and of the lists (0 where the mask
        broadcasts over a size-1 dim) and the stride between the lists' rows."""
        def broadcast_strides(t: torch.Tensor) -> list[int]:
            return [t.stride(0) if t.shape[0] > 1 else 0, t.stride(1) if t.shape[1] > 1 else 0]

        return [*self._tensors(), *broadcast_strides(self.full_counts),
                *broadcast_strides(self.full_indices), self.full_indices.stride(2)]

    def _tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.full_counts, self.full_indices, self.partial_counts,
                self.partial_indices, self.partial_tile_ids, self.partial_tiles)

    # -- combining ------------------------------------------------------------------------
    def __and__(self, other: BlockMask) -> BlockMask:
        return self._combine(other, torch.logical_and)

    def __or__(self, other: BlockMask) -> BlockMask:
        return self._combine(other, torch.logical_or)

    def _combine(self, other: BlockMask, op: Callable[[torch.Tensor, torch.Tensor],
                                                     torch.Tensor]) -> BlockMask:
        if not isinstance(other, BlockMask):
            return NotImplemented
        if (self.seqlen_q, self.seqlen_kv, self.block_size) != (
                other.seqlen_q, other.seqlen_kv, other.block_size):
            raise ValueError(f"can only combine masks of one geometry, but got (N_q, N_kv, "
                             f"block_size) {(self.seqlen_q, self.seqlen_kv, self.block_size)} "
                             f"and {(other.seqlen_q, other.seqlen_kv, other.block_size)}")
        bm = max(self.shape[0], other.shape[0])
        hm = max(self.shape[1], other.shape[1])
        for name, a, b, n in (("batch", self.shape[0], other.shape[0], bm),
                              ("head", self.shape[1], other.shape[1], hm)):
            if {a, b} - {1, n}:
                raise ValueError(f"the masks' {name} dims {a} and {b} do not broadcast")

        def rows(lo: int, hi: int) -> torch.Tensor:
            return op(self.to_dense(lo, hi), other.to_dense(lo, hi)).expand(
                bm, hm, hi - lo, self.seqlen_kv)

        return BlockMask._build(rows, bm, hm, self.seqlen_q, self.seqlen_kv, self.block_size,
                                self.device)

    def __repr__(self) -> str:
        return (f"BlockMask(shape={self.shape}, block_size={self.block_size}, "
                f"density={self.density():.3f}, partial_tiles={self.partial_tiles.shape[0]})")


def _keys_complete(nk: int, kb: int, n_kv: int, device: torch.device) -> torch.Tensor:
    """(nk,) True where the KV block lies wholly inside N_kv (only those can be full)."""
    return (torch.arange(nk, device=device) + 1) * kb <= n_kv


def block_lists(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Counts and ascending indices of the True entries of the last dim."""
    nk = blocks.shape[-1]
    order = torch.arange(nk, device=blocks.device).expand_as(blocks)
    keyed = torch.where(blocks, order, nk + order)  # chosen blocks first, each in order
    indices = torch.argsort(keyed, dim=-1, stable=True)
    counts = blocks.sum(dim=-1, dtype=torch.int32)
    indices = torch.where(listed_slots(counts, nk), indices, 0)
    return counts, indices.to(torch.int32).contiguous()


def listed_slots(counts: torch.Tensor, nk: int) -> torch.Tensor:
    """(.., nk) True for the slots below each row's count."""
    return torch.arange(nk, device=counts.device) < counts[..., None]
