"""One trial, in the process that owns the GPU: compile, check, time.

    1. the inputs, made afresh from the trial's seed (the search asks for one seed per problem;
       for a seed this process ran before, every free block of the CUDA caching allocator is
       then filled with NaN, so that a kernel that leaves part of its output unwritten cannot
       pass on memory that still holds an earlier run's answer: ``reference_cache``),
    2. the first launch compiles (or loads from Triton's cache) and runs: its wall time is
       the compile time; an exception here is a compile error or a runtime error,
    3. the reference: the template's torch reference of the inputs, or the one the worker
       kept from a trial of the same problem and seed (``reference_cache``),
    4. the check of the trial's own output against it: beyond the tolerance it is a wrong
       result, with the measured error,
    5. the launch is timed: ``do_bench`` median on the GPU; a few wall-clock runs under the
       interpreter, which are NOT GPU timings and are marked so.

Each phase's seconds go into the outcome (``TrialOutcome.phases``), after a synchronize on
the GPU so that a phase's queued work is not billed to the next one.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import torch

from db.models import TrialStatus
from templates.base import KernelConfig, Problem, Template
from templates.device import DeviceInfo
from tuner.tuning.runner.outcome import TrialOutcome
from tuner.tuning.runner.reference_cache import ReferenceCache
from tuner.tuning.runner.timing import REP_MS, time_gpu, time_interpreter

__all__ = ["INTERPRETER_NOTE", "describe_exception", "is_compile_error", "is_out_of_memory",
           "measure"]

INTERPRETER_NOTE = "interpreter wall-clock timing, not a GPU timing"
# Exception class names (anywhere in the MRO) that mean the kernel did not compile or load:
# Triton's CompilationError (and its static-assert subclass), MLIR failures, and
# OutOfResources (too much shared memory or too many registers for this GPU).
_COMPILE_ERROR_NAMES = ("CompilationError", "CompileTimeAssertionFailure", "OutOfResources",
                        "MLIRCompilationError", "PTXASError")
_MAX_REASON = 600


def is_compile_error(exc: BaseException) -> bool:
    return any(cls.__name__ in _COMPILE_ERROR_NAMES for cls in type(exc).__mro__)


def describe_exception(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    if len(text) > _MAX_REASON:
        text = text[: _MAX_REASON - 3] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _synchronize(on_gpu: bool) -> None:
    if on_gpu:
        torch.cuda.synchronize()


def cuda_context_lost(on_gpu: bool) -> bool:
    """True if the CUDA context is unusable (illegal address, device assert): the process
    must be replaced, every later launch in it would fail."""
    if not on_gpu:
        return False
    try:
        _synchronize(True)
        return False
    except Exception:
        return True


class _CacheInTheWay(Exception):
    """The trial ran out of memory while the worker held kept references: it runs again
    without them."""


def is_out_of_memory(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


def measure(template: Template, problem: Problem, config: KernelConfig, *,
            device: DeviceInfo, seed: int, rep_ms: float = REP_MS,
            cache: ReferenceCache | None = None) -> TrialOutcome:
    """One trial (the module docstring); ``cache``: the worker's kept references (None:
    every reference is computed, and ``seed`` is taken as it is)."""
    try:
        return _measure(template, problem, config, device=device, seed=seed, rep_ms=rep_ms,
                        cache=cache, keep=True)
    except _CacheInTheWay:
        assert cache is not None
        cache.clear()  # and this trial keeps nothing either (its seed is still minded)
        return _measure(template, problem, config, device=device, seed=seed, rep_ms=rep_ms,
                        cache=cache, keep=False)


def _measure(template: Template, problem: Problem, config: KernelConfig, *,
             device: DeviceInfo, seed: int, rep_ms: float, cache: ReferenceCache | None,
             keep: bool) -> TrialOutcome:
    on_gpu = not device.is_interpreter
    reason = template.constraint(problem, config, device)
    if reason:
        return TrialOutcome.failed(TrialStatus.INVALID, reason)
    where = "cuda" if on_gpu else "cpu"
    phases: dict[str, Any] = {}

    def failed(status: TrialStatus, why: str, exc: BaseException | None = None,
               **extra: Any) -> TrialOutcome:
        if (keep and exc is not None and cache is not None and cache.holds()
                and is_out_of_memory(exc)):
            raise _CacheInTheWay() from exc
        fatal = exc is not None and cuda_context_lost(on_gpu)
        return TrialOutcome.failed(status, why, fatal=fatal, **phases, **extra)

    if cache is not None:
        cache.start_problem(problem)
        seed = cache.inputs_seed(seed)
    start = time.perf_counter()
    try:
        inputs = template.make_inputs(problem, where, seed)
        _synchronize(on_gpu)
        phases["inputs_s"] = time.perf_counter() - start
        if cache is not None and not cache.poison_freed():  # (not a phase: the worker's rest)
            seed = cache.inputs_seed(seed)  # a fresh one
            start = time.perf_counter()
            inputs = template.make_inputs(problem, where, seed)
            _synchronize(on_gpu)
            phases["inputs_s"] += time.perf_counter() - start
    except Exception as exc:
        phases["inputs_s"] = phases.get("inputs_s", 0.0) + time.perf_counter() - start
        return failed(TrialStatus.RUNTIME_ERROR,
                      f"making the inputs failed: {describe_exception(exc)}", exc)
    start = time.perf_counter()
    try:
        out = template.run(inputs, config)
        _synchronize(on_gpu)
    except Exception as exc:
        status = TrialStatus.COMPILE_ERROR if is_compile_error(exc) else TrialStatus.RUNTIME_ERROR
        return failed(status, describe_exception(exc), exc)
    phases["compile_s"] = time.perf_counter() - start
    start = time.perf_counter()
    try:
        ref = _reference(template, problem, inputs, seed, where, cache if keep else None,
                         on_gpu, phases)
    except Exception as exc:
        phases["reference_s"] = time.perf_counter() - start
        return failed(TrialStatus.RUNTIME_ERROR,
                      f"computing the reference failed: {describe_exception(exc)}", exc)
    phases["reference_s"] = time.perf_counter() - start
    start = time.perf_counter()
    try:
        error = template.error(out, ref)
        _synchronize(on_gpu)
    except Exception as exc:
        phases["check_s"] = time.perf_counter() - start
        return failed(TrialStatus.RUNTIME_ERROR, f"checking against the reference failed: "
                      f"{describe_exception(exc)}", exc)
    phases["check_s"] = time.perf_counter() - start
    del out, ref
    tolerance = template.tolerance(problem)
    if not error <= tolerance:  # NaN fails too
        return failed(TrialStatus.WRONG_RESULT,
                      f"relative error {error:.3g} exceeds the tolerance "
                      f"{tolerance:.3g} of {problem.dtype}", error=error)
    return _timed(template, problem, inputs, config, on_gpu=on_gpu, error=error,
                  rep_ms=rep_ms, phases=phases, failed=failed)


def _reference(template: Template, problem: Problem, inputs: dict[str, Any], seed: int,
               where: str, cache: ReferenceCache | None, on_gpu: bool,
               phases: dict[str, Any]) -> Any:
    """The reference of ``inputs``: computed, or the worker's kept one (``cache``)."""
    def compute() -> Any:
        ref = template.reference(inputs)
        _synchronize(on_gpu)
        return ref

    if cache is None:
        return compute()
    ref, kept = cache.reference(cache.key(template, problem, seed, where), inputs, compute)
    phases["reference_kept"] = kept
    return ref


