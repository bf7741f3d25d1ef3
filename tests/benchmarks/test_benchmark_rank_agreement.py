"""benchmarks/rank_agreement.py on the CPU: a torchrun job of 3 gloo ranks resolves the
implementation and configs of a recording's problems pinned to a snapshot and through a live
`tuner serve`, while new bests are stored mid-job; the gathered choices agree across ranks and
do not change under the job (TUNER_REFRESH=off), though the database did change."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.benchmarks.benchmark_scripts import BENCHMARKS


def run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [
        str(BENCHMARKS.parent), os.environ.get("PYTHONPATH")]))}
    env.pop("TUNER_URL", None)
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True,
                          timeout=240, check=False)


def test_three_ranks_agree_pinned_and_live_while_a_worker_stores_new_bests(
        tmp_path: Path) -> None:
    recording = tmp_path / "job.toml"
    done = run(str(BENCHMARKS / "fleet.py"), "--make-recording", str(recording), "--shapes",
               "cpu", "--problems", "12", "--template", "flash_fwd")
    assert done.returncode == 0, done.stderr
    out = tmp_path / "ranks.json"
    done = run(str(BENCHMARKS / "rank_agreement.py"), "--recording", str(recording),
               "--ranks", "3", "--json", str(out))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert (report["ranks"], report["problems"]) == (3, 12)
    assert report["agree"] == {"pinned": True, "live": True, "again": True}
    assert report["unchanged_under_the_job"] and report["pinned_equals_live_before_the_store"]
    assert report["pinned_sources"] == ["snapshot"]
    # The seeded bests make both implementations win somewhere; the mid-job store changed
    # what a fresh process would run.
    assert set(report["implementations"]) == {"flash", "sdpa"}
    assert report["changed_in_database_after"] > 0
