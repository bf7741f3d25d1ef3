"""What a stored device says about its hardware: a ``DeviceInfo`` from a database row or a
device key, the shared memory of a compute capability, and what an unseen device is taken for.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from templates.compile.offline_target import TARGETS
from templates.device import CPU_INTERPRETER, DeviceInfo

__all__ = ["HOPPER_DEFAULT", "device_info_from_key", "device_info_from_row", "smem_for_cc"]


# Shared memory one program may opt into, by compute capability (CUDA programming guide,
# "Technical Specifications per Compute Capability"); the Device table does not store it.
_SMEM_BY_CC = {"7.0": 96, "7.5": 64, "8.0": 163, "8.6": 99, "8.7": 163, "8.9": 99, "9.0": 227,
               "10.0": 227, "12.0": 99}

# What a device that the service has never seen is assumed to be: the GPU family the project
# tunes first (H100 SXM, the offline compile target's table). Default-config heuristics only
# read family, SM count and smem.
HOPPER_DEFAULT = TARGETS["h100"]


def smem_for_cc(compute_capability: str) -> int:
    if not compute_capability:  # the interpreter: as templates.device.current_device says
        return 228 * 1024
    return _SMEM_BY_CC.get(compute_capability, 99) * 1024


def device_info_from_row(row: Any) -> DeviceInfo:
    """A ``DeviceInfo`` from a ``db.models.Device`` row (smem from the compute capability)."""
    return DeviceInfo(
        name=row.name, compute_capability=row.compute_capability, sm_count=row.sm_count,
        total_memory=row.total_memory, smem_per_block=smem_for_cc(row.compute_capability),
        driver_version=row.driver_version, triton_version=row.triton_version,
        torch_version=row.torch_version, cuda_version=row.cuda_version,
        cudnn_version=row.cudnn_version)


# The parts of a device key after the name, as ``DeviceInfo.key`` writes them: the cuDNN part
# only for devices with cuDNN (and never in keys written before it was recorded).
_KEY_PREFIXES = ("cc", "triton", "torch", "cuda")
_CUDNN_PREFIX = "cudnn"


def device_info_from_key(key: str) -> DeviceInfo:
    """Best guess at a device the database does not know, from its key or its name.

    A full key (``name|cc9.0|triton3.6.0|torch2.11.0|cuda12.8``, with ``|cudnn9.19.0`` after it
    for a device with cuDNN, as ``DeviceInfo.key`` writes it) gives the compute capability and
    versions; anything else is taken as a device name on the ``HOPPER_DEFAULT`` hardware.
    """
    parts = _key_parts(key)
    if parts is None:
        return dataclasses.replace(HOPPER_DEFAULT, name=key or HOPPER_DEFAULT.name)
    name, cc, triton_v, torch_v, cuda_v, cudnn_v = parts
    if name == CPU_INTERPRETER:
        return DeviceInfo(name=name, compute_capability="", sm_count=1, total_memory=0,
                          smem_per_block=smem_for_cc(""), driver_version="",
                          triton_version=triton_v, torch_version=torch_v, cuda_version="",
                          cudnn_version=cudnn_v)
    if not _valid_cc(cc):
        cc = HOPPER_DEFAULT.compute_capability
    return DeviceInfo(name=name, compute_capability=cc, sm_count=HOPPER_DEFAULT.sm_count,
                      total_memory=HOPPER_DEFAULT.total_memory, smem_per_block=smem_for_cc(cc),
                      driver_version="", triton_version=triton_v, torch_version=torch_v,
                      cuda_version=cuda_v, cudnn_version=cudnn_v)


def _key_parts(key: str) -> tuple[str, str, str, str, str, str | None] | None:
    """(name, cc, triton, torch, cuda, cudnn or None) of a full device key, else None."""
    name_and_rest, _, last = key.rpartition("|")
    cudnn = None
    if last.startswith(_CUDNN_PREFIX) and last != _CUDNN_PREFIX:
        key, cudnn = name_and_rest, last[len(_CUDNN_PREFIX):]
    parts = key.rsplit("|", len(_KEY_PREFIXES))
    if len(parts) != len(_KEY_PREFIXES) + 1 or not all(
            p.startswith(pre) for p, pre in zip(parts[1:], _KEY_PREFIXES, strict=True)):
        return None
    cc, triton_v, torch_v, cuda_v = (p[len(pre):] for p, pre in zip(parts[1:], _KEY_PREFIXES,
                                                                   strict=True))
    return parts[0], cc, triton_v, torch_v, cuda_v, cudnn


def _valid_cc(cc: str) -> bool:
    major, _, minor = cc.partition(".")
    return major.isdigit() and minor.isdigit()
