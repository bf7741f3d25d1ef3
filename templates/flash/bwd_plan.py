"""``BackwardPlan``: the launches of one flash backward less their tensors, kept for the next
call laid out alike.

``bwd_kernel.launch`` works out three launches (preprocess, dK/dV, dQ) from its arguments on
every call, then launches each through Triton's JIT, whose binder specializes some 60
arguments per call again: together a few hundred microseconds of host time per backward on
an H200 host, as long as a masked backward's kernels at 4k tokens. A plan does that work once
per layout (``bwd_kernel.kernel_calls`` run on slots that name each tensor's role) and, per
call, allocates the outputs, puts the call's tensors into the kept argument lists and
launches each kernel through a ``DirectLaunch``.

What the plan fixes, and so what its key must hold (``flash_attention_bwd``'s plan cache):
shapes, strides, dtypes and devices of the six inputs, of an ``attn_mask`` view and of a
block mask's tensors (its integer arguments are their strides), the causal mode, scale,
softcap and config. Pointers are specialized on 16-byte alignment: a call whose pointers are
all aligned takes the direct launches, any other goes through the JIT (which compiles or
finds its own kernel), so the key need not hold alignment.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from templates.compile.direct_launch import DirectLaunch, current_stream
from templates.compile.launch_device import LaunchDevice
from templates.flash import bwd_kernel as kernel

__all__ = ["BackwardPlan", "block_mask_key"]

LAUNCH_OPTIONS = ("num_warps", "num_stages")
# Roles of the tensors a launch reads or writes, in the order ``BackwardPlan`` lists them.
_ROLES = ("do", "q", "k", "v", "o", "lse", "delta", "lse2", "dq", "dk", "dv", "attn_mask")
_MASK_TENSORS = 6  # a BlockMask's tensors in its ``kernel_args``


class _Slot:
    """Stands in for one tensor while the launches are worked out: what ``kernel_calls``
    reads of it (dtype, shape, strides) and which argument of a call it is (``role``)."""

    def __init__(self, role: int, tensor: Any) -> None:
        self.role = role
        self.dtype = tensor.dtype
        self.shape = tensor.shape
        self._strides = tuple(tensor.stride())

    def stride(self) -> tuple[int, ...]:
        return self._strides


class _SlotMask:
    """Stands in for a BlockMask (and its transposed lists) while the launches are worked
    out: ``kernel_args`` gives slots for its tensors and its strides."""

    def __init__(self, args: list[Any], first_role: int, block_size: tuple[int, int],
                 transposed: _SlotMask | None = None) -> None:
        self._args = [_Slot(first_role + i, t) if i < _MASK_TENSORS else t
                      for i, t in enumerate(args)]
        self.block_size = block_size
        self._transposed = transposed

    def kernel_args(self) -> list[Any]:
        return self._args

    @property
    def transposed(self) -> _SlotMask:
        assert self._transposed is not None
        return self._transposed


def block_mask_key(block_mask: Any) -> tuple[object, ...] | None:
    """What a plan reads of a block mask: its geometry (the shapes of its lists, whose strides
    follow: they are contiguous) and device; the transposed lists' geometry follows too."""
    if block_mask is None:
        return None
    return (block_mask.__class__, tuple(block_mask.shape), tuple(block_mask.block_size),
            tuple(block_mask.full_indices.shape), tuple(block_mask.partial_tiles.shape),
            block_mask.device)


class _Launch:
    """One kernel's launch: its argument list with the tensors' positions (and roles) left to
    fill, and its ``DirectLaunch``."""

    def __init__(self, fn: Any, grid: tuple[int, ...], args: list[Any],
                 options: dict[str, Any]) -> None:
        self.fn = fn
        self.grid = grid
        self.options = options
        self.template = [None if isinstance(a, _Slot) else a for a in args]
        self.slots = [(i, a.role) for i, a in enumerate(args) if isinstance(a, _Slot)]
        self.direct = DirectLaunch(
            fn, grid, {k: v for k, v in options.items() if k not in LAUNCH_OPTIONS},
            {k: v for k, v in options.items() if k in LAUNCH_OPTIONS})

    def args(self, tensors: list[Any]) -> list[Any]:
        out = self.template.copy()
        for position, role in self.slots:
            out[position] = tensors[role]
        return out


