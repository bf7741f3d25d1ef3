"""``tuner best`` says what each stored best rests on: how many readings its median is of (the
first and the OK re-measurements) and their spread, in the table and in --json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from db.session import dispose_engine
from tests.api.readings_data import SPREAD, seed_bests
from tests.api.serving_data import FWD, H100
from tests.tuner.cli.test_sweep_cli import cli
from tests.tuner.piped_table import piped_table


def test_best_shows_the_readings_and_their_spread(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'tuner.db'}"
    seeded = seed_bests(url)
    code, out, err = cli("best", "--device", H100.key, "--db", url, "--json")
    assert code == 0, err
    items = {it["problem_key"]: it for it in json.loads(out)}
    once = items[FWD.problem_key(seeded.once)]
    assert once["readings"] == 1 and once["spread"] is None
    again = items[FWD.problem_key(seeded.again)]
    assert again["readings"] == 3 and again["spread"] == pytest.approx(SPREAD)

    code, out, _ = cli("best", "--device", H100.key, "--db", url)
    assert code == 0
    header, rows = piped_table(out, "problem")
    assert header == ["problem", "TFLOP/s", "readings (spread)", "default", "speedup", "config"]
    assert sorted(row[2] for row in rows) == ["1", f"3 ({SPREAD * 100:.1f}%)"]
    dispose_engine(url)
