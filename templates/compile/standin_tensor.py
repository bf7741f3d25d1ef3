"""Stand-in tensors: what a Triton launch specializes on, without any memory behind it.

``kernel.warmup(*args, grid=..., **options)`` compiles the kernel a launch with these
arguments would load, so compile-ahead workers (and ``templates.compile.offline_target``) compile
exactly what a trial will run without allocating inputs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import overload

import torch
from triton.runtime.jit import MockTensor

__all__ = ["StandinTensor"]


class StandinTensor(MockTensor):  # type: ignore[misc]
    """A contiguous tensor's dtype and shape at address 0 (16-byte aligned, like any torch
    allocation).

    triton's ``MockTensor`` with the strides of a contiguous tensor: its own ``stride()``
    multiplies the sizes in the wrong order for rank > 2 (e.g. (60, 12, 3, 1) for shape
    (2, 3, 4, 5)), which changes the divisibility-by-16 specialization of the strides (seen on
    triton 3.6, where precompiled kernels then never matched a launch).
    """

    def __init__(self, dtype: torch.dtype, shape: Sequence[int]) -> None:
        super().__init__(dtype, list(shape))

    @overload
    def stride(self) -> tuple[int, ...]: ...

    @overload
    def stride(self, dim: int) -> int: ...

    def stride(self, dim: int | None = None) -> tuple[int, ...] | int:
        """As ``torch.Tensor.stride``: all of them, or dimension ``dim``'s."""
        strides = [1]
        for size in reversed(self.shape[1:]):
            strides.append(strides[-1] * size)
        whole = tuple(reversed(strides))
        return whole if dim is None else whole[dim]
