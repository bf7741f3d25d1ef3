"""gluon_fwd's ``doc_offsets``: under a block mask whose rows each see one causal range of
keys (causal packed documents, a causal window), a partial block's visibility from the rows'
first visible keys instead of its uint8 tile. On the CPU: which masks qualify, the plan's
key, the mask as the kernel reads it, the constraint, the sweep's alternative, the offline
sm_90 build; on the GPU: the outputs against the reference and against the tile path."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from templates.base import Problem
from templates.compile.offline_target import TARGETS
from templates.gluon.fwd import GLUON_MISSING, TEMPLATE
from tests.templates.gluon.gluon_checks import compile_reports, is_hopper

H100 = TARGETS["h100"]
needs_gluon = pytest.mark.skipif(bool(GLUON_MISSING), reason=GLUON_MISSING or "gluon present")
OFFSETS = [0, 37, 700, 700, 1900, 3333]  # odd lengths, an empty document


def _masks(n: int, device: str) -> dict[str, Any]:
    from templates.masks.documents import document_block_mask
    from templates.masks.mods import pattern_block_mask

    offsets = [min(o, n) for o in OFFSETS[:-1]] + [n]
    return {"documents": document_block_mask(offsets, offsets, causal=True, device=device),
            "window": pattern_block_mask("sliding_causal:1024", n, n, device=device),
            "random": pattern_block_mask("random:0.5", n, n, device=device)}


@needs_gluon
def test_which_masks_take_offsets_and_how_the_kernel_reads_them() -> None:
    from templates.masks.row_ranges import PAST_EVERY_KEY, WithFirstKeys, rows_take_offsets

    masks = _masks(3333, "cpu")
    assert rows_take_offsets(masks["documents"])
    assert rows_take_offsets(masks["window"])
    assert not rows_take_offsets(masks["random"])
    assert not rows_take_offsets(None)
    seen = WithFirstKeys(masks["documents"], 3456)
    args, own = seen.kernel_args(), masks["documents"].kernel_args()
    assert [a is b for a, b in zip(args, own, strict=True)] == [True] * 5 + [False] + [True] * (
        len(own) - 6)
    first = args[5]
    assert first.dtype == torch.int32 and first.shape == (3456,)
    assert first[36] == 0 and first[37] == 37 and first[699] == 37 and first[700] == 700
    assert bool((first[3333:] == PAST_EVERY_KEY).all())
    assert seen.block_size == masks["documents"].block_size  # the rest is the mask's


@needs_gluon
def test_the_constraint_the_plan_key_and_the_sweeps_alternative() -> None:
    from templates.gluon import fwd as gluon_fwd
    from tests.templates.flash.test_flash_fwd_doc_offsets import assert_doc_offsets_defaults

    assert len(assert_doc_offsets_defaults(TEMPLATE)) == 1  # the tile path alone
    random = Problem(1, 16, 16, 4096, 4096, 128, "bfloat16", "none", mask="random:0.5")
    assert TEMPLATE.known_good_configs(random, H100) == []
    on = dataclasses.replace(TEMPLATE.default_config(random, H100), doc_offsets=True)
    # Masks of one geometry, one whose rows take offsets and one not: two plans.
    q = torch.empty(1, 4, 3333, 128, dtype=torch.bfloat16)
    masks = _masks(3333, "cpu")
    keys = {gluon_fwd._plan_key(q, q, q, False, None, on, masks[name])
            for name in ("documents", "random")}
    assert len(keys) == 2


@needs_gluon
def test_it_builds_for_the_h100_without_new_spills() -> None:
    jobs = []
    for mask in ("documents_causal:1024", "sliding_causal:1024"):
        problem = Problem(1, 16, 16, 16384, 16384, 128, "bfloat16", "none", mask=mask)
        base = TEMPLATE.default_config(problem, H100)
        for cfg in (base, dataclasses.replace(base, doc_offsets=True)):
            jobs.append({"template": "gluon_fwd", "problem": problem.to_dict(),
                         "config": cfg.to_dict()})
    outcomes = compile_reports("templates.gluon.fwd", jobs)
    for tiles, offsets in zip(outcomes[::2], outcomes[1::2], strict=True):
        assert tiles["error"] == "" and offsets["error"] == "", (tiles, offsets)
        (a,), (b,) = tiles["kernels"], offsets["kernels"]
        assert b["registers"] <= a["registers"] and b["stack_bytes"] <= a["stack_bytes"], (a, b)
        assert b["wgmma_serialized"] == "", b


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_doc_offsets_on_the_gpu(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """Documents (odd lengths, an empty one) and a causal window by their rows' first keys:
    right against the reference and equal to the tile path within rounding; a random mask
    with doc_offsets keeps its tiles (the same outputs bit for bit)."""
    if not is_hopper():
        pytest.skip("gluon_fwd needs a Hopper GPU")
    from templates.attention_reference import attention_reference
    from templates.device import current_device
    from templates.gluon import fwd_kernel as gluon_fwd_kernel
    from templates.gluon.fwd import gluon_attention_fwd
    from tests.templates.flash.test_block_sparse import qkv

    monkeypatch.setattr(gluon_fwd_kernel, "DEBUG_POISON", True)
    device = current_device()
    for d, n in ((128, 3333), (64, 1500)):
        q, k, v = qkv(1, 8, 2, n, n, d, dtype, "cuda")
        problem = Problem(1, 8, 2, n, n, d, "bfloat16", "none", mask="documents_causal:512")
        # (the documents problem's default has doc_offsets on: the tile path is the knob off)
        offsets = TEMPLATE.default_config(problem, device)
        tiles = dataclasses.replace(offsets, doc_offsets=False)
        assert offsets.doc_offsets
        for name, bm in _masks(n, "cuda").items():
            o, lse = gluon_attention_fwd(q, k, v, config=offsets, block_mask=bm)
            o_tiles, lse_tiles = gluon_attention_fwd(q, k, v, config=tiles, block_mask=bm)
            ref = attention_reference(q, k, v, causal="none", scale=d ** -0.5,
                                      mask=bm.to_dense())
            err = TEMPLATE.error((o, lse), ref)
            assert err <= TEMPLATE.tolerance(problem), (name, d, err)
            if name == "random":
                assert torch.equal(o, o_tiles) and torch.equal(lse, lse_tiles)
            else:
                assert TEMPLATE.error((o, lse), (o_tiles, lse_tiles)) <= 1e-3, (name, d)
