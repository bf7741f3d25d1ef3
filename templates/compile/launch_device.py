"""``LaunchDevice``: the device a kept launch plan launches on. Triton launches on the current
CUDA device, so a plan called with tensors on another one must make theirs current first."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

__all__ = ["LaunchDevice"]


class LaunchDevice:
    """Per plan: whether the process has several CUDA devices is asked once (first call); with
    one (or on the CPU) every call gets a no-op context."""

    def __init__(self) -> None:
        self._several: bool | None = None

    def of(self, t: torch.Tensor) -> contextlib.AbstractContextManager[Any]:
        """A context that makes ``t``'s device current where it is not."""
        if self._several is None:
            self._several = t.is_cuda and torch.cuda.device_count() > 1
        if self._several and t.device.index != torch.cuda.current_device():
            return torch.cuda.device(t.device)
        return contextlib.nullcontext()
