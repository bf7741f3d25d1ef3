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
reads: the dtype and 16-byte alignment of each tensor argument, and the value of each integer
argument (Triton specializes on == 1 and on divisibility by 16). Runtime float arguments may
change freely. Where no compiled launcher can be used (the CPU interpreter, a launch hook
set by a profiler, a Triton without the attributes used here), every call takes the JIT's
path, which is always correct.

Needs only torch and triton: exported kernel modules inline it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import triton

__all__ = ["DirectLaunch", "alignment_key", "current_stream"]


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


def _hook_set(hook: Any) -> bool:
    # Triton 3.6 keeps None or a function; later ones a chain of hooks, empty when unset.
    return hook is not None and bool(getattr(hook, "calls", True))


def _launch_hooks_set() -> bool:
    """Whether a profiler (proton, say) asked to hear of launches: those go through the JIT,
    which passes the hooks their launch metadata."""
    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    return runtime is not None and (_hook_set(getattr(runtime, "launch_enter_hook", None))
                                    or _hook_set(getattr(runtime, "launch_exit_hook", None)))


class DirectLaunch:
    """The launch of one kernel with fixed grid, constexprs and options; see the module doc.

    ``launch_on(stream, *args)`` takes the kernel's runtime arguments positionally, in the
    kernel's order (they must come first in its signature, the constexprs after them).
    """

    def __init__(self, kernel: Any, grid: Sequence[int], constexprs: dict[str, Any],
                 options: dict[str, Any]) -> None:
        self.kernel = kernel
        self.grid = tuple(grid) + (1,) * (3 - len(grid))
        self.constexprs = constexprs
        self.options = options
        self._launcher: Callable[..., Any] | None = None
        self._function: Any = None
        self._metadata: Any = None
        self._constexpr_values: tuple[Any, ...] = ()
        self.direct_launches = 0  # how many calls skipped the JIT (tests read it)

    def launch_on(self, stream: int, *args: Any) -> None:
        """Launch on ``stream`` (a raw CUDA stream handle of the current device, which the
        caller has already looked up for several launches)."""
        launcher = self._launcher
        if launcher is None or _launch_hooks_set():
            self._launch_through_jit(args)
            return
        grid = self.grid
        launcher(grid[0], grid[1], grid[2], stream, self._function, self._metadata, None,
                 None, None, *args, *self._constexpr_values)
        self.direct_launches += 1

    def _launch_through_jit(self, args: tuple[Any, ...]) -> None:
        compiled = self.kernel[self.grid](*args, **self.constexprs, **self.options)
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
        self._function, self._metadata, self._launcher = function, metadata, launcher
