"""The storage contract of db.crud, on SQLite and on PostgreSQL."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

from db import crud
from db.models import SweepStatus, TrialStatus
from db.session import session_scope
from templates.base import Problem
from tests.db import _data


@dataclass(frozen=True)
class Target:
    url: str
    device_id: int
    device_key: str
    template_id: int


@pytest.fixture
def target(db_url: str) -> Target:
    info = _data.device_info(random.Random(10), key="NVIDIA H100|cc9.0|triton3.6")
    with session_scope(db_url) as s:
        device = crud.get_or_create_device(s, info=info)
        template = crud.get_or_create_template(s, name="flash_fwd", version="abc123",
                                               space={"type": "object"})
        return Target(db_url, device.id, device.key, template.id)


def _record(s: Session, t: Target, rng: random.Random, *, problem: dict[str, object],
            config_key: str, tflops: float | None, status: TrialStatus = TrialStatus.OK,
            **extra: object) -> int:
    trial = crud.record_trial(
        s, device_id=t.device_id, template_id=t.template_id,
        problem_key=_data.problem_key(problem), problem=problem, config_key=config_key,
        config=_data.config(rng), status=status, tflops=tflops,
        median_ms=None if tflops is None else 1000.0 / tflops, **extra)  # type: ignore[arg-type]
    return trial.id


# ----------------------------------------------------------------------------- devices, templates
def test_get_or_create_device_is_idempotent(db_url: str) -> None:
    rng = random.Random(11)
    info = _data.device_info(rng)
    with session_scope(db_url) as s:
        first = crud.get_or_create_device(s, info=info)
        assert first.name == info["name"] and first.total_memory == info["total_memory"]
    with session_scope(db_url) as s:
        again = crud.get_or_create_device(s, info={**info, "driver_version": "999.1"})
        other = crud.get_or_create_device(s, info=_data.device_info(rng))
        assert again.id == first.id and again.driver_version == info["driver_version"]
        assert other.id != first.id
        by_name = sorted([first, other], key=lambda d: (d.name, d.id))
        assert [d.id for d in crud.list_devices(s)] == [d.id for d in by_name]


def test_get_or_create_device_names_missing_fields(db_url: str) -> None:
    info = _data.device_info(random.Random(12))
    del info["sm_count"]
    with session_scope(db_url) as s, pytest.raises(ValueError, match=r"\['sm_count'\] are missing"):
        crud.get_or_create_device(s, info=info)


def test_get_or_create_template_per_version(db_url: str) -> None:
    with session_scope(db_url) as s:
        v1 = crud.get_or_create_template(s, name="flash_fwd", version="v1", space={"a": [1, 2]})
        v1_again = crud.get_or_create_template(s, name="flash_fwd", version="v1", space={})
        v2 = crud.get_or_create_template(s, name="flash_fwd", version="v2", space={})
        bwd = crud.get_or_create_template(s, name="flash_bwd", version="v1", space={})
        assert v1_again.id == v1.id and v1_again.space == {"a": [1, 2]}
        assert len({v1.id, v2.id, bwd.id}) == 3
        assert [(t.name, t.version) for t in crud.list_templates(s)] == [
            ("flash_bwd", "v1"), ("flash_fwd", "v1"), ("flash_fwd", "v2")]


# ----------------------------------------------------------------------------- sweeps
def test_sweeps_start_running_and_finish(db_url: str) -> None:
    with session_scope(db_url) as s:
        ids = [crud.create_sweep(s, name=f"sweep-{i}", spec={"n": i}, host="gpu-7").id
               for i in range(3)]
    with session_scope(db_url) as s:
        crud.finish_sweep(s, sweep_id=ids[1], status=SweepStatus.INTERRUPTED)
        with pytest.raises(LookupError, match="no sweep with id 424242"):
            crud.finish_sweep(s, sweep_id=424242, status=SweepStatus.DONE)
    with session_scope(db_url, write=False) as s:
        newest_first = crud.list_sweeps(s, limit=2)
        assert [w.id for w in newest_first] == [ids[2], ids[1]]
        assert newest_first[0].status is SweepStatus.RUNNING
        assert newest_first[0].finished_at is None
        assert newest_first[1].status is SweepStatus.INTERRUPTED
        assert newest_first[1].finished_at is not None and newest_first[1].spec == {"n": 1}


# ----------------------------------------------------------------------------- trials
def test_record_trial_is_idempotent_and_keeps_the_first_result(target: Target) -> None:
    rng = random.Random(13)
    problem = _data.problem(rng)
    with session_scope(target.url) as s:
        sweep = crud.create_sweep(s, name="s", spec={}, host="h")
        ok_id = _record(s, target, rng, problem=problem, config_key="c1", tflops=321.5,
                        sweep_id=sweep.id, worker="w1", optuna_study="st", optuna_trial=4)
        failed_id = _record(s, target, rng, problem=problem, config_key="c2", tflops=None,
                            status=TrialStatus.COMPILE_ERROR, reason="out of shared memory")
    with session_scope(target.url) as s:
        # A second record of the same config, whatever it says, returns the stored row.
        again = crud.record_trial(
            s, device_id=target.device_id, template_id=target.template_id,
            problem_key=_data.problem_key(problem), problem=problem, config_key="c1",
            config={}, status=TrialStatus.RUNTIME_ERROR, reason="crash")
        assert again.id == ok_id and again.status is TrialStatus.OK and again.tflops == 321.5
        assert (again.sweep_id, again.worker, again.optuna_study, again.optuna_trial) == (
            sweep.id, "w1", "st", 4)
        found = crud.find_trial(s, device_id=target.device_id, template_id=target.template_id,
                                problem_key=_data.problem_key(problem), config_key="c2")
        assert found is not None and found.id == failed_id
        assert found.reason == "out of shared memory" and found.tflops is None
        assert crud.find_trial(s, device_id=target.device_id, template_id=target.template_id,
                               problem_key=_data.problem_key(problem), config_key="c3") is None
        assert [t.id for t in crud.trials_for(s, device_id=target.device_id,
                                              template_id=target.template_id,
                                              problem_key=_data.problem_key(problem))] == [
            ok_id, failed_id]


def test_record_trial_refuses_an_unknown_status(target: Target) -> None:
    rng = random.Random(14)
    with session_scope(target.url) as s, pytest.raises(ValueError, match="exploded"):
        _record(s, target, rng, problem=_data.problem(rng), config_key="c", tflops=1.0,
                status="exploded")  # type: ignore[arg-type]


def test_trial_counts_by_status_and_sweep(target: Target) -> None:
    rng = random.Random(15)
    problem = _data.problem(rng)
    statuses = [rng.choice(list(TrialStatus)) for _ in range(30)]
    with session_scope(target.url) as s:
        sweeps = [crud.create_sweep(s, name=f"s{i}", spec={}, host="h").id for i in range(2)]
        for n, status in enumerate(statuses):
            _record(s, target, rng, problem=problem, config_key=f"c{n}", status=status,
                    tflops=rng.uniform(1, 100) if status is TrialStatus.OK else None,
                    sweep_id=sweeps[n % 2])
    with session_scope(target.url, write=False) as s:
        everything = crud.trial_counts(s)
        first = crud.trial_counts(s, sweep_id=sweeps[0])
    assert everything == {st.value: statuses.count(st) for st in TrialStatus}
    assert first == {st.value: statuses[0::2].count(st) for st in TrialStatus}


# ----------------------------------------------------------------------------- best configs
def test_problem_variant_follows_problem_variant() -> None:
    rng = random.Random(16)
    for causal in ("none", "top_left", "bottom_right"):
        for mask in ("none", "random:0.10", "sliding:1024"):
            p = _data.problem(rng, causal=causal, mask=mask)
            assert crud.problem_variant(p) == Problem.from_dict(p).variant


def test_refresh_best_takes_the_fastest_ok_trial(target: Target) -> None:
    rng = random.Random(17)
    problem = _data.problem(rng, causal="bottom_right", mask="random:0.10", dtype="float16")
    key = _data.problem_key(problem)
    speeds = [rng.uniform(10, 400) for _ in range(12)]
    with session_scope(target.url) as s:
        sweep_id = crud.create_sweep(s, name="s", spec={}, host="h").id
        assert crud.refresh_best(s, device_id=target.device_id, template_id=target.template_id,
                                 problem_key=key) is None  # nothing measured yet
        for n, tflops in enumerate(speeds):
            _record(s, target, rng, problem=problem, config_key=f"c{n}", tflops=tflops,
                    is_default=n == 3, sweep_id=sweep_id)
        # Failures never win, whatever number they carry.
        _record(s, target, rng, problem=problem, config_key="wrong", tflops=10 * max(speeds),
                status=TrialStatus.WRONG_RESULT)
        best = crud.refresh_best(s, device_id=target.device_id, template_id=target.template_id,
                                 problem_key=key)
    assert best is not None
    winner = speeds.index(max(speeds))
    assert best.tflops == pytest.approx(max(speeds))
    assert best.median_ms == pytest.approx(1000.0 / max(speeds))
    assert best.default_tflops == pytest.approx(speeds[3])
    assert best.speedup == pytest.approx(max(speeds) / speeds[3])
    assert (best.dtype, best.variant) == ("float16", "causal-bottom_right+sparse-random:0.10")
    assert best.problem == problem and best.sweep_id == sweep_id
    with session_scope(target.url, write=False) as s:
        trial = crud.find_trial(s, device_id=target.device_id, template_id=target.template_id,
                                problem_key=key, config_key=f"c{winner}")
        assert trial is not None and best.trial_id == trial.id and best.config == trial.config


def test_refresh_best_updates_the_row_when_a_faster_trial_arrives(target: Target) -> None:
    rng = random.Random(18)
    problem = _data.problem(rng)
    key = _data.problem_key(problem)
    with session_scope(target.url) as s:
        _record(s, target, rng, problem=problem, config_key="a", tflops=50.0)
        first = crud.refresh_best(s, device_id=target.device_id, template_id=target.template_id,
                                  problem_key=key)
        assert first is not None and first.default_tflops is None and first.speedup is None
        first_id = first.id
    with session_scope(target.url) as s:
        _record(s, target, rng, problem=problem, config_key="default", tflops=40.0,
                is_default=True)
        _record(s, target, rng, problem=problem, config_key="b", tflops=80.0)
        second = crud.refresh_best(s, device_id=target.device_id,
                                   template_id=target.template_id, problem_key=key)
    assert second is not None and second.id == first_id  # the same row, updated
    assert (second.tflops, second.default_tflops, second.speedup) == (80.0, 40.0, 2.0)
    with session_scope(target.url, write=False) as s:
        assert crud.count_best(s) == 1


def test_refresh_best_that_changes_nothing_writes_nothing(target: Target) -> None:
    """A refresh that finds the same best leaves the row as it was, updated_at included: the
    service reloads what changed, and an upload storing nothing must not look like a change
    (issue 19)."""
    rng = random.Random(19)
    problem = _data.problem(rng)
    key = _data.problem_key(problem)
    ids = {"device_id": target.device_id, "template_id": target.template_id}
    with session_scope(target.url) as s:
        _record(s, target, rng, problem=problem, config_key="a", tflops=50.0)
        assert crud.refresh_bests(s, **ids, problem_keys=[key]) == [key]
        first = crud.refresh_best(s, **ids, problem_key=key)
        assert first is not None
        stamp = first.updated_at
    with session_scope(target.url) as s:
        _record(s, target, rng, problem=problem, config_key="slower", tflops=20.0)
        assert crud.refresh_bests(s, **ids, problem_keys=[key]) == []
        again = crud.refresh_best(s, **ids, problem_key=key)
        assert again is not None and again.updated_at == stamp and again.tflops == 50.0
    with session_scope(target.url) as s:
        _record(s, target, rng, problem=problem, config_key="faster", tflops=70.0)
        assert crud.refresh_bests(s, **ids, problem_keys=[key]) == [key]
        faster = crud.refresh_best(s, **ids, problem_key=key)
        assert faster is not None and faster.tflops == 70.0 and faster.updated_at > stamp


def test_refresh_bests_of_many_keys_matches_one_by_one(target: Target) -> None:
    """The bulk refresh chooses as refresh_best does, key by key, in a few queries: created,
    changed and deleted rows are reported, untouched ones are not."""
    rng = random.Random(20)
    ids = {"device_id": target.device_id, "template_id": target.template_id}
    problems = [_data.problem(rng) for _ in range(30)]
    keys = sorted({_data.problem_key(p) for p in problems})
    with session_scope(target.url) as s:
        for n, p in enumerate(problems):
            _record(s, target, rng, problem=p, config_key=f"c{n}", tflops=rng.uniform(1, 99))
            if n % 3 == 0:
                _record(s, target, rng, problem=p, config_key=f"d{n}", tflops=rng.uniform(1, 99),
                        is_default=True)
        one_by_one = {k: crud.refresh_best(s, **ids, problem_key=k) for k in keys}
        expected = {k: (b.trial_id, b.tflops, b.default_tflops) for k, b in one_by_one.items()
                    if b is not None}
        s.execute(sa.delete(crud.BestConfig))
        queries: list[str] = []

        def count(*args: object) -> None:
            queries.append(str(args[2]))

        engine = s.get_bind()
        sa.event.listen(engine, "before_cursor_execute", count)
        try:
            assert crud.refresh_bests(s, **ids, problem_keys=keys) == keys
        finally:
            sa.event.remove(engine, "before_cursor_execute", count)
        # Not one query per key (PostgreSQL takes each key's advisory lock on its own).
        locks = [q for q in queries if "pg_advisory_xact_lock" in q]
        assert len(locks) in (0, len(keys))
        # And on PostgreSQL one notification that best configs changed (api/changes.py).
        notices = [q for q in queries if "pg_notify" in q]
        assert len(notices) == (1 if locks else 0)
        # Trials, re-measurements, head-to-head readings, stored rows, winners, upsert.
        assert len(queries) - len(locks) - len(notices) <= 6, [q[:60] for q in queries]
        again = {k: crud.refresh_best(s, **ids, problem_key=k) for k in keys}
        assert {k: (b.trial_id, b.tflops, b.default_tflops)
                for k, b in again.items() if b is not None} == expected
        assert crud.refresh_bests(s, **ids, problem_keys=keys) == []
        # Every OK trial of one key disqualified: its best row goes, and that is a change.
        gone = keys[0]
        for trial in crud.trials_for(s, **ids, problem_key=gone):
            crud.record_remeasurement(s, trial_id=trial.id, status=TrialStatus.RUNTIME_ERROR,
                                      reason="crashed")
        assert crud.refresh_bests(s, **ids, problem_keys=keys) == [gone]
        assert crud.refresh_best(s, **ids, problem_key=gone) is None


def test_insert_new_trials_stores_each_identity_once(target: Target) -> None:
    rng = random.Random(21)
    problem = _data.problem(rng)
    key = _data.problem_key(problem)

    def row(config_key: str, tflops: float) -> dict[str, object]:
        return {"device_id": target.device_id, "template_id": target.template_id,
                "problem_key": key, "problem": problem, "config_key": config_key,
                "config": _data.config(rng), "status": TrialStatus.OK, "median_ms": 1.0,
                "tflops": tflops, "error": None, "is_default": False, "sweep_id": None,
                "worker": "w"}

    with session_scope(target.url) as s:
        stored_id = _record(s, target, rng, problem=problem, config_key="old", tflops=5.0)
        ident = (target.device_id, target.template_id, key)
        assert crud.stored_trial_identities(s, identities=[(*ident, "old"), (*ident, "a")]) \
            == {(*ident, "old")}
        new = crud.insert_new_trials(s, rows=[row("old", 99.0), row("a", 10.0),
                                              row("b", 20.0), row("a", 30.0)])
        assert sorted(new) == [(*ident, "a"), (*ident, "b")]
        assert crud.insert_remeasurements(s, rows=[
            {"trial_id": new[(*ident, "a")], "status": TrialStatus.OK, "median_ms": 0.9,
             "tflops": 11.0},
            {"trial_id": new[(*ident, "b")], "status": "timeout", "reason": "slow"}]) == 2
        with pytest.raises(ValueError, match="missing"):
            crud.insert_new_trials(s, rows=[{"device_id": target.device_id}])
    with session_scope(target.url, write=False) as s:
        trials = {t.config_key: t for t in crud.trials_for(
            s, device_id=target.device_id, template_id=target.template_id, problem_key=key)}
        assert trials["old"].id == stored_id and trials["old"].tflops == 5.0  # the first stays
        assert trials["a"].tflops == 10.0  # the first row of the same identity wins
        again = crud.remeasurements_for(s, device_id=target.device_id,
                                        template_id=target.template_id, problem_key=key)
        assert [(k, r.status, r.reason) for k, r in again] == [
            ("a", TrialStatus.OK, ""), ("b", TrialStatus.TIMEOUT, "slow")]


def _seed_bests(url: str, rng: random.Random) -> list[tuple[str, str, str, str]]:
    """Bests on two devices x two templates with mixed dtypes and variants."""
    rows = []
    with session_scope(url) as s:
        for d in range(2):
            device = crud.get_or_create_device(
                s, info={**_data.device_info(rng, key=f"gpu{d}|cc9.0"), "name": f"GPU-{d}"})
            for name in ("flash_fwd", "flash_decode"):
                template = crud.get_or_create_template(s, name=name, version="v1", space={})
                for causal in ("none", "top_left"):
                    for dtype in ("float16", "float32"):
                        p = _data.problem(rng, causal=causal, dtype=dtype)
                        key = _data.problem_key(p) + f"-{causal}"
                        crud.record_trial(
                            s, device_id=device.id, template_id=template.id, problem_key=key,
                            problem=p, config_key="c", config=_data.config(rng),
                            status=TrialStatus.OK, median_ms=1.0, tflops=rng.uniform(1, 99))
                        crud.refresh_best(s, device_id=device.id, template_id=template.id,
                                          problem_key=key)
                        variant = "dense" if causal == "none" else "causal-top_left"
                        rows.append((device.key, name, dtype, variant))
    return rows


def test_list_and_count_best_filter_and_page(db_url: str) -> None:
    rows = _seed_bests(db_url, random.Random(19))
    assert len(rows) == 16
    with session_scope(db_url, write=False) as s:
        everything = crud.list_best(s)
        assert len(everything) == crud.count_best(s) == 16
        # The problem's numbers compare as numbers ("q932" before "q2526"), sequence lengths last.
        numbers = ("head_dim", "heads_q", "heads_kv", "batch", "seqlen_q", "seqlen_kv")
        order = [(b.device.name, b.template.name, b.dtype, b.variant,
                  *(int(b.problem[n]) for n in numbers)) for b in everything]
        assert order == sorted(order)
        # Pages tile the ordered list exactly.
        pages = [crud.list_best(s, offset=o, limit=5) for o in range(0, 20, 5)]
        assert [b.id for page in pages for b in page] == [b.id for b in everything]
        for device in ("GPU-1", "gpu1|cc9.0"):  # by name or by key
            chosen = crud.list_best(s, device=device)
            assert len(chosen) == crud.count_best(s, device=device) == 8
            assert {b.device.key for b in chosen} == {"gpu1|cc9.0"}
        chosen = crud.list_best(s, template="flash_decode", dtype="float32",
                                variant="causal-top_left")
        expected = [r for r in rows
                    if r[1:] == ("flash_decode", "float32", "causal-top_left")]
        assert len(chosen) == len(expected) == 2
        assert crud.count_best(s, template="flash_decode", dtype="float32",
                               variant="causal-top_left") == 2
        assert crud.list_best(s, device="no-such-gpu") == []
        assert crud.count_best(s, variant="sparse-sliding:64") == 0
        with pytest.raises(ValueError, match="offset and limit must be >= 0"):
            crud.list_best(s, offset=-1)


def test_best_for_and_candidates(db_url: str) -> None:
    _seed_bests(db_url, random.Random(20))
    with session_scope(db_url, write=False) as s:
        candidates = crud.best_candidates(s, device_key="gpu0|cc9.0", template_name="flash_fwd",
                                          template_version="v1")
        assert len(candidates) == 4
        assert {(b.device.key, b.template.name) for b in candidates} == {("gpu0|cc9.0",
                                                                          "flash_fwd")}
        assert crud.best_candidates(s, device_key="gpu0|cc9.0", template_name="flash_fwd",
                                    template_version="v0") == []
        for b in candidates:
            hit = crud.best_for(s, device_key="gpu0|cc9.0", template_name="flash_fwd",
                                template_version="v1", problem_key=b.problem_key)
            assert hit is not None and hit.id == b.id
        assert crud.best_for(s, device_key="gpu1|cc9.0", template_name="flash_fwd",
                             template_version="v1", problem_key="no-such-problem") is None


def test_refresh_best_takes_the_finalist_with_the_fastest_median(target: Target) -> None:
    rng = random.Random(21)
    problem = _data.problem(rng)
    key = _data.problem_key(problem)
    ids = {"device_id": target.device_id, "template_id": target.template_id,
           "problem_key": key}
    with session_scope(target.url) as s:  # times are 1000 / TFLOP/s ms
        lucky = _record(s, target, rng, problem=problem, config_key="lucky", tflops=200.0)
        steady = _record(s, target, rng, problem=problem, config_key="steady", tflops=125.0)
        default = _record(s, target, rng, problem=problem, config_key="default", tflops=100.0,
                          is_default=True)
        best = crud.refresh_best(s, **ids)
        assert best is not None and best.trial_id == lucky  # single readings: the old rule
    with session_scope(target.url) as s:
        for trial_id, times in ((lucky, (10.5, 12.0)), (steady, (8.0, 8.2)),
                                (default, (10.0, 10.0))):
            for ms in times:
                crud.record_remeasurement(s, trial_id=trial_id, status=TrialStatus.OK,
                                          median_ms=ms, tflops=1000.0 / ms, worker="w")
        best = crud.refresh_best(s, **ids)
    assert best is not None and best.trial_id == steady
    assert best.median_ms == 8.0 and best.tflops == pytest.approx(125.0)  # of 8, 8, 8.2
    assert best.default_tflops == pytest.approx(100.0)  # at its median, 10 ms
    assert best.speedup == pytest.approx(1.25)
    with session_scope(target.url) as s:
        crud.record_remeasurement(s, trial_id=steady, status=TrialStatus.WRONG_RESULT,
                                  reason="relative error 0.4", error=0.4)
        best = crud.refresh_best(s, **ids)
        assert best is not None and best.trial_id == default  # 10 ms against lucky's 10.5
        assert [(k, r.status) for k, r in crud.remeasurements_for(s, **ids)][-1] == (
            "steady", TrialStatus.WRONG_RESULT)
    with session_scope(target.url) as s:
        for trial_id in (lucky, default):
            crud.record_remeasurement(s, trial_id=trial_id, status=TrialStatus.TIMEOUT)
        assert crud.refresh_best(s, **ids) is None  # every config disqualified: not served
        assert crud.count_best(s) == 0
        assert len(crud.trials_for(s, **ids)) == 3  # nothing measured is lost
        assert len(crud.remeasurements_for(s, **ids)) == 9


def test_best_readings_are_the_first_and_the_ok_remeasurements(target: Target) -> None:
    rng = random.Random(22)
    once, again = _data.problem(rng), _data.problem(rng, causal="top_left")
    with session_scope(target.url) as s:  # times are 1000 / TFLOP/s ms
        _record(s, target, rng, problem=once, config_key="a", tflops=100.0)  # 10 ms, only
        steady = _record(s, target, rng, problem=again, config_key="b", tflops=125.0)  # 8 ms
        default = _record(s, target, rng, problem=again, config_key="c", tflops=50.0,
                          is_default=True)
        for ms in (8.4, 7.6):
            crud.record_remeasurement(s, trial_id=steady, status=TrialStatus.OK, median_ms=ms,
                                      tflops=1000.0 / ms)
        crud.record_remeasurement(s, trial_id=default, status=TrialStatus.OK, median_ms=9.0,
                                  tflops=1000.0 / 9.0)  # another config's reading
        for problem in (once, again):
            crud.refresh_best(s, device_id=target.device_id, template_id=target.template_id,
                              problem_key=_data.problem_key(problem))
        # A failed re-measurement of the best's own trial (its best row not refreshed yet, as
        # while another worker's round is in flight): no reading, even with a time on it.
        crud.record_remeasurement(s, trial_id=steady, status=TrialStatus.WRONG_RESULT,
                                  median_ms=1.0, reason="relative error 0.4")
    with session_scope(target.url, write=False) as s:
        bests = {b.trial_id: b for b in crud.list_best(s)}
        readings = crud.best_readings(s, list(bests.values()))
    by_trial = {trial_id: readings[b.id] for trial_id, b in bests.items()}
    assert by_trial[steady].times_ms == (8.0, 8.4, 7.6) and by_trial[steady].count == 3
    assert by_trial[steady].spread == pytest.approx((8.4 - 7.6) / 8.0)
    (single,) = [r for trial_id, r in by_trial.items() if trial_id != steady]
    assert single.times_ms == (10.0,) and single.count == 1 and single.spread is None


def test_best_readings_of_many_bests_take_two_queries(db_url: str) -> None:
    _seed_bests(db_url, random.Random(23))
    with session_scope(db_url, write=False) as s:
        bests = crud.list_best(s)
        statements: list[str] = []
        engine = s.get_bind()

        def count(_conn: object, _cursor: object, statement: str, *_args: object) -> None:
            statements.append(statement)

        sa.event.listen(engine, "before_cursor_execute", count)
        try:
            readings = crud.best_readings(s, bests)
            assert crud.best_readings(s, []) == {}  # nothing to read: no query
        finally:
            sa.event.remove(engine, "before_cursor_execute", count)
    # The trials with their re-measurements, and their head-to-head readings.
    assert len(bests) == 16 and len(statements) == 2
    # Each rests on its one trial's reading (1.0 ms, as _seed_bests records them).
    assert {b.id: (readings[b.id].times_ms, readings[b.id].spread) for b in bests} == {
        b.id: ((1.0,), None) for b in bests}


# ----------------------------------------------------------------------------- re-measurement claims
def test_claims_grant_exactly_the_missing_remeasurements(target: Target) -> None:
    rng = random.Random(22)
    never_stale = lambda *_: False  # noqa: E731
    with session_scope(target.url) as s:
        trial_id = _record(s, target, rng, problem=_data.problem(rng), config_key="c",
                           tflops=10.0)

    def claim(worker: str, stale: object = never_stale) -> int | None:
        with session_scope(target.url) as s:
            return crud.claim_remeasurement(s, trial_id=trial_id, wanted=2, worker=worker,
                                            is_stale=stale)  # type: ignore[arg-type]

    a, b = claim("a"), claim("b")
    assert a is not None and b is not None and claim("c") is None  # two wanted, two held
    with session_scope(target.url) as s:  # a's re-measurement lands, its claim goes
        crud.record_remeasurement(s, trial_id=trial_id, status=TrialStatus.OK, median_ms=1.0,
                                  tflops=10.0)
        crud.drop_remeasurement_claim(s, claim_id=a)
    assert claim("c") is None  # one stored, one in flight: enough
    seen: list[tuple[str, object]] = []

    def b_is_dead(worker: str, renewed_at: object) -> bool:
        seen.append((worker, renewed_at))
        return worker == "b"

    d = claim("d", b_is_dead)  # b died: its share is taken over
    assert d is not None and [w for w, _ in seen] == ["b"]
    assert getattr(seen[0][1], "tzinfo", None) is not None  # compared in UTC, on both backends
    with session_scope(target.url) as s:
        assert crud.renew_remeasurement_claim(s, claim_id=d)
        assert not crud.renew_remeasurement_claim(s, claim_id=b)  # gone
        crud.drop_remeasurement_claim(s, claim_id=d)  # given up, nothing stored
    assert claim("e") is not None
    with session_scope(target.url) as s, pytest.raises(ValueError, match="wanted must be >= 1"):
        crud.claim_remeasurement(s, trial_id=trial_id, wanted=0, worker="x",
                                 is_stale=never_stale)


def test_racing_claims_are_granted_no_more_than_wanted(target: Target) -> None:
    """Eight workers claim at the same moment; three re-measurements are wanted: three win."""
    import threading

    from db.session import run_in_transaction

    rng = random.Random(23)
    with session_scope(target.url) as s:
        trial_id = _record(s, target, rng, problem=_data.problem(rng), config_key="c",
                           tflops=10.0)
    start = threading.Barrier(8)
    granted: list[int | None] = []

    def worker(n: int) -> None:
        start.wait(timeout=30)
        granted.append(run_in_transaction(target.url, lambda s: crud.claim_remeasurement(
            s, trial_id=trial_id, wanted=3, worker=f"w{n}", is_stale=lambda *_: False)))

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(granted) == 8 and sum(g is not None for g in granted) == 3
