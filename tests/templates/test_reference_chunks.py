"""The attention reference computed a chunk of query rows at a time equals the whole."""

from __future__ import annotations

import pytest
import torch

from templates import attention_reference
from templates.attention_reference import attention_reference as reference


@pytest.mark.parametrize("causal", ["none", "top_left", "bottom_right"])
@pytest.mark.parametrize("mask_kind", [None, "bool_rows", "bool_broadcast", "float"])
def test_chunks_give_the_whole(monkeypatch: pytest.MonkeyPatch, causal: str,
                               mask_kind: str | None) -> None:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 37, 16, generator=gen, dtype=torch.float64)
    k = torch.randn(2, 2, 29, 16, generator=gen, dtype=torch.float64)
    v = torch.randn(2, 2, 29, 16, generator=gen, dtype=torch.float64)
    mask = {None: None,
            "bool_rows": torch.rand(1, 4, 37, 29, generator=gen) > 0.3,
            "bool_broadcast": torch.rand(29, generator=gen) > 0.3,
            "float": torch.randn(2, 1, 37, 29, generator=gen, dtype=torch.float64)}[mask_kind]
    whole = reference(q, k, v, causal=causal, scale=0.25, mask=mask)
    # 5 query rows per chunk (2 * 4 * 29 scores a row): 8 chunks, the last one of 2 rows
    monkeypatch.setattr(attention_reference, "REFERENCE_CHUNK_SCORES", 5 * 2 * 4 * 29)
    chunked = reference(q, k, v, causal=causal, scale=0.25, mask=mask)
    torch.testing.assert_close(chunked[0], whole[0], rtol=0, atol=1e-12)
    torch.testing.assert_close(chunked[1], whole[1], rtol=0, atol=1e-12)
    assert torch.isneginf(whole[1]).any() == torch.isneginf(chunked[1]).any()
