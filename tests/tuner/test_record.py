"""tuner.record / TUNER_RECORD: the problems a job ran, written as a sweep spec that tunes
exactly them (issue 18, item 3). Tiny shapes on the interpreter without a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tuner
from templates.base import Problem
from tests.tuner.cli.test_sweep_cli import cli
from tuner.errors import TunerError
from tuner.tuning.suites import load_spec_file

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
    # Recorded by bucket (sequence lengths rounded up to powers of two): what the sweep tunes.
    assert sorted(p.seqlen_q for p in load_spec_file(path).problems) == [32, 64]
    db = f"sqlite:///{tmp_path / 'tuned.db'}"
    code, out, err = cli("sweep", str(path), "--trials", "1", "--finalists", "0",
                         "--db", db, "--json")
    assert code == 0, err
    assert "torch_sdpa" in out and "flash_fwd" in out


def test_a_line_names_the_templates_its_calls_could_run(tmp_path: Path) -> None:
    """A decode step is never a training call: its line names the templates that serve it,
    the sweep measures only those there, and a second run adds to them."""
    path = tmp_path / "job.toml"
    decode = Problem(1, 4, 2, 1, 4096, 64, "float16")
    train = Problem(1, 4, 2, 512, 512, 64, "float16", causal="top_left")
    with tuner.record(path) as recorder:
        recorder.add(decode, ["torch_sdpa", "flash_decode"])
        recorder.add(train, ["torch_sdpa_train", "flash_fwd", "flash_bwd", "torch_sdpa"])
    spec = load_spec_file(path)
    assert spec.templates == ("torch_sdpa", "flash_decode", "torch_sdpa_train", "flash_fwd",
                              "flash_bwd")
    assert spec.problem_templates == {decode: ("torch_sdpa", "flash_decode"),
                                      train: ("torch_sdpa", "torch_sdpa_train", "flash_fwd",
                                              "flash_bwd")}
    with tuner.record(path) as recorder:  # another run: its decode calls of flash_fwd too
        recorder.add(decode, ["flash_fwd"])
        recorder.add(train, ["flash_decode"])  # now every template: no list on its line
    spec = load_spec_file(path)
    assert spec.problem_templates == {decode: ("torch_sdpa", "flash_decode", "flash_fwd")}
    assert "templates = [" in path.read_text().splitlines()[6]


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


def test_a_decode_loop_is_one_line_per_bucket_with_its_count(tmp_path: Path,
                                                             device: str) -> None:
    """Issue 42: every decode step is its own shape (the KV grows), but the sweep tunes
    buckets; the recording holds one line per bucket and how often the job ran it."""
    path = tmp_path / "decode.toml"
    q = torch.randn(1, 2, 1, 16, device=device)
    with tuner.record(path) as recorder:
        for length in range(17, 41):  # 24 steps: 17..32 in one bucket, 33..40 in the next
            kv = torch.randn(1, 2, length, 16, device=device)
            tuner.attention(q, kv, kv)
    spec = load_spec_file(path)
    assert {p.seqlen_kv: spec.counts[p] for p in spec.problems} == {32: 16, 64: 8}
    assert "2 problem(s) to tune" in recorder.summary()
    assert "from 24 plan(s)" in recorder.summary()
    text = path.read_text()
    assert text.startswith("# Recorded by tuner.record: 2 problem(s) to tune")
    assert text.count("count = ") == 2
    # Recording the same job again adds the counts up.
    with tuner.record(path):
        kv = torch.randn(1, 2, 20, 16, device=device)
        tuner.attention(q, kv, kv)
    spec = load_spec_file(path)
    assert {p.seqlen_kv: spec.counts[p] for p in spec.problems} == {32: 17, 64: 8}


def test_a_malformed_recording_names_the_line_at_fault(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("""name = "bad"
templates = ["flash_fwd"]
shapes = [
  {B = 1, H = 2, N = 32, D = 16, count = 3},
  {B = 1, H = 2, N = 64, D = 16, count = 0},
]
""")
    with pytest.raises(TunerError, match=r"shapes\[1\]\.count must be a positive integer.*"
                                         r"\(line 5\)"):
        load_spec_file(path)
    path.write_text(path.read_text().replace("count = 0", "dtype = \"int4\""))
    with pytest.raises(TunerError, match=r"dtype 'int4' is unknown \(line 5\)"):
        load_spec_file(path)
    path.write_text(path.read_text().replace("dtype = \"int4\"", "Q = 3"))
    with pytest.raises(TunerError, match=r"unknown key 'Q'.* \(line 5\)"):
        load_spec_file(path)


def test_a_recording_of_another_release_still_tunes(tmp_path: Path) -> None:
    """Problems are problems: a recording that names a template this release lacks, with other
    kernel versions, sweeps the problems with the templates it has (the rest skipped)."""
    from tuner.tuning.sweep import expand_tasks

    path = tmp_path / "old.toml"
    path.write_text("""name = "old"
templates = ["flash_fwd", "flash_fwd_v0"]
shapes = [
  {B = 1, H_q = 2, H_kv = 2, N_q = 32, N_kv = 32, D = 16, dtype = "float16", count = 4},
  {B = 1, H = 2, N = 30, D = 16, dtype = "float16", count = 2},
]

[recorded]
by = "tuner.record"
versions = {flash_fwd = "0123456789abcdef", flash_fwd_v0 = "fedcba9876543210"}
""")
    spec = load_spec_file(path)
    assert spec.recorded is not None
    tasks, skipped = expand_tasks(spec)
    # N 30 falls in N 32's bucket: one task, the counts of the bucket's problems added up.
    assert [(t.template.name, t.count) for t in tasks] == [("flash_fwd", 6)]
    assert [name for name, _ in skipped] == ["flash_fwd_v0"]
    # Without [recorded], an unknown template is still the spec's error.
    path.write_text(path.read_text().split("[recorded]")[0])
    with pytest.raises(TunerError, match="flash_fwd_v0"):
        expand_tasks(load_spec_file(path))


def test_a_recording_sweeps_within_a_budget_and_bad_budgets_are_refused(
        tmp_path: Path, device: str) -> None:
    path = tmp_path / "job.toml"
    q = torch.randn(1, 2, 1, 16, device=device)
    with tuner.record(path):
        for length in (20, 24):
            kv = torch.randn(1, 2, length, 16, device=device)
            tuner.attention(q, kv, kv)
    db = f"sqlite:///{tmp_path / 'tuned.db'}"
    code, out, err = cli("sweep", str(path), "--budget", "10m", "--trials", "1",
                         "--finalists", "0", "--head-to-head-rounds", "0", "--db", db)
    assert code == 0, err
    assert "within the --budget of 600 s" in " ".join(out.split())
    code, out, err = cli("sweep", str(path), "--budget", "10m", "--trials", "1",
                         "--finalists", "0", "--head-to-head-rounds", "0", "--db", db,
                         "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["budget_s"] == 600 and not report["budget_spent"]
    assert {p["count"] for p in report["problems"] if not p["skipped"]} == {2}
    code, _, err = cli("sweep", str(path), "--budget", "soon", "--db", db)
    assert code == 2 and "not a positive duration" in err
    fresh = f"sqlite:///{tmp_path / 'fresh.db'}"
    code, _, err = cli("sweep", str(path), "--budget", "0.001", "--db", fresh)
    assert code == 2 and "too small for any measurement" in " ".join(err.split())
