"""``TensorMapLaunch``: a compiled kernel's launch with its TMA tensor maps kept per pointer.

How Triton passes a host ``TensorDescriptor`` to a compiled kernel (triton 3.6 and 3.9 alike):
the binder types it ``tensordesc<dtype[block_shape]>`` (nothing else of it is specialized
on), and the compiled kernel's ``run`` (a ``CudaLauncher``) calls ``self.launch``, a Python
wrapper (``wrap_handle_tensordesc``) around the C launcher. At every launch that wrapper walks
all the arguments and replaces each descriptor by ``make_tensordesc_arg(descriptor, meta)``:
``[tensor map, *shape, *strides]``, where the tensor map is a fresh 128-byte ``CUtensorMap``
that ``fill_tma_descriptor`` encodes (``cuTensorMapEncodeTiled``) from the base's data pointer,
the shape, strides, block shape, swizzle and element type. The C launcher copies the map into
the kernel's parameters (``__grid_constant__``), so a map object can serve any number of
launches. What differs between the versions is only how the C launcher takes its arguments:

* 3.6: ``launcher(gx, gy, gz, stream, function, cooperative, pdl, global_scratch,
  profile_scratch, kernel_metadata, launch_metadata, enter_hook, exit_hook, *args)``, the
  wrapper a closure over ``launcher``, ``tensordesc_indices`` and ``tensordesc_meta``;
* 3.9: ``launcher(gx, gy, gz, stream, function, cooperative, pdl, kernel_metadata,
  launch_metadata, enter_hook, exit_hook, global_scratch, profile_scratch, arg_annotations,
  kernel_signature, args)``, the wrapper a closure over ``launcher``, ``signature``,
  ``relevant_paths``, ``tensordesc_meta`` and ``make_tensordesc_arg``.

A launch plan knows its descriptors' shapes, strides, dtype and block shapes in advance, so a
descriptor's expansion depends on its tensor's data pointer alone. This module keeps the
expansions per pointer and hands the C launcher the expanded arguments itself: a repeated
pointer (a weight, a KV cache, or an output the caching allocator hands out again) costs a
dictionary lookup instead of a descriptor, the wrapper's walk over every argument and a map
encoding. A kept map holds an address, never a tensor, and is found only under that address:
it cannot outlive its tensor in any way that matters, since a later tensor at the same address
with the plan's layout is described by exactly the same map.

Anything not recognized (another launcher, scratch memory, descriptors Triton passes
decomposed, no metadata) makes ``tensor_map_launch`` return None: the caller then passes
descriptor objects to ``run``, as the JIT does. Needs only torch and triton.
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["TensorMapLaunch", "tensor_map_launch"]

# Distinct pointers kept per descriptor slot; past it the slot starts over (a plan whose
# outputs never repeat an address would otherwise grow without bound).
MAX_KEPT_MAPS = 16

Expand = Callable[[Any], Sequence[Any]]  # a descriptor -> its arguments to the C launcher


class TensorMapLaunch:
    """Launch one compiled kernel on runtime arguments whose ``slots`` hold tensors that
    ``factories[i]`` turns into the plan's descriptors; see the module doc."""

    def __init__(self, raw: Callable[..., Any], one_sequence: bool, head: tuple[Any, ...],
                 slots: Sequence[int],
                 factories: Sequence[Callable[[Any], Any]], expand: Sequence[Expand],
                 constexpr_values: tuple[Any, ...]) -> None:
        self._raw = raw
        self._one_sequence = one_sequence  # 3.9: the kernel's arguments as one sequence
        self._head = head  # what comes between the function and the kernel's arguments
        self._slots: list[tuple[int, dict[int, tuple[Any, ...]], Callable[[Any], Any], Expand]] = [
            (slot, {}, factory, one) for slot, factory, one in zip(slots, factories, expand,
                                                                  strict=True)]
        self._constexpr_values = constexpr_values

    def __call__(self, grid: tuple[int, ...], stream: int, function: Any,
                 args: Sequence[Any]) -> None:
        flat: list[Any] = []
        start = 0
        for slot, kept, factory, expand in self._slots:
            flat += args[start:slot]
            tensor = args[slot]
            ptr = tensor.data_ptr()
            expanded = kept.get(ptr)
            if expanded is None:
                expanded = self._expanded(kept, ptr, expand(factory(tensor)))
            flat += expanded
            start = slot + 1
        flat += args[start:]
        flat += self._constexpr_values
        if self._one_sequence:  # any sequence; Triton's wrapper passes a list too
            self._raw(*grid, stream, function, *self._head, flat)
        else:
            self._raw(*grid, stream, function, *self._head, *flat)

    @staticmethod
    def _expanded(kept: dict[int, tuple[Any, ...]], ptr: int, expanded: Sequence[Any]
                  ) -> tuple[Any, ...]:
        out = tuple(expanded)
        if any(isinstance(x, torch.Tensor) for x in out):
            # Passed decomposed (base tensor, shape, strides; tensor_map_launch refuses such
            # launchers, so never here): right for this launch, but not to be kept, as keeping
            # it would keep the tensor alive.
            return out
        if len(kept) >= MAX_KEPT_MAPS:
            kept.clear()
        kept[ptr] = out
        return out


