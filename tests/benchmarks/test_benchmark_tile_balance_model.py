"""benchmarks/tile_balance_model.py: the assignments it models, on cases whose balance is
known by hand."""

from __future__ import annotations

from tests.benchmarks.benchmark_scripts import load_benchmark_script

model = load_benchmark_script("tile_balance_model")


def test_a_dynamic_start_fills_the_free_sm_and_a_snake_is_static() -> None:
    cost = [4, 1, 1, 1]
    # Two SMs: the long tile first, the short ones on the other SM meanwhile.
    assert model.dynamic(range(4), cost, 2) == 4
    assert model.dynamic([1, 2, 3, 0], cost, 2) == 5  # the long tile last
    # Snake rounds: (4, 1), then reversed (1, 1): program 0 takes a second tile regardless.
    assert model.snake(range(4), cost, 2) == 5
    assert model.snake([1, 0, 2, 3], cost, 2) == 5  # (1, 4), then (1, 1) reversed


def test_the_masks_are_modelled_on_every_assignment() -> None:
    got = model.balance("document-causal:1024", 4096, 4, 16, overhead=2)
    assert len(got) == 5 and all(ratio >= 1.0 - 1e-9 for ratio in got.values())
    assert model.main(["--seqlen", "2048", "--heads", "2", "--programs", "8"]) == 0
