"""Bundles carry the finalists' readings (version 2): export -> import into a fresh database
keeps the re-measurements and what each best rests on; a second import adds nothing; bundles
of version 1 still import; readings that contradict their item are refused."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from db import crud
from db.models import Remeasurement, TrialStatus
from db.session import dispose_engine, session_scope
from tests.api.serving_data import FWD, H100, bundle, item, problem
from tuner.lookup.bundle import (
    BUNDLE_VERSION,
    BundleError,
    make_bundle,
    store_bundle,
    validate_bundle,
)


def _remeasure(url: str, p: Any, *, config: dict[str, Any],
               readings: list[tuple[TrialStatus, float | None]]) -> None:
    """Re-measurements of one stored config of ``p`` on the H100 (times as multiples of its
    first reading), then its best refreshed, as a sweep's finalist round does."""
    with session_scope(url) as s:
        best = crud.best_for(s, device_key=H100.key, template_name=FWD.name,
                             template_version=FWD.version(), problem_key=FWD.problem_key(p))
        assert best is not None
        trial = crud.find_trial(s, device_id=best.device_id, template_id=best.template_id,
                                problem_key=best.problem_key, config_key=FWD.config(config).key())
        assert trial is not None and trial.median_ms and trial.tflops
        for status, factor in readings:
            ok = status == TrialStatus.OK and factor is not None
            crud.record_remeasurement(
                s, trial_id=trial.id, status=status, worker="w",
                median_ms=trial.median_ms * factor if ok else None,
                tflops=trial.tflops / factor if ok else None,
                reason="" if ok else "relative error 0.4")
        crud.refresh_best(s, device_id=best.device_id, template_id=best.template_id,
                          problem_key=best.problem_key)


def _default_config(p: Any) -> dict[str, Any]:
    return FWD.default_config(p, H100).to_dict()


@pytest.fixture
def source(tmp_path: Path) -> Iterator[str]:
    """A database of three stored bests: (a) the best and the default re-measured, the
    default once failing (disqualified: no speedup); (b) only the default re-measured (the
    best, measured once, beat every finalist's first reading); (c) nothing re-measured."""
    url = f"sqlite:///{tmp_path / 'source.db'}"
    a, b, c = problem(1024), problem(2048), problem(4096)
    items = [item(a), item(b), item(c)]
    with session_scope(url) as s:
        store_bundle(s, validate_bundle(bundle(*items)), host="gpu-a")
    _remeasure(url, a, config=items[0]["config"],
               readings=[(TrialStatus.OK, 1.10), (TrialStatus.OK, 0.97)])
    _remeasure(url, a, config=_default_config(a),
               readings=[(TrialStatus.OK, 1.0), (TrialStatus.WRONG_RESULT, None)])
    _remeasure(url, b, config=_default_config(b),
               readings=[(TrialStatus.OK, 0.9), (TrialStatus.OK, 0.95)])
    yield url
    dispose_engine(url)


def _bests(url: str) -> dict[str, tuple[Any, ...]]:
    """Per problem key: what the best row stores and what it rests on."""
    with session_scope(url, write=False) as s:
        rows = crud.list_best(s)
        readings = crud.best_readings(s, rows)
        return {r.problem_key: (r.config, r.median_ms, r.tflops, r.default_tflops, r.speedup,
                                readings[r.id].times_ms) for r in rows}


def _remeasurements(url: str) -> list[tuple[str, str, str, float | None]]:
    """Every re-measurement: problem and config of its trial, status, time."""
    with session_scope(url, write=False) as s:
        return sorted((r.trial.problem_key, r.trial.config_key, r.status.value, r.median_ms)
                      for r in s.scalars(select(Remeasurement)))