def _closure(fn: Any) -> dict[str, Any]:
    """The variables a Python closure captured, by name ({} for anything else)."""
    code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None)
    if code is None or not cells:
        return {}
    try:
        return {name: cell.cell_contents for name, cell in zip(code.co_freevars, cells,
                                                                strict=True)}
    except ValueError:  # an empty cell
        return {}


def _descriptor_positions(signature: Any) -> list[int] | None:
    if not isinstance(signature, Sequence):
        return None
    if any(isinstance(s, tuple) for s in signature):
        return None  # tuple arguments: not flattened here
    return [i for i, s in enumerate(signature) if isinstance(s, str) and s.startswith("tensordesc")]


def _expanders(make_arg: Any, metas: Sequence[Any]) -> list[Expand] | None:
    """``make_tensordesc_arg`` bound to each descriptor's metadata, as functions of the
    descriptor; None where its parameters are not one of the known two."""
    try:
        arity = len(inspect.signature(make_arg).parameters)
    except (TypeError, ValueError):
        return None
    if arity == 2:  # 3.6: (arg, metadata)
        return [functools.partial(_expand2, make_arg, meta) for meta in metas]
    if arity == 3:  # 3.9: (arg, metadata, base_args), the last unused by the CUDA backend
        return [functools.partial(_expand3, make_arg, meta) for meta in metas]
    return None


def _expand2(make_arg: Any, meta: Any, desc: Any) -> Sequence[Any]:
    return make_arg(desc, meta)  # type: ignore[no-any-return]


def _expand3(make_arg: Any, meta: Any, desc: Any) -> Sequence[Any]:
    return make_arg(desc, meta, ())  # type: ignore[no-any-return]


def tensor_map_launch(compiled: Any, slots: Sequence[int],
                      factories: Sequence[Callable[[Any], Any]],
                      constexpr_values: tuple[Any, ...]) -> TensorMapLaunch | None:
    """The tensor-map launch of ``compiled`` (a Triton ``CompiledKernel``) whose runtime
    arguments at ``slots`` (ascending) are its only descriptors, or None where this Triton's
    launcher is not one described in the module doc."""
    run: Any = getattr(compiled, "run", None)
    cls = type(run)
    if cls.__name__ != "CudaLauncher" or cls.__module__ != "triton.backends.nvidia.driver":
        return None
    if getattr(run, "global_scratch_size", 1) or getattr(run, "profile_scratch_size", 1) or \
            getattr(run, "gsan_enabled", False):
        return None  # scratch is allocated per launch by CudaLauncher.__call__
    wrapper = getattr(run, "launch", None)
    cells = _closure(wrapper)
    raw, metas = cells.get("launcher"), cells.get("tensordesc_meta")
    if not callable(raw) or not metas or any(m is None for m in metas):
        return None  # no metadata: descriptors are passed decomposed (pre-Hopper lowering)
    cooperative, pdl = getattr(run, "launch_cooperative_grid", None), getattr(run, "launch_pdl",
                                                                              None)
    metadata = getattr(compiled, "packed_metadata", None)
    if cooperative is None or pdl is None or metadata is None:
        return None
    if {"signature", "relevant_paths", "make_tensordesc_arg"} <= cells.keys() and \
            hasattr(run, "arg_annotations") and hasattr(run, "kernel_signature"):
        positions = _descriptor_positions(cells["signature"])
        expand = _expanders(cells["make_tensordesc_arg"], metas)
        one_sequence = True
        # kernel metadata; launch metadata, hooks and scratch: none; the argument annotations
        head: tuple[Any, ...] = (cooperative, pdl, metadata, None, None, None, None, None,
                                 run.arg_annotations, run.kernel_signature)
    elif "tensordesc_indices" in cells and \
            getattr(sys.modules.get(getattr(wrapper, "__module__", "")), "_BASE_ARGS_FORMAT_LEN",
                    None) == 13:
        module = sys.modules[wrapper.__module__]
        positions = sorted(cells["tensordesc_indices"])
        expand = _expanders(getattr(module, "make_tensordesc_arg", None), metas)
        one_sequence = False
        # scratch: none; kernel metadata; launch metadata and hooks: none
        head = (cooperative, pdl, None, None, metadata, None, None, None)
    else:
        return None
    if expand is None or positions != list(slots) or len(metas) != len(slots):
        return None
    return TensorMapLaunch(raw, one_sequence, head, slots, factories, expand, constexpr_values)
