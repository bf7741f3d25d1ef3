"""benchmarks/hf_mask_cost.py: the two rows really differ in the mask the attention gets (a
BlockMask from tuner.hf's own mask function, a dense boolean tensor from transformers' sdpa
mask), give the same logits, and --smoke writes its JSON (CPU here: times mean nothing)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is not installed")

from tests.benchmarks.benchmark_scripts import load_benchmark_script  # noqa: E402

SCRIPT = load_benchmark_script("hf_mask_cost")


def test_smoke_rows_get_a_block_mask_and_a_dense_mask(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, set[str]] = {"own": set(), "dense": set()}
    inner = SCRIPT.tuner_attention_forward

    def recorded(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: Any, *args: Any, **kwargs: Any) -> Any:
        row = "dense" if module.config._attn_implementation == SCRIPT.DENSE_MASK_NAME else "own"
        seen[row].add(type(attention_mask).__name__)
        return inner(module, query, key, value, attention_mask, *args, **kwargs)

    monkeypatch.setattr(SCRIPT, "tuner_attention_forward", recorded)
    monkeypatch.setattr("tuner.hf.tuner_attention_forward", recorded)
    monkeypatch.setenv("TUNER_DATABASE_URL", f"sqlite:///{tmp_path / 'none.db'}")
    monkeypatch.delenv("TUNER_URL", raising=False)
    out = tmp_path / "mask_cost.json"
    assert SCRIPT.main(["--smoke", "--rounds", "2", "--json", str(out)]) == 0
    assert seen["dense"] == {"Tensor"}, seen  # transformers' L x L boolean mask
    assert seen["own"] and "Tensor" not in seen["own"], seen  # tuner.hf's own: a BlockMask, never L x L
    result = json.loads(out.read_text())
    assert result["logits_gap"] < 1e-5
    # The A/A floor is the base timed twice (paired.compare's contract), not the candidate.
    assert set(result["median_ms"]) == {"tuner", "tuner_dense_mask", "tuner_dense_mask again"}
