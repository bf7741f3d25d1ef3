"""One trial in this process: check against the reference, time, classify failures."""

from __future__ import annotations

import pytest
from triton.compiler.errors import CompileTimeAssertionFailure
from triton.runtime.errors import OutOfResources

from db.models import TrialStatus
from templates import current_device, get_template
from tests.tuner.conftest import TOY_PROBLEM
from tuner.tuning.runner.measure import (
    INTERPRETER_NOTE,
    describe_exception,
    is_compile_error,
    measure,
)


def test_a_good_config_is_checked_and_timed() -> None:
    template = get_template("toy_add")
    device = current_device()
    outcome = measure(template, TOY_PROBLEM, template.config_cls(BLOCK=64, num_warps=2),
                      device=device, seed=5)
    assert outcome.status == TrialStatus.OK, outcome.reason
    assert outcome.error is not None and outcome.error <= template.tolerance(TOY_PROBLEM)
    assert outcome.median_ms is not None and outcome.median_ms > 0
    assert outcome.tflops == pytest.approx(template.flops(TOY_PROBLEM) / outcome.median_ms / 1e9)
    assert outcome.compile_s is not None and outcome.compile_s > 0
    assert outcome.bench_s > 0
    if device.is_interpreter:
        assert not outcome.gpu_timing and outcome.reason == INTERPRETER_NOTE


def test_failures_are_results_with_reasons() -> None:
    faulty = get_template("toy_faulty")
    device = current_device()
    wrong = measure(faulty, TOY_PROBLEM, faulty.config_cls(fault="wrong"), device=device, seed=1)
    assert wrong.status == TrialStatus.WRONG_RESULT
    assert wrong.error is not None and wrong.error > faulty.tolerance(TOY_PROBLEM)
    assert "exceeds the tolerance" in wrong.reason and wrong.tflops is None
    raised = measure(faulty, TOY_PROBLEM, faulty.config_cls(fault="raise"), device=device, seed=1)
    assert raised.status == TrialStatus.RUNTIME_ERROR
    assert raised.reason == "RuntimeError: toy: simulated launch failure"
    rejected = measure(faulty, TOY_PROBLEM, faulty.config_cls(BLOCK=64, fault="raise"),
                       device=device, seed=1)
    assert rejected.status == TrialStatus.INVALID and rejected.reason == "faults need BLOCK 32"


def test_compile_failures_are_told_from_runtime_ones() -> None:
    assert is_compile_error(CompileTimeAssertionFailure("src", None, "BLOCK too big"))
    assert is_compile_error(OutOfResources(300_000, 232_448, "shared memory"))
    assert not is_compile_error(RuntimeError("CUDA error: an illegal memory access"))
    long = describe_exception(ValueError("x" * 5000))
    assert long.startswith("ValueError: x") and len(long) < 700
