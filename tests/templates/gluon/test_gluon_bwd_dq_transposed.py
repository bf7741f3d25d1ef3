"""gluon_bwd's ``dq_transposed``: the warp-specialized backward's fp32 dQ staging tile and
accumulator D-major ((B H_q, D, N_q)), dq cast back after the kernel. On the CPU: the cast
kernel (interpreter), the launch plan's accumulator and descriptor, the constraint, the
offline sm_90 build; the GPU runs are the ``*_dqt`` variants of test_gluon_bwd.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from templates.base import Problem
from templates.compile.offline_target import TARGETS
from templates.gluon.bwd import GLUON_MISSING, TEMPLATE, GluonBwdConfig, shared_memory_estimate
from tests.templates.gluon.gluon_checks import compile_reports

H100 = TARGETS["h100"]
needs_gluon = pytest.mark.skipif(bool(GLUON_MISSING), reason=GLUON_MISSING or "gluon present")
DQT = GluonBwdConfig(BLOCK_M=64, BLOCK_N=128, stages=3, consumers=2, warp_specialize=True,
                     dq_transposed=True)


@needs_gluon
@pytest.mark.parametrize("shape", [(1, 2, 1, 64), (2, 3, 333, 128), (1, 1, 130, 64)])
def test_the_cast_transposes_the_accumulator_back(shape: tuple[int, int, int, int],
                                                  device: str) -> None:
    from templates.gluon.bwd_ws_kernel import dq_from_transposed

    batch, heads, seqlen, head_dim = shape
    columns = -(-seqlen // 4) * 4
    torch.manual_seed(0)
    acc = torch.randn(batch, heads, head_dim, columns, device=device)
    acc[..., seqlen:] = float("nan")  # the padding columns are never read
    for dtype in (torch.float16, torch.float32):
        dq = dq_from_transposed(acc, seqlen, dtype)
        assert dq.shape == (batch, heads, seqlen, head_dim) and dq.is_contiguous()
        assert torch.equal(dq, acc[..., :seqlen].transpose(-1, -2).to(dtype))


@needs_gluon
def test_the_plan_lays_out_the_accumulator_d_major() -> None:
    from templates.gluon.bwd_ws_kernel import WsLaunchPlan

    q = torch.empty(2, 4, 333, 128, dtype=torch.bfloat16)
    k = torch.empty(2, 2, 333, 128, dtype=torch.bfloat16)
    plan = WsLaunchPlan(q, k, causal_mode="none", scale=0.1, config=DQT.to_dict())
    assert plan.options["DQ_T"] is True
    # 333 rows padded to 336 columns: TMA's strides are multiples of 16 bytes.
    assert plan.dq_shape == (8, 128, 333) and plan.dq_strides == [128 * 336, 336, 1]
    assert plan.dq_block == [1, 128, 64]
    _, _, dq_accum, dk, dv = plan.buffers(q, k, k)
    assert dq_accum.shape == (2, 4, 128, 336) and dq_accum.dtype == torch.float32
    assert not dq_accum.any() and dk.shape == k.shape
    desc = plan._dq_descriptor(dq_accum)
    assert list(desc.shape) == [8, 128, 333] and list(desc.strides) == [128 * 336, 336, 1]
    row_major = WsLaunchPlan(q, k, causal_mode="none", scale=0.1,
                             config=dataclasses.replace(DQT, dq_transposed=False).to_dict())
    assert "DQ_T" not in row_major.options and row_major.dq_shape == (8, 333, 128)
    assert row_major.buffers(q, k, k)[2].shape == q.shape


@needs_gluon
def test_it_needs_warp_specialization_and_counts_the_same_memory() -> None:
    problem = Problem(1, 16, 16, 4096, 4096, 128, "bfloat16", "none")
    reason = TEMPLATE.constraint(problem, GluonBwdConfig(dq_transposed=True), H100)
    assert reason is not None and "dq_transposed" in reason and "warp_specialize" in reason
    assert TEMPLATE.constraint(problem, DQT, H100) is None
    assert shared_memory_estimate(problem, DQT) == shared_memory_estimate(
        problem, dataclasses.replace(DQT, dq_transposed=False))


@needs_gluon
def test_dq_transposed_builds_for_the_h100_as_the_row_major_tile() -> None:
    """Offline sm_90: no more stack and the same shared memory as the row-major staging
    tile, no wgmma serialization (dense, causal, split, deterministic, d64 128-query steps)."""
    d128 = Problem(1, 16, 16, 16384, 16384, 128, "bfloat16", "none")
    causal = dataclasses.replace(d128, causal="top_left")
    d64 = Problem(1, 32, 32, 16384, 16384, 64, "bfloat16", "none")
    cases = [(d128, DQT), (causal, DQT), (d128, dataclasses.replace(DQT, split_warpgroups=True)),
             (d128, dataclasses.replace(DQT, deterministic=True)),
             (d64, dataclasses.replace(DQT, BLOCK_M=128))]
    jobs = [{"template": "gluon_bwd", "problem": p.to_dict(),
             "config": dataclasses.replace(c, dq_transposed=t).to_dict()}
            for p, c in cases for t in (True, False)]
    outcomes = compile_reports("templates.gluon.bwd", jobs)
    assert len(outcomes) == len(jobs)
    for out in outcomes:
        assert out["error"] == "" and out["constraint"] == "", out
        assert all(k["wgmma_serialized"] == "" for k in out["kernels"]), out
    for transposed, row_major in zip(outcomes[::2], outcomes[1::2], strict=True):
        main_t, main_r = transposed["kernels"][1], row_major["kernels"][1]
        assert main_t["stack_bytes"] <= main_r["stack_bytes"], (transposed, row_major)
        assert main_t["shared_bytes"] == main_r["shared_bytes"], (transposed, row_major)


@needs_gluon
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("shape", [(1, 4, 150, 64), (2, 3, 70, 128)])
def test_dq_and_the_gradients_come_out_in_the_inputs_layout(
        shape: tuple[int, int, int, int], transposed: bool) -> None:
    """A packed caller's q, k, v ((B, L, H, D) viewed as (B, H, L, D), as transformers and
    tuner.varlen_attention pass them) get dq, dk, dv laid out as ``torch.empty_like`` of
    them, so autograd copies nothing after; dq holds the accumulator's values (interpreter)."""
    from templates.gluon.bwd_ws_kernel import WsLaunchPlan

    batch, heads, seqlen, head_dim = shape
    torch.manual_seed(1)
    q = torch.randn(batch, seqlen, heads, head_dim).half().transpose(1, 2)
    k = torch.randn(batch, seqlen, 1, head_dim).half().transpose(1, 2)
    plan = WsLaunchPlan(q, k, causal_mode="none", scale=0.1,
                        config=dataclasses.replace(DQT, dq_transposed=transposed).to_dict())
    _, _, dq_accum, dk, dv = plan.buffers(q, k, k)
    assert dk.stride() == k.stride() and dv.stride() == k.stride()
    dq_accum.copy_(torch.randn(dq_accum.shape))
    dq = plan.dq_result(dq_accum, q)
    assert dq.stride() == q.stride() and dq.dtype == q.dtype
    values = dq_accum[..., :seqlen].transpose(-1, -2) if transposed else dq_accum
    assert torch.equal(dq, values.to(q.dtype))


@needs_gluon
def test_the_casts_grid_takes_heads_past_the_second_dimensions_limit() -> None:
    """Heads along the grid's first dimension (2^31 - 1 programs), rows along the second
    (65535): a batch x heads of 70000 (a CUDA grid's y and z stop at 65535) still launches."""
    from templates.gluon.bwd_kernel import dq_cast_launch

    grid, options = dq_cast_launch(200, 70000, 128)
    assert grid == (70000, 4) and options["ROWS"] == 64
