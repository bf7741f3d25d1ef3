"""tuner.dispatch.dense_mask.recognize_mask: a dense attn_mask that is exactly causal, a causal
sliding window or block-diagonal documents is recognized (bool or additive), as the very block mask
(to_dense equals it) with its named problem; anything else, including masks that differ
between batch rows, biases and near misses, is None."""

from __future__ import annotations

import pytest
import torch

from tuner.dispatch.dense_mask import recognize_mask

N = 300
ROWS = torch.arange(N)[:, None]
COLS = torch.arange(N)[None, :]
CAUSAL = COLS <= ROWS
DOC_OF = torch.repeat_interleave(torch.arange(3), torch.tensor([90, 130, 80]))
SAME_DOC = DOC_OF[:, None] == DOC_OF[None, :]


def additive(mask: torch.Tensor, hidden: float) -> torch.Tensor:
    return torch.where(mask, 0.0, hidden)


def test_causal_needs_no_mask() -> None:
    for mask in (CAUSAL[None, None], additive(CAUSAL, float("-inf")),
                 additive(CAUSAL, torch.finfo(torch.float32).min).expand(2, 4, N, N)):
        found = recognize_mask(mask, N, N)
        assert found is not None and found.is_causal and found.block_mask is None


@pytest.mark.parametrize(("mask", "name"), [
    ((COLS <= ROWS) & (COLS > ROWS - 40), "sliding_causal:40"),
    (SAME_DOC & CAUSAL, "documents_causal:128"),
    (SAME_DOC, "documents:128"),
    (COLS == ROWS, "sliding_causal:1"),
])
def test_windows_and_documents_become_their_named_block_mask(mask: torch.Tensor,
                                                             name: str) -> None:
    for given in (mask[None, None].expand(2, 4, N, N), additive(mask, float("-inf"))):
        found = recognize_mask(given, N, N)
        assert found is not None and not found.is_causal and found.name == name
        assert found.block_mask is not None and found.block_mask.pattern == name
        assert torch.equal(found.block_mask.to_dense()[0, 0], mask)


@pytest.mark.parametrize("mask", [
    torch.rand(N, N) < 0.5,  # random
    CAUSAL & (COLS >= 5),  # left padding: the first rows see nothing
    CAUSAL & ~((ROWS == 200) & (COLS == 100)),  # one hole: not an interval
    (COLS <= ROWS) & (COLS > ROWS - 40) | (COLS == 0),  # a window with a sink key
    SAME_DOC & CAUSAL & (COLS > ROWS - 50),  # documents and a window together
], ids=["random", "padding", "hole", "sink", "documents-window"])
def test_other_masks_are_not_recognized(mask: torch.Tensor) -> None:
    assert recognize_mask(mask, N, N) is None


def test_rows_that_differ_between_batches_are_not_recognized() -> None:
    padded = CAUSAL[None, None].repeat(2, 1, 1, 1)
    padded[1, :, :, :3] = False
    assert recognize_mask(padded, N, N) is None


def test_a_bias_is_not_a_mask() -> None:
    alibi = -(ROWS - COLS).abs().float() * 0.1
    assert recognize_mask(torch.where(CAUSAL, alibi, float("-inf")), N, N) is None


def test_the_answer_is_kept_per_tensor_version() -> None:
    mask = CAUSAL.clone()
    first = recognize_mask(mask, N, N)
    assert recognize_mask(mask, N, N) is first
    mask[250, 10] = False  # in place: a new version, read again
    assert recognize_mask(mask, N, N) is None


def test_tuner_attention_runs_a_recognized_mask_as_what_it_is(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A dense window / document / causal mask given to tuner.attention runs as its block
    mask (or is_causal) and gives SDPA's answer with that mask; SDPA never sees the mask."""
    import tuner
    from tuner.dispatch import outside_scope as entry  # where a call outside our kernels goes

    seen: list[object] = []
    real_sdpa = entry.sdpa

    def spy(*args: object, **kw: object) -> torch.Tensor:
        seen.append(kw.get("attn_mask"))
        return real_sdpa(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(entry, "sdpa", spy)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, N, 32, generator=g) for _ in range(3))
    for mask in ((COLS <= ROWS) & (COLS > ROWS - 40), SAME_DOC & CAUSAL, CAUSAL):
        seen.clear()
        out = tuner.attention(q, k, v, attn_mask=mask[None, None])
        ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
        assert all(m is None for m in seen), "SDPA was handed the dense mask"
    # A mask that is none of them still reaches SDPA as given.
    other = torch.rand(N, N, generator=g) > 0.5
    other.fill_diagonal_(True)
    seen.clear()
    tuner.attention(q, k, v, attn_mask=other)
    assert seen and seen[-1] is other
