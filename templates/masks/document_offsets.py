"""What a document block mask is, exactly: the packed documents' offsets (the contents of
FlashAttention's ``cu_seqlens_q`` / ``cu_seqlens_k``) and whether each document is causal.

A ``BlockMask`` built from documents carries this (``BlockMask.documents``), so an
implementation that runs packed sequences by their offsets rather than by blocks (torch's
``varlen_attn``) can run the very call the mask describes. The blocks alone do not say it:
a document edge inside a block is only in that block's tile. Imports nothing of ours (the
mask module imports it).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DocumentOffsets"]


@dataclass(frozen=True)
class DocumentOffsets:
    """Documents d = 0..n-1: queries ``offsets_q[d]:offsets_q[d + 1]`` see the keys
    ``offsets_k[d]:offsets_k[d + 1]`` of the same document, and with ``causal`` only those
    at or before them, aligned bottom-right (FlashAttention's varlen rule: query i of L_q
    sees key j of L_k iff j <= i + L_k - L_q). Offsets start at 0 and never decrease; a
    document may be empty. One batch row's worth: a mask whose every row is packed alike."""

    offsets_q: tuple[int, ...]
    offsets_k: tuple[int, ...]
    causal: bool

    def __post_init__(self) -> None:
        for name, offsets in (("offsets_q", self.offsets_q), ("offsets_k", self.offsets_k)):
            if len(offsets) < 2 or offsets[0] != 0:
                raise ValueError(f"DocumentOffsets.{name} must start at 0 and hold n_docs + 1 "
                                 f">= 2 offsets, but is {offsets[:8]}")
            if any(b < a for a, b in zip(offsets[:-1], offsets[1:], strict=True)):
                raise ValueError(f"DocumentOffsets.{name} must not decrease")
        if len(self.offsets_q) != len(self.offsets_k):
            raise ValueError(f"DocumentOffsets: offsets_q and offsets_k must describe the same "
                             f"documents, but hold {len(self.offsets_q)} and "
                             f"{len(self.offsets_k)} offsets")

    @property
    def max_q(self) -> int:
        """The longest document's query count (FlashAttention's ``max_seqlen_q``)."""
        return max(b - a for a, b in zip(self.offsets_q[:-1], self.offsets_q[1:], strict=True))

    @property
    def max_k(self) -> int:
        return max(b - a for a, b in zip(self.offsets_k[:-1], self.offsets_k[1:], strict=True))

    @classmethod
    def of_lengths(cls, lengths: list[int] | tuple[int, ...], *, causal: bool
                   ) -> DocumentOffsets:
        """Self-attention documents of these lengths (queries and keys share offsets)."""
        offsets = [0]
        for n in lengths:
            offsets.append(offsets[-1] + int(n))
        return cls(tuple(offsets), tuple(offsets), causal)
