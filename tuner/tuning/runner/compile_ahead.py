"""Compile ahead: while the GPU times one config, other processes compile the next ones.

Each upcoming candidate goes to a pool of CPU processes that call
``template.precompile(problem, config)``; Triton writes the compiled kernel to its on-disk
cache, so the trial worker's first launch of that config loads it instead of compiling, and
a trial's wall time approaches its benchmark time. A template whose ``precompile`` returns
False (not supported) is not sent again. A precompile that fails is ignored: the trial
worker compiles the config itself and records the error.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import multiprocessing as mp
import os
import threading
import time
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures.process import BrokenProcessPool

from templates.base import Problem, Template
from templates.registry import get_template
from tuner.tuning.runner.outcome import TrialRequest
from tuner.tuning.runner.parent_death import die_with_parent

__all__ = ["CompileAhead", "precompile_request", "supports_precompile"]

log = logging.getLogger(__name__)
# A pool that breaks (a compiler abort kills one of its processes) is rebuilt this often.
_MAX_POOL_RESTARTS = 3
# The compile processes' niceness above the sweep's: where they and the trial worker want
# more cores than there are, the timing wins them. A small call's paced reading is host
# time, and it moved with the compiles beside it (one SDPA decode call read 25-52 us within
# one H200 sweep).
COMPILE_NICENESS = 10


def supports_precompile(template: Template) -> bool:
    cls = type(template)
    return (cls.precompile is not Template.precompile
            or cls.kernel_launches is not Template.kernel_launches)


def _init_pool(env: dict[str, str]) -> None:
    # A pool process waits on a queue whose writing end it holds itself: without this it
    # outlives a killed sweep, forever (seen: two, 400 MB each, and the sweep's stdout open).
    die_with_parent()
    # Where it is not allowed, the compiles run at the sweep's priority, as before.
    with contextlib.suppress(OSError):
        os.nice(COMPILE_NICENESS)
    os.environ.update(env)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    os.close(devnull)


def precompile_request(request: TrialRequest) -> bool:
    """Runs in a pool process: compile ``request``'s config; False if not supported."""
    importlib.import_module(request.template_module)
    template = get_template(request.template)
    problem = Problem.from_dict(request.problem)
    return bool(template.precompile(problem, template.config(request.config)))


Key = tuple[str, str, str]


class CompileAhead:
    """A pool of ``workers`` compile processes shared by every search loop of a process."""

    def __init__(self, workers: int, *, env: dict[str, str] | None = None) -> None:
        self.workers = max(0, workers)
        self._env = dict(env or {})
        self._pool: ProcessPoolExecutor | None = None
        self._futures: dict[Key, Future[bool]] = {}
        self._unsupported: set[str] = set()
        self._lock = threading.Lock()
        self._restarts = 0
        self._warm = False  # a precompile has finished: the pool's processes are up
        self.submitted = 0
        self.waited_s = 0.0

    def enabled_for(self, template: Template) -> bool:
        return (self.workers > 0 and self._restarts <= _MAX_POOL_RESTARTS
                and supports_precompile(template) and template.name not in self._unsupported)

    def submit(self, template: Template, key: Key, request: TrialRequest) -> None:
        if not self.enabled_for(template):
            return
        with self._lock:
            if key in self._futures:
                return
            try:
                future = self._executor().submit(precompile_request, request)
            except (BrokenProcessPool, RuntimeError) as exc:
                self._broken(exc)
                return
            self._futures[key] = future
            self.submitted += 1
        future.add_done_callback(functools.partial(self._done, template.name))

    def wait(self, key: Key, timeout_s: float) -> None:
        """Wait (at most ``timeout_s``) until ``key``'s precompile, if any, has finished, so
        the trial worker loads the compiled kernel rather than compiling it again."""
        with self._lock:
            future = self._futures.pop(key, None)
        if future is None:
            return
        if not self._warm:
            # The pool is still starting (importing torch, creating contexts): the trial
            # worker compiles sooner itself than after that.
            future.cancel()
            return
        start = time.monotonic()
        try:
            future.result(timeout=timeout_s)
        except FutureTimeout:
            pass
        except Exception as exc:  # the trial worker will hit (and record) the same error
            log.debug("precompile of %s failed: %s", key, exc)
        finally:
            self.waited_s += time.monotonic() - start

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
            self._futures.clear()
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    def _executor(self) -> ProcessPoolExecutor:
        if self._pool is None:
            self._pool = ProcessPoolExecutor(max_workers=self.workers,
                                             mp_context=mp.get_context("spawn"),
                                             initializer=_init_pool, initargs=(self._env,))
        return self._pool

    def _done(self, template_name: str, future: Future[bool]) -> None:
        if future.cancelled():
            return
        exc = future.exception()
        if exc is None:
            self._warm = True
        if isinstance(exc, BrokenProcessPool):
            with self._lock:
                self._broken(exc)
        elif exc is None and future.result() is False:
            self._unsupported.add(template_name)

    def _broken(self, exc: BaseException) -> None:
        # Called with the lock held. The next submit builds a new pool.
        log.debug("compile-ahead pool broke: %s", exc)
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        self._pool = None
        self._futures.clear()
        self._restarts += 1
