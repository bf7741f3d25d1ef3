"""Bodies of the processes that the concurrency tests start (spawned: importable, top level)."""

from __future__ import annotations

import functools
import random
import traceback
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
