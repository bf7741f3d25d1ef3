"""benchmarks/dispatch_bench.py --smoke: every row's candidates are checked and timed (on the
CPU interpreter here: the numbers mean nothing), and the JSON says what ran and was chosen."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.benchmarks.benchmark_scripts import BENCHMARKS


def test_smoke_rows_time_every_candidate_and_record_the_choice(tmp_path: Path) -> None:
    out = tmp_path / "dispatch.json"
    env = {k: v for k, v in os.environ.items() if k != "TUNER_URL"}
    done = subprocess.run([sys.executable, str(BENCHMARKS / "dispatch_bench.py"), "--smoke",
                           "--rounds", "2", "--train-rounds", "5", "--shipped", "off",
                           "--json", str(out)],
                          env=env, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "worst vs sdpa" in done.stdout and "geomean vs sdpa" in done.stdout
    assert "A/A noise floor" in done.stdout and "verdicts: " in done.stdout
    results = json.loads(out.read_text())
    assert results["timings_are_gpu_timings"] is False
    assert results["db"] is None and results["shipped"] == "off"  # the untuned state
    rows = results["rows"]
    assert [r["training"] for r in rows] == [False, False, True]
    for row in rows:
        # Every candidate passed its check, but the Hopper-only Gluon kernel, refused here.
        assert set(row["errors"]) <= {"gluon"}, row["errors"]
        assert all("cannot run" in why for why in row["errors"].values())
        # No database, no shipped table: torch SDPA, as the user had it.
        assert row["chosen"].startswith("sdpa ")
        names = set(row["ms"])
        assert {"sdpa", "sdpa again", "flash", "tuner.attention"} <= names
        assert all(t > 0 for name, t in row["ms"].items() if name not in row["errors"])
        assert row["vs_sdpa"] == row["ms"]["sdpa"] / row["ms"]["tuner.attention"]
        # every timed candidate once a round; the pairs: tuner.attention / sdpa per round
        rounds = 5 if row["training"] else 2
        assert set(row["rounds_ms"]) == set(row["ms"]) - set(row["errors"])
        assert all(len(ts) == rounds for ts in row["rounds_ms"].values())
        ratios = sorted(t / s for s, t in zip(row["rounds_ms"]["sdpa"],
                                              row["rounds_ms"]["tuner.attention"], strict=True))
        assert row["paired"]["ratio"]["median"] == pytest.approx(ratios[rounds // 2]
                                                                 if rounds % 2 else
                                                                 sum(ratios) / 2)
        assert row["paired"]["verdict"] in (("faster", "same within noise", "slower")
                                            if row["training"] else ("too few rounds",))
    assert "decode" in rows[1]["ms"] and "decode" not in rows[2]["ms"]
