"""tuner.dispatch.hf_mask: transformers-style mask rules (written here as transformers writes them:
index-based closures) straight to a BlockMask, without transformers installed: exact against
the rule evaluated everywhere, the plain causal rule recognized, rules outside the family
refused, masks kept per segment layout."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from templates.masks.block_mask import BlockMask
from tuner.dispatch.hf_mask import CAUSAL, clear_rule_masks, rule_block_mask

Rule = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def causal(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    return k <= q


def sliding(window: int) -> Rule:  # transformers' sliding_window_causal_mask_function
    return lambda b, h, q, k: (k > q - window) & (k <= q)


def chunked(chunk: int) -> Rule:  # chunked_causal_mask_function without left padding
    return lambda b, h, q, k: (k // chunk == q // chunk) & (k <= q)


def packed(lengths_per_row: list[list[int]], inner: Rule = causal) -> Rule:
    """and_masks(inner, packed_sequence_mask_function(ids)) with find_packed_sequence_indices'
    ids, one row of lengths per batch row."""
    ids = torch.stack([torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r))
                       for r in lengths_per_row])
    return lambda b, h, q, k: inner(b, h, q, k) & (ids[b, q] == ids[b, k])


def dense(rule: Rule, batch: int, n: int) -> torch.Tensor:
    i = torch.arange(n)
    out = rule(torch.arange(batch)[:, None, None], torch.zeros(1, 1, 1, dtype=torch.long),
               i[None, :, None], i[None, None, :])
    return out.expand(batch, n, n)


@pytest.fixture(autouse=True)
def fresh() -> None:
    clear_rule_masks()


@pytest.mark.parametrize(("rule", "batch", "window", "pattern"), [
    (sliding(50), 2, 50, "sliding_causal:50"),
    (chunked(96), 1, 96, None),  # chunks become segments; no named problem
    (packed([[90, 130, 80]]), 1, None, "documents_causal:128"),
    (packed([[90, 130, 80], [300]]), 2, None, None),  # rows differ: (B, 1, L, L)
    (packed([[150, 150]], sliding(40)), 1, 40, None),
])
def test_the_mask_is_the_rule_exactly(rule: Rule, batch: int, window: int | None,
                                      pattern: str | None) -> None:
    n = 300
    mask = rule_block_mask(rule, batch, n, window, "cpu", block_size=32)
    assert isinstance(mask, BlockMask)
    want = dense(rule, batch, n)
    got = mask.to_dense()[:, 0].expand(batch, n, n)
    assert torch.equal(got, want)
    reference = BlockMask.from_dense(want[:, None], 32)
    assert torch.equal(mask.full_counts.expand_as(reference.full_counts),
                       reference.full_counts)
    assert mask.pattern is None  # blocks of 32: not the sweeps' mask
    named = rule_block_mask(rule, batch, n, window, "cpu")
    assert isinstance(named, BlockMask) and named.pattern == pattern


def test_plain_causal_needs_no_mask() -> None:
    assert rule_block_mask(causal, 2, 300, None, "cpu") is CAUSAL
    assert rule_block_mask(sliding(400), 1, 300, 400, "cpu") is CAUSAL  # window covers it


@pytest.mark.parametrize("rule", [
    lambda b, h, q, k: q >= 0,  # bidirectional
    lambda b, h, q, k: (k <= q) & (k >= 3),  # left padding: padded queries see nothing
    lambda b, h, q, k: (k <= q) & ((q - k) % 7 != 3),  # not a window: holes in every block
], ids=["bidirectional", "padding", "strided"])
def test_rules_outside_the_family_are_refused(rule: Rule) -> None:
    assert rule_block_mask(rule, 1, 300, None, "cpu", block_size=32) is None


def test_a_window_other_than_the_one_named_is_refused() -> None:
    """local_size says 40, the rule's window is 100: the blocks the hypothesis empties
    are seen at their corners."""
    assert rule_block_mask(sliding(100), 1, 300, 40, "cpu", block_size=32) is None


def test_one_mask_per_segment_layout() -> None:
    first = rule_block_mask(packed([[90, 130, 80]]), 1, 300, None, "cpu")
    again = rule_block_mask(packed([[90, 130, 80]]), 1, 300, None, "cpu")  # a new closure
    other = rule_block_mask(packed([[100, 120, 80]]), 1, 300, None, "cpu")
    assert first is again and other is not first


def and_masks(*rules: Rule) -> Rule:  # transformers' and_masks: a closure over its rules
    def and_mask(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                 ) -> torch.Tensor:
        out = q.new_ones((), dtype=torch.bool)
        for rule in rules:
            out = out & rule(b, h, q, k)
        return out
    return and_mask


def overlay(window: int) -> Rule:  # transformers' sliding_window_overlay
    def inner(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, k: torch.Tensor
              ) -> torch.Tensor:
        return k > q - window
    return inner


def test_a_rule_seen_before_is_not_evaluated_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers composes a new closure per forward; one of the same code and closure
    values gets the verdict read off the first (no rule evaluation, no read from the device:
    ~280 operations and a GPU wait per forward before); one over a tensor is read every time."""
    from tuner.dispatch import hf_mask

    reads: list[int] = []
    read_rule = hf_mask._read_rule
    monkeypatch.setattr(hf_mask, "_read_rule",
                        lambda *a, **kw: reads.append(1) or read_rule(*a, **kw))
    assert rule_block_mask(causal, 1, 300, None, "cpu") is CAUSAL
    assert rule_block_mask(causal, 1, 300, None, "cpu") is CAUSAL
    assert len(reads) == 1
    first = rule_block_mask(and_masks(overlay(50), causal), 1, 300, 50, "cpu")
    again = rule_block_mask(and_masks(overlay(50), causal), 1, 300, 50, "cpu")  # new closures
    assert isinstance(first, BlockMask) and again is first and len(reads) == 2
    assert torch.equal(first.to_dense()[0, 0], dense(and_masks(overlay(50), causal), 1, 300)[0])
    # Another window, another shape: read again.
    other = rule_block_mask(and_masks(overlay(60), causal), 1, 300, 60, "cpu")
    assert isinstance(other, BlockMask) and other.pattern == "sliding_causal:60"
    assert rule_block_mask(causal, 1, 400, None, "cpu") is CAUSAL
    assert len(reads) == 4
    # A refusal is remembered too (a new closure of one code each time, as transformers makes).
    def bidirectional() -> Rule:
        return lambda b, h, q, k: q >= 0
    assert rule_block_mask(bidirectional(), 1, 300, None, "cpu") is None
    assert rule_block_mask(bidirectional(), 1, 300, None, "cpu") is None
    assert len(reads) == 5
    # Closures over tensors (packed sequences): read on every call, the answer still right.
    assert rule_block_mask(packed([[90, 130, 80]]), 1, 300, None, "cpu") is not None
    assert rule_block_mask(packed([[100, 120, 80]]), 1, 300, None, "cpu").pattern is not None
    assert len(reads) == 7
