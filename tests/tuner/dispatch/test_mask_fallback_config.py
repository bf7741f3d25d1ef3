"""Masked calls no measurement of their mask problem prices: the dense problem's configs where
that problem is measured itself, else the templates' defaults; never a nearest neighbour's
(on the H100 a flash_bwd config tuned for a one-token decode problem, the nearest stored,
made a sliding-window training step 2.3x slower than the default)."""

from __future__ import annotations

import dataclasses
import importlib
from pathlib import Path

import pytest
import torch

from templates.base import Problem
from templates.device import current_device
from templates.registry import get_template
from tests.tuner.dispatch.test_dispatch import measured, store

pytestmark = pytest.mark.usefixtures("no_tuned_configs")
flash_module = importlib.import_module("tuner.dispatch.implementations.flash")


def inputs(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(1, 4, n, 16), torch.randn(1, 2, n, 16)


def other_config(template: str, p: Problem) -> dict[str, object]:
    """A valid config of ``template`` unlike its default for ``p``."""
    t = get_template(template)
    default = t.default_config(p, current_device()).to_dict()
    cfg = dict(default)
    cfg["num_warps"] = 8 if default["num_warps"] == 4 else 4
    assert t.config(cfg) != t.default_config(p, current_device())
    return cfg


@pytest.mark.parametrize("template", ["flash_fwd", "flash_bwd"])
def test_a_nearest_neighbours_config_is_not_used(tmp_path: Path, template: str) -> None:
    q, k = inputs(64)
    dense = Problem(1, 4, 2, 64, 64, 16, "float32", "none")
    decode = Problem(1, 4, 2, 1, 64, 16, "float32", "none")  # another bucket: nearest only
    store(tmp_path, measured(template, decode, 100.0, other_config(template, decode)))
    got = flash_module.mask_fallback_config(template, q, k, False)
    assert got == get_template(template).default_config(dense, current_device())


@pytest.mark.parametrize("template", ["flash_fwd", "flash_bwd"])
def test_the_dense_problems_own_measurement_is_used(tmp_path: Path, template: str) -> None:
    q, k = inputs(64)
    dense = Problem(1, 4, 2, 64, 64, 16, "float32", "none")
    cfg = other_config(template, dense)
    store(tmp_path, measured(template, dense, 100.0, cfg))
    got = flash_module.mask_fallback_config(template, q, k, False)
    assert got == get_template(template).config(cfg)


def test_a_block_masks_fallback_forward_reads_rows_by_their_first_keys(tmp_path: Path) -> None:
    """The dense problem's forward config runs a block mask with doc_offsets on (the
    forwards' own default under a block mask; the mask's rows decide at launch), and an
    elementwise mask with it as measured (doc_offsets needs a block mask)."""
    from templates.masks.mods import pattern_block_mask
    from tuner.dispatch.implementations.mask_args import Masked

    q, k = inputs(64)
    dense = Problem(1, 4, 2, 64, 64, 16, "float32", "none")
    cfg = other_config("flash_fwd", dense)
    store(tmp_path, measured("flash_fwd", dense, 100.0, cfg))
    unnamed = Masked(block_mask=pattern_block_mask("sliding_causal:32", 64, 64, block_size=16))
    assert unnamed.pattern is None  # (not the sweeps' blocks: no measurement can name it)
    fwd, _ = flash_module.masked_configs(q, k, False, unnamed, None, False)
    assert fwd.doc_offsets and dataclasses.replace(fwd, doc_offsets=False) == (
        flash_module.fit_to_block_mask(get_template("flash_fwd").config(cfg), (16, 16)))
    elementwise = Masked(attn_mask=torch.ones(1, 4, 64, 64, dtype=torch.bool))
    fwd, _ = flash_module.masked_configs(q, k, False, elementwise, None, False)
    assert fwd == get_template("flash_fwd").config(cfg)
