"""benchmarks/fleet.py end to end on the CPU: a synthetic recording (tuner.record's format) of
toy problems, two interpreter workers on a scratch PostgreSQL database, one SIGKILLed mid-run:
every problem is finished, nothing is measured twice or lost, the killed worker's claim is
finished by the other. Skipped when no PostgreSQL server answers (tests/db/conftest.py's)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import sqlalchemy as sa

from tests.benchmarks.benchmark_scripts import BENCHMARKS
from tests.db.conftest import _connectable, _postgres_candidates
from tuner.tuning.suites import load_spec_file

TOY = ["--template-modules", '["tests.tuner.toy_templates"]']


def server_url() -> str:
    for url in _postgres_candidates():
        if _connectable(url) is None:
            return url.render_as_string(hide_password=False)
    pytest.skip("PostgreSQL server unreachable (set TUNER_TEST_POSTGRES_URL)")


def fleet(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [
        str(BENCHMARKS.parent), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, str(BENCHMARKS / "fleet.py"), *args], env=env,
                          capture_output=True, text=True, timeout=timeout, check=False)


def test_the_synthetic_recording_has_64_buckets_in_tuner_records_format(tmp_path: Path) -> None:
    done = fleet("--make-recording", str(tmp_path / "job.toml"), "--template", "toy_add", *TOY)
    assert done.returncode == 0, done.stderr
    spec = load_spec_file(tmp_path / "job.toml")
    assert len(spec.problems) == 64 and spec.templates == ("toy_add",)
    assert len({p.bucket_key() for p in spec.problems}) == 64


def test_two_workers_one_killed_finish_every_problem_without_duplicates(tmp_path: Path) -> None:
    server = server_url()
    recording = tmp_path / "job.toml"
    done = fleet("--make-recording", str(recording), "--template", "toy_add", "--problems", "6",
                 *TOY)
    assert done.returncode == 0, done.stderr
    out = tmp_path / "fleet.json"
    done = fleet("--recording", str(recording), *TOY, "--db", server, "--workers", "2",
                 "--kill", "1", "--trials", "2", "--lease", "4", "--heartbeat", "1",
                 "--poll", "0.5", "--max-seconds", "180", "--json", str(out))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["label"] == "cpu-interpreter: not GPU timings"
    [run] = report["runs"]
    assert (run["workers"], run["problems"], run["done"], run["settled"]) == (2, 6, 6, True)
    assert run["duplicate_measurements"] == 0 and run["duplicated_configs"] == []
    assert run["claims_stuck"] == 0 and run["claims_lost"] == 0
    assert run["measured"] == run["stored_trials"] == 12  # 2 configs x 6 problems, once each
    [(victim, killed)] = run["killed"].items()
    assert killed["held"] and all(by not in ("", victim)
                                  for by in killed["finished_by"].values())
    assert run["killed_problems_finished_by_others"] and run["nothing_measured_lost"]
    assert set(map(int, killed["held"])) <= set(run["taken_over"])
    # The scratch database is gone.
    engine = sa.create_engine(server, poolclass=sa.NullPool)
    with engine.connect() as c:
        left = c.scalars(sa.text("SELECT datname FROM pg_database WHERE datname LIKE "
                                 "'fleet\\_%\\_n2'")).all()
    engine.dispose()
    assert left == []
