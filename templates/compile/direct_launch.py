"""``DirectLaunch``: one compiled Triton kernel, launched again without the JIT's binder.

``kernel[grid](*args, **constexprs)`` binds and specializes its arguments on every call
(Python work per argument: type, 16-byte alignment, divisibility by 16, the cache key) before
it reaches the compiled launcher. With some 30 arguments that costs tens of microseconds of
host time per launch on an H100 host, more than a decode kernel runs on the GPU. A launch
plan knows everything that specialization reads (shapes, strides, dtypes, pointer alignment,
the constexprs) before the call, so the first call goes through the JIT, which compiles or
finds the kernel and returns it, and later calls hand their arguments straight to that
kernel's launcher.

The caller guarantees that the key of its plan captures every property the specialization
reads: the dtype and 16-byte alignment of each pointer argument, and the value of each integer
argument (Triton specializes on == 1 and on divisibility by 16). Runtime float arguments may
change freely. A direct launch may pass a pointer argument as its address (an int), or None
for a null one (an argument the kernel's constexprs compile out): the launcher then reads no
``data_ptr`` and makes no ``cuPointerGetAttribute`` call for it. Only ``try_direct`` takes
those: ``launch_on`` may go through the JIT, which needs the tensors (it would type an int an
integer and compile another kernel).

TMA descriptor arguments (``descriptors``: argument position -> a function making the plan's
host descriptor of a tensor) are passed as tensors laid out as the plan says; Triton types a
descriptor by its dtype and block shape only. Where this Triton's launcher is recognized
(``templates.compile.tensor_maps``), a direct launch keeps each descriptor's encoded tensor map per
data pointer; elsewhere it passes descriptor objects to the compiled launcher, as the JIT does.

Where no compiled launcher can be used (the CPU interpreter, a launch hook set by a profiler,
a Triton without the attributes used here, ``ENABLED`` off), every call takes the JIT's path,
which is always correct.

Needs only torch and triton: exported kernel modules inline it (and
``templates.compile.tensor_maps``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import triton

from templates.compile.tensor_maps import TensorMapLaunch, tensor_map_launch

__all__ = ["DirectLaunch", "alignment_key", "current_stream"]

# Off: every launch goes through the JIT (benchmarks time the same plans both ways).
ENABLED = True


def alignment_key(*tensors: torch.Tensor) -> tuple[bool, ...]:
    """Whether each tensor's data pointer is 16-byte aligned: the pointer specialization
    Triton compiles into a kernel, and so part of any key a ``DirectLaunch`` is kept under."""
    return tuple(t.data_ptr() % 16 == 0 for t in tensors)


def current_stream(device_index: int) -> int:
    """The raw handle of the current CUDA stream of a device (what Triton's own launch
    asks torch for; ``torch.cuda.current_stream`` builds a Stream object first)."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return int(raw(device_index))
    return torch.cuda.current_stream(device_index).cuda_stream


# Triton's runtime knobs (3.6 and later): where a profiler sets its launch hooks.
_RUNTIME = getattr(getattr(triton, "knobs", None), "runtime", None)


def _launch_hooks_set() -> bool:
    """Whether a profiler (proton, say) asked to hear of launches: those go through the JIT,
    which passes the hooks their launch metadata. Each hook is a chain of hooks, empty when
    unset, or a function set in its place (or None); read on every launch, so kept short."""
    if _RUNTIME is None:
        return False
    enter, leave = _RUNTIME.launch_enter_hook, _RUNTIME.launch_exit_hook
    return bool(getattr(enter, "calls", enter)) or bool(getattr(leave, "calls", leave))


