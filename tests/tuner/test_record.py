"""tuner.record / TUNER_RECORD: the problems a job ran, written as a sweep spec that tunes
exactly them (issue 18, item 3). Tiny shapes on the interpreter without a GPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tuner
from templates.base import Problem
from tests.tuner.test_sweep_cli import cli
from tuner.errors import TunerError
from tuner.suites import load_spec_file

pytestmark = pytest.mark.usefixtures("no_tuned_configs")


def run_a_tiny_job(device: str) -> None:
    q = torch.randn(1, 4, 32, 16, device=device, dtype=torch.float16)
    kv = torch.randn(1, 2, 32, 16, device=device, dtype=torch.float16)
    for _ in range(3):  # repeated calls are one problem
        tuner.attention(q, kv, kv, is_causal=True, enable_gqa=True)
    tuner.attention(q[:, :, :1], kv, kv, enable_gqa=True)  # a decode-shaped call
    lengths = torch.tensor([20], dtype=torch.int32, device=device)
    tuner.decode(q[:, :, :1], kv, kv, cache_seqlens=lengths)


def test_a_recorded_job_becomes_a_spec_of_exactly_its_problems(tmp_path: Path,
                                                               device: str) -> None:
    path = tmp_path / "job.toml"
    with tuner.record(path) as recorder:
        run_a_tiny_job(device)
    spec = load_spec_file(path)
    base = dict(batch=1, heads_q=4, heads_kv=2, seqlen_kv=32, head_dim=16, dtype="float16")
    assert set(spec.problems) == {
        Problem(seqlen_q=32, causal="top_left", **base),  # the prefill
        Problem(seqlen_q=1, **base),  # the one-token call and tuner.decode's problem
    }
    assert set(recorder.problems) == set(spec.problems)
    # torch's SDPA beside ours: the sweep measures what the dispatcher compares against.
    assert spec.templates[0] == "torch_sdpa"
    assert {"flash_fwd", "flash_decode"} <= set(spec.templates)


def test_runs_add_up_in_one_spec_and_it_sweeps(tmp_path: Path, device: str) -> None:
    path = tmp_path / "job.toml"
    with tuner.record(path):
        tuner.attention(*(torch.randn(1, 2, 24, 16, device=device) for _ in range(3)))
    with tuner.record(path):
        tuner.attention(*(torch.randn(1, 2, 40, 16, device=device) for _ in range(3)))
    assert sorted(p.seqlen_q for p in load_spec_file(path).problems) == [24, 40]
    db = f"sqlite:///{tmp_path / 'tuned.db'}"
    code, out, err = cli("sweep", str(path), "--trials", "1", "--finalists", "0",
                         "--db", db, "--json")
    assert code == 0, err
    assert "torch_sdpa" in out and "flash_fwd" in out


def test_nothing_recorded_writes_nothing_and_a_missing_folder_is_refused(
        tmp_path: Path) -> None:
    path = tmp_path / "empty.toml"
    with tuner.record(path):
        pass
    assert not path.exists()
    with pytest.raises(TunerError, match="folder does not exist"), \
            tuner.record(tmp_path / "nope" / "job.toml"):
        pass


@pytest.mark.skipif(torch.cuda.is_available(), reason="the subprocess runs on the interpreter")
def test_tuner_record_in_the_environment_writes_at_exit(tmp_path: Path) -> None:
    path = tmp_path / "env.toml"
    code = ("import torch, tuner\n"
            "q = torch.randn(1, 2, 16, 16)\n"
            "tuner.attention(q, q, q, is_causal=True)\n")
    env = {**os.environ, "TUNER_RECORD": str(path),
           "TUNER_DATABASE_URL": f"sqlite:///{tmp_path / 'none.db'}"}
    env.pop("TUNER_URL", None)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    [problem] = load_spec_file(path).problems
    assert (problem.seqlen_q, problem.causal, problem.dtype) == (16, "top_left", "float32")
