"""benchmarks/e2e_softcap.py: its sweep spec names the model's softcapped problems (no
transformers needed), and --smoke runs a tiny Gemma 2 through "eager" and "tuner" where
transformers is installed (CPU here: times mean nothing)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.benchmarks.benchmark_scripts import BENCHMARKS, load_benchmark_script
from tuner.tuning.suites import spec_from_mapping

SCRIPT = load_benchmark_script("e2e_softcap")


def test_the_tune_spec_is_the_models_softcapped_problems() -> None:
    text = SCRIPT.tune_spec(SCRIPT.GEMMA2, SCRIPT.SIZES)
    spec = spec_from_mapping(tomllib.loads(text), source="e2e_softcap")
    keys = sorted(p.key() for p in spec.problems)
    assert keys == ["b1-hq16-hkv8-q8192-kv8192-d256-bfloat16-causal-top_left+softcap50",
                    "b1-hq16-hkv8-q8192-kv8192-d256-bfloat16-sparse-sliding_causal:4096"
                    "+softcap50"]
    assert {"flash_fwd", "flash_bwd", "torch_eager", "torch_eager_train"} <= set(
        spec.templates)


def test_smoke_rows_and_logits(tmp_path: Path) -> None:
    pytest.importorskip("transformers", reason="transformers is not installed")
    out = tmp_path / "softcap.json"
    env = {**os.environ, "TUNER_DATABASE_URL": f"sqlite:///{tmp_path / 'none.db'}"}
    env.pop("TUNER_URL", None)
    done = subprocess.run([sys.executable, str(BENCHMARKS / "e2e_softcap.py"), "--smoke",
                           "--force", "flash", "--json", str(out)], env=env,
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads(out.read_text())
    row = data["results"]
    assert set(row["speedup over eager"]) == {"prefill ms", "train step ms"}
    assert data["tuner runs"]["inference"].startswith("flash")
    for impl in ("eager", "tuner"):
        assert row[impl]["logits error vs fp32"] < 1e-5  # fp32 on the CPU
