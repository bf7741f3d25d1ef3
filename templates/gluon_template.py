"""What the Gluon templates (``gluon_fwd``, ``gluon_bwd``) share around their kernel modules:
loading the kernel module (Gluon may be missing), the problems no Gluon kernel takes, the
source that defines them, the standalone export and the config an entry point runs.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from types import ModuleType
from typing import ClassVar

import torch

from templates.base import KernelConfig, KernelLaunch, Problem, Template
from templates.device import DeviceInfo, current_device

DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16"}
TORCH_DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}


def load_kernel_module(name: str) -> tuple[ModuleType | None, str]:
    """(the kernel module, "") or, on a triton without Gluon, (None, why): the template then
    still imports, and rejects every problem with that reason."""
    try:
        return importlib.import_module(name), ""
    except ImportError as exc:  # pragma: no cover - a triton without Gluon
        return None, f"triton.experimental.gluon is not usable here ({exc})"


def problem_of(q: torch.Tensor, k: torch.Tensor, causal_mode: str) -> Problem:
    return Problem(batch=q.shape[0], heads_q=q.shape[1], heads_kv=k.shape[1],
                   seqlen_q=q.shape[2], seqlen_kv=k.shape[2], head_dim=q.shape[3],
                   dtype=DTYPE_NAMES[q.dtype], causal=causal_mode)


class GluonTemplate(Template):
    """A Hopper-only Gluon template whose kernels live in ``kernel`` (torch + triton only)."""

    kernel: ClassVar[ModuleType | None]
    gluon_missing: ClassVar[str]
    head_dims: ClassVar[tuple[int, ...]]
    # Why the head dims stop where they do, said after a rejected head dim.
    head_dims_why: ClassVar[str]
    standalone_entry: ClassVar[str]

    def source_modules(self) -> Sequence[str]:
        mods = [__name__, type(self).__module__]
        if self.kernel is not None:
            from templates import gluon_common  # imports only where Gluon does

            mods[:0] = [self.kernel.__name__, gluon_common.__name__]
        return mods

    def unsupported(self, problem: Problem) -> str | None:
        if self.gluon_missing:
            return self.gluon_missing
        if problem.mask != "none":
            return f"{self.name} has no block masks (dense and causal only)"
        if problem.dtype not in TORCH_DTYPES:
            return f"{self.name} takes float16 or bfloat16, but got {problem.dtype}"
        if problem.head_dim not in self.head_dims:
            return (f"{self.name} takes head_dim in {list(self.head_dims)}, but got "
                    f"{problem.head_dim} ({self.head_dims_why})")
        return None

    def unsupported_on(self, problem: Problem, device: DeviceInfo) -> str | None:
        """``unsupported``, or why ``device`` cannot run a Gluon kernel (wgmma: Hopper only)."""
        reason = self.unsupported(problem)
        if reason or device.family == "hopper":
            return reason
        return (f"{self.name} needs a Hopper GPU (wgmma, compute capability 9.x), but "
                f"{device.name} is {device.family}")

    def standin_launches(self, problem: Problem, config: KernelConfig) -> list[KernelLaunch]:
        """``kernel_launches``, or ValueError saying why there is none (for ``compile_for``)."""
        launches = self.kernel_launches(problem, config)
        if launches is None:
            raise ValueError(f"no stand-in launch for {problem.key()}: "
                             f"{self.unsupported(problem)}")
        return launches

    def standalone_source(self, config: KernelConfig) -> str:
        if self.kernel is None:
            raise NotImplementedError(self.gluon_missing)
        return self._kernel_module_with_config(self.kernel, self.standalone_entry, config)

    def config_to_run(self, q: torch.Tensor, k: torch.Tensor, causal_mode: str,
                      config: KernelConfig | Mapping[str, object] | None) -> KernelConfig:
        """The config an entry point runs on validated inputs: ``config`` checked against the
        problem and the device (ValueError saying why not), or the default where None."""
        if config is not None and not isinstance(config, (self.config_cls, Mapping)):
            raise TypeError(f"config must be a {self.config_cls.__name__}, a mapping of its "
                            f"fields or None, but got {type(config).__name__}")
        if q.device.type != "cuda":
            raise ValueError(f"{self.name} runs on CUDA tensors, but q is on {q.device}")
        problem = problem_of(q, k, causal_mode)
        device = current_device(q.device.index)
        if config is None:
            return self.default_config(problem, device)
        cfg = self.config(config)
        reason = self.constraint(problem, cfg, device)
        if reason:
            raise ValueError(f"config {cfg.key()} cannot run {problem.key()} on "
                             f"{device.name}: {reason}")
        return cfg
