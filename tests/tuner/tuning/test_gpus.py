"""GPU claims: the sweeps of one host (worker containers) never share a GPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tuner.cli.test_sweep_cli import cli
from tuner.errors import TunerError
from tuner.tuning.gpus import claim_gpus, gpus_for_sweep, lock_path

GPUS = ["0", "1", "2"]
_HOLD = ("import fcntl, sys, time\nf = open(sys.argv[1], 'a')\nfcntl.flock(f, fcntl.LOCK_EX)\n"
         "print('held', flush=True)\ntime.sleep(120)\n")


def test_claims_take_free_gpus_and_release_them(tmp_path: Path) -> None:
    with claim_gpus(tmp_path, GPUS, 1) as first, claim_gpus(tmp_path, GPUS, 2) as second:
        assert (first, second) == (["0"], ["1", "2"])
        with pytest.raises(TunerError, match="only 0 of this host's 3 are free"), \
                claim_gpus(tmp_path, GPUS, 1):
            pass
    with claim_gpus(tmp_path, GPUS, 3) as everything:
        assert everything == GPUS


def test_a_killed_holders_gpu_is_free_at_once(tmp_path: Path) -> None:
    gpu = "GPU-8f3e/1"  # a UUID-like id: the lock file name stays safe
    path = lock_path(tmp_path, gpu)
    assert path.parent == tmp_path
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, str(path)], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(TunerError), claim_gpus(tmp_path, [gpu], 1):
            pass
    finally:
        holder.kill()  # SIGKILL: no clean-up runs; the kernel drops the lock
        holder.wait()
    with claim_gpus(tmp_path, [gpu], 1) as claimed:
        assert claimed == [gpu]


def test_a_sweep_sees_only_its_claimed_gpus(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("tuner.tuning.gpus.visible_gpus", lambda: ["0", "1"])
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with gpus_for_sweep(str(tmp_path), 1) as first:
        assert first == ["0"] and os.environ["CUDA_VISIBLE_DEVICES"] == "0"
        with gpus_for_sweep(str(tmp_path), 1) as second:
            assert second == ["1"] and os.environ["CUDA_VISIBLE_DEVICES"] == "1"
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "0"
    assert "CUDA_VISIBLE_DEVICES" not in os.environ
    with gpus_for_sweep(None, 1) as unclaimed:
        assert unclaimed == []


def test_without_a_gpu_nothing_is_claimed(tmp_path: Path) -> None:
    # Under the interpreter no GPU is visible: the lock folder is not even created.
    with gpus_for_sweep(str(tmp_path / "locks"), 1) as claimed:
        assert claimed == []
    assert not (tmp_path / "locks").exists()


def test_sweep_stops_when_no_gpu_is_free(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("tuner.tuning.gpus.visible_gpus", lambda: ["0"])
    monkeypatch.setenv("TUNER_GPU_LOCK_DIR", str(tmp_path))
    from tuner.settings import get_settings

    get_settings.cache_clear()
    try:
        with claim_gpus(tmp_path, ["0"], 1):  # another worker holds the host's one GPU
            code, out, _ = cli("sweep", "--shape", "B=1,H=2,N=32,D=16", "--db",
                               f"sqlite:///{tmp_path / 't.db'}", "--json")
    finally:
        get_settings.cache_clear()
    assert code == 2
    assert "only 0 of this host's 1 are free" in out and "--scale worker" in out
