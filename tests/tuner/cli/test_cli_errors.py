"""What a new user met in a fresh clone (issue 20): a database that cannot be opened, a bad
TUNER_LOG_LEVEL, a SQLite path in a missing folder and piped tables are answered by the one
error path (error:, fix:, exit 2) or printed whole, never a traceback or a silent guess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from db.session import dispose_engine
from tests.api.readings_data import seed_bests
from tests.api.serving_data import H100
from tests.tuner.cli.test_sweep_cli import cli
from tuner.settings import get_settings

ROOT = Path(__file__).resolve().parents[3]
UNREACHABLE = "postgresql+psycopg://nobody:s3cret-pass@127.0.0.1:1/tuner"  # port 1: refused


@pytest.fixture(autouse=True)
def fresh_settings() -> None:
    get_settings.cache_clear()  # the settings are read once per process: read this test's


@pytest.mark.parametrize("command", [
    ["best"],
    ["sweep", "--shape", "B=1,H=1,N=16,D=16", "--trials", "1"],
    ["serve", "--port", "8123"],
])
def test_an_unreachable_database_is_an_error_with_a_fix(command: list[str],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    import uvicorn

    monkeypatch.setattr(uvicorn, "run", lambda *a, **kw: pytest.fail("served without a db"))
    code, out, err = cli(*command, "--db", UNREACHABLE)
    assert code == 2, err
    assert "error: cannot open the database postgresql+psycopg://nobody:***@127.0.0.1:1/tuner" \
        in " ".join(err.split())
    assert "fix: start the PostgreSQL server" in err and "Traceback" not in err + out
    assert "s3cret-pass" not in err


def test_a_sqlite_file_in_a_missing_folder_is_refused(tmp_path: Path) -> None:
    missing = tmp_path / "no" / "such"
    code, out, _ = cli("best", "--db", f"sqlite:///{missing / 'x.db'}", "--json")
    assert code == 2
    error = json.loads(out)
    assert f"folder that does not exist ({missing})" in error["error"]
    assert f"mkdir -p {missing}" in error["fix"]
    assert not missing.parent.exists()  # nothing created


def test_a_bad_log_level_names_that_variable(monkeypatch: pytest.MonkeyPatch,
                                             tmp_path: Path) -> None:
    monkeypatch.setenv("TUNER_LOG_LEVEL", "LOUD")
    code, out, err = cli("best", "--db", f"sqlite:///{tmp_path / 't.db'}", "--json")
    assert code == 2
    error = json.loads(out)
    assert "TUNER_LOG_LEVEL" in error["error"] and "DEBUG, INFO, WARNING" in error["error"]
    assert error["fix"].startswith("correct or unset TUNER_LOG_LEVEL") and "--db" not in error["fix"]


def python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("TUNER_")}
    return subprocess.run([sys.executable, "-c", code], env={**clean, **env, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=300, cwd=ROOT)


LOGS = ("import logging, tuner\n"
        "logging.getLogger('tuner.lookup.resolver').debug('resolved from the database')\n"
        "logging.getLogger('db.session').info('opened')\n")


@pytest.mark.slow
def test_the_log_level_reaches_the_library() -> None:
    shown = python(LOGS, TUNER_LOG_LEVEL="debug")
    assert shown.returncode == 0, shown.stderr
    assert "DEBUG tuner.lookup.resolver: resolved from the database" in shown.stderr
    assert "INFO db.session: opened" in shown.stderr
    unset = python(LOGS)  # a library leaves logging to its application
    assert unset.returncode == 0 and "resolved from the database" not in unset.stderr


@pytest.mark.slow
def test_piped_tables_keep_each_config_on_one_line(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'b.db'}"
    seed_bests(url)
    dispose_engine(url)
    done = subprocess.run([sys.executable, "-m", "tuner.cli.app", "best", "--db", url,
                           "--device", H100.key], capture_output=True, text=True, timeout=300,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    rows = [line for line in done.stdout.splitlines() if "bfloat16" in line]
    assert len(rows) == 2  # one line per stored config, not fragments
    assert all("warp_specialize=False" in row and "use_tma=" in row for row in rows)