def test_a_round_trip_keeps_the_readings_and_a_second_import_adds_nothing(
        source: str, tmp_path: Path) -> None:
    with session_scope(source, write=False) as s:
        exported = make_bundle(s, host="gpu-a")
    assert exported["version"] == BUNDLE_VERSION == 2
    a, b, c = (_item_of(exported, n) for n in (1024, 2048, 4096))
    assert [r["status"] for r in a["measurements"]["remeasured"]] == ["ok", "ok"]
    assert [r["status"] for r in a["default_measurements"]["remeasured"]] == [
        "ok", "wrong_result"]
    assert "measurements" not in b and len(b["default_measurements"]["remeasured"]) == 2
    assert "measurements" not in c and "default_measurements" not in c

    target = f"sqlite:///{tmp_path / 'target.db'}"
    text = json.dumps(exported)  # what `tuner export` writes
    with session_scope(target) as s:
        summary = store_bundle(s, validate_bundle(json.loads(text)), host="gpu-a")
    assert (summary.items, summary.trials, summary.remeasurements) == (3, 6, 6)
    assert _bests(target) == _bests(source)
    assert _remeasurements(target) == _remeasurements(source)
    a_best = _bests(target)[FWD.problem_key(problem(1024))]
    assert len(a_best[-1]) == 3 and a_best[3] is None  # 3 readings; the default disqualified

    with session_scope(target) as s:
        again = store_bundle(s, validate_bundle(json.loads(text)), host="gpu-a")
    assert (again.trials, again.remeasurements, again.best_updated) == (0, 0, 0)
    with session_scope(target, write=False) as s:
        assert s.scalar(select(func.count(Remeasurement.id))) == 6
    dispose_engine(target)


def test_a_bundle_without_readings_stays_version_1(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'plain.db'}"
    with session_scope(url) as s:
        store_bundle(s, validate_bundle(bundle(item(problem(1024)))))
    with session_scope(url, write=False) as s:
        exported = make_bundle(s)
    assert exported["version"] == 1 and "measurements" not in exported["items"][0]
    dispose_engine(url)


def _with(source: str) -> dict[str, Any]:
    with session_scope(source, write=False) as s:
        return make_bundle(s)


def _item_of(data: dict[str, Any], seqlen: int) -> dict[str, Any]:
    (found,) = [i for i in data["items"] if i["problem"] == problem(seqlen).to_dict()]
    return found


def _set(data: dict[str, Any], path: str, value: Any) -> None:
    *parents, last = path.split(".")
    node: Any = _item_of(data, 1024)
    for name in parents:
        node = node[int(name)] if name.isdigit() else node[name]
    node[last] = value


@pytest.mark.parametrize(("change", "says"), [
    (lambda d: d.update(version=1), "came with bundle version 2"),
    (lambda d: _set(d, "measurements.remeasured.0.status", "timeout"),
     "which disqualifies it"),
    (lambda d: _set(d, "measurements.first_ms", 1e-3), "the median of the readings"),
    (lambda d: _set(d, "measurements.remeasured.0.median_ms", None),
     "needs median_ms and tflops"),
    (lambda d: _set(d, "measurements.remeasured.0.status", "lucky"), "status"),
    (lambda d: _set(d, "measurements.remeasured.0.tflops", -1.0),
     "measurements.remeasured.0.tflops: Input should be greater than 0"),
    (lambda d: _set(d, "measurements.first_ms", "1.5"),
     "measurements.first_ms: Input should be a valid number"),
    (lambda d: _set(d, "measurements.remeasured.0.error", float("inf")),
     "measurements.remeasured.0.error: Input should be a finite number"),
    (lambda d: _set(d, "default_tflops", None), "default_measurements need default_tflops"),
    (lambda d: _set(d, "default_config", _item_of(d, 1024)["config"]),
     "its readings go in measurements"),
    (lambda d: _set(d, "default_measurements.remeasured", [{"status": "ok"}] * 2),
     "needs median_ms"),
])
def test_readings_that_contradict_their_item_reject_the_bundle(
        source: str, change: Any, says: str) -> None:
    data = copy.deepcopy(_with(source))
    validate_bundle(data)  # as exported: fine
    change(data)
    with pytest.raises(BundleError) as err:
        validate_bundle(data)
    assert says in str(err.value)
    if says != "came with bundle version 2":
        index = data["items"].index(_item_of(data, 1024))
        assert err.value.index == index


def test_an_upload_stores_the_readings(source: str, client: TestClient,
                                       auth: dict[str, str]) -> None:
    exported = _with(source)
    r = client.post("/v1/results", json=exported, headers=auth)
    assert r.status_code == 201, r.text
    assert r.json() == {"items": 3, "trials": 6, "best_updated": 3, "remeasurements": 6}
    rows = {row["problem_key"]: row for row in client.get("/v1/configs").json()["items"]}
    assert rows[FWD.problem_key(problem(1024))]["readings"] == 3
    assert rows[FWD.problem_key(problem(2048))]["readings"] == 1  # only its default re-measured