def _timed(template: Template, problem: Problem, inputs: dict[str, Any], config: KernelConfig,
           *, on_gpu: bool, error: float, rep_ms: float, phases: dict[str, Any],
           failed: Callable[..., TrialOutcome]) -> TrialOutcome:
    def launch() -> Any:
        return template.run(inputs, config)

    start = time.perf_counter()
    try:
        median_ms = time_gpu(launch, rep_ms) if on_gpu else time_interpreter(launch)
        _synchronize(on_gpu)
    except Exception as exc:
        phases["bench_s"] = time.perf_counter() - start
        return failed(TrialStatus.RUNTIME_ERROR, f"failed while timing: {describe_exception(exc)}",
                      exc, error=error)
    phases["bench_s"] = time.perf_counter() - start
    if not (math.isfinite(median_ms) and median_ms > 0):
        return failed(TrialStatus.RUNTIME_ERROR,
                      f"timing gave {median_ms!r} ms, expected a positive time", error=error)
    tflops = template.flops(problem) / (median_ms * 1e-3) / 1e12
    return TrialOutcome(status=TrialStatus.OK, reason="" if on_gpu else INTERPRETER_NOTE,
                        median_ms=median_ms, tflops=tflops, error=error,
                        gpu_timing=on_gpu, **phases)
