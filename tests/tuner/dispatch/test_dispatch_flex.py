"""Block-mask calls: our block-sparse kernels or compiled FlexAttention, by stored measurement
of the mask's named problem (``BlockMask.pattern``); ours where nothing decides otherwise.

Flex itself is stood in for by a recorder here (compiling it on the CPU takes ~10 s per shape,
and it has no CPU backward; tests/templates/pytorch/test_torch_flex.py runs it); our kernels run
under the interpreter."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

import tuner
from templates.attention_reference import attention_reference
from templates.base import Problem
from templates.device import DeviceInfo, current_device
from templates.masks.mods import pattern_block_mask
from templates.registry import get_template
from tests.api.serving_data import H100
from tests.tuner.dispatch.test_dispatch import measured, store
from tuner.dispatch.implementations.call import call_of
from tuner.dispatch.rule import Call, choose, choose_masked, decide
from tuner.lookup.resolver import Resolved

pytestmark = pytest.mark.usefixtures("no_tuned_configs")

PATTERN = "sliding:16"
N = 64


def inputs(device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return (torch.randn(1, 4, N, 16, device=device), torch.randn(1, 2, N, 16, device=device),
            torch.randn(1, 2, N, 16, device=device))


def masked_problem(causal: str = "top_left") -> Problem:
    return Problem(batch=1, heads_q=4, heads_kv=2, seqlen_q=N, seqlen_kv=N, head_dim=16,
                   dtype="float32", causal=causal, mask=PATTERN)


def run(device: str, *, mask_pattern: str | None = PATTERN) -> torch.Tensor:
    q, k, v = inputs(device)
    mask = pattern_block_mask(PATTERN, N, N, device=device)
    if mask_pattern is None:
        mask = dataclasses.replace(mask, pattern=None)
    assert mask.pattern == mask_pattern
    return tuner.attention(q, k, v, block_mask=mask, is_causal=True, enable_gqa=True)


def test_flex_measured_faster_runs(tmp_path: Path, device: str,
                                   flex_calls: list[dict[str, Any]]) -> None:
    p = masked_problem()
    store(tmp_path, measured("flash_fwd", p, 100.0), measured("torch_flex", p, 150.0))
    choice = choose(Call(p, False, current_device()))
    assert choice.implementation.name == "flex" and choice.match in ("exact", "bucket")
    assert "flash" in choice.why
    run(device)
    [call] = flex_calls
    assert call["causal"] == "top_left" and call["enable_gqa"] is True
    assert call["config"] == get_template("torch_flex").config(choice.config.to_dict())


def test_flex_measured_faster_but_blocks_too_small_for_it_runs_ours(
        tmp_path: Path, device: str, flex_calls: list[dict[str, Any]]) -> None:
    """Flex's tiles (128) must divide the mask's blocks: a 64-block mask of a pattern Flex
    won runs ours (seen on the H100: Flex has no backward for such masks)."""
    p = masked_problem()
    store(tmp_path, measured("flash_fwd", p, 100.0), measured("torch_flex", p, 150.0))
    q, k, v = inputs(device)
    # A user's mask of the pattern, made with smaller blocks (from_mask_mod(pattern=...)).
    mask = dataclasses.replace(pattern_block_mask(PATTERN, N, N, device=device, block_size=64),
                               pattern=PATTERN)
    assert mask.block_size == (64, 64) and mask.pattern == PATTERN
    out = tuner.attention(q, k, v, block_mask=mask, is_causal=True, enable_gqa=True)
    assert not flex_calls
    ref = attention_reference(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                              causal="top_left", scale=0.25, mask=mask.to_dense())[0]
    assert float((out - ref).norm() / ref.norm()) < 1e-3


def test_ours_measured_faster_runs_ours(tmp_path: Path, device: str,
                                       flex_calls: list[dict[str, Any]]) -> None:
    p = masked_problem()
    store(tmp_path, measured("flash_fwd", p, 150.0), measured("torch_flex", p, 100.0))
    assert choose(Call(p, False, current_device())).implementation.name == "flash"
    out = run(device)
    assert not flex_calls
    q, k, v = inputs(device)
    mask = pattern_block_mask(PATTERN, N, N, device=device).to_dense()
    ref = attention_reference(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                              causal="top_left", scale=0.25, mask=mask)[0]
    assert float((out - ref).norm() / ref.norm()) < 1e-3


def test_nothing_measured_runs_ours(device: str, flex_calls: list[dict[str, Any]]) -> None:
    choice = choose(Call(masked_problem(), False, current_device()))
    assert choice.implementation.name == "flash" and "not measured" in choice.why
    run(device)
    assert not flex_calls


def test_flex_measured_but_ours_not_runs_ours(tmp_path: Path, device: str,
                                             flex_calls: list[dict[str, Any]]) -> None:
    p = masked_problem()
    store(tmp_path, measured("torch_flex", p, 150.0))
    assert choose(Call(p, False, current_device())).implementation.name == "flash"
    run(device)
    assert not flex_calls


def test_a_mask_without_a_pattern_runs_ours_whatever_is_measured(
        tmp_path: Path, device: str, flex_calls: list[dict[str, Any]]) -> None:
    p = masked_problem()
    store(tmp_path, measured("flash_fwd", p, 100.0), measured("torch_flex", p, 150.0))
    run(device, mask_pattern=None)
    assert not flex_calls


def test_use_implementation_forces_flex_or_ours(tmp_path: Path, device: str,
                                                flex_calls: list[dict[str, Any]]) -> None:
    with tuner.use_implementation("flex"):
        run(device, mask_pattern=None)
        run(device)
    assert len(flex_calls) == 2
    p = masked_problem()
    store(tmp_path, measured("flash_fwd", p, 100.0), measured("torch_flex", p, 150.0))
    with tuner.use_implementation("flash"):
        run(device)
    assert len(flex_calls) == 2


def test_forcing_flash_runs_its_measurements_of_the_pattern(tmp_path: Path,
                                                            device: str) -> None:
    """use_implementation("flash") on a patterned mask runs ours as measured on that problem
    (masked_dispatch_bench's "flash" column), not the dense problem's configs."""
    p = masked_problem()
    cfg = get_template("flash_fwd").default_config(p, current_device()).to_dict()
    cfg["num_warps"] = 8 if cfg["num_warps"] == 4 else 4  # not what the fallback would pick
    store(tmp_path, measured("flash_fwd", p, 150.0, cfg), measured("torch_flex", p, 100.0))
    q, k, v = inputs(device)
    mask = pattern_block_mask(PATTERN, N, N, device=device)
    with tuner.use_implementation("flash"):
        choice = choose_masked(call_of(q, k, True, False), mask.pattern, mask.block_size)
    assert choice is not None and choice.implementation.name == "flash"
    assert choice.resolved[0].measured and choice.resolved[0].config.to_dict() == cfg
    with tuner.use_implementation("flash"):
        unpatterned = dataclasses.replace(mask, pattern=None)
        # ours with the dense problem's configs (no resolved configs of the mask problem)
        fallback = choose_masked(call_of(q, k, True, False), unpatterned.pattern,
                                 unpatterned.block_size)
        assert fallback.implementation.name == "flash" and fallback.resolved == ()


def test_flex_never_serves_dense_calls(device: str) -> None:
    q, k, v = inputs(device)
    with tuner.use_implementation("flex"), pytest.raises(ValueError, match="block masks"):
        tuner.attention(q, k, v, enable_gqa=True)


# ----------------------------------------------------------------------------- the rule alone
GPU = H100


def priced(tflops: dict[str, float]) -> Any:
    """A resolver answering each template with a stored best at ``tflops`` (absent: default)."""
    def resolve(template: Any, problem: Problem, device: DeviceInfo) -> Resolved:
        config = template.default_config(problem, device)
        if template.name not in tflops:
            return Resolved(config, "default", "default")
        return Resolved(config, "exact", "database", tflops=tflops[template.name])

    return resolve


@pytest.mark.parametrize(("tflops", "winner"), [
    # Flex's forward slower, its forward + backward faster (the H100's d128 rows): training
    # runs Flex, inference ours.
    ({"flash_fwd": 300.0, "flash_bwd": 150.0, "torch_flex": 250.0,
      "torch_flex_train": 250.0}, {False: "flash", True: "flex"}),
    ({"flash_fwd": 300.0, "flash_bwd": 300.0, "torch_flex": 400.0,
      "torch_flex_train": 100.0}, {False: "flex", True: "flash"}),
    # No backward measured for ours: the training step runs ours, unpriced.
    ({"flash_fwd": 300.0, "torch_flex": 250.0, "torch_flex_train": 250.0},
     {False: "flash", True: "flash"}),
])
def test_training_is_decided_by_the_training_measurements(tflops: dict[str, float],
                                                          winner: dict[bool, str]) -> None:
    p = dataclasses.replace(masked_problem(), dtype="bfloat16", head_dim=128)
    for needs_grad in (False, True):
        choice = decide(Call(p, needs_grad, GPU), resolve=priced(tflops), margin=0.03)
        assert choice.implementation.name == winner[needs_grad], choice.why


def test_sdpa_is_no_candidate_for_a_block_mask() -> None:
    choice = decide(Call(masked_problem(), False, GPU),
                    resolve=priced({"torch_sdpa": 1e6, "flash_fwd": 1.0}), margin=0.03)
    assert choice.implementation.name == "flash"
    assert {e.implementation for e in choice.estimates} == {"flash", "flex"}
