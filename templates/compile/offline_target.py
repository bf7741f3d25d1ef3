"""Compiling the kernels for a GPU this machine does not have.

Triton's compiler runs on the CPU: only loading and launching a kernel need the GPU. Under
``offline_target("h100")`` Triton's active driver reports that GPU's architecture instead of
asking CUDA, so a template's ``kernel_launches`` can be compiled down to a cubin (ptxas ships
with triton) on a machine without any GPU: CI proves that a kernel change still compiles for
Hopper (the interpreter runs the kernels' Python, not the compiler), and the registers, stack
(spills) and shared memory of a config can be read before any GPU time is spent
(``templates.compile.report``).

The process must not run the interpreter (``TRITON_INTERPRET=0`` before ``templates`` is
first imported): ``@triton.jit`` decides at definition time whether a kernel is interpreted.
Nothing compiled here can run: there is no device to load it on.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from triton.backends.compiler import GPUTarget
from triton.runtime.driver import driver

from templates.device import DeviceInfo, interpreter_active

__all__ = ["TARGETS", "gpu_compiler_available", "offline_device", "offline_target"]

# What the templates' constraints and heuristics read of each target (not this machine's).
_H100 = DeviceInfo(name="NVIDIA H100 80GB HBM3", compute_capability="9.0", sm_count=132,
                   total_memory=80 << 30, smem_per_block=227 * 1024, driver_version="",
                   triton_version="", torch_version="", cuda_version="")
TARGETS: dict[str, DeviceInfo] = {
    "h100": _H100,
    "h200": dataclasses.replace(_H100, name="NVIDIA H200", total_memory=141 << 30),
    "a100": dataclasses.replace(_H100, name="NVIDIA A100-SXM4-80GB", compute_capability="8.0",
                                sm_count=108, smem_per_block=163 * 1024),
    "b200": dataclasses.replace(_H100, name="NVIDIA B200", compute_capability="10.0",
                                sm_count=148, total_memory=180 << 30),
}

_active: DeviceInfo | None = None


class _OfflineDriver:
    """The part of Triton's driver interface that compiling (``JITFunction.warmup``) uses."""

    def __init__(self, target: Any) -> None:
        self.target = target

    def get_current_target(self) -> Any:
        return self.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_active_torch_device(self) -> Any:
        return torch.device("cpu")


@contextmanager
def offline_target(name: str) -> Iterator[DeviceInfo]:
    """Within the block, Triton compiles for GPU ``name`` (a key of ``TARGETS``); yields the
    target's ``DeviceInfo`` for constraints and default configs."""
    global _active
    if name not in TARGETS:
        raise ValueError(f"unknown offline target {name!r}; known: {sorted(TARGETS)}")
    if interpreter_active():
        raise RuntimeError("offline compiling needs TRITON_INTERPRET=0 set before `templates` "
                           "is imported (interpreted kernels never reach the compiler)")
    if _active is not None:
        raise RuntimeError(f"an offline target ({_active.name}) is already active")

    device = TARGETS[name]
    major, minor = device.compute_capability.split(".")
    # Put back exactly what was active: ``reset_active`` would create the default driver,
    # which fails on a machine without a GPU.
    previous = driver._active
    driver.set_active(_OfflineDriver(GPUTarget("cuda", int(major) * 10 + int(minor), 32)))
    _active = device
    try:
        yield device
    finally:
        _active = None
        driver._active = previous


def offline_device() -> DeviceInfo | None:
    """The target of the enclosing ``offline_target`` block, if any."""
    return _active


def gpu_compiler_available() -> bool:
    """Whether ``warmup`` compiles real GPU code here: a CUDA device or an offline target,
    and no interpreter."""
    if interpreter_active():
        return False
    if _active is not None:
        return True

    return torch.cuda.is_available()
