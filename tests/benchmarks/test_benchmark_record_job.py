"""benchmarks/record_job.py --smoke: issue 42's two-model job recorded on the CPU (tiny models):
the prefills, the decode loop (one line for its bucket, with its count), the training steps
and the interleaved model's sliding-window layers are all in the recording."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="transformers is not installed")

from tests.benchmarks.benchmark_scripts import load_benchmark_script  # noqa: E402


def test_the_smoke_job_records_every_kind_of_problem(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TUNER_DATABASE_URL", f"sqlite:///{tmp_path / 'none.db'}")
    monkeypatch.delenv("TUNER_URL", raising=False)
    out = tmp_path / "job.toml"
    assert load_benchmark_script("record_job").main(["--out", str(out), "--smoke"]) == 0
    spec = tomllib.loads(out.read_text())
    shapes = spec["shapes"]
    decode = [s for s in shapes if s["N_q"] == 1]
    assert len(decode) == 1 and decode[0]["count"] >= 3  # 4 steps, one bucket, one line
    assert any(s["mask"].startswith("sliding_causal:") for s in shapes)
    assert any(s["B"] == 2 for s in shapes)  # the Llama training step
    assert {"flash_decode", "flash_bwd", "torch_sdpa_train"} <= set(spec["templates"])
