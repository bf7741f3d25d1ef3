"""flash_fwd's ``doc_offsets`` (the Triton forward): a partial block of causal packed
documents or of a causal window by its rows' first visible keys instead of its uint8 tile.
Under the interpreter: the same outputs as the tile path bit for bit (the same scores are
visible, in the same order) and right against the reference; a mask whose rows are not one
range keeps its tiles; the constraint, the plan's key and the sweep's alternative."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from templates.attention_reference import attention_reference
from templates.base import Problem
from templates.compile.offline_target import TARGETS
from templates.flash.fwd import TEMPLATE, FwdConfig, flash_attention_fwd
from templates.masks.documents import document_block_mask
from templates.masks.mods import pattern_block_mask
from tests.templates.flash.test_block_sparse import qkv

H100 = TARGETS["h100"]
TILES = FwdConfig(BLOCK_M=32, BLOCK_N=32, num_warps=4, num_stages=1)
OFFSETS = [0, 37, 90, 90, 201, 300]  # odd lengths, an empty document


def _masks(n: int) -> dict[str, object]:
    return {"documents": document_block_mask(OFFSETS, OFFSETS, causal=True, device="cpu",
                                             block_size=64),
            # (the sweeps' block size: a pattern's mask carries its name only with it)
            "window": pattern_block_mask("sliding_causal:50", n, n),
            "random": pattern_block_mask("random:0.5", n, n, block_size=64)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_rows_first_keys_give_the_tiles_outputs(dtype: torch.dtype) -> None:
    from templates.flash import fwd as flash_fwd

    n = 300
    q, k, v = qkv(1, 4, 2, n, n, 32, dtype, "cpu")
    offsets = dataclasses.replace(TILES, doc_offsets=True)
    for name, mask in _masks(n).items():
        o, lse = flash_attention_fwd(q, k, v, config=offsets, block_mask=mask)
        o_tiles, lse_tiles = flash_attention_fwd(q, k, v, config=TILES, block_mask=mask)
        plan = flash_fwd._cached_plan(q, k, v, False, None, mask, None, offsets)
        assert plan.options["SPARSE"] == (True if name == "random" else 2), name
        assert torch.equal(o, o_tiles) and torch.equal(lse, lse_tiles), name
        ref = attention_reference(q, k, v, causal="none", scale=32 ** -0.5,
                                  mask=mask.to_dense())  # type: ignore[attr-defined]
        problem = Problem(1, 4, 2, n, n, 32, str(dtype).removeprefix("torch."), "none")
        assert TEMPLATE.error((o, lse), ref) <= TEMPLATE.tolerance(problem), name


def test_the_constraint_and_the_sweeps_alternative() -> None:
    alternatives = assert_doc_offsets_defaults(TEMPLATE)
    assert all(isinstance(c, FwdConfig) and c.doc_offsets for c in alternatives[1:])


def assert_doc_offsets_defaults(template: Any) -> list[Any]:
    """A forward template's doc_offsets (``template``: flash_fwd's or gluon_fwd's): refused
    without a block mask; on in the default of a documents_causal problem, whose sweep
    measures the default's tile path first; off for a random mask, none of whose
    alternatives has it. Returns the documents problem's alternatives."""
    dense = Problem(1, 16, 16, 4096, 4096, 128, "bfloat16", "top_left")
    on = dataclasses.replace(template.default_config(dense, H100), doc_offsets=True)
    reason = template.constraint(dense, on, H100)
    assert reason is not None and "doc_offsets reads a block mask" in reason
    docs = Problem(1, 16, 16, 4096, 4096, 128, "bfloat16", "none", mask="documents_causal:512")
    default = template.default_config(docs, H100)
    assert default.doc_offsets and template.constraint(docs, default, H100) is None
    # the sweep's first alternative: the default with its tiles, so the knob is measured
    alternatives = template.known_good_configs(docs, H100)
    assert alternatives[0] == dataclasses.replace(default, doc_offsets=False)
    random = dataclasses.replace(docs, mask="random:0.5")
    assert not template.default_config(random, H100).doc_offsets
    assert not any(c.doc_offsets for c in template.known_good_configs(random, H100))
    return alternatives


def test_masks_of_one_geometry_get_their_own_plans() -> None:
    from templates.flash import fwd as flash_fwd

    q = torch.empty(1, 4, 300, 32)
    masks = _masks(300)
    offsets = dataclasses.replace(TILES, doc_offsets=True)
    keys = {flash_fwd._plan_key(q, q, q, False, None, masks[name], None, offsets)
            for name in ("documents", "random")}
    assert len(keys) == 2
