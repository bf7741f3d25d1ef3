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
from templates.gluon import common as gluon_common
from templates.masks.mods import pattern_problem

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
    # Whether the kernel walks a BlockMask's lists (problems with a ``mask`` pattern).
    block_masks: ClassVar[bool] = False

    def source_modules(self) -> Sequence[str]:
        mods = [__name__, type(self).__module__]
        if self.kernel is not None:
            mods[:0] = [self.kernel.__name__, gluon_common.__name__]
        return mods

    def unsupported(self, problem: Problem) -> str | None:
        reason = super().unsupported(problem)  # a softcapped problem, where it does not cap
        if reason:
            return reason
        if self.gluon_missing:
            return self.gluon_missing
        if problem.mask != "none":
            if not self.block_masks:
                return f"{self.name} has no block masks (dense and causal only)"
            reason = pattern_problem(problem.mask, problem.seqlen_q, problem.seqlen_kv)
            if reason:
                return reason
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

    def run_constraint(self, problem: Problem, config: KernelConfig, device: DeviceInfo,
                       mask_block: tuple[int, int] | None) -> str | None:
        """``constraint`` for a call whose block mask (if any) has blocks ``mask_block``:
        templates with ``block_masks`` override it (and ``run_default``)."""
        assert mask_block is None, f"{self.name} takes no block masks"
        return self.constraint(problem, config, device)

    def run_default(self, problem: Problem, device: DeviceInfo,
                    mask_block: tuple[int, int] | None) -> KernelConfig:
        assert mask_block is None, f"{self.name} takes no block masks"
        return self.default_config(problem, device)

    def config_to_run(self, q: torch.Tensor, k: torch.Tensor, causal_mode: str,
                      config: KernelConfig | Mapping[str, object] | None,
                      mask_block: tuple[int, int] | None = None) -> KernelConfig:
        """The config an entry point runs on validated inputs: ``config`` checked against the
        problem, the device and the blocks of the call's block mask, if any (ValueError
        saying why not), or the default where None."""
        if config is not None and not isinstance(config, (self.config_cls, Mapping)):
            raise TypeError(f"config must be a {self.config_cls.__name__}, a mapping of its "
                            f"fields or None, but got {type(config).__name__}")
        if q.device.type != "cuda":
            raise ValueError(f"{self.name} runs on CUDA tensors, but q is on {q.device}")
        problem = problem_of(q, k, causal_mode)
        device = current_device(q.device.index)
        if config is None:
            return self.run_default(problem, device, mask_block)
        cfg = self.config(config)
        reason = self.run_constraint(problem, cfg, device, mask_block)
        if reason:
            raise ValueError(f"config {cfg.key()} cannot run {problem.key()} on "
                             f"{device.name}: {reason}")
        return cfg
