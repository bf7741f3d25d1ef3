"""tuner.varlen_attention: packed documents against a per-document loop of torch SDPA
(forward and gradients, fp32 and fp16 under the interpreter, odd lengths, GQA, empty
documents, query and key offsets that differ; softcapped scores against eager attention per
document), and its errors for bad cu_seqlens and caps."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import templates.masks.documents
import tuner
from templates.base import Problem
from templates.device import current_device
from templates.masks.block_mask import BlockMask
from tests.tuner.dispatch.test_dispatch import measured, store
from tuner.dispatch.rule import Call, choose
from tuner.varlen import (
    clear_document_masks,
    document_block_mask,
    varlen_attention,
    varlen_attention_reference,
)

pytestmark = pytest.mark.usefixtures("no_tuned_configs")

# Odd lengths, none a multiple of a tile, an empty document in the middle; 300 tokens are
# three query blocks of 128, so full, partial and skipped blocks all occur.
SELF = [0, 37, 170, 170, 213, 300]
# Keys longer than queries in some documents, shorter in others (bottom-right causal).
CROSS_Q, CROSS_K = [0, 20, 150, 150, 190], [0, 60, 90, 130, 260]


def cu(offsets: list[int], dtype: torch.dtype = torch.int32, device: str = "cpu"
       ) -> torch.Tensor:
    return torch.tensor(offsets, dtype=dtype, device=device)


def inputs(offsets_q: list[int], offsets_k: list[int], dtype: torch.dtype, device: str,
           heads: tuple[int, int] = (4, 2), dim: int = 16
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    q = torch.randn(offsets_q[-1], heads[0], dim, dtype=dtype, device=device)
    k = torch.randn(offsets_k[-1], heads[1], dim, dtype=dtype, device=device)
    v = torch.randn(offsets_k[-1], heads[1], dim, dtype=dtype, device=device)
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_()


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.detach().double() - want.detach().double()).norm()
                 / want.detach().double().norm())


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("offsets_q", "offsets_k"), [(SELF, SELF), (CROSS_Q, CROSS_K)],
                         ids=["self", "cross"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_forward_and_gradients_match_the_per_document_loop(
        device: str, causal: bool, offsets_q: list[int], offsets_k: list[int],
        dtype: torch.dtype) -> None:
    q, k, v = inputs(offsets_q, offsets_k, dtype, device)
    cu_q, cu_k = cu(offsets_q, device=device), cu(offsets_k, device=device)
    out = varlen_attention(q, k, v, cu_q, cu_k, 133, 133, causal=causal)
    ref = varlen_attention_reference(q, k, v, cu_q, cu_k, causal=causal)
    assert out.shape == (offsets_q[-1], 4, 16) and out.dtype == dtype and out.is_contiguous()
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(ref, (q, k, v), grad)
    tolerance = 1e-5 if dtype == torch.float32 else 5e-3  # benchmarks/dispatch_bench.TOLERANCE
    assert relative_error(out, ref) < tolerance
    for name, g, w in zip("qkv", got, want, strict=True):
        assert relative_error(g, w) < tolerance * 5, name


@pytest.mark.parametrize("causal", [False, True])
def test_softcapped_documents_match_the_per_document_eager_loop(device: str,
                                                                causal: bool) -> None:
    """Gemma 2's capped scores within each document, forward and gradients, against eager
    attention per document; the cap is applied (a small cap moves the output)."""
    q, k, v = inputs(CROSS_Q, CROSS_K, torch.float32, device)
    q, k = (t.detach().mul(4).requires_grad_() for t in (q, k))  # scores the cap bends
    cu_q, cu_k = cu(CROSS_Q, device=device), cu(CROSS_K, device=device)
    out = varlen_attention(q, k, v, cu_q, cu_k, 130, 130, causal=causal, softcap=2.0)
    ref = varlen_attention_reference(q, k, v, cu_q, cu_k, causal=causal, softcap=2.0)
    uncapped = varlen_attention_reference(q, k, v, cu_q, cu_k, causal=causal)
    assert relative_error(out, ref) < 1e-5 and relative_error(uncapped, ref) > 1e-2
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(ref, (q, k, v), grad)
    for name, g, w in zip("qkv", got, want, strict=True):
        assert relative_error(g, w) < 5e-5, name


def test_queries_that_see_no_key_get_zeros(device: str) -> None:
    """Bottom-right causal with more queries than keys (FlashAttention's rule: the first
    L_q - L_k queries of the document see nothing), and a document with no keys at all."""
    offsets_q, offsets_k = [0, 10, 16, 20], [0, 4, 4, 24]
    q, k, v = inputs(offsets_q, offsets_k, torch.float32, device)
    out = varlen_attention(q, k, v, cu(offsets_q, device=device),
                           cu(offsets_k, device=device), 10, 20, causal=True)
    assert torch.equal(out[:6], torch.zeros_like(out[:6]))  # 10 queries, 4 keys
    assert torch.equal(out[10:16], torch.zeros_like(out[10:16]))  # no keys
    assert out[6:10].abs().sum() > 0 and out[16:].abs().sum() > 0
    ref = varlen_attention_reference(q, k, v, cu(offsets_q), cu(offsets_k), causal=True)
    assert relative_error(out, ref) < 1e-5


def test_the_mask_has_full_partial_and_skipped_blocks_and_a_priced_pattern() -> None:
    """Built from the offsets at small blocks, it is exactly the document rule evaluated
    everywhere (``from_mask_mod``), with most blocks never evaluated."""
    for causal in (False, True):
        for offsets_q, offsets_k in ((SELF, SELF), (CROSS_Q, CROSS_K)):
            mask = document_block_mask(offsets_q, offsets_k, causal=causal, device="cpu",
                                       block_size=16)
            rows = torch.arange(offsets_q[-1])[:, None]
            cols = torch.arange(offsets_k[-1])[None, :]
            want = torch.zeros(offsets_q[-1], offsets_k[-1], dtype=torch.bool)
            for d in range(len(offsets_q) - 1):
                in_doc = ((rows >= offsets_q[d]) & (rows < offsets_q[d + 1])
                          & (cols >= offsets_k[d]) & (cols < offsets_k[d + 1]))
                if causal:  # bottom-right: j - end_k <= i - end_q
                    in_doc &= cols - offsets_k[d + 1] <= rows - offsets_q[d + 1]
                want |= in_doc
            assert torch.equal(mask.to_dense()[0, 0], want), (causal, offsets_q)
            dense = BlockMask.from_dense(want, 16)
            assert torch.equal(mask.full_counts, dense.full_counts)
            assert torch.equal(mask.partial_counts, dense.partial_counts)
            assert int(mask.full_counts.sum()) > 0 and int(mask.partial_counts.sum()) > 0
            assert mask.density() < 0.7
            assert mask.pattern is None  # blocks of 16: not the sweeps' mask
    lengths = [37, 133, 0, 43, 87]  # per-token document length ~95 -> 2^6.6 -> 128
    assert document_block_mask(SELF, SELF, causal=True, device="cpu").pattern == (
        "documents_causal:128")
    assert document_block_mask(SELF, SELF, causal=False, device="cpu").pattern == (
        "documents:128")
    assert sum(lengths) == SELF[-1]
    assert document_block_mask(CROSS_Q, CROSS_K, causal=True, device="cpu").pattern is None


def test_the_mask_is_built_once_for_the_same_documents(device: str,
                                                       monkeypatch: pytest.MonkeyPatch
                                                       ) -> None:
    clear_document_masks()
    built: list[object] = []
    real = templates.masks.documents._build_document_mask

    def counting(*args: Any) -> BlockMask:
        built.append(args)
        return real(*args)

    monkeypatch.setattr(templates.masks.documents, "_build_document_mask", counting)
    q, k, v = inputs(SELF, SELF, torch.float32, device)
    cu_32, cu_64 = cu(SELF, device=device), cu(SELF, torch.int64, device)
    with torch.no_grad():
        for _ in range(3):  # three layers of one step
            varlen_attention(q, k, v, cu_32, cu_64, 133, 133, causal=True)
        assert len(built) == 1
        varlen_attention(q, k, v, cu_32, cu_32, 133, 133, causal=False)
        assert len(built) == 2
    for i in range(templates.masks.documents.MAX_CACHED_MASKS + 2):  # the LRU stays small
        document_block_mask([0, i + 1], [0, i + 1], causal=True, device="cpu")
    assert len(templates.masks.documents._MASKS) == templates.masks.documents.MAX_CACHED_MASKS


def test_a_measured_flex_win_on_the_documents_problem_runs_flex(
        tmp_path: Path, device: str, flex_calls: list[dict[str, Any]]) -> None:
    """The mask is priced as its named problem, like any other: Flex measured faster on
    ``documents_causal:128`` at these shapes runs Flex; unmeasured, ours."""
    q, k, v = inputs(SELF, SELF, torch.float32, device)
    cu_q = cu(SELF, device=device)
    with torch.no_grad():
        varlen_attention(q, k, v, cu_q, cu_q, 133, 133, causal=True)
    assert not flex_calls
    p = Problem(batch=1, heads_q=4, heads_kv=2, seqlen_q=300, seqlen_kv=300, head_dim=16,
                dtype="float32", causal="none", mask="documents_causal:128")
    store(tmp_path, measured("flash_fwd", p, 100.0), measured("torch_flex", p, 150.0))
    assert choose(Call(p, False, current_device())).implementation.name == "flex"
    with torch.no_grad():
        out = varlen_attention(q, k, v, cu_q, cu_q, 133, 133, causal=True)
    [call] = flex_calls
    assert call["block_mask"].pattern == p.mask and call["causal"] == "none"
    ref = varlen_attention_reference(q, k, v, cu_q, cu_q, causal=True)
    assert relative_error(out, ref) < 1e-5


def test_it_is_exported() -> None:
    assert tuner.varlen_attention is varlen_attention
    assert "varlen_attention" in tuner.__all__


# ----------------------------------------------------------------------------- errors
def call_with(**changes: Any) -> None:
    q, k, v = inputs([0, 5, 9], [0, 5, 9], torch.float32, "cpu")
    args: dict[str, Any] = dict(q=q, k=k, v=v, cu_seqlens_q=cu([0, 5, 9]),
                                cu_seqlens_k=cu([0, 5, 9]), max_seqlen_q=5, max_seqlen_k=5)
    args.update(changes)
    varlen_attention(**args)


@pytest.mark.parametrize(("changes", "error", "words"), [
    ({"cu_seqlens_q": torch.tensor([0.0, 5.0, 9.0])}, TypeError,
     ["cu_seqlens_q", "int32 or int64", "float32"]),
    ({"cu_seqlens_k": cu([0, 7, 5, 9])}, ValueError,
     ["cu_seqlens_k", "must not decrease", "cu_seqlens_k[2] = 5", "cu_seqlens_k[1] = 7"]),
    ({"cu_seqlens_q": cu([1, 5, 9])}, ValueError, ["cu_seqlens_q[0] must be 0"]),
    ({"cu_seqlens_q": cu([0, 5, 8])}, ValueError,
     ["cu_seqlens_q[-1]", "total number of tokens 9", "is 8"]),
    ({"cu_seqlens_k": cu([0, 9])}, ValueError, ["same documents", "3 and 2"]),
    ({"cu_seqlens_q": cu([[0, 5, 9]])}, ValueError, ["cu_seqlens_q", "1-D"]),
    ({"max_seqlen_q": 4}, ValueError, ["max_seqlen_q (4)", "document 0 has 5 tokens"]),
    ({"max_seqlen_k": 4.0}, TypeError, ["max_seqlen_k must be an int"]),
    ({"q": torch.randn(1, 9, 4, 16)}, ValueError, ["q must be (total_tokens, heads, head_dim)"]),
    ({"q": torch.randn(9, 3, 16)}, ValueError, ["query heads (3)", "key/value heads (2)"]),
    ({"softcap": -1.0}, ValueError, ["softcap must be a finite number >= 0", "-1.0"]),
    ({"softcap": "50"}, TypeError, ["softcap must be a finite number >= 0", "str"]),
])
def test_bad_arguments_are_named(changes: dict[str, Any], error: type[Exception],
                                 words: list[str]) -> None:
    with pytest.raises(error) as info:
        call_with(**changes)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_cu_seqlens_on_another_device_is_refused() -> None:
    with pytest.raises(ValueError, match="cu_seqlens_q must be on the inputs' device cpu"):
        call_with(cu_seqlens_q=torch.empty(3, dtype=torch.int32, device="meta"))


# ----------------------------------------------------------------------------- cu_seqlens reads
def test_a_cu_seqlens_tensor_is_read_once_while_it_is_unchanged(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The offsets are a device-to-host copy (a wait on the GPU): read once per tensor, and
    again after the tensor changes in place, with every rule checked on the new values."""
    import tuner.varlen as varlen_module

    reads: list[object] = []
    real = torch.Tensor.tolist

    def counting(self: torch.Tensor) -> object:
        reads.append(self)
        return real(self)

    monkeypatch.setattr(torch.Tensor, "tolist", counting)
    offsets = cu([0, 5, 9])
    for _ in range(3):
        assert varlen_module._offsets("cu_seqlens_q", offsets, 9, offsets.device) == (0, 5, 9)
    assert len(reads) == 1
    with pytest.raises(ValueError, match=r"total number of tokens 12, but is 9"):
        varlen_module._offsets("cu_seqlens_q", offsets, 12, offsets.device)
    offsets[1] = 7  # in place: read again
    assert varlen_module._offsets("cu_seqlens_q", offsets, 9, offsets.device) == (0, 7, 9)
    offsets[1] = 11
    with pytest.raises(ValueError, match="must not decrease"):
        varlen_module._offsets("cu_seqlens_q", offsets, 9, offsets.device)
    assert len(reads) == 3


def test_a_freed_cu_seqlens_tensor_leaves_nothing_behind() -> None:
    import gc

    import tuner.varlen as varlen_module

    offsets = cu([0, 3, 4])
    varlen_module._offsets("cu_seqlens_k", offsets, 4, offsets.device)
    key = id(offsets)
    assert key in varlen_module._offsets_seen
    del offsets
    gc.collect()
    assert key not in varlen_module._offsets_seen


def test_the_gradient_path_has_no_select() -> None:
    """The (1, H, T, D) output leaves as a squeeze, not ``out[0]``: a select's backward is a
    zeroed (1, H, T, D) tensor and a strided copy into it, which also hands the kernels'
    backward the gradient in (H, T, D) order (torch's varlen then copied it again: 0.38 ms of
    a 16k-token step on the H200)."""
    q, k, v = inputs(SELF, SELF, torch.float32, "cpu")
    out = varlen_attention(q, k, v, cu(SELF), cu(SELF), 170, 170, causal=True)
    seen, todo = set(), [out.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        todo.extend(fn for fn, _ in node.next_functions)
    names = {type(node).__name__ for node in seen}
    assert "SqueezeBackward1" in names or "SqueezeBackward0" in names, names
    assert not any(name.startswith("SelectBackward") for name in names), names
