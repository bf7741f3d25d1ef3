"""One trial, in the process that owns the GPU: compile, check, time.

    1. fresh random inputs (a new seed per trial: a kernel that leaves part of its output
       unwritten cannot pass on memory that still holds the previous trial's answer),
    2. the first launch compiles (or loads from Triton's cache) and runs: its wall time is
       the compile time; an exception here is a compile error or a runtime error,
    3. the output is checked against the template's torch reference: beyond the tolerance
       it is a wrong result, with the measured error,
    4. the launch is timed: ``do_bench`` median on the GPU; a few wall-clock runs under the
       interpreter, which are NOT GPU timings and are marked so.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from db.models import TrialStatus
from templates.base import KernelConfig, Problem, Template
from templates.device import DeviceInfo
from tuner.tuning.runner.outcome import TrialOutcome
from tuner.tuning.runner.timing import REP_MS, time_gpu, time_interpreter

__all__ = ["INTERPRETER_NOTE", "describe_exception", "is_compile_error", "measure"]

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


def measure(template: Template, problem: Problem, config: KernelConfig, *,
            device: DeviceInfo, seed: int, rep_ms: float = REP_MS) -> TrialOutcome:
    on_gpu = not device.is_interpreter
    reason = template.constraint(problem, config, device)
    if reason:
        return TrialOutcome.failed(TrialStatus.INVALID, reason)
    try:
        inputs = template.make_inputs(problem, "cuda" if on_gpu else "cpu", seed)
    except Exception as exc:
        return TrialOutcome.failed(TrialStatus.RUNTIME_ERROR,
                                   f"making the inputs failed: {describe_exception(exc)}",
                                   fatal=cuda_context_lost(on_gpu))
    start = time.perf_counter()
    try:
        out = template.run(inputs, config)
        _synchronize(on_gpu)
    except Exception as exc:
        status = TrialStatus.COMPILE_ERROR if is_compile_error(exc) else TrialStatus.RUNTIME_ERROR
        return TrialOutcome.failed(status, describe_exception(exc),
                                   fatal=cuda_context_lost(on_gpu))
    compile_s = time.perf_counter() - start
    try:
        error = template.error(out, template.reference(inputs))
    except Exception as exc:
        return TrialOutcome.failed(TrialStatus.RUNTIME_ERROR,
                                   f"checking against the reference failed: "
                                   f"{describe_exception(exc)}", compile_s=compile_s,
                                   fatal=cuda_context_lost(on_gpu))
    del out
    tolerance = template.tolerance(problem)
    if not error <= tolerance:  # NaN fails too
        return TrialOutcome.failed(TrialStatus.WRONG_RESULT,
                                   f"relative error {error:.3g} exceeds the tolerance "
                                   f"{tolerance:.3g} of {problem.dtype}",
                                   error=error, compile_s=compile_s)
    return _timed(template, problem, inputs, config, on_gpu=on_gpu, compile_s=compile_s,
                  error=error, rep_ms=rep_ms)


def _timed(template: Template, problem: Problem, inputs: dict[str, Any], config: KernelConfig,
           *, on_gpu: bool, compile_s: float, error: float, rep_ms: float) -> TrialOutcome:
    def launch() -> Any:
        return template.run(inputs, config)

    start = time.perf_counter()
    try:
        median_ms = time_gpu(launch, rep_ms) if on_gpu else time_interpreter(launch)
        _synchronize(on_gpu)
    except Exception as exc:
        return TrialOutcome.failed(TrialStatus.RUNTIME_ERROR,
                                   f"failed while timing: {describe_exception(exc)}",
                                   compile_s=compile_s, error=error,
                                   fatal=cuda_context_lost(on_gpu))
    bench_s = time.perf_counter() - start
    if not (math.isfinite(median_ms) and median_ms > 0):
        return TrialOutcome.failed(TrialStatus.RUNTIME_ERROR,
                                   f"timing gave {median_ms!r} ms, expected a positive time",
                                   compile_s=compile_s, error=error, bench_s=bench_s)
    tflops = template.flops(problem) / (median_ms * 1e-3) / 1e12
    return TrialOutcome(status=TrialStatus.OK, reason="" if on_gpu else INTERPRETER_NOTE,
                        median_ms=median_ms, tflops=tflops, compile_s=compile_s, error=error,
                        bench_s=bench_s, gpu_timing=on_gpu)
