"""bfloat16 under Triton's interpreter: the kernels compute in float32, the outputs come back
in bfloat16.

The interpreter runs the kernels' arithmetic in numpy, which has no bfloat16: a ``tl.dot`` of
two bf16 16x16 tiles was off by 2.6e10 (triton 3.9, the dev machines' CPU), and
``tuner.attention`` on bf16 CPU tensors returned values around 1e8 without an error (issue 20).
Loads of bf16 converted to float32 are exact, so the launchers hand the kernels float32 copies
of bf16 inputs there and cast the outputs back: the answer a GPU gives, up to bf16 rounding. A
GPU never takes this path.
"""

from __future__ import annotations

from typing import Any

import torch

from templates.device import interpreter_active

__all__ = ["Float32Plan", "as_float32", "runs_in_float32"]


def runs_in_float32(dtype: torch.dtype) -> bool:
    """Whether a kernel given inputs of ``dtype`` computes on float32 copies instead."""
    return dtype == torch.bfloat16 and interpreter_active()


def as_float32(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Float32 copies of bf16 tensors (their strides kept where the layout is dense, as a
    launch plan made for one call's copies expects of the next's); others as they are."""
    return tuple(t.float() if t.dtype == torch.bfloat16 else t for t in tensors)


class Float32Plan:
    """A forward launch plan made for the float32 copies of bf16 inputs: called with the bf16
    tensors, it runs ``plan`` on their copies and returns o in bfloat16 (lse stays float32)."""

    def __init__(self, plan: Any) -> None:
        self.plan = plan

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: Any = None,
                 attn_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        o, lse = self.plan(*as_float32(q, k, v), block_mask, attn_mask)
        return o.to(q.dtype), lse
