"""Bodies of the processes that the concurrency tests start (spawned: importable, top level),
and ``race``, which starts them."""

from __future__ import annotations

import functools
import multiprocessing
import queue
import random
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from db import crud
from db.models import TrialStatus
from db.session import init_db, run_in_transaction, session_scope
from tests.db import _data

SHARED_CONFIG = "BLOCK_M=128,BLOCK_N=64,shared"
PROBLEM_KEYS = 3


def write_trials(url: str, worker: int, n_trials: int, barrier: Any, results: Any) -> None:
    """Race the others through migration, device/template creation and trial writes.

    Puts ``(worker, None, report)`` on ``results``, or ``(worker, traceback, None)``.
    """
    try:
        rng = random.Random(1000 + worker)
        problems = [_data.problem(random.Random(p)) for p in range(PROBLEM_KEYS)]
        barrier.wait(timeout=60)
        init_db(url)  # every worker at once, on an empty database
        info = _data.device_info(random.Random(7), key="shared-gpu|cc9.0")

        def identify(s: Any) -> tuple[int, int]:
            device = crud.get_or_create_device(s, info=info)
            template = crud.get_or_create_template(s, name="flash_fwd", version="v1", space={})
            return device.id, template.id

        device_id, template_id = run_in_transaction(url, identify)

        def record(s: Any, problem: dict[str, object], config_key: str, tflops: float) -> int:
            key = _data.problem_key(problem)
            trial = crud.record_trial(
                s, device_id=device_id, template_id=template_id, problem_key=key,
                problem=problem, config_key=config_key, config={"worker": worker},
                status=TrialStatus.OK, median_ms=1000.0 / tflops, tflops=tflops,
                worker=f"w{worker}")
            crud.refresh_best(s, device_id=device_id, template_id=template_id, problem_key=key)
            return trial.id

        # The same config of the same problem, from every worker at the same moment.
        barrier.wait(timeout=60)
        shared_id = run_in_transaction(
            url, lambda s: record(s, problems[0], SHARED_CONFIG, rng.uniform(1, 10)))
        written: list[tuple[str, float]] = []
        for i in range(n_trials):
            problem = problems[i % PROBLEM_KEYS]
            tflops = rng.uniform(10, 500)
            config_key = f"w{worker}-c{i}"
            if i % 2:  # both ways of writing must hold up under contention
                run_in_transaction(url, functools.partial(record, problem=problem,
                                                          config_key=config_key, tflops=tflops))
            else:
                with session_scope(url) as s:
                    record(s, problem, config_key, tflops)
            written.append((_data.problem_key(problem), tflops))
        results.put((worker, None, {"shared_id": shared_id, "written": written,
                                    "device_id": device_id, "template_id": template_id}))
    except BaseException:
        results.put((worker, traceback.format_exc(), None))


def claim_demand_rows(url: str, worker: str, device_key: str, versions: dict[str, str],
                      most: int, barrier: Any, results: Any) -> None:
    """Claim up to ``most`` demand rows, racing the others; puts ``(worker, None, keys)`` on
    ``results``, or ``(worker, traceback, None)``."""
    from db import demand

    try:
        init_db(url)
        barrier.wait(timeout=60)
        keys: list[str] = []
        for _ in range(most):
            key = run_in_transaction(url, lambda s: getattr(demand.claim_demand(
                s, device_key=device_key, versions=versions, worker=worker, lease_s=600,
                max_attempts=3), "problem_key", None))
            if key is None:
                break
            keys.append(key)
        results.put((worker, None, keys))
    except Exception:
        results.put((worker, traceback.format_exc(), None))


def race(target: Callable[..., None], arg_lists: Sequence[tuple[Any, ...]],
         timeout_s: float = 120) -> dict[Any, Any]:
    """Run ``target(*args, barrier, results)`` in one spawned process per ``args``, all
    released at once by the barrier; each puts ``(worker, traceback or None, report)`` on
    ``results``. Returns worker -> report; a worker that failed or did not report in time
    fails the test."""
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(len(arg_lists)), ctx.Queue()
    procs = [ctx.Process(target=target, args=(*args, barrier, results)) for args in arg_lists]
    for p in procs:
        p.start()
    reports: dict[Any, Any] = {}
    try:
        for _ in procs:
            worker, failure, report = results.get(timeout=timeout_s)
            assert failure is None, f"worker {worker} failed:\n{failure}"
            reports[worker] = report
    except queue.Empty:
        raise AssertionError(f"workers did not report within {timeout_s:g} s; got "
                             f"{sorted(reports)}") from None
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert all(p.exitcode == 0 for p in procs)
    return reports
