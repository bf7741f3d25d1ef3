"""The warp-specialized Gluon backward under a block mask (templates.gluon.bwd_ws_kernel's
SPARSE walk): which problems and configs take a mask, the launch it plans, an offline sm_90
compile of the masked variants, and numerics against the dense-mask reference on a Hopper GPU
(``gpu`` marker): sliding windows, documents, random blocks, a mask per head under GQA, odd
lengths, fp16 and bf16."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from templates.base import Problem
from templates.compile.offline_target import TARGETS
from templates.flash.bwd import forward_for_backward
from templates.gluon.bwd import GLUON_MISSING, TEMPLATE, GluonBwdConfig, block_mask_reason
from templates.masks.block_mask import BlockMask
from tests.templates.gluon.gluon_checks import compile_reports, is_hopper

H100 = TARGETS["h100"]
needs_gluon = pytest.mark.skipif(bool(GLUON_MISSING), reason=GLUON_MISSING or "gluon present")
WS = GluonBwdConfig(warp_specialize=True)


# ----------------------------------------------------------------------------- the problems
@needs_gluon
def test_mask_patterns_are_taken_without_causal() -> None:
    for mask in ("sliding:128", "sliding_causal:1024", "documents:512", "random:0.3",
                 "document:4", "documents_causal:256", "prefix:100"):
        assert TEMPLATE.unsupported(Problem(1, 2, 2, 2048, 2048, 128, mask=mask)) is None
    reason = TEMPLATE.unsupported(Problem(1, 2, 2, 2048, 2048, 128, causal="top_left",
                                          mask="sliding:128"))
    assert reason is not None and "own causality" in reason and "_causal patterns" in reason
    reason = TEMPLATE.unsupported(Problem(1, 2, 2, 2048, 2048, 128, mask="sliding:-1"))
    assert reason is not None and "pattern" in reason


@needs_gluon
def test_only_the_warp_specialized_kernel_walks_masks() -> None:
    for d in (64, 128):
        problem = Problem(2, 8, 2, 4096, 4096, d, "bfloat16", mask="sliding_causal:1024")
        reason = TEMPLATE.constraint(problem, GluonBwdConfig(), H100)
        assert reason is not None and "warp_specialize=True" in reason
        cfg = TEMPLATE.default_config(problem, H100)
        assert cfg.warp_specialize and TEMPLATE.constraint(problem, cfg, H100) is None
        known = TEMPLATE.known_good_configs(problem, H100)
        assert all(c.warp_specialize for c in known)
        assert TEMPLATE.warp_specialized_configs(problem, H100)
    # Blocks other than the sweeps' 128 x 128 are refused by name.
    for blocks in ((64, 64), (256, 256), (128, 64)):
        reason = block_mask_reason(WS, blocks)
        assert reason is not None and "128 x 128" in reason and str(blocks) in reason
    assert block_mask_reason(WS, (128, 128)) is None
    dense = Problem(1, 2, 2, 1024, 1024, 128)
    reason = TEMPLATE.run_constraint(dense, GluonBwdConfig(), H100, (128, 128))
    assert reason is not None and "warp_specialize" in reason
    assert TEMPLATE.run_default(dense, H100, (128, 128)).warp_specialize
    with pytest.raises(ValueError, match="128 x 128"):
        TEMPLATE.run_default(dense, H100, (64, 64))


@needs_gluon
def test_masked_launch_walks_the_kv_major_lists() -> None:
    # 1000 query rows: 8 mask blocks of 128, so the row vectors pad to 1024 (whole blocks).
    problem = Problem(1, 4, 2, 1000, 1000, 128, "float16", mask="sliding:200")
    (_, pre_grid, pre_args, _), (main, grid, args, options) = TEMPLATE.kernel_launches(
        problem, WS)
    assert main.__name__ == "_gluon_bwd_ws_kernel"
    assert options["SPARSE"] and options["MASK_BLOCK_Q"] == 128 == options["MASK_BLOCK_KV"]
    assert options["CAUSAL"] is False
    assert grid == (8 * 1 * 2,)  # KV tiles x batch x kv heads
    assert tuple(pre_args[3].shape) == (1, 4, 1024) and pre_grid == (1024 // 64 * 4,)
    # 9 descriptors/tensors, 10 scalars (n_q_tiles = 1024 / 64), the 11 mask arguments, the
    # dQ counters (None: not deterministic), the tiles' order (dk standing in: no order).
    assert len(args) == 9 + 10 + 11 + 1 + 1 and args[9 + 7] == 16 and args[-2] is None
    assert args[-3] == 8  # the KV-major lists' row stride: one entry per query block
    assert args[-1] is args[4].base  # (dk: its descriptor's tensor)
    # Dense launches pass stand-ins for the mask's arguments and leave SPARSE off.
    dense = Problem(1, 4, 2, 1000, 1000, 128, "float16")
    (_, _, _, _), (_, _, dense_args, dense_options) = TEMPLATE.kernel_launches(dense, WS)
    assert len(dense_args) == 32 and "SPARSE" not in dense_options
    assert dense_args[9 + 7] == 16  # cdiv(1000, 64)
    # Without warp specialization there is no masked launch.
    assert TEMPLATE.kernel_launches(problem, GluonBwdConfig()) is None


@needs_gluon
def test_block_mask_errors_name_the_argument() -> None:
    from templates.gluon.bwd import gluon_attention_bwd

    q = torch.zeros(1, 2, 256, 64, dtype=torch.bfloat16)
    lse = torch.zeros(1, 2, 256)
    mask = BlockMask.from_dense(torch.ones(256, 256, dtype=torch.bool))
    with pytest.raises(ValueError, match="causal must be 'none' with a block_mask"):
        gluon_attention_bwd(q, q, q, q, q, lse, causal=True, block_mask=mask)
    with pytest.raises(ValueError, match=r"block_mask is for \(N_q, N_kv\)"):
        other = BlockMask.from_dense(torch.ones(128, 128, dtype=torch.bool))
        gluon_attention_bwd(q, q, q, q, q, lse, block_mask=other)
    with pytest.raises(TypeError, match="block_mask must be"):
        gluon_attention_bwd(q, q, q, q, q, lse, block_mask="sliding:128")  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- offline compile
COMPILE_JOBS = [
    Problem(2, 16, 16, 4096, 4096, 128, "bfloat16", mask="sliding_causal:1024"),
    Problem(1, 8, 2, 1000, 1000, 128, "float16", mask="documents:256"),  # GQA, odd length
    Problem(2, 32, 32, 4096, 4096, 64, "bfloat16", mask="random:0.3"),
]
# Stack bytes of the masked walk's offline build at d128 (notes/gluon_notes.md, "Block masks
# in the warp-specialized backward"): 96 with triton 3.9, 56 with 3.6 (the dense kernel's
# 16 / 56); at d64 8 with 3.9, none with 3.6.
MASKED_D128_STACK = 96
MASKED_D64_STACK = 8
# The same for the split kernel (d128's default under masks): 128-136 with triton 3.9, 40-48
# with 3.6 (notes/gluon_notes.md, "split_warpgroups ... built").
MASKED_SPLIT_STACK = 136
# Its persistent grid (d128's default on causal sliding windows): 144 with triton 3.9 (its
# tile loop's carried state); not read with 3.6, whose builds ran at the speeds quoted in
# gluon_bwd's ``persistent`` knob.
MASKED_PERSISTENT_STACK = 144


@needs_gluon
def test_masked_configs_compile_for_the_h100() -> None:
    jobs = [{"template": "gluon_bwd", "problem": p.to_dict(), "config": cfg.to_dict()}
            for p in COMPILE_JOBS for cfg in TEMPLATE.warp_specialized_configs(p, H100)]
    outcomes = compile_reports("templates.gluon.bwd", jobs)
    assert len(outcomes) == len(jobs)
    for job, out in zip(jobs, outcomes, strict=True):
        assert out["error"] == "" and out["constraint"] == "", out
        _, main = out["kernels"]
        split = job["config"]["split_warpgroups"]
        kernel = "_gluon_bwd_split_kernel" if split else "_gluon_bwd_ws_kernel"
        assert main["kernel"] == kernel and main["registers"] == 168, out
        allowed = ((MASKED_PERSISTENT_STACK if job["config"]["persistent"]
                    else MASKED_SPLIT_STACK) if split else MASKED_D128_STACK
                   if job["problem"]["head_dim"] == 128 else MASKED_D64_STACK)
        assert main["stack_bytes"] <= allowed, f"registers spilled: {out}"
        assert main["wgmma_serialized"] == "", out


# ----------------------------------------------------------------------------- GPU numerics
MASK_CASES = [
    (1, 2, 2, 1000, 1000, 128, "bfloat16", "none", "sliding:200"),
    (2, 4, 2, 1100, 1100, 64, "float16", "none", "sliding_causal:300"),  # GQA
    (1, 4, 1, 777, 777, 128, "float16", "none", "random:0.3"),  # MQA, odd length
    (1, 2, 2, 1500, 1500, 128, "bfloat16", "none", "documents:256"),
    (1, 8, 2, 2048, 2048, 128, "bfloat16", "none", "documents_causal:512"),  # GQA
    (1, 2, 2, 700, 1300, 64, "bfloat16", "none", "sliding:150"),  # N_q < N_kv
    (1, 2, 2, 1300, 700, 128, "float16", "none", "prefix:100"),  # N_q > N_kv
    (2, 2, 2, 4096, 4096, 128, "bfloat16", "none", "sliding_causal:1024"),
]


def _check(inputs: dict[str, Any], problem: Problem, cfg: GluonBwdConfig) -> None:
    ref = TEMPLATE.reference(inputs)
    runs = [TEMPLATE.run(inputs, cfg) for _ in range(2)]
    for out in runs:
        for grad in out:
            assert not torch.isnan(grad).any()
        err = TEMPLATE.error(out, ref)
        assert err <= TEMPLATE.tolerance(problem), (cfg.key(), err)
    # dk and dv are summed in registers in a fixed order; dq by atomics is not (no check).
    assert torch.equal(runs[0][1], runs[1][1]) and torch.equal(runs[0][2], runs[1][2])


@pytest.mark.gpu
@pytest.mark.parametrize("dq_early", [False, True], ids=["", "dq_early"])
@pytest.mark.parametrize("dq_buffers", [1, 2])
@pytest.mark.parametrize("case", MASK_CASES, ids=lambda c: Problem(*c).key())
def test_masked_matches_the_dense_mask_reference(case: tuple[Any, ...], dq_buffers: int,
                                                 dq_early: bool,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    if not is_hopper():
        pytest.skip("gluon_bwd needs a Hopper GPU")
    from templates.device import current_device
    from templates.gluon import bwd_kernel as gluon_bwd_kernel

    monkeypatch.setattr(gluon_bwd_kernel, "DEBUG_POISON", True)  # unwritten dk/dv read NaN
    problem = Problem(*case)
    cfg = GluonBwdConfig(warp_specialize=True, dq_buffers=dq_buffers, dq_early=dq_early)
    if TEMPLATE.constraint(problem, cfg, current_device()):
        pytest.skip(f"{cfg.key()} does not fit {problem.key()}")
    _check(TEMPLATE.make_inputs(problem, "cuda", seed=5), problem, cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_mask_per_head_under_gqa(dtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each query head of a GQA group walks its own lists (different lengths per head), and a
    KV block no query of a head sees, and rows that see no key at all."""
    if not is_hopper():
        pytest.skip("gluon_bwd needs a Hopper GPU")
    from templates.gluon import bwd_kernel as gluon_bwd_kernel

    monkeypatch.setattr(gluon_bwd_kernel, "DEBUG_POISON", True)
    problem = Problem(2, 6, 2, 900, 1000, 128, dtype)
    inputs = TEMPLATE.make_inputs(problem, "cuda", seed=7)
    gen = torch.Generator(device="cuda").manual_seed(11)
    dense = torch.rand(2, 6, 900, 1000, generator=gen, device="cuda") < 0.6
    blocks = torch.rand(2, 6, 8, 8, generator=gen, device="cuda") < 0.5  # whole blocks off
    dense &= blocks.repeat_interleave(128, 2).repeat_interleave(128, 3)[:, :, :900, :1000]
    dense[:, :, 300:420] = False  # rows that see no key: their gradients are 0
    dense[:, 0, 128:] |= True  # head 0: full blocks beside partial ones
    block_mask = BlockMask.from_dense(dense)
    inputs["o"], inputs["lse"] = forward_for_backward(
        inputs["q"], inputs["k"], inputs["v"], causal="none", scale=inputs["scale"],
        block_mask=block_mask)
    inputs["block_mask"] = block_mask
    _check(inputs, problem, WS)
