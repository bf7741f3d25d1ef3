"""benchmarks/e2e_hf.py --smoke: a tiny Llama and a tiny sliding-window Mistral run through
"sdpa" and "tuner" (CPU here: times mean nothing) in paired rounds with an A/A floor, and
both match an fp32 eager model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.benchmarks.benchmark_scripts import BENCHMARKS

pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[hf]')")


def test_smoke_rows_and_logits(tmp_path: Path) -> None:
    out = tmp_path / "e2e.json"
    env = {**os.environ, "TUNER_DATABASE_URL": f"sqlite:///{tmp_path / 'none.db'}"}
    env.pop("TUNER_URL", None)
    done = subprocess.run([sys.executable, str(BENCHMARKS / "e2e_hf.py"), "--smoke", "--json",
                           str(out)], env=env, capture_output=True, text=True, timeout=600,
                          check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "A/A noise floor" in done.stdout
    data = json.loads(out.read_text())
    assert data["rounds"] == 3
    results = data["results"]
    assert set(results) == {"llama", "sliding"}
    assert set(results["llama"]["ratio"]) == {"prefill ms", "decode ms/token", "train step ms"}
    assert set(results["sliding"]["ratio"]) == {"prefill ms", "train step ms"}
    for row in results.values():
        for impl in ("sdpa", "tuner"):
            assert row[impl]["logits error vs fp32"] < 1e-5  # fp32 on the CPU
        for step, c in row["paired"].items():
            rounds = row["rounds_ms"][step]
            assert set(rounds) == {"sdpa", "tuner", "sdpa again"}
            assert all(len(ts) == 3 for ts in rounds.values())
            assert row["ratio"][step] == c["ratio"]["median"]
            assert sorted(rounds["tuner"])[1] == row["tuner"][step]  # the median of 3
            assert c["verdict"] == "too few rounds"  # 3 rounds: min..max is no interval

