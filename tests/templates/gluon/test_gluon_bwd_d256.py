"""gluon_bwd at head_dim 256: the d256 kernel (templates/gluon/bwd_d256_kernel.py). On
the CPU: which problems it takes, which configs and problems the constraint takes and refuses (each
refusal with its reason), the shared memory it counts, the launch plan, the standalone
source, and the offline sm_90 build (no spills, no serialized wgmma, within the H100's shared
memory); on a Hopper GPU (``gpu`` marker): gradients against the fp32 reference on odd
shapes, every variant, dK/dV bit for bit between them and between runs, and the entry point's
default."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from templates.base import Problem
from templates.compile.offline_target import TARGETS
from templates.compile.standin_tensor import StandinTensor
from templates.gluon import bwd
from templates.gluon.bwd import (
    D256_CONFIG,
    GLUON_MISSING,
    TEMPLATE,
    GluonBwdConfig,
    shared_memory_estimate,
    tile_registers,
)
from templates.gluon.bwd_variants import D256_CASES, D256_VARIANTS
from tests.templates.gluon.gluon_checks import compile_reports, import_standalone, is_hopper

H100 = TARGETS["h100"]
needs_gluon = pytest.mark.skipif(bool(GLUON_MISSING), reason=GLUON_MISSING or "gluon present")
DENSE = Problem(2, 8, 8, 4096, 4096, 256, "bfloat16", "none")
CAUSAL = Problem(2, 8, 8, 4096, 4096, 256, "float16", "top_left")
GQA = Problem(1, 16, 2, 3000, 3000, 256, "bfloat16", "bottom_right")
ROW_MAJOR = dataclasses.replace(D256_CONFIG, dq_transposed=False)
ATOMIC = dataclasses.replace(D256_CONFIG, stages=2, dq_buffers=0, dq_transposed=False)


# ----------------------------------------------------------------------------- the problems
@needs_gluon
def test_head_dim_256_is_taken_dense_and_causal_and_refused_under_a_block_mask() -> None:
    for problem in (DENSE, CAUSAL, GQA):
        assert TEMPLATE.unsupported(problem) is None
    masked = Problem(1, 8, 8, 4096, 4096, 256, "bfloat16", "none", "sliding_causal:1024")
    reason = TEMPLATE.unsupported(masked)
    assert reason is not None and "block masks at head_dim 256" in reason, reason
    d192 = dataclasses.replace(DENSE, head_dim=192)
    reason = TEMPLATE.unsupported(d192)
    assert reason is not None and "[64, 128, 256]" in reason, reason


@needs_gluon
def test_the_default_at_d256_is_the_d256_kernel() -> None:
    for problem in (DENSE, CAUSAL, GQA, Problem(1, 2, 2, 1, 1, 256, "float16", "none")):
        assert TEMPLATE.unsupported(problem) is None
        assert TEMPLATE.default_config(problem, H100) == D256_CONFIG
        assert TEMPLATE.constraint(problem, D256_CONFIG, H100) is None
        assert TEMPLATE.constraint(problem, ROW_MAJOR, H100) is None
        assert TEMPLATE.constraint(problem, ATOMIC, H100) is None
        assert TEMPLATE.known_good_configs(problem, H100) == [ROW_MAJOR, ATOMIC]
        assert TEMPLATE.run_constraint(problem, D256_CONFIG, H100, None) is None
    # head dims 64 and 128 keep their defaults and refuse the d256 tile
    d128 = Problem(2, 16, 16, 4096, 4096, 128, "bfloat16", "none")
    assert not bwd._is_d256(TEMPLATE.default_config(d128, H100))
    reason = TEMPLATE.constraint(d128, D256_CONFIG, H100)
    assert reason is not None and "head_dim" in reason, reason
    # dQ by atomics without a staging tile is the d256 kernel's only
    ws = dataclasses.replace(TEMPLATE.default_config(d128, H100), dq_buffers=0)
    reason = TEMPLATE.constraint(d128, ws, H100)
    assert reason is not None and "dq_buffers 0" in reason, reason


# ----------------------------------------------------------------------------- the constraint
@needs_gluon
@pytest.mark.parametrize(("change", "word"), [
    ({"stages": 3}, "stages 3, dq_buffers 1"),
    ({"stages": 2}, "stages 2, dq_buffers 1"),
    ({"dq_buffers": 0}, "stages 1, dq_buffers 0"),
    ({"dq_buffers": 2}, "stages 1, dq_buffers 2"),
    ({"stages": 2, "dq_buffers": 0}, "dq_transposed"),  # (the default's D-major tile)
    ({"BLOCK_N": 128}, "BLOCK_N"),
    ({"BLOCK_M": 128}, "BLOCK_M"),
    ({"split_warpgroups": False}, "split_warpgroups"),
    ({"warp_specialize": False, "split_warpgroups": False}, "warp_specialize"),
    ({"deterministic": True}, "deterministic"),
    ({"dq_early": True}, "dq_early"),
    ({"persistent": True}, "persistent"),
    ({"longest_first": True}, "longest_first"),
])
def test_what_the_d256_kernel_does_not_take_is_refused_by_name(change: dict[str, Any],
                                                               word: str) -> None:
    reason = TEMPLATE.constraint(DENSE, dataclasses.replace(D256_CONFIG, **change), H100)
    assert reason is not None, change
    if word in ("deterministic", "dq_early", "persistent", "longest_first"):
        assert f"does not take {word}" in reason, reason
    elif "stages" in word or word == "dq_transposed":
        assert word in reason, reason
    else:  # the knob named among the config's wrong values
        assert f"'{word}': {change[word]!r}" in reason, reason


@needs_gluon
def test_block_masks_are_refused_at_d256() -> None:
    masked = Problem(1, 8, 8, 4096, 4096, 256, "bfloat16", "none", "sliding_causal:1024")
    reason = TEMPLATE.constraint(masked, D256_CONFIG, H100)
    assert reason is not None and "block mask" in reason, reason
    with pytest.raises(ValueError, match="no gluon_bwd config fits"):
        TEMPLATE.run_default(DENSE, H100, (128, 128))


@needs_gluon
def test_a_ring_of_one_stays_refused_at_d64_and_d128() -> None:
    for d in (64, 128):
        problem = Problem(1, 8, 8, 4096, 4096, d, "bfloat16", "none")
        cfg = dataclasses.replace(TEMPLATE.default_config(problem, H100), stages=1)
        reason = TEMPLATE.constraint(problem, cfg, H100)
        assert reason is not None and "stages" in reason, reason


@needs_gluon
def test_a_smaller_shared_memory_refuses_it() -> None:
    small = dataclasses.replace(H100, smem_per_block=228 * 1024 - 4096)
    reason = TEMPLATE.constraint(DENSE, D256_CONFIG, small)
    assert reason is not None and "shared memory" in reason, reason


# ----------------------------------------------------------------------------- sizes
def test_the_shared_memory_estimate_counts_p_and_ds_tiles() -> None:
    # K and V 64 x 256, one stage of Q and dO 64 x 256 with their lse2/delta rows, two
    # P^T + dS^T pairs of 64 x 64, the 64 x 256 fp32 dQ tile, the barriers' allowance.
    want = (2 * 64 * 256 * 2 + (2 * 64 * 256 * 2 + 2 * 64 * 4) + 4 * 64 * 64 * 2
            + 64 * 256 * 4 + bwd.BARRIER_BYTES)
    assert shared_memory_estimate(DENSE, D256_CONFIG) == want == 230_912
    assert want <= H100.smem_per_block
    # dQ by atomics: no staging tile, a second stage of Q and dO
    atomic = want - 64 * 256 * 4 + (2 * 64 * 256 * 2 + 2 * 64 * 4)
    assert shared_memory_estimate(DENSE, ATOMIC) == atomic == 231_424 <= H100.smem_per_block
    # dK + dV (64 x 128 each) and S^T + dP^T (64 x 32 each) per thread of a warpgroup
    assert tile_registers(DENSE, D256_CONFIG) == 160 <= bwd.MAX_WS_TILE_REGISTERS


@needs_gluon
def test_the_launch_plan() -> None:
    launches = TEMPLATE.kernel_launches(GQA, D256_CONFIG)
    assert launches is not None
    (_, _, _, _), (main, grid, _, options) = launches
    assert main.__name__ == "_gluon_bwd_d256_kernel"
    assert grid == (-(-3000 // 64) * 1 * 2,)  # a program per 64-key tile per kv head
    assert options["BLOCK_M"] == 64 and options["BLOCK_N"] == 64
    assert options["STAGES"] == 1 and options["DQ_BUFFERS"] == 1 and options["DQ_T"]
    assert options["num_warps"] == 4 and options["MMA_REGS"] == 240
    row = TEMPLATE.kernel_launches(GQA, ROW_MAJOR)
    assert row is not None and "DQ_T" not in row[1][3]
    # dQ by atomics: the accumulator's pointer where the others pass its TMA descriptor
    atomic = TEMPLATE.kernel_launches(GQA, ATOMIC)
    assert atomic is not None
    _, _, args, options = atomic[1]
    assert options["STAGES"] == 2 and options["DQ_BUFFERS"] == 0 and "DQ_T" not in options
    assert isinstance(args[8], StandinTensor) and args[8].dtype == torch.float32
    assert not isinstance(launches[1][2][8], StandinTensor)
    from templates.gluon import bwd_d256_kernel

    q = StandinTensor(torch.bfloat16, [1, 16, 3000, 256])
    k = StandinTensor(torch.bfloat16, [1, 2, 3000, 256])
    with pytest.raises(ValueError, match="block mask"):
        bwd_d256_kernel.D256LaunchPlan(q, k, causal_mode="none", scale=0.1,
                                       config=D256_CONFIG.to_dict(), kv_major_mask=object())


@needs_gluon
def test_its_standalone_source_runs_the_d256_kernel(tmp_path: Path) -> None:
    source = TEMPLATE.standalone_source(D256_CONFIG)
    assert "from templates" not in source and "import templates" not in source
    module = import_standalone(source, tmp_path / "gluon_bwd_d256_standalone.py")
    assert module.CONFIG["BLOCK_N"] == 64 and module.CONFIG["stages"] == 1
    assert module.D256LaunchPlan.main_kernel(None) is module._gluon_bwd_d256_kernel
    # its input check takes head_dim 256 (the other kernels' takes 64 and 128)
    q = torch.zeros(1, 2, 5, 256, dtype=torch.bfloat16)
    lse = torch.zeros(1, 2, 5)
    assert module.validate_inputs(q, q, q, q, q, lse, True, None) == ("top_left", 1 / 16)
    with pytest.raises(ValueError, match="head_dim"):
        q128 = torch.zeros(1, 2, 5, 128, dtype=torch.bfloat16)
        module.validate_inputs(q128, q128, q128, q128, q128, lse, False, None)


# ----------------------------------------------------------------------------- offline build
@needs_gluon
def test_it_compiles_for_the_h100_without_spills_or_serialized_gemms() -> None:
    """The offline sm_90 build of the default (D-major dQ tile) on a dense and a causal walk,
    and of dQ by atomics on a causal one: no stack, both MMA partitions' wgmma pipelines
    intact (no ptxas note), the shared memory within the H100's and the estimate (triton
    3.9: 230,528 and 230,864 bytes, 0 stack; 3.6 the same)."""
    jobs = [{"template": "gluon_bwd", "problem": p.to_dict(), "config": c.to_dict()}
            for p, c in ((DENSE, D256_CONFIG), (CAUSAL, D256_CONFIG), (CAUSAL, ATOMIC))]
    for out in compile_reports("templates.gluon.bwd", jobs):
        assert out["error"] == "" and out["constraint"] == "", out
        _, main = out["kernels"]
        assert main["kernel"] == "_gluon_bwd_d256_kernel", out
        assert main["wgmma_serialized"] == "", out
        assert main["stack_bytes"] in (0, None), out
        assert main["shared_bytes"] <= H100.smem_per_block, out
        problem = Problem(**out["problem"])
        cfg = GluonBwdConfig(**out["config"])
        assert 0 <= shared_memory_estimate(problem, cfg) - main["shared_bytes"] <= 1024


# ----------------------------------------------------------------------------- GPU numerics
@pytest.mark.gpu
@pytest.mark.parametrize("case", D256_CASES, ids=lambda c: Problem(*c).key())
def test_d256_matches_the_reference_on_the_gpu(case: tuple[Any, ...],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Every d256 variant (both dQ staging layouts, dQ by atomics) against the fp32 reference (dk/dv poisoned with NaN first, so
    an element never written shows), dK and dV bit for bit between runs and between variants
    (the same GEMMs in the same order per key row; dQ's reduces land in any order), and rows
    that see no key get a zero dQ."""
    if not is_hopper():
        pytest.skip("gluon_bwd needs a Hopper GPU")
    from templates.gluon import bwd_kernel as gluon_bwd_kernel

    monkeypatch.setattr(gluon_bwd_kernel, "DEBUG_POISON", True)
    problem = Problem(*case)
    inputs = TEMPLATE.make_inputs(problem, "cuda", seed=3)
    ref = TEMPLATE.reference(inputs)
    outs = {}
    for name, knobs in D256_VARIANTS.items():
        cfg = GluonBwdConfig(**knobs)
        assert TEMPLATE.constraint(problem, cfg, H100) is None
        runs = [TEMPLATE.run(inputs, cfg) for _ in range(2)]
        for out in runs:
            for grad in out:
                assert not torch.isnan(grad).any(), name
            err = TEMPLATE.error(out, ref)
            assert err <= TEMPLATE.tolerance(problem), (name, err)
        assert torch.equal(runs[0][1], runs[1][1]) and torch.equal(runs[0][2], runs[1][2])
        if problem.causal == "bottom_right" and problem.seqlen_q > problem.seqlen_kv:
            blind = problem.seqlen_q - problem.seqlen_kv
            assert torch.all(runs[0][0][..., :blind, :] == 0)
        outs[name] = runs[0]
    first, *others = outs.values()
    for other in others:
        assert torch.equal(first[1], other[1]) and torch.equal(first[2], other[2])


@pytest.mark.gpu
def test_d256_default_through_the_entry_point() -> None:
    """gluon_attention_bwd without a config at D 256 runs the d256 kernel, right."""
    if not is_hopper():
        pytest.skip("gluon_bwd needs a Hopper GPU")
    problem = Problem(1, 8, 2, 1500, 1500, 256, "bfloat16", "top_left")
    inputs = TEMPLATE.make_inputs(problem, "cuda", seed=5)
    args = [inputs[n] for n in ("do", "q", "k", "v", "o", "lse")]
    out = bwd.gluon_attention_bwd(*args, causal=inputs["causal"], scale=inputs["scale"])
    assert TEMPLATE.error(out, TEMPLATE.reference(inputs)) <= TEMPLATE.tolerance(problem)
