"""The parent side of a trial worker: send a config, wait at most the timeout, survive.

A worker that dies mid-trial gives a ``runtime_error`` with its exit signal and the last
lines it printed; one that does not answer within the timeout is killed and gives a
``timeout``. Either way the next trial starts a fresh worker.
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing as mp
import os
import signal
import tempfile
import time
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

from db.models import TrialStatus
from tuner.errors import TunerError
from tuner.tuning.runner.outcome import TrialOutcome, TrialRequest
from tuner.tuning.runner.trial_process import trial_process_main

__all__ = ["IsolatedRunner"]

# Importing torch and triton and probing the GPU in a fresh process takes seconds.
START_TIMEOUT_S = 300.0
_LOG_TAIL = 400


class IsolatedRunner:
    """Measures configs in a child process that is replaced whenever it dies or hangs."""

    def __init__(self, *, name: str = "runner", env: dict[str, str] | None = None,
                 start_timeout_s: float = START_TIMEOUT_S) -> None:
        self.name = name
        self._env = dict(env or {})
        self._start_timeout_s = start_timeout_s
        self._ctx = mp.get_context("spawn")
        self._proc: BaseProcess | None = None
        self._conn: Connection | None = None
        self._device: dict[str, Any] | None = None
        fd, path = tempfile.mkstemp(prefix=f"tuner-{name}-", suffix=".log")
        os.close(fd)
        self._log = Path(path)
        self.restarts = 0

    # -- lifecycle --------------------------------------------------------------------------
    def start(self) -> None:
        if self.alive:
            return
        self._discard()
        parent, child = self._ctx.Pipe()
        proc = self._ctx.Process(target=trial_process_main, args=(child, self._env, str(self._log)),
                                 name=self.name, daemon=True)
        proc.start()
        child.close()
        self._proc, self._conn = proc, parent
        if not parent.poll(self._start_timeout_s):
            self._discard()
            raise TunerError(f"trial worker {self.name} did not start within "
                             f"{self._start_timeout_s:g} s", "check that torch and triton "
                             "import in a fresh python (`python -c 'import templates'`)")
        try:
            hello = parent.recv()
        except (EOFError, OSError):
            tail = self._log_tail()
            self._discard()
            raise TunerError(f"trial worker {self.name} died while starting: {tail}",
                             "check that `python -c 'import templates'` works") from None
        self._device = hello["device"]

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.is_alive() and self._conn is not None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def device(self) -> dict[str, Any]:
        """The worker's DeviceInfo as a dict (plus ``key``); starts the worker if needed."""
        if self._device is None:
            self.start()
        assert self._device is not None
        return self._device

    def close(self) -> None:
        if self._conn is not None and self.alive:
            with contextlib.suppress(BrokenPipeError, OSError):
                self._conn.send(None)
            assert self._proc is not None
            self._proc.join(timeout=5)
        self._discard()
        self._log.unlink(missing_ok=True)

    def _discard(self) -> None:
        """Kill the worker (if any) and forget it."""
        if self._proc is not None:
            if self._proc.is_alive():
                self._proc.kill()
            self._proc.join(timeout=10)
        if self._conn is not None:
            self._conn.close()
        self._proc = self._conn = None

    # -- trials -------------------------------------------------------------------------------
    def measure(self, request: TrialRequest, timeout_s: float) -> TrialOutcome:
        started = time.monotonic()
        start_s = 0.0  # starting a worker for this trial (the first, or after a crash)
        if not self.alive:
            if self._proc is not None:
                self.restarts += 1
            self.start()
            start_s = time.monotonic() - started
        outcome = self._measure(request, timeout_s)
        return dataclasses.replace(outcome, start_s=start_s) if start_s else outcome

    def _measure(self, request: TrialRequest, timeout_s: float) -> TrialOutcome:
        assert self._conn is not None and self._proc is not None
        self._log.write_bytes(b"")  # the log of this trial only: the worker appends
        start = time.monotonic()
        self._conn.send(dataclasses.asdict(request))
        if not self._conn.poll(timeout_s):
            self._discard()
            return TrialOutcome.failed(
                TrialStatus.TIMEOUT, f"no result within the {timeout_s:g} s trial timeout "
                "(hung or too slow); the worker was killed and replaced",
                runner_s=time.monotonic() - start)
        try:
            answer = self._conn.recv()
        except (EOFError, OSError):
            return self._crashed(time.monotonic() - start)
        outcome = TrialOutcome.from_dict(answer)
        if outcome.fatal:
            self._discard()  # it exits by itself; a fresh one takes the next trial
        return outcome

    def _crashed(self, elapsed: float) -> TrialOutcome:
        assert self._proc is not None
        self._proc.join(timeout=10)
        code = self._proc.exitcode
        if code is not None and code < 0:
            how = f"killed by {signal.Signals(-code).name}"
        else:
            how = f"exit code {code}"
        tail = self._log_tail()
        self._discard()
        reason = f"the worker process died ({how})"
        if tail:
            reason += f"; its last output: {tail}"
        return TrialOutcome.failed(TrialStatus.RUNTIME_ERROR, reason, runner_s=elapsed,
                                   fatal=True)

    def _log_tail(self) -> str:
        try:
            text = self._log.read_text(errors="replace")
        except OSError:
            return ""
        text = " | ".join(line.strip() for line in text.strip().splitlines()[-6:])
        return text[-_LOG_TAIL:]
