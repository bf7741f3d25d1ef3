"""benchmarks/tile_cost_fit.py: the fit recovers known per-tile and per-block costs."""

from __future__ import annotations

import pytest

from tests.benchmarks.benchmark_scripts import load_benchmark_script

fit = load_benchmark_script("tile_cost_fit")


def rows(o: float, c: float, causal: str) -> list[dict[str, object]]:
    """PROTOCOL-like d64 rows (B x N = 16k, 32 heads) timed exactly as o + n * c per wave."""
    out = []
    for n in (512, 1024, 2048, 4096, 8192, 16384):
        problem = {"batch": 16384 // n, "heads_q": 32, "seqlen_q": n, "seqlen_kv": n,
                   "head_dim": 64, "causal": causal, "mask": "none"}
        waves, blocks = fit.tile_terms(problem, 132)
        out.append({"problem": problem,
                    "median_ms": {"ours": waves * (o + c * blocks) / 1e3, "other": None}})
    return out


def test_the_fit_recovers_the_costs_it_was_made_from() -> None:
    got = fit.fit(rows(2.0, 1.25, "none") + rows(3.0, 1.1, "top_left"), 132)
    assert set(got) == {(64, "dense", "ours"), (64, "causal", "ours")}
    assert got[(64, "dense", "ours")]["per_tile_us"] == pytest.approx(2.0)
    assert got[(64, "dense", "ours")]["per_block_us"] == pytest.approx(1.25)
    assert got[(64, "causal", "ours")]["per_tile_us"] == pytest.approx(3.0)
    assert got[(64, "causal", "ours")]["problems"] == 6


def test_causal_tiles_count_half_the_blocks_and_the_diagonal() -> None:
    problem = {"batch": 4, "heads_q": 32, "seqlen_q": 4096, "causal": "top_left"}
    assert fit.tile_terms(problem, 128) == (32.0, 16.5)
    assert fit.tile_terms({**problem, "causal": "none"}, 128) == (32.0, 32.0)
