"""benchmarks/docs_fwd_configs.py on the CPU: the two rows it times (a real packed row and the
pattern that prices it) and its refusal without a Hopper GPU. The timings run on the GPU only."""

from __future__ import annotations

import pytest

from tests.benchmarks.benchmark_scripts import load_benchmark_script


def test_the_real_row_and_its_pattern() -> None:
    script = load_benchmark_script("docs_fwd_configs")
    masks = script.row_masks(16384, 13, 0, "cpu")
    assert list(masks) == ["real", "documents_causal:2048"]
    real, pattern = masks.values()
    assert real.documents is not None and pattern.documents is not None
    # Mixed documents both, the pattern's of the same bucket (more work than this row's:
    # its per-token length is 1.28x the bucket's, this row's 0.87x).
    assert len(set(pattern.documents.offsets_q)) > 5
    assert real.density() < pattern.density() < 1.5 * real.density()
    window = script.row_masks(4096, 3, 0, "cpu", window=1024)["sliding_causal:1024"]
    assert window.pattern == "sliding_causal:1024"  # (the rows the forwards' doc_offsets read)


def test_it_refuses_without_a_hopper_gpu() -> None:
    script = load_benchmark_script("docs_fwd_configs")
    with pytest.raises(SystemExit):
        script.main([])