class DirectLaunch:
    """The launch of one kernel with fixed grid, constexprs and options; see the module doc.

    ``launch_on(stream, *args)`` takes the kernel's runtime arguments positionally, in the
    kernel's order (they must come first in its signature, the constexprs after them);
    ``descriptors`` maps the positions of TMA descriptor arguments to the functions that make
    them from the tensors passed there.
    """

    def __init__(self, kernel: Any, grid: Sequence[int], constexprs: dict[str, Any],
                 options: dict[str, Any],
                 descriptors: Mapping[int, Callable[[Any], Any]] | None = None) -> None:
        self.kernel = kernel
        self.grid = tuple(grid) + (1,) * (3 - len(grid))
        self.constexprs = constexprs
        self.options = options
        # One dict: a Gluon kernel's num_warps is both a constexpr and a launch option.
        self._jit_kwargs = {**constexprs, **options}
        self.descriptors = dict(sorted((descriptors or {}).items()))
        self._launcher: Callable[..., Any] | None = None
        self._function: Any = None
        self._metadata: Any = None
        self._constexpr_values: tuple[Any, ...] = ()
        self._tensor_maps: TensorMapLaunch | None = None
        self._compiled: Any = None
        self.direct_launches = 0  # how many calls skipped the JIT (tests read it)

    @property
    def keeps_tensor_maps(self) -> bool:
        """Whether direct launches reuse encoded TMA tensor maps (tests read it)."""
        return self._tensor_maps is not None

    def launch_on(self, stream: int, *args: Any) -> None:
        """Launch on ``stream`` (a raw CUDA stream handle of the current device, which the
        caller has already looked up for several launches); tensors as tensors."""
        if self._launcher is None or not ENABLED or _launch_hooks_set():
            self._launch_through_jit(args)
        else:
            self._launch_direct(stream, args)

    def try_direct(self, stream: int, *args: Any) -> bool:
        """Launch directly, pointers possibly as addresses (see the module doc), and say so;
        False (nothing launched) where the call must go through ``launch_on``."""
        if self._launcher is None or not ENABLED or _launch_hooks_set():
            return False
        self._launch_direct(stream, args)
        return True

    def _launch_direct(self, stream: int, args: Sequence[Any]) -> None:
        grid = self.grid
        if self._tensor_maps is not None:
            self._tensor_maps(grid, stream, self._function, args)
        else:
            if self.descriptors:
                args = self._with_descriptors(args)
            self._launcher(grid[0], grid[1], grid[2], stream, self._function,  # type: ignore[misc]
                           self._metadata, None, None, None, *args, *self._constexpr_values)
        self.direct_launches += 1

    def _with_descriptors(self, args: Sequence[Any]) -> list[Any]:
        out = list(args)
        for position, make in self.descriptors.items():
            out[position] = make(out[position])
        return out

    def _launch_through_jit(self, args: Sequence[Any]) -> None:
        jit_args = self._with_descriptors(args) if self.descriptors else args
        compiled = self.kernel[self.grid](*jit_args, **self._jit_kwargs)
        if self._launcher is None and compiled is not None:
            self._adopt(compiled, len(args))

    def _adopt(self, compiled: Any, runtime_count: int) -> None:
        """Keep ``compiled``'s launcher if this Triton exposes what the JIT itself calls and
        the kernel's parameters are the runtime arguments followed by the constexprs."""
        names = list(getattr(self.kernel, "arg_names", ()))
        if names[runtime_count:] != list(self.constexprs) and \
                sorted(names[runtime_count:]) != sorted(self.constexprs):
            return
        try:
            launcher = compiled.run
            function = compiled.function
            metadata = compiled.packed_metadata
        except (AttributeError, RuntimeError):
            return
        if not callable(launcher):
            return
        self._constexpr_values = tuple(self.constexprs[name] for name in names[runtime_count:])
        if self.descriptors:
            self._tensor_maps = tensor_map_launch(compiled, list(self.descriptors),
                                                  list(self.descriptors.values()),
                                                  self._constexpr_values)
        self._function, self._metadata, self._launcher = function, metadata, launcher
        # Kept alive with its function: triton 3.9 (not 3.6) unloads a compiled kernel's
        # module when the kernel object goes (the JIT's cache cleared, say), which would leave
        # the function handle dangling.
        self._compiled = compiled


class PlannedDescriptor:
    """A launch plan's TMA descriptor of one argument, as a function of the tensor passed
    there (a ``DirectLaunch`` descriptor maker). ``build(tensor)`` makes the first, checking
    the layout (``TensorDescriptor`` checks shape, strides and alignment: about 5 us on a
    CPU of the dev machines); later ones copy its fields onto the new tensor, skipping checks
    that held for a tensor laid out alike. The fields are kept without their tensor: a plan
    must not keep its first call's memory alive."""

    def __init__(self, build: Callable[[Any], Any]) -> None:
        self._build = build
        self._cls: type[Any] | None = None
        self._fields: dict[str, Any] = {}

    def __call__(self, tensor: Any) -> Any:
        if self._cls is None:
            desc = self._build(tensor)
            self._fields = {**vars(desc), "base": None}
            self._cls = type(desc)
            return desc
        desc = object.__new__(self._cls)
        desc.__dict__ = self._fields.copy()
        desc.base = tensor
        return desc
