"""The trial worker: a child process that owns the GPU and measures one config at a time.

It runs in its own process (multiprocessing ``spawn``: a fresh interpreter, no CUDA state
inherited) so that a config that kills it (segfault, ``os._exit``, a compiler abort, an
illegal memory access that poisons the CUDA context) or hangs costs one worker, not the
sweep: the parent records the failure and starts another.

Protocol over a Pipe: the worker sends ``{"kind": "ready", "device": {...}}`` once, then
answers each request dict (a TrialRequest) with an outcome dict (a TrialOutcome); ``None``
or the pipe closing ends it. Between trials it keeps the last references of the problem at
hand (``tuner.tuning.runner.reference_cache``).
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import sys
import time
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from tuner.tuning.runner.parent_death import die_with_parent

if TYPE_CHECKING:
    from tuner.tuning.runner.reference_cache import ReferenceCache

__all__ = ["trial_process_main"]


def _redirect_output(log_path: str | None) -> None:
    # Compiler and kernel messages go to a log the parent reads when the worker dies, not
    # onto the progress display.
    if not log_path:
        return
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _no_core_dumps() -> None:
    # A config that segfaults should cost a trial, not a multi-gigabyte core file and the
    # seconds it takes to write one.
    try:
        import resource  # POSIX only (the ImportError below)

        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    except (ImportError, ValueError, OSError):
        pass


def trial_process_main(conn: Connection, env: dict[str, str], log_path: str | None) -> None:
    # A worker stuck in a hung kernel never reads its pipe, so it would not notice that the
    # sweep was killed (SIGKILL included).
    die_with_parent()
    _no_core_dumps()
    os.environ.update(env)  # before torch is imported: CUDA_VISIBLE_DEVICES, TRITON_*
    _redirect_output(log_path)

    # After os.environ.update(env): torch and triton read CUDA_VISIBLE_DEVICES, TRITON_* at import.
    import templates  # noqa: F401  (registers the built-in templates)
    from templates.device import current_device
    from tuner.tuning.runner.reference_cache import ReferenceCache

    device = current_device()
    cache = ReferenceCache.for_device(not device.is_interpreter)
    conn.send({"kind": "ready", "device": device.to_dict() | {"key": device.key},
               "pid": os.getpid()})
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message is None:
            return
        outcome = _answer(message, device, cache)
        try:
            conn.send(outcome)
        except (BrokenPipeError, OSError):
            return
        if outcome.get("fatal"):
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(3)


def _answer(message: dict[str, Any], device: Any,
            cache: ReferenceCache | None = None) -> dict[str, Any]:
    # lazy: the kernels are imported once trial_process_main has set the environment (above)
    from db.models import TrialStatus
    from templates.base import Problem
    from templates.registry import get_template
    from tuner.tuning.runner.measure import describe_exception, measure
    from tuner.tuning.runner.outcome import TrialOutcome, TrialRequest

    start = time.perf_counter()
    try:
        request = TrialRequest(**message)
        importlib.import_module(request.template_module)
        template = get_template(request.template)
        problem = Problem.from_dict(request.problem)
    except Exception as exc:
        outcome = TrialOutcome.failed(TrialStatus.RUNTIME_ERROR,
                                      f"bad request: {describe_exception(exc)}")
    else:
        try:
            config = template.config(request.config)
        except ValueError as exc:
            outcome = TrialOutcome.failed(TrialStatus.INVALID, str(exc))
        else:
            outcome = measure(template, problem, config, device=device, seed=request.seed,
                              rep_ms=request.rep_ms, cache=cache)
    outcome = dataclasses.replace(outcome, runner_s=time.perf_counter() - start)
    return outcome.to_dict()
