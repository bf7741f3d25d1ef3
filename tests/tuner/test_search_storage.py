"""The search on the project database, on SQLite and PostgreSQL: Optuna's RDB storage and
the trials table shared by concurrent workers."""

from __future__ import annotations

import threading

from sqlalchemy import select

from db.models import BestConfig, Trial, TrialStatus
from db.session import init_db, session_scope
from templates import Problem, current_device, get_template
from tuner.replay import RecordedProblem, ReplayRunner
from tuner.search.loop import ProblemSearch, SearchSettings
from tuner.search.samplers import make_sampler
from tuner.search.store import DbStore
from tuner.search.study import HeartbeatKeeper, make_storage, open_study, study_name


def test_workers_share_one_study_and_one_trials_table(db_url: str,
                                                      landscape: RecordedProblem) -> None:
    template = get_template("toy_tiles")
    device = current_device()
    problem = Problem.from_dict(landscape.problem)
    key = template.problem_key(problem)
    init_db(db_url)
    storage = make_storage(db_url)
    heartbeats = HeartbeatKeeper(storage)
    name = study_name(device.key, template.name, template.version(), key)
    runner = ReplayRunner(template, landscape.trials, delay_s=0.005)
    budget = 16

    def worker(seed: int) -> None:
        store = DbStore(db_url, device=device.to_dict() | {"key": device.key},
                        template_name=template.name, template_version=template.version(),
                        space=template.config_cls.json_schema(), worker=f"w{seed}")
        study = open_study(storage, name, make_sampler("tpe", template.config_cls,
                                                       budget=budget, seed=seed), {"k": key})
        ProblemSearch(template=template, problem=problem, device=device, study=study,
                      store=store, runner=runner, heartbeats=heartbeats,
                      settings=SearchSettings(budget=budget, seed=seed)).run()

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in (0, 1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    heartbeats.close()
    assert max(runner.calls.values()) == 1, "a config was measured twice"
    with session_scope(db_url, write=False) as s:
        rows = list(s.scalars(select(Trial)))
        measured = [r for r in rows if r.status != TrialStatus.INVALID]
        assert budget <= len(measured) <= budget + 2
        assert len(measured) == sum(runner.calls.values())
        assert {r.worker for r in rows} == {"w0", "w1", "w2"}
        (best,) = s.scalars(select(BestConfig))
        top = max(r.tflops or 0 for r in measured if r.status == TrialStatus.OK)
        assert best.tflops == top and best.default_tflops is not None
        default = template.default_config(problem, device)
        assert [r.config_key for r in rows if r.is_default] == [default.key()]
