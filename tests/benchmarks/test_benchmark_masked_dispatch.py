"""benchmarks/masked_dispatch_bench.py --smoke: one tiny block-mask row on the CPU (compiled
FlexAttention through Inductor's CPU codegen, ours under the interpreter), every candidate
checked against the reference and timed (the numbers mean nothing), and the JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.benchmarks.benchmark_scripts import BENCHMARKS, load_benchmark_script


def test_gluon_is_a_candidate_of_inference_rows_where_it_runs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    bench = load_benchmark_script("masked_dispatch_bench")
    assert not bench.gluon_runs("cpu")
    assert "gluon" not in bench.candidates("cpu", False)
    monkeypatch.setattr(bench, "gluon_runs", lambda device: True)  # a Hopper GPU with Gluon
    assert list(bench.candidates("cuda", False)) == [
        "flash", "flex", "gluon", "flash again", "tuner.attention"]
    assert "gluon" not in bench.candidates("cuda", True)  # its backward takes no block mask
    row = bench.Row({}, False, "row", ms={"flash": 2.0, "flex": 3.0, "gluon": 1.0,
                                          "flash again": 2.0, "tuner.attention": 1.0})
    assert row.verdicts() == {"vs_flash": 2.0, "vs_best": 1.0}  # gluon is a single candidate


@pytest.mark.slow
def test_smoke_row_checks_and_times_ours_flex_and_the_choice(tmp_path: Path) -> None:
    out = tmp_path / "masked.json"
    env = {k: v for k, v in os.environ.items() if k != "TUNER_URL"}
    done = subprocess.run([sys.executable, str(BENCHMARKS / "masked_dispatch_bench.py"),
                           "--smoke", "--rounds", "2", "--json", str(out)],
                          env=env, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(out.read_text())
    assert results["timings_are_gpu_timings"] is False
    [row] = results["rows"]
    assert row["errors"] == {}, row["errors"]
    assert set(row["ms"]) == {"flash", "flex", "flash again", "tuner.attention"}
    assert all(ms is not None and ms > 0 for ms in row["ms"].values())
    assert row["chosen"].startswith("flash")
