"""What a trial worker keeps between trials: the last references, and the seeds it has run.

A trial's reference (``template.reference(inputs)``, plain torch in float32/float64) depends
only on the reference function, the inputs function, the problem and the seed: every
template's ``make_inputs`` is deterministic per problem and seed (seeded generators, masks
built from the problem). At 64k tokens it is the costliest step of a trial after the compile:
a float32 attention over every (query, key) pair, a dense mask of the problem's size on top.
So a worker keeps the last ``MAX_ENTRIES`` references of the problem at hand, by (reference
function, inputs function, problem, seed, device), and a trial of the same problem and seed
(the search asks for one seed per problem: ``tuner.tuning.search.loop``) takes the kept one
instead of computing it again. An entry of another problem goes as soon as a trial of a new
problem comes (a 64k-token problem's reference holds 0.5-2 GB of GPU memory).

Nothing kept can hide a wrong result:

* Every trial makes its inputs afresh and checks its own output. The kept reference is used
  only while the fresh inputs are bit for bit the ones it was computed from (a fingerprint of
  their tensors and numbers), and while the reference itself is intact (its fingerprint,
  checked after the trial's first launch: a config that writes outside its outputs may hit
  it); otherwise it is computed again, as without the cache.
* A seed run before leaves the outputs of those runs in freed memory, and a kernel that
  leaves part of its output unwritten could pass on memory that holds an earlier run's right
  answer. Before the first launch of a repeated seed, every free block of the CUDA caching
  allocator is therefore filled with 0xFF bytes (NaN in every float dtype: ``CudaPoisoner``),
  after the trial made its inputs.
  Where that cannot be promised (the CPU and the interpreter, memory given back to the driver
  since the seed's first run, expandable segments), the trial runs on a fresh seed instead:
  fresh inputs, as every trial had before the cache.
"""

from __future__ import annotations

import logging
import os
import random
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from templates.base import Problem, Template

__all__ = ["MAX_ENTRIES", "CudaPoisoner", "Poisoner", "ReferenceCache", "fingerprint"]

log = logging.getLogger(__name__)

# References kept at once (of one problem): a forward's and a training template's, say.
MAX_ENTRIES = 2
# Elements summed per step of a fingerprint (bounds the temporaries of a 1 GB tensor).
_CHUNK = 1 << 24


class Poisoner(Protocol):
    """Fills freed memory so that no earlier run's output can be read back as a new one's."""

    def mark(self) -> Hashable:
        """Where the allocator stands now; ``safe_since`` takes it."""

    def safe_since(self, mark: Hashable) -> bool:
        """Whether every byte freed since ``mark`` is still in reach of ``poison`` (none was
        given back to the driver, whose next allocation could hand it out unpoisoned)."""

    def poison(self) -> None: ...


class _Span:
    """A stretch of device memory as ``torch.as_tensor`` takes it (the CUDA array
    interface): bytes, not owned."""

    def __init__(self, address: int, size: int) -> None:
        self.__cuda_array_interface__ = {"shape": (size,), "typestr": "|u1",
                                         "data": (address, False), "version": 2}


class CudaPoisoner:
    """Poisons the free blocks of the CUDA caching allocator's default pool on the current
    device (``Poisoner``); the driver's frees are counted by ``num_device_free``."""

    @staticmethod
    def available() -> bool:
        conf = (os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
                + os.environ.get("PYTORCH_ALLOC_CONF", ""))
        if not torch.cuda.is_available() or "expandable_segments:true" in conf.replace(
                " ", "").lower():
            return False  # expandable segments: pages of a free block may be unmapped
        torch.cuda.init()  # memory_stats is empty until then
        return "num_device_free" in torch.cuda.memory_stats()

    def mark(self) -> Hashable:
        return self._device_frees()

    def safe_since(self, mark: Hashable) -> bool:
        return mark is not None and self._device_frees() == mark

    @staticmethod
    def _device_frees() -> int | None:
        stats = torch.cuda.memory_stats()
        frees = stats.get("num_device_free")
        return None if frees is None else int(frees) + int(stats.get("num_alloc_retries", 0))

    def poison(self) -> None:
        torch.cuda.synchronize()
        device = torch.cuda.current_device()
        for segment in torch.cuda.memory_snapshot():
            if segment.get("device", device) != device or tuple(
                    segment.get("segment_pool_id", (0, 0))) != (0, 0):
                continue  # another device's, or a CUDA graph's private pool
            address = int(segment["address"])
            for block in segment["blocks"]:
                start = int(block.get("address", address))
                if block["state"] == "inactive" and block["size"]:
                    torch.as_tensor(_Span(start, int(block["size"])),
                                    device=f"cuda:{device}").fill_(0xFF)
                address = start + int(block["size"])
        torch.cuda.synchronize()


def fingerprint(value: Any) -> tuple[Any, ...]:
    """A summary of ``value`` that changes when any of its tensors' bytes (their whole
    storage), numbers or structure change: sums of its tensors' 32-bit words and of their
    squares (wrapping), with shapes, strides and dtypes. Other objects count by type only
    (strings, block masks: made from the problem, or a token that names one run)."""
    if isinstance(value, torch.Tensor):
        return ("tensor", value.dtype, tuple(value.shape), value.stride(),
                value.storage_offset(), str(value.device), *_storage_sums(value))
    if isinstance(value, bool | int | float) or value is None:
        return ("value", repr(value))
    if isinstance(value, dict):
        return ("dict", *((key, fingerprint(item)) for key, item in sorted(
            value.items(), key=lambda kv: str(kv[0]))))
    if isinstance(value, list | tuple):
        return (type(value).__name__, *(fingerprint(item) for item in value))
    return ("object", type(value).__qualname__)


