"""tuner.dispatch.mask_rule_key: equal keys for rules that compute the same (new closures of the
same code over the same values), different keys otherwise, none for closures over tensors."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from tests.tuner.dispatch.test_hf_rule_mask import and_masks as both
from tests.tuner.dispatch.test_hf_rule_mask import causal, overlay
from tuner.dispatch.mask_rule_key import rule_key


def window_rule(window: int) -> Callable[..., torch.Tensor]:
    return both(overlay(window), causal)


def test_same_code_and_values_same_key() -> None:
    assert rule_key(window_rule(64)) == rule_key(window_rule(64))
    assert hash(rule_key(both(window_rule(64), causal))) == hash(
        rule_key(both(window_rule(64), causal)))
    assert rule_key(causal) == rule_key(causal)
    assert rule_key(functools.partial(causal)) == rule_key(functools.partial(causal))


def test_other_values_or_code_other_key() -> None:
    assert rule_key(window_rule(64)) != rule_key(window_rule(65))
    assert rule_key(both(window_rule(64), causal)) != rule_key(both(causal, window_rule(64)))
    assert rule_key(window_rule(64)) != rule_key(both(window_rule(64)))
    assert rule_key(overlay(64)) != rule_key(window_rule(64))
    assert rule_key(True) != rule_key(1)  # bool and int are told apart


def test_closures_over_tensors_have_no_key() -> None:
    ids = torch.tensor([0, 0, 1])
    packed = both(causal, lambda b, h, q, k: ids[q] == ids[k])
    assert rule_key(packed) is None
    assert rule_key(torch.ones(3)) is None
    assert rule_key(object()) is None


def test_an_empty_cell_has_no_key() -> None:
    def outer() -> Callable[..., torch.Tensor]:
        def inner(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                  ) -> torch.Tensor:
            return k <= q - later
        key = rule_key(inner)  # `later` is not bound yet
        assert key is None
        later = 3
        return inner
    assert rule_key(outer()) is not None
