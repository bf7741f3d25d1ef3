"""The documents of the ``documents[_causal]:<L>`` patterns: mixed lengths in the pattern's
own bucket, the same in the mask and in the offsets it carries."""

import math

import pytest
import torch

from templates.masks.mods import (
    STANDIN_DOCUMENTS,
    pattern_block_mask,
    pattern_documents,
    standin_document_lengths,
)
from templates.masks.patterns import documents_pattern


@pytest.mark.parametrize(("length", "seqlen"), [(2048, 16384), (2048, 65536), (1024, 4096),
                                                (128, 300), (1, 3), (4096, 1000)])
def test_lengths_cover_the_row_and_are_mixed(length: int, seqlen: int) -> None:
    lengths = standin_document_lengths(length, seqlen)
    assert sum(lengths) == seqlen and min(lengths) >= 1
    if seqlen >= 2 * length * sum(STANDIN_DOCUMENTS):
        assert len(set(lengths)) > 2  # mixed, not equal documents
    if length >= 1024:  # documents meet inside blocks, as packed rows' do
        assert all(n % 128 for n in lengths[:-1])


@pytest.mark.parametrize("length", [256, 1024, 2048, 4096])
def test_the_pattern_of_its_own_documents_is_itself(length: int) -> None:
    """documents_pattern (how a packed call is bucketed) maps the stand-in's documents back to
    the same pattern: the sweep measures a row of the bucket it prices."""
    lengths = standin_document_lengths(length, 32 * length)
    assert documents_pattern(lengths, causal=True) == f"documents_causal:{length}"
    assert documents_pattern(lengths, causal=False) == f"documents:{length}"
    per_token = sum(n * n for n in lengths) / sum(lengths)
    assert abs(math.log2(per_token / length)) < 0.5


def test_the_mask_and_its_offsets_agree() -> None:
    mask = pattern_block_mask("documents_causal:64", 320, 320, block_size=16)
    offsets = pattern_documents("documents_causal:64", 320)
    assert offsets is not None
    doc = torch.zeros(320, dtype=torch.long)
    assert offsets.offsets_q == offsets.offsets_k
    for i, (a, b) in enumerate(zip(offsets.offsets_q[:-1], offsets.offsets_q[1:], strict=True)):
        doc[a:b] = i
    dense = (doc[:, None] == doc[None, :]) & torch.ones(320, 320, dtype=torch.bool).tril()
    assert len(offsets.offsets_q) > 3
    assert torch.equal(mask.to_dense()[0, 0].bool(), dense)
