"""What the templates need to know about the GPU a config is for.

Without CUDA the kernels run under Triton's interpreter (``TRITON_INTERPRET=1``) and the
device is ``cpu-interpreter``: correct results, timings that mean nothing for a GPU.
"""

from __future__ import annotations

import os
import platform
import subprocess
from dataclasses import asdict, dataclass
from functools import lru_cache

import torch
import triton
import triton.language.standard as standard
from triton.runtime.jit import JITFunction

CPU_INTERPRETER = "cpu-interpreter"


@dataclass(frozen=True)
class DeviceInfo:
    name: str
    compute_capability: str  # "9.0"; "" for the interpreter
    sm_count: int
    total_memory: int  # bytes
    smem_per_block: int  # bytes of shared memory one program may use (opt-in limit)
    driver_version: str
    triton_version: str
    torch_version: str
    cuda_version: str
    # cuDNN as torch loads it ("9.19.0"): it decides torch SDPA's cuDNN backend's speed, so a
    # cuDNN upgrade under the same torch is a new tuning target. None without cuDNN (the CPU,
    # a torch built without it) and for devices stored before it was recorded.
    cudnn_version: str | None = None

    @property
    def is_interpreter(self) -> bool:
        return self.name == CPU_INTERPRETER

    @property
    def family(self) -> str:
        """Coarse architecture name used by default-config heuristics."""
        if self.is_interpreter:
            return CPU_INTERPRETER
        major = int(self.compute_capability.split(".")[0])
        return {7: "volta-turing", 8: "ampere-ada", 9: "hopper", 10: "blackwell"}.get(
            major, "other")

    @property
    def key(self) -> str:
        """Identity of a tuning target: the chip and the software that changes which config wins.

        ``name|cc9.0|triton3.6.0|torch2.11.0|cuda12.8|cudnn9.19.0``; without cuDNN the last
        part is absent, so the keys of such devices are those of releases before it was part
        of the key (docs/DISPATCH.md, "The device key").
        """
        key = (f"{self.name}|cc{self.compute_capability}|triton{self.triton_version}"
               f"|torch{self.torch_version}|cuda{self.cuda_version}")
        return f"{key}|cudnn{self.cudnn_version}" if self.cudnn_version else key

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def interpreter_active() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def check_interpreter_usable() -> None:
    """Raise RuntimeError, saying what to set, if the kernels are interpreted but triton's own
    jit functions (``tl.zeros``, ``tl.max``, ...) are not: triton was imported (by the user,
    or by ``torch._inductor``) before ``templates`` turned the interpreter on for a machine
    without CUDA, and an interpreted kernel cannot call them ("Cannot call @triton.jit'd
    outside of the scope of a kernel", issue 20)."""
    if interpreter_active() and _triton_built_for_a_compiler():
        raise RuntimeError(
            "triton was imported before TRITON_INTERPRET=1 was set, so its own functions "
            "(tl.zeros, tl.max, ...) were built for a GPU compiler, and this machine has no "
            "CUDA GPU: the kernels run under Triton's interpreter, which cannot call them. "
            "Set TRITON_INTERPRET=1 in the environment before Python starts "
            "(TRITON_INTERPRET=1 python train.py), or import tuner (or templates) before "
            "triton and torch._inductor")


@lru_cache(maxsize=1)
def _triton_built_for_a_compiler() -> bool:
    # Fixed once triton.language is imported: jit decides at definition time.

    return any(isinstance(value, JITFunction) for value in vars(standard).values())


@lru_cache(maxsize=1)
def cpu_device() -> DeviceInfo:
    """The CPU, where kernels run under Triton's interpreter (``cpu-interpreter``); also what
    CPU tensors run on in a process that has a GPU."""
    return DeviceInfo(
        name=CPU_INTERPRETER, compute_capability="", sm_count=os.cpu_count() or 1,
        total_memory=0, smem_per_block=228 * 1024, driver_version=platform.machine(),
        triton_version=triton.__version__, torch_version=torch.__version__.split("+")[0],
        cuda_version="", cudnn_version=None)  # torch's CPU attention never runs cuDNN


@lru_cache(maxsize=8)
def current_device(index: int | None = None) -> DeviceInfo:
    """Describe the CUDA device ``index`` (default: current), or the CPU interpreter."""
    if interpreter_active() or not torch.cuda.is_available():
        return cpu_device()
    idx = torch.cuda.current_device() if index is None else index
    props = torch.cuda.get_device_properties(idx)
    smem = int(getattr(props, "shared_memory_per_block_optin", 0) or 0)
    if not smem:
        smem = 227 * 1024 if props.major >= 9 else 99 * 1024
    return DeviceInfo(
        name=props.name, compute_capability=f"{props.major}.{props.minor}",
        sm_count=props.multi_processor_count, total_memory=int(props.total_memory),
        smem_per_block=smem, driver_version=_driver_version(),
        triton_version=triton.__version__, torch_version=torch.__version__.split("+")[0],
        cuda_version=str(torch.version.cuda or ""), cudnn_version=cudnn_version_text(
            torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None))


def cudnn_version_text(number: int | None) -> str | None:
    """cuDNN's version number as torch reports it (``torch.backends.cudnn.version()``), as
    text: 91900 -> "9.19.0" (cuDNN 9 counts major * 10000 + minor * 100 + patch), 8902 ->
    "8.9.2" (cuDNN 8 and older: major * 1000 + minor * 100 + patch); None stays None."""
    if number is None:
        return None
    if number < 0:
        raise ValueError(f"a cuDNN version number is >= 0, but got {number}")
    major, rest = divmod(number, 10_000 if number >= 10_000 else 1_000)
    return f"{major}.{rest // 100}.{rest % 100}"


def _driver_version() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10, check=False)
        return out.stdout.strip().splitlines()[0] if out.stdout.strip() else ""
    except (OSError, subprocess.SubprocessError):
        return ""
