"""Block-mask calls on Hopper: the Gluon forward runs a masked call that needs no gradient
where it is measured faster on the mask's named problem (or is forced), never one that needs
a gradient, never an elementwise ``attn_mask``.

The CPU stands in for an H100 here: the calls' device is the H100 of tests/api/serving_data
(the measurements are stored for it), and ``gluon_attention_fwd`` is a recorder that checks
its config as the real one does and answers with the reference (Gluon kernels do not run
under the interpreter); our kernels run under the interpreter. The recorder is reached only
through the dispatcher's Gluon branch: the dense Gluon plan (``tuner.dispatch.implementations``)
holds its own reference to the real function."""

from __future__ import annotations

import dataclasses
import importlib
from pathlib import Path
from typing import Any

import pytest
import torch

import templates.gluon.fwd
import tuner
from templates.attention_reference import attention_reference
from templates.base import Problem, Template
from templates.masks.block_mask import BlockMask
from templates.masks.mods import pattern_block_mask
from templates.registry import get_template
from tests.api.serving_data import H100
from tests.tuner.dispatch.test_dispatch import measured as measured_on
from tests.tuner.dispatch.test_dispatch import store
from tuner.dispatch.rule import Call, choose

pytestmark = pytest.mark.usefixtures("no_tuned_configs", "on_hopper")

PATTERN = "sliding:64"
N = 256  # two 128-blocks each way: the block below the diagonal is partly visible
SCALE = 64 ** -0.5
MASKED = Problem(batch=1, heads_q=4, heads_kv=2, seqlen_q=N, seqlen_kv=N, head_dim=64,
                 dtype="bfloat16", causal="top_left", mask=PATTERN)
GLUON = get_template("gluon_fwd")
call_module = importlib.import_module("tuner.dispatch.implementations.call")


