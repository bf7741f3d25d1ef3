"""benchmarks/bwd_passes_bench.py --smoke: every launch shape of the backward's preprocess
(zeroing the dQ accumulator or not) and of the dq cast runs under the interpreter and is
checked against torch before it is "timed"; the JSON lists them, the current shapes marked."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.benchmarks.benchmark_scripts import BENCHMARKS


def test_smoke_checks_every_launch_shape(tmp_path: Path) -> None:
    out = tmp_path / "passes.json"
    done = subprocess.run([sys.executable, str(BENCHMARKS / "bwd_passes_bench.py"), "--smoke",
                           "--rows", "32,64", "--warps", "4", "--json", str(out)],
                          env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True,
                          text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    passes = {(r["pass"], r["rows"]) for r in rows}
    assert passes == {(name, n) for n in (32, 64) for name in (
        "preprocess (zeroes dQ)", "preprocess + torch.zeros", "dq cast")}
    current = [r for r in rows if r["current"]]
    assert {r["pass"] for r in current} == {"preprocess (zeroes dQ)", "dq cast"}
    assert all(r["rows"] == 64 and r["warps"] == 4 for r in current)
