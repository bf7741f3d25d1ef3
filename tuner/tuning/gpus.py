"""GPU claims among the sweep processes of one host (the worker containers of a deployment).

Docker hands GPUs to a container by index from 0: a service reserving ``count: 1`` gets GPU 0
in every replica, so ``docker compose up --scale worker=N`` would stack all N workers on one
GPU, where their timings disturb each other. So the worker containers see every GPU of the
host and each ``tuner sweep`` claims its own: an exclusive ``flock`` on
``<lock dir>/gpu-<id>.lock`` per GPU it takes, held while it runs, and the process then sees
only those GPUs (CUDA_VISIBLE_DEVICES). The kernel drops a lock when its process dies,
SIGKILL included, so a dead worker's GPU is free again at once.

The lock folder must be on the host's own disk (a named volume, not NFS), shared by the
processes that share the GPUs, and they must all see the same GPUs under the same ids.
"""

from __future__ import annotations

import fcntl
import os
import re
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import IO

import torch

from tuner.errors import TunerError

__all__ = ["claim_gpus", "gpus_for_sweep", "lock_path", "visible_gpus"]


def lock_path(lock_dir: Path, gpu: str) -> Path:
    # Ids may be indices or UUIDs ("GPU-8f3e..."): keep them readable but file-name safe.
    return lock_dir / f"gpu-{re.sub(r'[^A-Za-z0-9_.-]', '_', gpu)}.lock"


def _try_lock(path: Path) -> IO[str] | None:
    handle = open(path, "a")  # noqa: SIM115  (closed by the caller's ExitStack)
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        return None
    return handle


@contextmanager
def claim_gpus(lock_dir: Path, candidates: list[str], count: int) -> Iterator[list[str]]:
    """Claim ``count`` of the GPU ids ``candidates`` (the first free ones) for the block."""
    lock_dir.mkdir(parents=True, exist_ok=True)
    with ExitStack() as held:
        claimed: list[str] = []
        for gpu in candidates:
            if len(claimed) == count:
                break
            handle = _try_lock(lock_path(lock_dir, gpu))
            if handle is not None:
                held.callback(handle.close)
                claimed.append(gpu)
        if len(claimed) < count:
            raise TunerError(
                f"{count} GPU(s) wanted, but only {len(claimed)} of this host's "
                f"{len(candidates)} are free: the others are claimed by sweeps sharing "
                f"{lock_dir}",
                f"run at most {len(candidates)} GPU worker(s) per host (e.g. docker compose "
                "up --scale worker=N), or lower --workers")
        yield claimed


def visible_gpus() -> list[str]:
    """GPU ids for CUDA_VISIBLE_DEVICES, without creating a CUDA context here."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return []
    count = torch.cuda.device_count()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [v.strip() for v in visible.split(",") if v.strip()] if visible else []
    return ids[:count] if ids else [str(i) for i in range(count)]


@contextmanager
def gpus_for_sweep(lock_dir: str | None, workers: int) -> Iterator[list[str]]:
    """With a lock folder and GPUs in sight: claim one GPU per worker and show this process
    (and so its trial workers) only those while the block runs. Otherwise claim nothing:
    without a GPU (the interpreter) there is nothing to share."""
    gpus = visible_gpus() if lock_dir else []
    if not lock_dir or not gpus:
        yield []
        return
    with claim_gpus(Path(lock_dir), gpus, workers) as claimed:
        before = os.environ.get("CUDA_VISIBLE_DEVICES")
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(claimed)
        try:
            yield claimed
        finally:
            if before is None:
                os.environ.pop("CUDA_VISIBLE_DEVICES", None)
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = before
