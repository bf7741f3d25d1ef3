"""What the Gluon forward and backward kernel modules share: the triton names that moved
between versions, and the host side of their TMA descriptors.

Imports only torch, triton and ``templates.kernel_common``: the kernel modules are exported as standalone source, and
``templates.base.inline_template_imports`` pastes this module into them there (the
templates also hash it into their version).
"""

from __future__ import annotations

from typing import Any

import torch
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from templates.kernel_common import CAUSAL_MODES, LOG2_E  # noqa: F401  re-exported for the kernels

# Names that moved between triton versions. TMA copies: triton 3.6 names them
# async_copy_global_to_shared / async_copy_shared_to_global, later versions async_load /
# async_store (the old names raise there).
tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
# A barrier among the warps of the calling partition: thread_barrier in 3.6, barrier later.
warps_barrier = getattr(gl, "thread_barrier", None) or gl.barrier

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)


def host_smem_layout(block_shape: list[int], bitwidth: int) -> Any:
    row_bytes = block_shape[-1] * bitwidth // 8
    swizzle = 128 if row_bytes % 128 == 0 else (64 if row_bytes % 64 == 0 else 32)
    return gl.NVMMASharedLayout(swizzle_byte_width=swizzle, element_bitwidth=bitwidth,
                                rank=len(block_shape))


def tma_descriptor(t: Any, block: list[int], layout: Any) -> Any:
    return TensorDescriptor(t, list(t.shape), list(t.stride()), block, layout)


def tma_layout_problem(t: torch.Tensor, name: str) -> str | None:
    """Why a rank-4 TMA descriptor cannot cover ``t`` (None if it can)."""
    strides = t.stride()
    if strides[-1] != 1:
        return f"TMA needs {name}'s last dimension contiguous, but its strides are {strides}"
    for dim, (size, stride) in enumerate(zip(t.shape[:-1], strides[:-1], strict=True)):
        if size > 1 and (stride <= 0 or (stride * t.element_size()) % 16):
            return (f"TMA needs every stride of {name} to be a positive multiple of 16 bytes, "
                    f"but dim {dim} has stride {stride}")
    if t.data_ptr() % 16:
        return f"TMA needs {name} to start at a 16-byte aligned address"
    return None


def tma_ready(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself if TMA can read it, else a contiguous copy."""
    return t if tma_layout_problem(t, "t") is None else t.contiguous()
