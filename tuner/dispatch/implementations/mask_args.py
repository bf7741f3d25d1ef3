"""A masked call's mask, checked once, and how it travels through a ``torch.library`` op: an
elementwise ``attn_mask`` as a tensor, a ``BlockMask`` as its six tensors, its geometry and its
pattern name (an op takes tensors, ints and strings, not a Python object). So a masked call is
one op in a compiled graph, as a dense one is."""

from __future__ import annotations

import weakref
from collections import OrderedDict
from dataclasses import dataclass

import torch

from templates.flash.fwd import check_block_mask
from templates.masks.block_mask import BlockMask
from templates.masks.document_offsets import DocumentOffsets

__all__ = ["Masked", "OpMask"]

# What a masked call adds to an op's arguments (all None for a dense call): a block mask's six
# tensors (an op schema has no optional tensor list), its [seqlen_q, seqlen_kv, q_block,
# kv_block] and pattern, then an attn_mask.
OpMask = tuple[object, ...]
NO_MASK: OpMask = (None,) * 9
BLOCK_TENSORS = ("full_counts", "full_indices", "partial_counts", "partial_indices",
                 "partial_tile_ids", "partial_tiles")

# The user's masks by their tensors, so an op that gets the tensors back runs the user's
# object, with what it keeps (its transposed lists for the backward, Flex's conversion)
# instead of a copy that would build them again on every call.
_LIVE: weakref.WeakValueDictionary[tuple[object, ...], BlockMask] = (
    weakref.WeakValueDictionary())
# Masks rebuilt from an op's tensors (a compiled graph's calls never meet the user's object):
# the last few kept, so the layers of one step that share a mask rebuild it once. Holding
# them holds their tensors, so no other mask can come back at the same addresses meanwhile.
REBUILT_KEPT = 4
_REBUILT: OrderedDict[tuple[object, ...], BlockMask] = OrderedDict()
# The same masks by the id of their first tensor: an eager call hands an op the user's very
# tensor objects, and checking them by identity (``_same_mask``) costs a fraction of their
# data pointers, shapes, dtypes and devices (``_identity``), computed for three lookups per
# training step otherwise. An id is unique among live objects, and an entry leaves with its
# mask (whose tensors it holds).
_BY_FIRST_TENSOR: weakref.WeakValueDictionary[int, BlockMask] = weakref.WeakValueDictionary()


@dataclass(frozen=True)
class Masked:
    """An ``attn_mask`` expanded to (..., H_q, L, S), or a ``BlockMask`` (checked against q
    and k)."""

    attn_mask: torch.Tensor | None = None
    block_mask: BlockMask | None = None

    @property
    def pattern(self) -> str | None:
        return None if self.block_mask is None else self.block_mask.pattern

    @property
    def documents(self) -> DocumentOffsets | None:
        """The packed documents a document block mask carries (``BlockMask.documents``)."""
        return None if self.block_mask is None else self.block_mask.documents

    @property
    def block_size(self) -> tuple[int, int] | None:
        return None if self.block_mask is None else self.block_mask.block_size

    @classmethod
    def of(cls, q: torch.Tensor, k: torch.Tensor, attn_mask: object | None,
           block_mask: object | None) -> Masked:
        """The mask of a call whose checked inputs are q and k."""
        if block_mask is not None:
            if not isinstance(block_mask, BlockMask):
                raise TypeError(f"block_mask must be a tuner.BlockMask, but got "
                                f"{type(block_mask).__name__}")
            if q.dim() != 4:
                raise ValueError(f"block_mask needs 4-D (B, H, L, E) inputs, but query has "
                                 f"shape {tuple(q.shape)}")
            check_block_mask(block_mask, q, k)
            masked = cls(block_mask=block_mask)
            # (a weak dict is no graph operation); a mask seen before is kept already
            if (not torch.compiler.is_compiling()
                    and _BY_FIRST_TENSOR.get(id(block_mask.full_counts)) is not block_mask):
                _LIVE[(*_identity(masked.op_args()[:6]), block_mask.pattern)] = block_mask  # type: ignore[arg-type]
                _BY_FIRST_TENSOR[id(block_mask.full_counts)] = block_mask
            return masked
        if not isinstance(attn_mask, torch.Tensor):
            raise TypeError(f"attn_mask must be a torch.Tensor, but got "
                            f"{type(attn_mask).__name__}")
        if attn_mask.requires_grad:
            raise NotImplementedError(
                "attn_mask requires grad, but the kernels compute no gradient for it (that "
                "would be an N_q x N_kv matrix); pass attn_mask.detach() or use torch SDPA's "
                "math backend")
        full = (*q.shape[:-1], k.shape[-2])
        try:
            view = attn_mask.expand(full)
        except RuntimeError:
            raise ValueError(f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast "
                             f"to {full}") from None
        return cls(attn_mask=view)

    def op_args(self) -> OpMask:
        if self.block_mask is None:
            return (*NO_MASK[:8], self.attn_mask)
        m = self.block_mask
        return (*(getattr(m, name) for name in BLOCK_TENSORS),
                [m.seqlen_q, m.seqlen_kv, *m.block_size], m.pattern, None)

    @classmethod
    def from_op_args(cls, *args: object) -> Masked | None:
        """The mask an op got as ``op_args``; None for a dense call."""
        *tensors, geometry, pattern, attn_mask = (*args, *NO_MASK[len(args):])
        if tensors[0] is None:
            return None if attn_mask is None else cls(attn_mask=attn_mask)  # type: ignore[arg-type]
        assert isinstance(geometry, list) and (pattern is None or isinstance(pattern, str))
        seen = _BY_FIRST_TENSOR.get(id(tensors[0]))
        if seen is not None and _same_mask(seen, tensors, pattern):
            return cls(block_mask=seen)
        key = (*_identity(tensors), pattern)  # type: ignore[arg-type]
        block_mask = _LIVE.get(key) or _REBUILT.get(key)
        if block_mask is None:
            fc, fi, pc, pi, ids, tiles = tensors
            block_mask = BlockMask(geometry[0], geometry[1], (geometry[2], geometry[3]),
                                   fc, fi, pc, pi, ids, tiles, pattern)  # type: ignore[arg-type]
            _REBUILT[key] = block_mask
            while len(_REBUILT) > REBUILT_KEPT:
                _REBUILT.popitem(last=False)
        return cls(block_mask=block_mask)


def _same_mask(mask: BlockMask, tensors: list[object], pattern: object) -> bool:
    """Whether ``tensors`` are ``mask``'s own tensor objects, and ``pattern`` its name."""
    return mask.pattern == pattern and all(
        getattr(mask, name) is t for name, t in zip(BLOCK_TENSORS, tensors, strict=True))


def _identity(tensors: tuple[torch.Tensor, ...] | list[torch.Tensor]) -> tuple[object, ...]:
    return tuple((t.data_ptr(), t.shape, t.dtype, t.device) for t in tensors)