class BackwardPlan:
    """The preprocess, dK/dV and (``dq_mode="separate"``) dQ launches of one backward, worked
    out from the first call's inputs; ``plan(do, q, k, v, o, lse, block_mask, attn_mask)`` runs
    them on inputs laid out alike (module doc) and returns (dq, dk, dv)."""

    def __init__(self, do: Any, q: Any, k: Any, v: Any, o: Any, lse: Any, *,
                 causal_mode: str, scale: float, config: Mapping[str, Any],
                 block_mask: Any = None, attn_mask: Any = None, softcap: float = 0.0) -> None:
        self.rows = tuple(q.shape[:3])
        self.q_shape, self.k_shape, self.v_shape = tuple(q.shape), tuple(k.shape), tuple(v.shape)
        self.dtype = q.dtype
        self.atomic = str(config["dq_mode"]) == "atomic"
        self.sparse = block_mask is not None
        self.masked = attn_mask is not None
        f32 = torch.float32
        standins = [_Slot(i, t) for i, t in enumerate((do, q, k, v, o, lse))]
        # The row buffers contiguous, the gradients in their inputs' layouts (``_grad_strides``).
        self.q_strides, self.kv_strides = _grad_strides(q, k, v)
        for role, (shape, dtype, strides) in enumerate(
                ((self.rows, f32, None), (self.rows, f32, None),
                 (self.q_shape, f32 if self.atomic else q.dtype, self.q_strides),
                 (self.k_shape, k.dtype, self.kv_strides),
                 (self.v_shape, v.dtype, self.kv_strides)), start=6):
            standins.append(_Slot(role, _LaidOut(shape, dtype, strides)))
        mask_slot = None if attn_mask is None else _Slot(len(_ROLES) - 1, attn_mask)
        mask_standin = None
        if block_mask is not None:
            first = len(_ROLES)
            transposed = _SlotMask(block_mask.transposed.kernel_args(), first + _MASK_TENSORS,
                                   tuple(block_mask.transposed.block_size))
            mask_standin = _SlotMask(block_mask.kernel_args(), first,
                                     tuple(block_mask.block_size), transposed)
        calls = kernel.kernel_calls(*standins, causal_mode=causal_mode, scale=scale,
                                    config=config, block_mask=mask_standin,
                                    attn_mask=mask_slot, softcap=softcap)
        self.launches = [_Launch(fn, tuple(grid), args, options)
                         for fn, grid, args, options in calls]
        self._device = LaunchDevice()

    def __call__(self, do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 o: torch.Tensor, lse: torch.Tensor, block_mask: Any = None,
                 attn_mask: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.sparse != (block_mask is not None) or self.masked != (attn_mask is not None):
            raise ValueError("this backward plan was made for another kind of mask")
        delta = kernel._empty(self.rows, q, torch.float32)
        lse2 = kernel._empty(self.rows, q, torch.float32)
        dk = kernel._empty(self.k_shape, k, k.dtype, self.kv_strides)
        dv = kernel._empty(self.v_shape, v, v.dtype, self.kv_strides)
        # Atomic mode accumulates dQ in fp32 (zeroed: every visited tile adds into it); its
        # cast keeps the layout.
        dq = (torch.empty_strided(self.q_shape, self.q_strides, device=q.device,
                                  dtype=torch.float32).zero_() if self.atomic
              else kernel._empty(self.q_shape, q, q.dtype, self.q_strides))
        tensors: list[Any] = [do, q, k, v, o, lse, delta, lse2, dq, dk, dv, attn_mask]
        if block_mask is not None:
            tensors += block_mask.kernel_args()[:_MASK_TENSORS]
            tensors += block_mask.transposed.kernel_args()[:_MASK_TENSORS]
        with self._device.of(q):
            self._launch(q, tensors)
        return (dq.to(q.dtype) if self.atomic else dq), dk, dv

    def _launch(self, q: torch.Tensor, tensors: list[Any]) -> None:
        pointers = [None if t is None else t.data_ptr() for t in tensors]
        aligned = True
        for p in pointers:
            if p is not None and p % 16:
                aligned = False
                break
        stream = current_stream(q.device.index) if q.is_cuda else 0
        for launch in self.launches:
            # Pointers as addresses: the launcher then makes no driver call for them.
            if aligned and launch.direct.try_direct(stream, *launch.args(pointers)):
                continue
            if aligned:  # (the first launch compiles and is adopted by the DirectLaunch)
                launch.direct.launch_on(stream, *launch.args(tensors))
            else:  # another specialization than the one the DirectLaunch keeps
                launch.fn[launch.grid](*launch.args(tensors), **launch.options)


def _contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _grad_strides(q: Any, k: Any, v: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(dq's, dk's and dv's) strides: their inputs' layouts as ``torch.empty_like`` makes
    them, so a packed (B, L, H, D) caller's gradients need no copy after (what the dispatcher's
    backward ops return); dk's and dv's contiguous where k and v are laid out differently
    (the kernels take one set of strides for both)."""
    def like(t: Any) -> tuple[int, ...]:
        if not isinstance(t, torch.Tensor):
            return _contiguous(tuple(t.shape))
        return tuple(torch.empty_like(t, device="meta").stride())

    k_strides, v_strides = like(k), like(v)
    kv = k_strides if k_strides == v_strides else _contiguous(tuple(k.shape))
    return like(q), kv


class _LaidOut:
    """A tensor of ``shape`` and ``dtype`` as a ``_Slot`` reads it (nothing allocated):
    contiguous, or laid out by ``strides``."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype,
                 strides: tuple[int, ...] | None = None) -> None:
        self.shape = torch.Size(shape)
        self.dtype = dtype
        self.strides = strides or _contiguous(tuple(self.shape))

    def stride(self) -> tuple[int, ...]:
        return self.strides
