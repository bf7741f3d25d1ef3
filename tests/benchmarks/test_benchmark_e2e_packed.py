"""benchmarks/e2e_packed.py --smoke: a tiny Llama trained on one packed row through "sdpa",
"tuner" and "tuner" with the collator's cu_seq_lens (CPU here: times mean nothing), in paired
rounds with an A/A floor; every packed loss matches the unpacked documents', and the
leaking control misses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.benchmarks.benchmark_scripts import BENCHMARKS, load_benchmark_script

pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[hf]')")


def test_smoke_row_times_and_loss_check(tmp_path: Path) -> None:
    out = tmp_path / "packed.json"
    env = {**os.environ, "TUNER_DATABASE_URL": f"sqlite:///{tmp_path / 'none.db'}"}
    env.pop("TUNER_URL", None)
    done = subprocess.run([sys.executable, str(BENCHMARKS / "e2e_packed.py"), "--smoke",
                           "--json", str(out)], env=env, capture_output=True, text=True,
                          timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "A/A noise floor" in done.stdout
    data = json.loads(out.read_text())
    assert data["rounds"] == 3 and data["failed"] == [] and data["errors"] == {}
    assert sum(data["lengths"]) == 96 and all(5 <= n <= 40 for n in data["lengths"])
    impls = {"sdpa", "tuner", "tuner + cu_seq_lens"}
    assert set(data["train_step_ms"]) == impls | {"sdpa again"}
    assert set(data["speedup_vs_sdpa"]) == impls - {"sdpa"}
    assert all(len(t) == 3 for t in data["rounds_ms"].values())
    checks = data["loss_check"]
    for impl in impls:
        assert checks[impl]["passed"] and checks[impl]["logits_rel_err"] < 1e-5  # fp32
        assert checks[impl]["attention_rel_err"] < 1e-5
    control = checks["control: documents leaking (sdpa, no position resets)"]
    # Failed by the first attention layer's output (what the verdict reads), not the logits.
    assert not control["passed"] and control["attention_rel_err"] > 1e-2


@pytest.mark.parametrize("seed", range(5))
def test_document_lengths_fill_the_row_within_bounds(seed: int) -> None:
    bench = load_benchmark_script("e2e_packed")
    lengths = bench.document_lengths(16384, 200, 4000, seed)
    assert sum(lengths) == 16384 and all(200 <= n <= 4000 for n in lengths)
    with pytest.raises(ValueError, match="cannot fill"):
        bench.document_lengths(100, 200, 4000, seed)


def test_the_packed_row_is_what_the_collator_makes() -> None:
    """position_ids restart per document, each document's first label is -100, and the
    flash kwargs are the documents' offsets (DataCollatorWithFlattening's layout)."""
    import torch

    bench = load_benchmark_script("e2e_packed")
    row = bench.packed_row([3, 2, 4], 50, "cpu")
    batch, kwargs = row["batch"], row["flash_kwargs"]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3]]
    labels = batch["labels"][0].tolist()
    assert [labels[i] for i in (0, 3, 5)] == [-100] * 3
    assert batch["labels"][0, 1].item() == batch["input_ids"][0, 1].item()
    assert kwargs["cu_seq_lens_q"].tolist() == [0, 3, 5, 9]
    assert kwargs["cu_seq_lens_q"].dtype == torch.int32 and kwargs["max_length_q"] == 4
    assert batch["use_cache"] is False


def test_forced_implementations_run_or_are_reported(tmp_path: Path) -> None:
    """tuner:<implementation> runs the tuner model with it forced: ours passes the check; one
    that cannot run here (torch's varlen_attn on the CPU, in fp32) is reported with its reason and
    left out of the timing, which is no failure of the row."""
    out = tmp_path / "packed.json"
    env = {**os.environ, "TUNER_DATABASE_URL": f"sqlite:///{tmp_path / 'none.db'}"}
    env.pop("TUNER_URL", None)
    done = subprocess.run([sys.executable, str(BENCHMARKS / "e2e_packed.py"), "--smoke",
                           "--impls", "sdpa,tuner:flash,tuner:torch_varlen", "--json", str(out)],
                          env=env, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["loss_check"]["tuner:flash"]["passed"]
    assert "forced but cannot run" in data["errors"]["tuner:torch_varlen"]
    assert data["failed"] == []
    assert set(data["train_step_ms"]) == {"sdpa", "tuner:flash", "sdpa again"}
    bad = subprocess.run([sys.executable, str(BENCHMARKS / "e2e_packed.py"), "--smoke",
                          "--impls", "sdpa,tuner:nope"], env=env, capture_output=True,
                         text=True, timeout=600, check=False)
    assert bad.returncode == 2 and "unknown ['tuner:nope']" in bad.stderr
