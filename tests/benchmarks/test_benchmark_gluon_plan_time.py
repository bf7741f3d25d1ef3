"""benchmarks/gluon_plan_time.py: its shape parsing, and one row made on the CPU."""

from __future__ import annotations

import pytest

from templates.gluon.fwd import GLUON_MISSING
from tests.benchmarks.benchmark_scripts import load_benchmark_script

plan_time = load_benchmark_script("gluon_plan_time")


def test_shapes_are_parsed_and_bad_ones_named() -> None:
    assert plan_time.parse_shapes("1x2x4096x128, 2x8x512x64") == [(1, 2, 4096, 128),
                                                                  (2, 8, 512, 64)]
    for bad in ("1x2x4096", "1x2x4096x0", "axbxcxd"):
        with pytest.raises(ValueError, match=f"BxHxNxD items of positive integers, got '{bad}'"):
            plan_time.parse_shapes(bad)


@pytest.mark.skipif(bool(GLUON_MISSING), reason=GLUON_MISSING or "gluon present")
def test_a_row_says_what_plan_was_made() -> None:
    # One head at 8k, causal: 64 tiles of 1-64 blocks, the longest cut (TILE_ORDER 4).
    row = plan_time.plan_times((1, 1, 8192, 128), "top_left", 2)
    assert (row["shape"], row["tile_order"], row["cut"], row["tiles"]) == (
        "1x1x8192x128", 4, True, 64)
    assert 0 < row["min_ms"] <= row["median_ms"]
    dense = plan_time.plan_times((1, 32, 4096, 128), "none", 1)
    assert (dense["tile_order"], dense["cut"], dense["tiles"]) == (0, False, 1024)
