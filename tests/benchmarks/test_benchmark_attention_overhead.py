"""benchmarks/attention_overhead.py --smoke: the three forward paths, the three decode paths
and the training rows (forward + backward, dense causal and a block mask) run (on the CPU
interpreter here), agree, and come out as the tables' rows and the JSON's numbers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.benchmarks.benchmark_scripts import BENCHMARKS

SCRIPT = BENCHMARKS / "attention_overhead.py"
PATHS = ("launch plan", "flash_attention_fwd", "tuner.attention")
SDPA_PATHS = ("torch SDPA", "tuner.attention -> SDPA")
DECODE_PATHS = ("decode plan", "tuner.decode", "tuner.attention")
TRAIN_PATHS = ("flash entry points", "flash_attention", "tuner.attention",
               "flash entry points, unplanned backward")


def test_smoke_run_prints_the_three_paths_and_their_overheads(tmp_path: Path) -> None:
    out = tmp_path / "overhead.json"
    env = {**os.environ, "TUNER_DATABASE_URL": f"sqlite:///{tmp_path / 'none.db'}"}
    env.pop("TUNER_URL", None)  # no service: the config is the default, resolved once
    done = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--json", str(out)],
                          env=env, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    for label in ("(a) launch plan", "(b) flash_attention_fwd", "(c) tuner.attention",
                  "(b) - (a)", "(c) - (a)", *SDPA_PATHS, "dispatch over SDPA"):
        assert any(line.startswith(label) for line in lines), (label, done.stdout)
    assert "target (c) - (a) <= 10 us" in done.stdout
    assert "(a) decode plan" in done.stdout and "target (b), (c) - (a) <= 10 us" in done.stdout

    results = json.loads(out.read_text())
    on_cpu = results["device"].startswith("cpu")  # real launches are timed on CUDA only
    timings = ["host"] if on_cpu else ["host", "enqueue", "synced"]
    assert list(results["us_per_call"]) == timings
    for timing in timings:
        row = results["us_per_call"][timing]
        assert list(row) == [*PATHS, *SDPA_PATHS] and all(x > 0 for x in row.values())
        assert results["sdpa_overhead_us"][timing] == round(
            row[SDPA_PATHS[1]] - row[SDPA_PATHS[0]], 3)
        assert results["overhead_us"][timing] == {
            name: round(row[name] - row["launch plan"], 3) for name in PATHS[1:]}
        assert results["meets_target"][timing] == (
            results["overhead_us"][timing]["tuner.attention"] <= results["target_us"])
        assert all(len(runs) == results["rounds"]
                   for runs in results["rounds_us"][timing].values())
    assert results["config_source"] == "default" and results["target_us"] == 10.0

    decode = results["decode"]
    assert decode["shape"] == "1,4,2,64,16" and decode["config_source"] == "default"
    for timing in timings:
        row = decode["us_per_call"][timing]
        assert list(row) == list(DECODE_PATHS) and all(x > 0 for x in row.values())
        assert decode["overhead_us"][timing] == {
            name: round(row[name] - row["decode plan"], 3) for name in DECODE_PATHS[1:]}
        assert decode["meets_target"][timing] == all(
            x <= results["target_us"] for x in decode["overhead_us"][timing].values())

    train = results["train"]
    assert train["shape"] == "1,2,32,16" and train["mask"].startswith("sliding_causal:")
    assert list(train["cases"]) == ["dense causal", "block mask"]
    for case in train["cases"].values():
        for timing in timings:
            row = case["us_per_call"][timing]
            assert list(row)[:4] == list(TRAIN_PATHS) and all(x > 0 for x in row.values())
            assert case["dispatch_over_entry_us"][timing]["flash"] == round(
                row["tuner.attention"] - row["flash entry points"], 3)
    # torch's own SDPA step beside ours, dense only (SDPA takes no block mask).
    dense, masked = train["cases"].values()
    assert all(dense["us_per_call"][t]["torch SDPA"] > 0 for t in timings)
    assert all("torch SDPA" not in masked["us_per_call"][t] for t in timings)
    assert any(line.startswith("torch SDPA ") for line in lines)
    assert "train: block mask (us/step)" in done.stdout
