"""``tuner best --shape`` (issue 20, item 6): without --dtype it matches every dtype, and an
empty answer says what the database does hold: the same bucket on other devices, or this
device's rows for other shapes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from db.session import dispose_engine, session_scope
from tests.api.serving_data import H100, bundle, interpreter, item, problem
from tests.tuner.cli.test_sweep_cli import cli
from tuner.cli.common import console
from tuner.lookup.bundle import store_bundle, validate_bundle

HERE_SHAPE = "B=4,H=16,N=1024,D=128"  # stored here, in float16 only
H100_SHAPE = "B=4,H=16,N=2048,D=128"  # stored on the H100 only
NOWHERE_SHAPE = "B=4,H=16,N=8192,D=128"


@pytest.fixture
def db(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path / 'tuner.db'}"
    with session_scope(url) as s:
        store_bundle(s, validate_bundle(bundle(
            item(problem(1024, dtype="float16"), device=interpreter()),
            item(problem(2048), device=H100))))
    yield url
    dispose_engine(url)


def best(db: str, *args: str) -> tuple[int, str]:
    code, out, err = cli("best", "--db", db, *args)
    assert code == 0, err
    return code, " ".join(out.split())


def test_a_shape_without_dtype_finds_the_float16_best(db: str) -> None:
    _, out = best(db, "--shape", HERE_SHAPE, "--json")
    assert [it["dtype"] for it in json.loads(out)] == ["float16"]
    _, out = best(db, "--shape", HERE_SHAPE, "--dtype", "bfloat16", "--json")
    assert json.loads(out) == []


def test_an_empty_answer_points_at_other_devices_only_when_they_hold_the_bucket(
        db: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(console, "width", 400)
    _, out = best(db, "--shape", H100_SHAPE)
    assert "no best config for the --shape bucket stored for device" in out
    assert f"1 on other devices ({H100.name}): add --all" in out
    _, out = best(db, "--shape", H100_SHAPE, "--all", "--json")
    assert [it["device_name"] for it in json.loads(out)] == [H100.name]
    # Before: "(1 for other devices: add --all)", counting this device's other shapes.
    _, out = best(db, "--shape", NOWHERE_SHAPE, "--dtype", "float16")
    assert "1 stored on this device for other shapes: drop --shape to list them" in out
    assert "--all" not in out


def test_an_empty_database_says_to_sweep(tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(console, "width", 400)
    url = f"sqlite:///{tmp_path / 'empty.db'}"
    try:
        _, out = best(url, "--shape", HERE_SHAPE)
        assert out.endswith("(run `tuner sweep` first)")
        _, out = best(url)
        assert out.startswith("no best configs stored for device")
    finally:
        dispose_engine(url)
