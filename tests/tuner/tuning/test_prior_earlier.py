"""The transfer prior after a kernel change: a sweep measures the bucket's best under the
kernel's last version, from the database or from the package's shipped table of this GPU
model, right after the default (tuner.tuning.search.prior). A scripted runner stands in for the
trial workers (tests/tuner/tuning/test_head_to_head.py)."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from db.session import dispose_engine
from templates import Problem, current_device, get_template
from tests.tuner.tuning.test_head_to_head import ScriptedRunner
from tests.tuner.tuning.test_sweep_budget import SHAPE, stored_trials, sweep
from tuner.lookup.resolver import ConfigResolver, set_resolver
from tuner.lookup.shipped import file_name
from tuner.lookup.shipped.table import SHIPPED_FORMAT, ShippedDevice, ShippedRecord, ShippedTable
from tuner.settings import load_settings
from tuner.tuning.search.prior import shipped_bests

pytestmark = pytest.mark.usefixtures("no_tuned_configs")

OLD = "0123456789abcdef"  # a kernel version before the installed one
PROBLEM = Problem(batch=SHAPE["B"], heads_q=SHAPE["H"], heads_kv=SHAPE["H"], seqlen_q=SHAPE["N"],
                  seqlen_kv=SHAPE["N"], head_dim=SHAPE["D"], dtype="float16")


def flash_sweep(url: str, script: list[float], trials: int) -> Any:
    return sweep(url, ScriptedRunner({"flash_fwd": script}), templates=("flash_fwd",),
                 trials=trials, finalists=0, head_to_head_rounds=0)


def old_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(type(get_template("flash_fwd")), "version", lambda self: OLD)


def test_the_buckets_best_under_the_last_kernel_version_is_measured_after_the_default(
        db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with monkeypatch.context() as m:
        old_kernel(m)
        report = flash_sweep(db_url, [2.0, 1.0, 3.0], trials=3)  # the second config fastest
    old_best = report.problems[0].best_config
    first = stored_trials(db_url)
    assert old_best is not None and old_best != first[0][1]  # not the default
    # The installed version: a new study; its default, then the old version's best.
    flash_sweep(db_url, [1.0], trials=2)
    here = [config for _, config in stored_trials(db_url)[len(first):]]
    assert here[:2] == [first[0][1], old_best], here


def test_the_shipped_tables_config_of_the_bucket_is_measured_after_the_default(
        db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A table of the last version, made from a sweep on another database.
    other = f"sqlite:///{tmp_path / 'measured.db'}"
    with monkeypatch.context() as m:
        old_kernel(m)
        report = flash_sweep(other, [2.0, 1.0, 3.0], trials=3)
    dispose_engine(other)
    shipped_config = report.problems[0].best_config
    default_config = stored_trials(other)[0][1]
    assert shipped_config is not None and shipped_config != default_config
    device = current_device()
    template = get_template("flash_fwd")
    folder = tmp_path / "shipped"
    folder.mkdir()
    table = ShippedTable(
        format=SHIPPED_FORMAT, version=1, device=ShippedDevice.of(device), suite="test",
        source="test", generated_at=datetime.now(UTC), records=[ShippedRecord(
            template="flash_fwd", template_version=OLD, problem=report.problems[0].problem,
            config=shipped_config, tflops=100.0, median_ms=1.0, readings=2,
            head_to_head=False)])
    (folder / file_name(device.name)).write_text(table.to_json())
    set_resolver(ConfigResolver(load_settings(database_url=db_url, url=None),
                                shipped_dir=folder))
    assert [b.config for b in shipped_bests(table, template, device.key)] == [shipped_config]

    flash_sweep(db_url, [1.0], trials=2)  # a fresh database, the installed version
    here = [config for _, config in stored_trials(db_url)]
    assert here[:2] == [default_config, shipped_config], here


def test_a_shipped_record_whose_problem_no_longer_validates_is_left_out() -> None:
    device = current_device()
    template = get_template("flash_fwd")
    good = ShippedRecord(template="flash_fwd", template_version=OLD,
                         problem=PROBLEM.to_dict(),
                         config=template.default_config(PROBLEM, device).to_dict(),
                         tflops=1.0, median_ms=1.0, readings=1, head_to_head=False)
    bad = good.model_copy(update={"problem": {**good.problem, "head_dim": -1}})
    elsewhere = good.model_copy(update={"template": "torch_sdpa"})
    table = ShippedTable(format=SHIPPED_FORMAT, version=1, device=ShippedDevice.of(device),
                         suite="test", source="test", generated_at=datetime.now(UTC),
                         records=[good, bad, elsewhere])
    rows = shipped_bests(table, template, device.key)
    assert [(r.problem, r.template, r.device_key) for r in rows] == [
        (good.problem, "flash_fwd", device.key)]
    assert shipped_bests(None, template, device.key) == []

