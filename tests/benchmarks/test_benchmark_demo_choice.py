"""benchmarks/demo_choice.py, the end of `make demo`: after a sweep of SDPA beside ours, it
shows what tuner.attention runs per problem (on the CPU the choice only)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.benchmarks.benchmark_scripts import load_benchmark_script
from tests.tuner.tuning.test_head_to_head import ScriptedRunner
from tuner.lookup.resolver import set_resolver
from tuner.tuning.suites import load_spec_file
from tuner.tuning.sweep import SweepOptions, run_sweep

pytestmark = pytest.mark.usefixtures("no_tuned_configs")


def test_the_demo_shows_tuner_attention_choosing_what_the_sweep_measured_faster(
        tmp_path: Path, db_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    spec = tmp_path / "demo.toml"
    spec.write_text('name = "demo"\ntemplates = ["torch_sdpa", "flash_fwd"]\n'
                    'dtypes = ["float16"]\ncausal = ["none", "top_left"]\n'
                    'shapes = [{B = 1, H = 2, N = 32, D = 16}]\n')
    # Ours measured twice as fast as torch SDPA, in the searches and side by side.
    run_sweep(load_spec_file(spec), SweepOptions(trials=1, seed=1), db_url=db_url,
              make_runner=ScriptedRunner({"torch_sdpa": [2.0], "flash_fwd": [1.0]}))
    demo = load_benchmark_script("demo_choice")
    out = tmp_path / "choice.json"
    try:
        assert demo.main([str(spec), "--db", db_url, "--json", str(out)]) == 0
    finally:
        set_resolver(None)
    rows = json.loads(out.read_text())["rows"]
    assert [(r["problem"]["causal"], r["implementation"]) for r in rows] == [
        ("none", "flash"), ("top_left", "flash")]
    printed = capsys.readouterr().out
    assert "tuner.attention runs flash" in printed and "the choice only" in printed