def _storage_sums(tensor: torch.Tensor) -> tuple[int, int, int]:
    storage = tensor.untyped_storage()
    size = storage.nbytes()
    raw = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage, 0, (size,), (1,))
    words = raw[: size - size % 4].view(torch.int32)
    total = squares = 0
    for start in range(0, words.numel(), _CHUNK):
        chunk = words[start:start + _CHUNK].to(torch.int64)
        total += int(chunk.sum())
        squares += int((chunk * chunk).sum())
    tail = int(raw[size - size % 4:].to(torch.int64).sum()) if size % 4 else 0
    return size, total + tail, squares


@dataclass
class _Entry:
    key: tuple[Any, ...]
    inputs: tuple[Any, ...]  # fingerprint of the inputs it was computed from
    reference: Any
    reference_print: tuple[Any, ...]


class ReferenceCache:
    """The references a trial worker keeps, and the seeds it ran (module docstring)."""

    def __init__(self, *, max_entries: int = MAX_ENTRIES,
                 poisoner: Poisoner | None = None) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, but got {max_entries}")
        self.max_entries = max_entries
        self.poisoner = poisoner
        self._entries: list[_Entry] = []  # the last used last
        self._seeds: dict[int, Hashable] = {}  # seed run in this process -> poisoner mark
        self._instead: dict[int, int] = {}  # asked seed -> the fresh one that stands in for it
        self._poison_due = False  # the seed inputs_seed gave ran before: poison_freed fills
        self._fresh = random.Random()
        self.computed = 0  # references computed
        self.kept_hits = 0  # references taken from the cache

    @classmethod
    def for_device(cls, on_gpu: bool) -> ReferenceCache:
        try:
            poisoner = CudaPoisoner() if on_gpu and CudaPoisoner.available() else None
        except Exception:
            log.warning("no poisoning of freed memory here: repeated seeds run fresh",
                        exc_info=True)
            poisoner = None
        return cls(poisoner=poisoner)

    # -- seeds ------------------------------------------------------------------------------
    def inputs_seed(self, seed: int) -> int:
        """The seed to make this trial's inputs with: ``seed`` where this process can keep an
        earlier run of it from passing for this one's (``poison_freed`` must then run before
        the first launch), else a fresh seed, which stands in for ``seed`` from then on (so
        that its trials share a reference)."""
        asked, seed = seed, self._instead.get(seed, seed)
        self._poison_due = False
        if seed in self._seeds:
            if self._safe(self._seeds[seed]):
                self._poison_due = True
                return seed
            while seed in self._seeds:
                seed = self._fresh.randrange(2**31)
            self._instead[asked] = seed
        self._seeds[seed] = self._mark()
        return seed

    def poison_freed(self) -> bool:
        """Before the first launch: fill freed memory if the trial's seed ran before; False
        if that failed (the trial must then make its inputs again, from ``inputs_seed``,
        which now gives a fresh seed)."""
        if not self._poison_due:
            return True
        self._poison_due = False
        assert self.poisoner is not None
        try:
            self.poisoner.poison()
            return True
        except Exception:  # never a failed trial for it: fresh seeds from now on
            log.warning("poisoning freed memory failed; repeated seeds run fresh from now on",
                        exc_info=True)
            self.poisoner = None
            return False

    def _safe(self, mark: Hashable) -> bool:
        if self.poisoner is None:
            return False
        try:
            return self.poisoner.safe_since(mark)
        except Exception:
            log.warning("reading the allocator's counts failed; repeated seeds run fresh from "
                        "now on", exc_info=True)
            self.poisoner = None
            return False

    def _mark(self) -> Hashable:
        if self.poisoner is None:
            return None
        try:
            return self.poisoner.mark()
        except Exception:
            log.warning("reading the allocator's counts failed; repeated seeds run fresh from "
                        "now on", exc_info=True)
            self.poisoner = None
            return None

    # -- references -------------------------------------------------------------------------
    @staticmethod
    def key(template: Template, problem: Problem, seed: int, device: str) -> tuple[Any, ...]:
        return (_function(template.reference), _function(template.make_inputs), problem, seed,
                device)

    def start_problem(self, problem: Problem) -> None:
        """A trial of ``problem`` begins: the entries of other problems go."""
        self._entries = [e for e in self._entries if e.key[2] == problem]

    def reference(self, key: tuple[Any, ...], inputs: Any,
                  compute: Callable[[], Any]) -> tuple[Any, bool]:
        """The reference of ``inputs`` under ``key``: the kept one if ``inputs`` are those it
        was computed from and it is intact, else ``compute()`` (kept for the next trial);
        with whether it was the kept one."""
        printed = fingerprint(inputs)
        for entry in self._entries:
            if entry.key != key:
                continue
            self._entries.remove(entry)
            if entry.inputs == printed and fingerprint(entry.reference) == entry.reference_print:
                self._entries.append(entry)
                self.kept_hits += 1
                return entry.reference, True
            break  # other inputs (a make_inputs that is not deterministic) or overwritten
        reference = compute()
        self.computed += 1
        self._entries.append(_Entry(key, printed, reference, fingerprint(reference)))
        del self._entries[:-self.max_entries]
        return reference, False

    def holds(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()


def _function(method: Any) -> Any:
    """The function behind a bound method: two templates of one class, or of a subclass that
    does not override it, share it."""
    return getattr(method, "__func__", method)