@pytest.fixture
def on_hopper(monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU tensors' calls priced and run as an H100's."""
    monkeypatch.setattr(call_module, "cpu_device", lambda: H100)


@pytest.fixture
def gluon_calls(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Calls of templates.gluon.fwd.gluon_attention_fwd, answered with the reference."""
    calls: list[dict[str, Any]] = []

    def recorder(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append({"k_heads": k.shape[1], **kwargs})
        # What the real entry checks (GluonTemplate.config_to_run) before it launches.
        call_problem = templates.gluon.fwd.problem_of(q, k, kwargs["causal"])
        assert GLUON.run_constraint(call_problem, kwargs["config"], H100,
                                    kwargs["block_mask"].block_size) is None
        o, lse = attention_reference(q, k, v, causal=kwargs["causal"],
                                     scale=kwargs["scale"] or q.shape[-1] ** -0.5,
                                     mask=kwargs["block_mask"].to_dense())
        return o.to(q.dtype), lse.float()

    monkeypatch.setattr(templates.gluon.fwd, "gluon_attention_fwd", recorder)
    return calls


def measured(template: str, tflops: float, config: dict[str, Any] | None = None
             ) -> dict[str, Any]:
    """A stored best of ``template`` for the mask problem on the H100."""
    return measured_on(template, MASKED, tflops, config, device=H100)


def gluon_config_not_the_default(template: Template = GLUON, problem: Problem = MASKED
                                 ) -> dict[str, Any]:
    """A config of a Gluon template that runs ``problem`` on the H100 other than its default
    (the other ring depth)."""
    cfg = template.default_config(problem, H100).to_dict()
    other = {**cfg, "kv_stages": 3 if cfg["kv_stages"] == 2 else 2}
    assert template.constraint(problem, template.config(other), H100) is None
    return other


def inputs(requires_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, heads, N, 64, dtype=torch.bfloat16).requires_grad_(requires_grad)
               for heads in (4, 2, 2))
    return q, k, v


def mask(pattern: str | None = PATTERN, block: int = 128) -> BlockMask:
    """The pattern's mask, named ``pattern`` (None: unnamed), of blocks ``block``."""
    return dataclasses.replace(pattern_block_mask(PATTERN, N, N, block_size=block),
                               pattern=pattern)


def attend(block_mask: BlockMask, requires_grad: bool = False) -> torch.Tensor:
    q, k, v = inputs(requires_grad)
    return tuner.attention(q, k, v, block_mask=block_mask, is_causal=True, enable_gqa=True)


def assert_is_the_reference(out: torch.Tensor, block_mask: BlockMask) -> None:
    q, k, v = inputs()
    ref = attention_reference(q, k, v, causal="top_left", scale=SCALE,
                              mask=block_mask.to_dense())[0]
    assert out.shape == q.shape and out.dtype == q.dtype
    err = float((out.double() - ref).norm() / ref.norm())
    assert err < 1e-2, err  # bf16


def store_gluon_fastest(tmp_path: Path, gluon_config: dict[str, Any]) -> None:
    store(tmp_path, measured("flash_fwd", 100.0), measured("torch_flex", 150.0),
          measured("gluon_fwd", 200.0, gluon_config))


# ----------------------------------------------------------------------------- by measurement
def test_gluon_measured_fastest_runs_masked_inference_with_its_config(
        tmp_path: Path, gluon_calls: list[dict[str, Any]]) -> None:
    cfg = gluon_config_not_the_default()
    store_gluon_fastest(tmp_path, cfg)
    choice = choose(Call(MASKED, False, H100))
    assert choice.implementation.name == "gluon" and choice.match == "exact", choice.why
    block_mask = mask()
    with torch.no_grad():
        out = attend(block_mask)
    [call] = gluon_calls
    assert call["block_mask"] is block_mask and call["causal"] == "top_left"
    assert call["scale"] is None and call["k_heads"] == 2  # GQA: the kernel groups the heads
    assert call["config"] == GLUON.config(cfg)
    assert_is_the_reference(out, block_mask)


def test_inputs_not_requiring_grad_need_no_no_grad(tmp_path: Path,
                                                   gluon_calls: list[dict[str, Any]]) -> None:
    store_gluon_fastest(tmp_path, gluon_config_not_the_default())
    attend(mask())
    assert len(gluon_calls) == 1


def test_a_gradient_never_runs_gluon(tmp_path: Path, gluon_calls: list[dict[str, Any]]) -> None:
    store_gluon_fastest(tmp_path, gluon_config_not_the_default())
    assert choose(Call(MASKED, True, H100)).implementation.name == "flash"
    block_mask = mask()
    out = attend(block_mask, requires_grad=True)
    assert not gluon_calls and out.requires_grad
    assert_is_the_reference(out.detach(), block_mask)
    with tuner.use_implementation("gluon"), pytest.raises(ValueError, match="no block mask"):
        attend(block_mask, requires_grad=True)  # its backward is cuDNN's
    with tuner.use_implementation("gluon"), pytest.raises(ValueError, match="no block mask"):
        attend(mask(pattern=None), requires_grad=True)  # no name: the dense choice, refused
    assert not gluon_calls


def test_unmeasured_or_slower_gluon_does_not_run(tmp_path: Path,
                                                 gluon_calls: list[dict[str, Any]]) -> None:
    with torch.no_grad():
        attend(mask())  # nothing measured: ours
        store(tmp_path, measured("flash_fwd", 300.0), measured("gluon_fwd", 200.0))
        attend(mask())
    assert not gluon_calls


def test_a_mask_of_smaller_blocks_runs_gluon_fitted_to_them_or_ours_below_its_tiles(
        tmp_path: Path, gluon_calls: list[dict[str, Any]]) -> None:
    """The measured config walks the sweep's 128-blocks; a mask of the pattern with 64-blocks
    (``from_mask_mod(pattern=...)``) runs it with tiles fitted to them, one of 32-blocks
    (under the kernel's 64-row tiles) runs ours."""
    store_gluon_fastest(tmp_path, gluon_config_not_the_default())
    with torch.no_grad():
        out = attend(mask(block=64))
        [call] = gluon_calls
        assert call["config"].BLOCK_M <= 64 and call["config"].BLOCK_N <= 64
        assert_is_the_reference(out, mask(block=64))
        out = attend(mask(block=32))
    assert len(gluon_calls) == 1
    assert_is_the_reference(out, mask(block=32))


def test_a_mask_without_a_pattern_does_not_run_gluon_unforced(
        tmp_path: Path, gluon_calls: list[dict[str, Any]]) -> None:
    store_gluon_fastest(tmp_path, gluon_config_not_the_default())
    with torch.no_grad():
        attend(mask(pattern=None))
    assert not gluon_calls


def test_an_attn_mask_never_runs_gluon(tmp_path: Path,
                                       gluon_calls: list[dict[str, Any]]) -> None:
    store_gluon_fastest(tmp_path, gluon_config_not_the_default())
    q, k, v = inputs()
    dense = mask().to_dense()
    with torch.no_grad():
        tuner.attention(q, k, v, attn_mask=dense, enable_gqa=True)
        with tuner.use_implementation("gluon"):
            tuner.attention(q, k, v, attn_mask=dense, enable_gqa=True)
    assert not gluon_calls


# ----------------------------------------------------------------------------- forced
def test_use_implementation_forces_gluon_on_a_mask(gluon_calls: list[dict[str, Any]]) -> None:
    """Nothing measured: the mask problem's default config; a mask without a pattern: the
    dense problem's (no measurement names it), fitted to the mask's blocks (the dense causal
    default runs longest tiles first, which a mask's row order forbids)."""
    with torch.no_grad(), tuner.use_implementation("gluon"):
        out = attend(mask())
        attend(mask(pattern=None))
    named, unnamed = gluon_calls
    assert named["config"] == GLUON.default_config(MASKED, H100)
    dense_default = GLUON.default_config(dataclasses.replace(MASKED, mask="none"), H100)
    assert dense_default.longest_first
    assert unnamed["config"] == templates.gluon.fwd.fit_to_block_mask(dense_default, (128, 128))
    assert unnamed["block_mask"].pattern is None
    assert_is_the_reference(out, mask())


def test_gluon_forced_on_a_call_it_cannot_take_says_why(
        gluon_calls: list[dict[str, Any]]) -> None:
    q, k, v = (t.float() for t in inputs())
    with torch.no_grad(), tuner.use_implementation("gluon"), \
            pytest.raises(ValueError, match="cannot run"):
        tuner.attention(q, k, v, block_mask=mask(), is_causal=True, enable_gqa=True)
    assert not gluon_calls



def test_a_config_that_cuts_tiles_is_fitted_to_the_mask() -> None:
    """A dense problem's default may cut tiles (split_tail), which passes block_mask_reason
    but not the forward's constraint under a mask: mask_config fits it."""
    from tuner.dispatch.implementations.gluon import mask_config

    dense = dataclasses.replace(MASKED, mask="none", causal="none")
    cut = dataclasses.replace(GLUON.default_config(dense, H100), split_tail=True,
                              persistent=True)
    fitted = mask_config(cut, (128, 128))
    assert fitted is not None and not fitted.split_tail
    assert GLUON.run_constraint(dense, fitted, H100, (128, 128)) is None
