"""What a call of ``tuner.attention`` is: its checked inputs, the problem they pose on their
device (``Call``), and the keys a plan is kept under (``tuner.dispatch.plans``)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from templates.base import Problem
from templates.device import DeviceInfo, cpu_device, current_device
from templates.flash.fwd import DTYPE_NAMES
from templates.kernel_common import normalize_causal

__all__ = ["Call", "as_shape", "call_of", "call_of_shapes", "check_inputs", "check_tensors",
           "device_info",
           "in_kernel_scope", "layout_key", "problem_key", "shapes_4d"]

# The dtypes some kernel of ours takes; other calls run torch SDPA.
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class Call:
    """What the choice depends on: the problem, whether a gradient is needed, the device."""

    problem: Problem
    needs_grad: bool
    device: DeviceInfo


def check_tensors(**tensors: object) -> None:
    """TypeError naming the argument that is not a floating-point tensor."""
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, but got {type(t).__name__}")
        if not t.dtype.is_floating_point:
            raise TypeError(f"{name} must be a floating-point tensor, but got {t.dtype}")


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, enable_gqa: bool) -> None:
    """SDPA's rules for shapes, dtypes and devices, with messages that say what to change."""
    check_tensors(query=q, key=k, value=v)
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"query, key and value must share one dtype, but got {q.dtype}, "
                        f"{k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"query, key and value must be on one device, but got {q.device}, "
                         f"{k.device}, {v.device}")
    if q.dim() < 2 or not (q.dim() == k.dim() == v.dim()):
        raise ValueError(f"query, key and value must have the same number (>= 2) of dims, "
                         f"but got shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"query and key must have the same embedding dim E, but got "
                         f"{q.shape[-1]} and {k.shape[-1]}")
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(f"key and value must have the same sequence length S, but got "
                         f"{k.shape[-2]} and {v.shape[-2]}")
    if q.dim() >= 3:
        if not (q.shape[:-3] == k.shape[:-3] == v.shape[:-3]):
            raise ValueError(f"query, key and value must have the same batch dims, but got "
                             f"{tuple(q.shape[:-3])}, {tuple(k.shape[:-3])}, "
                             f"{tuple(v.shape[:-3])} (broadcasting is not supported)")
        hq, hk, hv = q.shape[-3], k.shape[-3], v.shape[-3]
        if hk != hv:
            raise ValueError(f"key and value must have the same number of heads, but got "
                             f"{hk} and {hv}")
        if enable_gqa:
            if hq % hk:
                raise ValueError(f"with enable_gqa=True the query heads ({hq}) must be a "
                                 f"multiple of the key/value heads ({hk})")
        elif hq != hk:
            raise ValueError(f"query has {hq} heads and key/value {hk}: pass enable_gqa=True "
                             f"for grouped-query attention (as with torch SDPA)")
    if q.numel() == 0 or k.numel() == 0:
        raise ValueError(f"query and key must not be empty, but got shapes {tuple(q.shape)} "
                         f"and {tuple(k.shape)}")


def in_kernel_scope(q: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether any kernel of ours could take these (checked) inputs (if not, torch SDPA runs
    them): float16/bfloat16/float32, and a value head dim equal to the query's."""
    return q.dtype in KERNEL_DTYPES and q.shape[-1:] == v.shape[-1:]


def device_info(device: torch.device) -> DeviceInfo:
    # CPU tensors run on the CPU also in a process with a GPU: there only torch SDPA (and,
    # under the interpreter, our kernels) can take them, whatever is stored for the GPU.
    return current_device(device.index) if device.type == "cuda" else cpu_device()


def call_of_shapes(shape_q: tuple[int, ...], shape_k: tuple[int, ...], dtype: torch.dtype,
                   is_causal: bool, needs_grad: bool, device: DeviceInfo,
                   mask: str = "none", softcap: float = 0.0) -> Call:
    batch = math.prod(shape_q[:-3])
    heads_q, heads_kv = (shape_q[-3], shape_k[-3]) if len(shape_q) >= 3 else (1, 1)
    problem = Problem(batch=batch, heads_q=heads_q, heads_kv=heads_kv, seqlen_q=shape_q[-2],
                      seqlen_kv=shape_k[-2], head_dim=shape_q[-1], dtype=DTYPE_NAMES[dtype],
                      causal=normalize_causal(is_causal), mask=mask, softcap=softcap)
    return Call(problem, needs_grad, device)


def call_of(q: torch.Tensor, k: torch.Tensor, is_causal: bool, needs_grad: bool,
            mask: str = "none", softcap: float = 0.0) -> Call:
    """The problem of checked inputs, on their device."""
    return call_of_shapes(tuple(q.shape), tuple(k.shape), q.dtype, is_causal, needs_grad,
                          device_info(q.device), mask, softcap)


def as_shape(t: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """``t.reshape(shape)``, or ``t`` itself where it has that shape already (4-D inputs, the
    common case: a training step reshapes 14 tensors, and a reshape to the same shape costs
    10x the comparison, ~1.5 us against 0.17 on a 2-core CPU)."""
    return t if t.shape == shape else t.reshape(shape)


def shapes_4d(q: torch.Tensor, k: torch.Tensor
              ) -> tuple[tuple[int, int, int, int], tuple[int, int, int, int]]:
    """The (B, H_q, L, E) and (B, H_kv, S, E) the kernels see of checked inputs with any
    number of leading dims (folded into B; 2-D inputs are one head)."""
    batch = math.prod(q.shape[:-3])
    heads_q, heads_kv = (q.shape[-3], k.shape[-3]) if q.dim() >= 3 else (1, 1)
    return ((batch, heads_q, q.shape[-2], q.shape[-1]),
            (batch, heads_kv, k.shape[-2], k.shape[-1]))


def problem_key(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
                scale: float | None, enable_gqa: bool, forced: str | None
                ) -> tuple[object, ...]:
    # All that the choice depends on: shapes, dtypes, devices, scale and its class (1 is
    # refused, True too, 1.0 accepted), and a forced implementation.
    return (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, k.device,
            v.device, is_causal, enable_gqa, scale.__class__, scale, forced)


def layout_key(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[object, ...]:
    # What a kernel's launch plan depends on beyond the problem: strides, and each pointer's
    # 16-byte alignment (Triton compiles it into the kernel, per argument: q misaligned and k
    # misaligned are two specializations).
    return (q.stride(), k.stride(), v.stride(), q.data_ptr() % 16 == 0,
            k.data_ptr() % 16 == 0, v.data_ptr() % 16 == 0)
