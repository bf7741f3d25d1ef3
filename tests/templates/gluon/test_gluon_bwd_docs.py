"""gluon_bwd's ``doc_offsets`` and ``window_offsets``: a mask of causal packed documents, or a
causal sliding window, run by its rows' first visible keys (templates/masks/row_ranges.py)
instead of its partial tiles. On the CPU: the first keys are the mask exactly, which masks
qualify, the knobs' constraints, the offline sm_90 build; on a Hopper GPU: gradients against
the reference and against the tiles' path."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from templates.base import Problem
from templates.compile.offline_target import TARGETS
from templates.gluon.bwd import GLUON_MISSING, TEMPLATE, GluonBwdConfig
from templates.masks.block_mask import BlockMask
from templates.masks.documents import document_block_mask
from templates.masks.mods import pattern_block_mask
from templates.masks.row_ranges import (
    PAST_EVERY_KEY,
    causal_window,
    row_first_keys,
    takes_offsets,
)
from tests.templates.gluon.gluon_checks import check_bwd_like, compile_reports, is_hopper

H100 = TARGETS["h100"]
needs_gluon = pytest.mark.skipif(bool(GLUON_MISSING), reason=GLUON_MISSING or "gluon present")
LENGTHS = [90, 0, 300, 17, 593]  # an empty document, ends inside blocks


def offsets(lengths: list[int]) -> list[int]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


def test_row_first_keys_are_the_mask_exactly() -> None:
    """Key j visible to query i iff first[i] <= j <= i: the same pairs as the dense mask;
    padded rows see nothing."""
    bounds = offsets(LENGTHS)
    mask = document_block_mask(bounds, bounds, causal=True, device="cpu")
    assert takes_offsets(mask)
    n = bounds[-1]
    first = row_first_keys(mask, 1152)
    assert first.dtype == torch.int32 and first.shape == (1152,)
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    computed = (j >= first[:n, None].long()) & (j <= i)
    assert torch.equal(computed, mask.to_dense()[0, 0])
    assert bool((first[n:] == PAST_EVERY_KEY).all())
    assert row_first_keys(mask, 1152) is first  # kept per documents and length


def test_only_causal_self_attention_documents_qualify() -> None:
    bounds = offsets(LENGTHS)
    assert not takes_offsets(document_block_mask(bounds, bounds, causal=False, device="cpu"))
    cross = offsets([100, 200, 350, 10, 430])
    assert not takes_offsets(document_block_mask(bounds, cross, causal=True, device="cpu"))
    assert not takes_offsets(BlockMask.from_dense(torch.ones(1, 1, 256, 256, dtype=torch.bool)))
    assert not takes_offsets(None)
    with pytest.raises(ValueError, match="causal self-attention documents"):
        row_first_keys(document_block_mask(bounds, bounds, causal=False, device="cpu"), 1152)


@needs_gluon
def test_the_knob_is_offered_on_causal_document_problems_only() -> None:
    docs = Problem(1, 32, 16, 16384, 16384, 128, "bfloat16", "none", "documents_causal:2048")
    dense = Problem(1, 32, 16, 16384, 16384, 128, "bfloat16", "top_left")
    sliding = Problem(1, 32, 16, 16384, 16384, 128, "bfloat16", "none", "sliding_causal:1024")
    # (longest_first, the default's too, needs a mask of any kind: not what this checks.)
    cfg = dataclasses.replace(TEMPLATE.default_config(docs, H100), doc_offsets=True,
                              longest_first=False)
    assert TEMPLATE.constraint(docs, cfg, H100) is None
    for problem in (dense, sliding):
        reason = TEMPLATE.constraint(problem, cfg, H100)
        assert reason is not None and "documents_causal" in reason
    # A call (its problem has no mask name) with a block mask takes it; without one, not.
    assert TEMPLATE.run_constraint(dense, cfg, H100, (128, 128)) is None
    reason = TEMPLATE.run_constraint(dense, cfg, H100, None)
    assert reason is not None and "no block mask" in reason
    # Measured faster on the H200: the default for documents, and for a call with a mask.
    assert TEMPLATE.default_config(docs, H100).doc_offsets
    assert not TEMPLATE.default_config(dense, H100).doc_offsets
    assert TEMPLATE.run_default(dense, H100, (128, 128)).doc_offsets
    assert not TEMPLATE.run_default(dense, H100, None).doc_offsets


@needs_gluon
def test_doc_offsets_compile_for_the_h100_with_fewer_spills() -> None:
    """The offline build of the one-partition kernel: the documents path compiles (no wgmma
    serialization) and spills no more than the tiles' path (triton 3.9 here: 72 against 96
    bytes at d128; 3.6, the GPU's: 48 against 56). (The split kernel, d128's default, builds
    in test_gluon_bwd_split.py: 40 against 48 bytes with 3.6, 136 against 128 with 3.9.)"""
    problems = [Problem(1, 32, 16, 16384, 16384, 128, "bfloat16", "none", "documents_causal:2048"),
                Problem(1, 32, 32, 16384, 16384, 64, "bfloat16", "none", "documents_causal:2048")]
    jobs: list[dict[str, Any]] = []
    for p in problems:
        cfg = dataclasses.replace(TEMPLATE.default_config(p, H100), split_warpgroups=False,
                                  longest_first=False)
        for docs in (False, True):
            jobs.append({"template": "gluon_bwd", "problem": p.to_dict(),
                         "config": dataclasses.replace(cfg, doc_offsets=docs).to_dict()})
    outcomes = compile_reports("templates.gluon.bwd", jobs)
    stacks = []
    for out in outcomes:
        assert out["error"] == "" and out["constraint"] == "", out
        _, main = out["kernels"]
        assert main["kernel"] == "_gluon_bwd_ws_kernel" and main["wgmma_serialized"] == "", out
        stacks.append(main["stack_bytes"])
    assert stacks[1] <= stacks[0] and stacks[3] <= stacks[2], stacks


@pytest.mark.parametrize(("n", "window"), [(1000, 300), (1000, 1024), (700, 1), (256, 128)])
def test_a_causal_windows_first_keys_are_the_mask_exactly(n: int, window: int) -> None:
    mask = pattern_block_mask(f"sliding_causal:{window}", n, n)
    assert causal_window(mask) == window and not takes_offsets(mask)
    rows = -(-n // 128) * 128
    first = row_first_keys(mask, rows)
    assert first.dtype == torch.int32 and first.shape == (rows,)
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    computed = (j >= first[:n, None].long()) & (j <= i)
    assert torch.equal(computed, mask.to_dense()[0, 0])
    assert bool((first[n:] == PAST_EVERY_KEY).all())
    assert row_first_keys(mask, rows) is first  # kept per window, length and device


def test_only_causal_windows_over_as_many_queries_as_keys_qualify() -> None:
    assert causal_window(pattern_block_mask("sliding:300", 1000, 1000)) is None
    assert causal_window(pattern_block_mask("sliding_causal:300", 500, 1000)) is None
    unnamed = BlockMask.from_dense(torch.tril(torch.ones(256, 256, dtype=torch.bool)))
    assert causal_window(unnamed) is None and causal_window(None) is None
    with pytest.raises(ValueError, match="sliding_causal"):
        row_first_keys(unnamed, 256)


@needs_gluon
def test_window_offsets_is_offered_on_causal_windows_only() -> None:
    sliding = Problem(1, 32, 16, 16384, 16384, 128, "bfloat16", "none", "sliding_causal:1024")
    docs = dataclasses.replace(sliding, mask="documents_causal:2048")
    cross = dataclasses.replace(sliding, seqlen_q=8192)
    cfg = dataclasses.replace(TEMPLATE.default_config(sliding, H100), window_offsets=True)
    assert TEMPLATE.constraint(sliding, cfg, H100) is None
    for problem in (docs, cross):
        reason = TEMPLATE.constraint(problem, cfg, H100)
        assert reason is not None and "sliding_causal" in reason, reason
    call = dataclasses.replace(sliding, mask="none")
    assert TEMPLATE.run_constraint(call, cfg, H100, (128, 128)) is None
    reason = TEMPLATE.run_constraint(call, cfg, H100, None)
    assert reason is not None and "window_offsets" in reason, reason
    # Not measured yet: no default takes it; a sweep of a window measures it first.
    assert not TEMPLATE.default_config(sliding, H100).window_offsets
    assert not TEMPLATE.run_default(call, H100, (128, 128)).window_offsets
    assert TEMPLATE.known_good_configs(sliding, H100)[0] == cfg
    assert not any(c.window_offsets for c in TEMPLATE.known_good_configs(docs, H100))


def test_a_plan_for_a_window_is_kept_apart() -> None:
    from templates.gluon.bwd import _plan_key

    q, k, v, do, o = (torch.randn(1, 2, 256, 64).half() for _ in range(5))
    lse = torch.randn(1, 2, 256)
    named = pattern_block_mask("sliding_causal:100", 256, 256)
    unnamed = BlockMask.from_dense(named.to_dense())
    keys = [_plan_key(do, q, k, v, o, lse, False, None, None, m) for m in (named, unnamed)]
    assert keys[0] != keys[1]


# ----------------------------------------------------------------------------- GPU numerics
DOC_CASES = [
    (1, 8, 2, 2048, 2048, 128, "bfloat16", "none", "documents_causal:512"),  # GQA
    (1, 2, 2, 1500, 1500, 64, "float16", "none", "documents_causal:256"),  # odd length
    (2, 4, 4, 1000, 1000, 128, "float16", "none", "documents_causal:128"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", DOC_CASES, ids=lambda c: Problem(*c).key())
def test_doc_offsets_match_the_reference_and_the_tiles(case: tuple[Any, ...],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    if not is_hopper():
        pytest.skip("gluon_bwd needs a Hopper GPU")
    from templates.device import current_device
    from templates.gluon import bwd_kernel as gluon_bwd_kernel

    monkeypatch.setattr(gluon_bwd_kernel, "DEBUG_POISON", True)  # unwritten dk/dv read NaN
    problem = Problem(*case)
    inputs = TEMPLATE.make_inputs(problem, "cuda", seed=3)
    assert takes_offsets(inputs["block_mask"]), "the stand-in documents carry their offsets"
    # The default takes doc_offsets for documents: the tiles' path is the same without it.
    base = dataclasses.replace(TEMPLATE.default_config(problem, current_device()),
                               doc_offsets=False)
    docs = dataclasses.replace(base, doc_offsets=True)
    # dk and dv are summed in registers in one order either way: bit for bit the tiles'.
    check_bwd_like(TEMPLATE, inputs, problem, docs, base)


WINDOW_CASES = [
    (1, 8, 2, 2048, 2048, 128, "bfloat16", "none", "sliding_causal:512"),  # GQA
    (1, 2, 2, 1500, 1500, 64, "float16", "none", "sliding_causal:300"),  # odd length, window
    (2, 4, 4, 1000, 1000, 128, "float16", "none", "sliding_causal:1"),  # the diagonal only
]


@pytest.mark.gpu
@pytest.mark.parametrize("split", [False, True], ids=["one_partition", "split"])
@pytest.mark.parametrize("case", WINDOW_CASES, ids=lambda c: Problem(*c).key())
def test_window_offsets_match_the_reference_and_the_tiles(case: tuple[Any, ...], split: bool,
                                                          monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    if not is_hopper():
        pytest.skip("gluon_bwd needs a Hopper GPU")
    from templates.gluon import bwd_kernel as gluon_bwd_kernel

    monkeypatch.setattr(gluon_bwd_kernel, "DEBUG_POISON", True)  # unwritten dk/dv read NaN
    problem = Problem(*case)
    inputs = TEMPLATE.make_inputs(problem, "cuda", seed=3)
    assert causal_window(inputs["block_mask"]) is not None, "the named window is its mask"
    base = GluonBwdConfig(warp_specialize=True, split_warpgroups=split)
    window = dataclasses.replace(base, window_offsets=True)
    if TEMPLATE.constraint(problem, window, H100):
        pytest.skip(f"{window.key()} does not fit {problem.key()}")
    check_bwd_like(TEMPLATE, inputs, problem, window, base)


@needs_gluon
def test_a_sweep_of_documents_measures_the_tiles_too() -> None:
    docs = Problem(1, 32, 16, 16384, 16384, 128, "bfloat16", "none", "documents_causal:2048")
    sliding = Problem(1, 32, 16, 16384, 16384, 128, "bfloat16", "none", "sliding_causal:1024")
    tiles = dataclasses.replace(TEMPLATE.default_config(docs, H100), doc_offsets=False)
    assert tiles in TEMPLATE.known_good_configs(docs, H100)
    assert not TEMPLATE.default_config(sliding, H100).doc_offsets
    assert not any(c.doc_offsets for c in TEMPLATE.known_good_configs(sliding, H100))
