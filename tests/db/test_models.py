"""The schema's own guarantees, on each backend: unique keys, foreign keys, statuses, JSON."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from db.models import BestConfig, Device, Sweep, Template, Trial, TrialStatus
from db.session import get_sessionmaker, session_scope
from tests.db import _data


def _device(rng: random.Random, key: str) -> Device:
    info = _data.device_info(rng, key)
    del info["smem_per_block"]  # not a column
    return Device(**info)


def _trial(device_id: int, template_id: int, rng: random.Random, **over: object) -> Trial:
    values: dict[str, object] = {
        "device_id": device_id, "template_id": template_id, "problem_key": "pk",
        "problem": _data.problem(rng), "config_key": "ck", "config": _data.config(rng),
        "status": TrialStatus.OK, "median_ms": rng.uniform(0.1, 5), "tflops": rng.uniform(1, 500),
    }
    values.update(over)
    return Trial(**values)


@pytest.fixture
def seeded(db_url: str) -> tuple[str, int, int]:
    rng = random.Random(1)
    with session_scope(db_url) as s:
        device, template = _device(rng, "dev-a"), Template(name="flash_fwd", version="v1")
        s.add_all([device, template])
        s.flush()
        return db_url, device.id, template.id


def _fails_to_flush(db_url: str, build: Callable[[Session], object]) -> IntegrityError:
    with get_sessionmaker(db_url)() as s:
        s.add(build(s))
        with pytest.raises(IntegrityError) as caught:
            s.flush()
        s.rollback()
    return caught.value


def test_device_key_is_unique(seeded: tuple[str, int, int]) -> None:
    url, _, _ = seeded
    _fails_to_flush(url, lambda s: _device(random.Random(2), "dev-a"))


def test_template_name_and_version_are_unique_together(seeded: tuple[str, int, int]) -> None:
    url, _, _ = seeded
    _fails_to_flush(url, lambda s: Template(name="flash_fwd", version="v1"))
    with session_scope(url) as s:
        s.add(Template(name="flash_fwd", version="v2"))
    with session_scope(url, write=False) as s:
        assert sorted(s.scalars(select(Template.version))) == ["v1", "v2"]


def test_trial_identity_is_unique(seeded: tuple[str, int, int]) -> None:
    url, device_id, template_id = seeded
    rng = random.Random(3)
    with session_scope(url) as s:
        s.add(_trial(device_id, template_id, rng))
    _fails_to_flush(url, lambda s: _trial(device_id, template_id,
                                          rng, status=TrialStatus.TIMEOUT))
    with session_scope(url) as s:  # another config of the same problem is a new trial
        s.add(_trial(device_id, template_id, rng,
                     config_key="ck2"))
    with session_scope(url, write=False) as s:
        assert len(s.scalars(select(Trial)).all()) == 2


def test_best_config_is_unique_per_problem(seeded: tuple[str, int, int]) -> None:
    url, device_id, template_id = seeded

    def best(_: Session) -> BestConfig:
        return BestConfig(device_id=device_id, template_id=template_id, problem_key="pk",
                          problem={"dtype": "float16"}, dtype="float16", variant="dense",
                          config={"BLOCK_M": 64}, median_ms=1.5, tflops=100.0)

    with session_scope(url) as s:
        s.add(best(s))
    _fails_to_flush(url, best)


def test_foreign_keys_are_enforced(seeded: tuple[str, int, int]) -> None:
    url, device_id, template_id = seeded
    rng = random.Random(4)
    _fails_to_flush(url, lambda s: _trial(device_id, template_id,
                                          rng, sweep_id=987654))


def test_statuses_round_trip_as_enums_and_unknown_ones_are_refused(
        seeded: tuple[str, int, int]) -> None:
    url, device_id, template_id = seeded
    rng = random.Random(5)
    with session_scope(url) as s:
        for n, status in enumerate(TrialStatus):
            s.add(_trial(device_id, template_id, rng,
                         config_key=f"c{n}", status=status))
        s.add(Sweep(name="s", spec={}, host="h"))
    with session_scope(url, write=False) as s:
        stored = {t.config_key: t.status for t in s.scalars(select(Trial))}
        assert stored == {f"c{n}": status for n, status in enumerate(TrialStatus)}
        assert all(type(v) is TrialStatus for v in stored.values())
        assert s.scalars(select(Sweep.status)).one() == "running"
    # The migration's CHECK keeps a raw string that is no status out of the table.
    _fails_to_flush(url, lambda s: _trial(device_id, template_id,
                                          rng, config_key="bad", status="exploded"))


def test_json_columns_round_trip(seeded: tuple[str, int, int]) -> None:
    url, device_id, template_id = seeded
    rng = random.Random(6)
    problem = _data.problem(rng, causal="bottom_right", mask="random:0.10")
    config = {**_data.config(rng), "ratio": rng.random(), "flag": True, "none": None,
              "nested": {"list": [rng.randint(-9, 9) for _ in range(5)], "text": "ünï ✓"}}
    with session_scope(url) as s:
        s.add(_trial(device_id, template_id, rng,
                     problem=problem, config=config))
        space = {"properties": {"BLOCK_M": {"enum": [32, 64, 128]}}, "additionalProperties": False}
        s.add(Template(name="flash_bwd", version="v9", space=space))
    with session_scope(url, write=False) as s:
        trial = s.scalars(select(Trial)).one()
        assert trial.problem == problem and trial.config == config
        assert s.scalars(select(Template.space).where(Template.name == "flash_bwd")).one() == space
        assert trial.created_at is not None
