"""Parameterized Triton attention kernels, each with its search space and a torch reference.

Without a CUDA device the kernels run under Triton's interpreter: the environment variable
must be set before any ``@triton.jit`` function is defined, hence here, before the imports.
"""

from __future__ import annotations

import os

import torch  # does not import triton (checked with torch 2.11 and 2.13: tuner/__init__.py)


def _use_interpreter_without_cuda() -> None:
    if "TRITON_INTERPRET" in os.environ:
        return
    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


_use_interpreter_without_cuda()

# Importing a template module registers its template.
from templates.base import KernelConfig, Problem, Template  # noqa: E402
from templates.decode.template import flash_decode  # noqa: E402
from templates.device import CPU_INTERPRETER, DeviceInfo, current_device  # noqa: E402
from templates.flash.autograd import flash_attention  # noqa: E402
from templates.flash.bwd import flash_attention_bwd  # noqa: E402
from templates.flash.fwd import flash_attention_fwd  # noqa: E402
from templates.gluon import cudnn_train, train  # noqa: E402, F401  (register their templates)
from templates.gluon.bwd import gluon_attention_bwd  # noqa: E402
from templates.gluon.fwd import gluon_attention_fwd  # noqa: E402
from templates.masks.block_mask import BlockMask  # noqa: E402
from templates.pytorch import eager, varlen  # noqa: E402, F401  (register their templates)
from templates.pytorch.flex import flex  # noqa: E402
from templates.pytorch.sdpa import sdpa  # noqa: E402
from templates.registry import all_templates, get_template, register  # noqa: E402

__all__ = [
    "BlockMask",
    "CPU_INTERPRETER",
    "DeviceInfo",
    "KernelConfig",
    "Problem",
    "Template",
    "all_templates",
    "current_device",
    "flash_attention",
    "flash_attention_bwd",
    "flash_attention_fwd",
    "flash_decode",
    "flex",
    "gluon_attention_bwd",
    "gluon_attention_fwd",
    "get_template",
    "register",
    "sdpa",
]
