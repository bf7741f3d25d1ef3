"""How a masked call's BlockMask travels through an op and comes back (mask_args): the user's
own object where the op gets its very tensors (eager calls) or tensors at the same addresses
(a compiled graph's), never another mask's."""

from __future__ import annotations

import torch

from templates.masks.mods import pattern_block_mask
from tuner.dispatch.implementations.mask_args import BLOCK_TENSORS, Masked


def inputs() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(1, 2, 256, 16), torch.randn(1, 2, 256, 16)


def test_an_eager_call_gets_the_users_mask_back() -> None:
    q, k = inputs()
    mask = pattern_block_mask("sliding_causal:64", 256, 256, block_size=64)
    args = Masked.of(q, k, None, mask).op_args()
    back = Masked.from_op_args(*args)
    assert back is not None and back.block_mask is mask
    assert Masked.of(q, k, None, mask).op_args()[0] is mask.full_counts  # seen again: same


def test_a_mask_sharing_tensors_under_another_name_is_not_taken_for_it() -> None:
    q, k = inputs()
    mask = pattern_block_mask("sliding_causal:64", 256, 256, block_size=64)
    Masked.of(q, k, None, mask)
    *tensors, geometry, _, attn = Masked.of(q, k, None, mask).op_args()
    other = Masked.from_op_args(*tensors, geometry, "sliding_causal:32", attn)
    assert other is not None and other.block_mask is not mask
    assert other.block_mask.pattern == "sliding_causal:32"
    assert all(getattr(other.block_mask, n) is t
               for n, t in zip(BLOCK_TENSORS, tensors, strict=True))


def test_tensors_at_the_same_addresses_find_the_users_mask() -> None:
    # A compiled graph hands the op other tensor objects over the same memory.
    q, k = inputs()
    mask = pattern_block_mask("sliding_causal:64", 256, 256, block_size=64)
    *tensors, geometry, pattern, attn = Masked.of(q, k, None, mask).op_args()
    views = [t.view(t.shape) for t in tensors]
    assert all(v is not t and v.data_ptr() == t.data_ptr()
               for v, t in zip(views, tensors, strict=True))
    back = Masked.from_op_args(*views, geometry, pattern, attn)
    assert back is not None and back.block_mask is mask
