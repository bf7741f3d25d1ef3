"""The Gluon backward template (templates.gluon.bwd): its space and constraints on the CPU, an
offline sm_90 compile of its default configs (registers, spills, shared memory) in a child
process without the interpreter, and numerics on a Hopper GPU (``gpu`` marker); the
warp-specialized kernel (``warp_specialize``) in each of them.

Gluon kernels do not run under Triton's interpreter, so the CPU cannot check their numbers;
the compile is the CPU's check, the GPU tests the numerics. dq is summed with fp32 atomics,
so it is not bitwise reproducible between runs: the GPU tests compare it to the reference
only (dk and dv are checked for bitwise repeatability)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from templates.base import Problem
from templates.compile.offline_target import TARGETS
from templates.flash.bwd import TEMPLATE as FLASH_BWD
from templates.gluon.bwd import (
    GLUON_MISSING,
    TEMPLATE,
    GluonBwdConfig,
    shared_memory_estimate,
    tile_registers,
)
from templates.gluon.bwd_variants import CASES, VARIANTS
from tests.templates.gluon.gluon_checks import compile_reports, import_standalone, is_hopper

H100 = TARGETS["h100"]
needs_gluon = pytest.mark.skipif(bool(GLUON_MISSING), reason=GLUON_MISSING or "gluon present")


def protocol_problems() -> list[Problem]:
    return [Problem(16384 // n, 2048 // d, 2048 // d, n, n, d, "bfloat16", causal)
            for d in (64, 128) for n in (4096, 16384) for causal in ("none", "top_left")]


# ----------------------------------------------------------------------------- the space
@needs_gluon
def test_default_configs_fit_protocol_and_odd_problems() -> None:
    odd = [Problem(1, 3, 1, 77, 1100, 64, "float16", "bottom_right"),
           Problem(2, 8, 2, 1000, 1000, 128, "bfloat16", "top_left"),
           Problem(1, 2, 2, 1, 1, 128, "float16", "none")]
    for problem in protocol_problems() + odd:
        cfg = TEMPLATE.default_config(problem, H100)
        assert TEMPLATE.constraint(problem, cfg, H100) is None, (problem.key(), cfg.key())
        assert shared_memory_estimate(problem, cfg) <= H100.smem_per_block
        for other in TEMPLATE.known_good_configs(problem, H100):
            assert TEMPLATE.constraint(problem, other, H100) is None


@needs_gluon
def test_constraints_name_what_is_wrong() -> None:
    problem = Problem(1, 2, 2, 1024, 1024, 128, "bfloat16", "none")
    reason = TEMPLATE.constraint(problem, GluonBwdConfig(BLOCK_N=64, consumers=2), H100)
    assert reason is not None and "64 or 128 keys" in reason
    cfg = GluonBwdConfig(BLOCK_M=64, BLOCK_N=128, stages=3, consumers=1)
    assert tile_registers(problem, cfg) == 384
    reason = TEMPLATE.constraint(problem, cfg, H100)
    assert reason is not None and "spill" in reason
    reason = TEMPLATE.constraint(problem, GluonBwdConfig(BLOCK_M=128, stages=4), H100)
    assert reason is not None and "shared memory" in reason
    # Wrong or crashing on the H100 (notes/gluon_notes.md): refused by name.
    d64 = Problem(1, 2, 2, 1024, 1024, 64, "bfloat16", "none")
    for cfg, words in ((GluonBwdConfig(BLOCK_N=64, consumers=1), "one consumer"),
                       (GluonBwdConfig(stages=4), "4 stages"),
                       (GluonBwdConfig(stages=2), "2 stages"),
                       (GluonBwdConfig(BLOCK_M=128), "BLOCK_M 128")):
        reason = TEMPLATE.constraint(d64, cfg, H100)
        assert reason is not None and words in reason and "H100" in reason
    assert TEMPLATE.constraint(d64, GluonBwdConfig(), H100) is None
    for name in ("a100", "b200"):
        reason = TEMPLATE.constraint(problem, GluonBwdConfig(), TARGETS[name])
        assert reason is not None and "Hopper" in reason


def test_unsupported_problems() -> None:
    assert "float16 or bfloat16" in str(TEMPLATE.unsupported(
        Problem(1, 2, 2, 64, 64, 64, "float32")))
    assert TEMPLATE.unsupported(Problem(1, 2, 2, 64, 64, 256)) is None  # the d256 kernel's
    assert "head_dim" in str(TEMPLATE.unsupported(Problem(1, 2, 2, 64, 64, 96)))
    # Block masks: the warp-specialized kernel's (tests/templates/gluon/test_gluon_bwd_mask.py).
    assert TEMPLATE.unsupported(Problem(1, 2, 2, 256, 256, 64, mask="sliding:128")) is None
    # head_dim 256 runs the d256 kernel's tiles only
    reason = TEMPLATE.constraint(Problem(1, 2, 2, 64, 64, 256), GluonBwdConfig(), H100)
    assert reason is not None and "d256 kernel only" in reason, reason


def test_flops_and_bytes_match_the_triton_backward() -> None:
    for problem in protocol_problems():
        assert TEMPLATE.flops(problem) == FLASH_BWD.flops(problem)
        assert TEMPLATE.bytes_moved(problem) == FLASH_BWD.bytes_moved(problem)


def test_config_round_trip_and_grid() -> None:
    cfg = GluonBwdConfig(BLOCK_M=128, stages=4)
    assert GluonBwdConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="stages"):
        GluonBwdConfig(stages=5)
    # A ring of one and no dQ staging tile (dq_buffers 0) are in the space for the d256
    # kernel only (the constraint refuses them elsewhere: test_gluon_bwd_d256.py).
    assert GluonBwdConfig(stages=1, dq_buffers=0).stages == 1
    assert GluonBwdConfig.grid_size() == 2 * 2 * 4 * 2 * 2 * 2 * 3 * 2 * 2 * 2 * 2 * 2 * 2 * 2 * 2 * 2
    ws = GluonBwdConfig(warp_specialize=True, dq_buffers=2)
    assert GluonBwdConfig.from_dict(ws.to_dict()) == ws
    assert GluonBwdConfig.from_dict(GluonBwdConfig().to_dict()).warp_specialize is False
    with pytest.raises(ValueError, match="dq_buffers"):
        GluonBwdConfig(warp_specialize=True, dq_buffers=3)


@needs_gluon
def test_warp_specialized_configs_and_their_constraints() -> None:
    d64 = Problem(4, 32, 32, 4096, 4096, 64, "bfloat16", "none")
    d128 = Problem(4, 16, 16, 4096, 4096, 128, "bfloat16", "top_left")
    # Two dQ staging tiles fit beside a ring of three at d64, not at d128 (242 KiB there).
    d64_causal = dataclasses.replace(d64, causal="top_left")
    d128_long = dataclasses.replace(d128, seqlen_q=16384, seqlen_kv=16384, causal="none")

    def shapes(problem: Problem) -> list[tuple[int, int, int, bool, bool, bool]]:
        return [(c.BLOCK_M, c.stages, c.dq_buffers, c.dq_early, c.split_warpgroups,
                 c.dq_transposed) for c in TEMPLATE.warp_specialized_configs(problem, H100)]

    # 128-query steps fit d64 with one dQ tile only (shared memory), and are d64's dense
    # default (1.12x dq_early's speed on the H200, 0.96x causal); the candidates' staging
    # tile is D-major (dq_transposed), and the kernel without warp specialization, made
    # warp-specialized here, adds the row-major one.
    row_major = [(64, 3, 2, False, False, False), (64, 3, 1, False, False, False)]
    assert shapes(d64) == [(128, 3, 1, False, False, True), (64, 3, 2, True, False, True),
                           (64, 3, 1, True, False, True), (64, 3, 2, False, False, True),
                           (64, 3, 1, False, False, True), *row_major,
                           (128, 3, 1, False, False, False)]
    assert shapes(d64_causal) == shapes(d64)[1:-1]  # 128 spills on causal walks
    # d128: the split kernel first (on a persistent grid, then not: causal and 16k walks),
    # then one partition.
    assert shapes(d128) == [(64, 3, 1, False, True, True)] * 2 + [
        (64, 3, 1, False, False, True), row_major[1]]
    assert shapes(d128_long) == shapes(d128)
    for problem in (d128, d128_long):
        assert [c.persistent for c in TEMPLATE.warp_specialized_configs(problem, H100)] == [
            True, False, False, False]
    short_dense = dataclasses.replace(d128, causal="none")  # 64-step walks: not persistent
    assert not TEMPLATE.default_config(short_dense, H100).persistent
    for problem in (d64, d64_causal, d128, d128_long):
        for cfg in TEMPLATE.warp_specialized_configs(problem, H100):
            assert cfg.warp_specialize and TEMPLATE.constraint(problem, cfg, H100) is None
    # Right on the H200 on every GPU case, 1.22-1.29x faster at d128 and 1.16-1.20x at d64:
    # the default at both; at d64 causal with dq_early (1.03-1.05x there, 0.95-1.01x at
    # d128), dense with 128-query steps; at d128 split_warpgroups (4k causal 1.04-1.06x,
    # elsewhere 0.98-1.03x).
    for problem in (d128, d128_long, dataclasses.replace(d128, heads_kv=4)):
        default = TEMPLATE.default_config(problem, H100)
        assert default.warp_specialize and default.split_warpgroups and not default.dq_early
    assert TEMPLATE.default_config(d64, H100).BLOCK_M == 128
    default_causal = TEMPLATE.default_config(d64_causal, H100)
    assert default_causal.warp_specialize and default_causal.dq_early
    assert default_causal.dq_buffers == 1 and default_causal.BLOCK_M == 64
    assert {(c.BLOCK_M, c.dq_buffers, c.dq_early) for c in
            TEMPLATE.known_good_configs(d64, H100) if c.warp_specialize} == {
        (64, 1, True), (64, 1, False), (64, 2, False)}
    for problem in (d64, d64_causal, d128, d128_long):
        assert TEMPLATE.default_config(problem, H100).dq_transposed
    # A block mask's walk takes 64-query steps (128 spilled there), the row-major dQ staging
    # tile (D-major measured no faster there), split at d128 only (d64 keeps dq_early).
    for problem in (d64, d128_long):
        masked = TEMPLATE.run_default(problem, H100, (128, 128))
        assert masked.BLOCK_M == 64 and not masked.dq_transposed
        assert masked.split_warpgroups == (problem.head_dim == 128)
    reason = TEMPLATE.run_constraint(d64, GluonBwdConfig(BLOCK_M=128, warp_specialize=True),
                                     H100, (128, 128))
    assert reason is not None and "BLOCK_M 128" in reason and "spills" in reason
    reason = TEMPLATE.constraint(d64_causal, GluonBwdConfig(BLOCK_M=128, warp_specialize=True),
                                 H100)
    assert reason is not None and "BLOCK_M 128" in reason and "causal" in reason
    reason = TEMPLATE.constraint(d128, GluonBwdConfig(BLOCK_M=128, warp_specialize=True), H100)
    assert reason is not None and "shared memory" in reason
    # A ring of two crashed on the H200 (illegal memory access): refused by name.
    reason = TEMPLATE.constraint(d64, GluonBwdConfig(warp_specialize=True, stages=2), H100)
    assert reason is not None and "H200" in reason and "2 stages" in reason
    reason = TEMPLATE.constraint(d128, GluonBwdConfig(warp_specialize=True, dq_buffers=2), H100)
    assert reason is not None and "shared memory" in reason
    reason = TEMPLATE.constraint(d64, GluonBwdConfig(dq_buffers=2), H100)
    assert reason is not None and "needs warp_specialize" in reason
    reason = TEMPLATE.constraint(d64, GluonBwdConfig(warp_specialize=True, defer_dq=False), H100)
    assert reason is not None and "defer_dq" in reason
    reason = TEMPLATE.constraint(d64, GluonBwdConfig(BLOCK_N=64, consumers=1,
                                                     warp_specialize=True), H100)
    assert reason is not None and "consumer" in reason
    # Its launch: the worker warps' registers go to the two MMA warpgroups (maxnreg 168 over
    # three warpgroups, setmaxnreg 240 / 24), dq_accum goes in as a TMA descriptor.
    from templates.gluon import bwd_ws_kernel

    cfg = GluonBwdConfig(warp_specialize=True, dq_buffers=2)
    (pre, _, _, _), (main, grid, args, options) = TEMPLATE.kernel_launches(d64, cfg)
    assert main is bwd_ws_kernel._gluon_bwd_ws_kernel
    assert options["maxnreg"] == 168 and options["num_warps"] == 8
    assert options["DQ_BUFFERS"] == 2 and options["LOAD_REGS"] == 24
    assert bwd_ws_kernel.MMA_REGS == 240
    # 9 descriptors/tensors, 10 scalars, the block mask's 11 arguments (stand-ins: dense),
    # the dQ counters (None: not deterministic), the tiles' order (dk standing in: none).
    assert grid == (32 * 4 * 32,) and len(args) == 9 + 10 + 11 + 1 + 1 and args[-2] is None
    assert type(args[8]).__name__ == "TensorDescriptor"
    (_, _, _, _), (plain, _, plain_args, plain_options) = TEMPLATE.kernel_launches(
        d64, GluonBwdConfig())
    assert plain.__name__ == "_gluon_bwd_kernel" and "maxnreg" not in plain_options
    assert type(plain_args[8]).__name__ == "StandinTensor"
    # dq_early: a constexpr of the warp-specialized kernel only where set (the default
    # kernel's options, so its compiled kernel, unchanged); refused without warp_specialize.
    assert "DQ_EARLY" not in options
    early = dataclasses.replace(cfg, dq_early=True)
    assert TEMPLATE.constraint(d64, early, H100) is None
    assert TEMPLATE.kernel_launches(d64, early)[1][3]["DQ_EARLY"] is True
    reason = TEMPLATE.constraint(d64, GluonBwdConfig(dq_early=True), H100)
    assert reason is not None and "dq_early needs warp_specialize" in reason


@needs_gluon
def test_standalone_source_needs_only_torch_and_triton(tmp_path: Path) -> None:
    plain = dataclasses.replace(TEMPLATE.default_config(protocol_problems()[0], H100),
                                warp_specialize=False, dq_buffers=1)
    source = TEMPLATE.standalone_source(plain)
    compile(source, "gluon_bwd_standalone.py", "exec")
    assert "from templates" not in source and "import templates" not in source
    module = import_standalone(source, tmp_path / "gluon_bwd_standalone.py")
    assert module.tma_ready and module.tma_load and module.LaunchPlan
    assert "@gluon.jit" in source and "def gluon_attention_bwd(" in source
    assert "_gluon_bwd_ws_kernel" not in source


@needs_gluon
def test_warp_specialized_standalone_source(tmp_path: Path) -> None:
    problem = protocol_problems()[0]
    cfg = TEMPLATE.warp_specialized_configs(problem, H100)[0]
    source = TEMPLATE.standalone_source(cfg)
    assert "from templates" not in source and "import templates" not in source
    module = import_standalone(source, tmp_path / "gluon_bwd_ws_standalone.py")
    # The warp-specialized launcher is the one the entry calls (it inlines the first module,
    # whose launch it replaces).
    assert module.launch.__doc__ and "warp-specialized" in module.launch.__doc__
    assert module.WsLaunchPlan and module._gluon_bwd_ws_kernel
    assert module.CONFIG["warp_specialize"] is True


@needs_gluon
def test_input_errors_name_the_argument() -> None:
    from templates.gluon.bwd import gluon_attention_bwd

    q = torch.zeros(1, 2, 8, 64, dtype=torch.bfloat16)
    lse = torch.zeros(1, 2, 8)
    with pytest.raises(TypeError, match="float16 or bfloat16"):
        gluon_attention_bwd(q.float(), q.float(), q.float(), q.float(), q.float(), lse)
    with pytest.raises(ValueError, match="head_dim must be one of"):
        w = torch.zeros(1, 2, 8, 96, dtype=torch.bfloat16)
        gluon_attention_bwd(w, w, w, w, w, lse)
    with pytest.raises(ValueError, match="heads of q"):
        k = torch.zeros(1, 3, 8, 64, dtype=torch.bfloat16)
        gluon_attention_bwd(q, q, k, k, q, lse)
    with pytest.raises(TypeError, match="lse must be 3-D float32"):
        gluon_attention_bwd(q, q, q, q, q, lse.double())
    with pytest.raises(ValueError, match="causal must be"):
        gluon_attention_bwd(q, q, q, q, q, lse, causal="diagonal")
    with pytest.raises(ValueError, match="CUDA tensors"):
        gluon_attention_bwd(q, q, q, q, q, lse)


@needs_gluon
def test_default_configs_are_unchanged_by_the_deterministic_knob() -> None:
    """The knob is off by default; the defaults and the runners-up a sweep measures first
    are the measured ones (warp-specialized, one dQ tile; at d64 dense with 128-query
    steps, causal with dq_early; at d128 split_warpgroups, persistent on causal and long
    walks), none ordered."""
    assert GluonBwdConfig().deterministic is False
    ws = GluonBwdConfig(BLOCK_M=64, BLOCK_N=128, stages=3, consumers=2, warp_specialize=True)
    for problem in protocol_problems():
        if problem.head_dim <= 64:
            want = (dataclasses.replace(ws, BLOCK_M=128) if problem.causal == "none"
                    else dataclasses.replace(ws, dq_early=True))
        else:
            # On a persistent grid where walks are causal or 256 steps long (16k rows).
            persistent = problem.causal != "none" or problem.seqlen_q >= 16384
            want = dataclasses.replace(ws, split_warpgroups=True, persistent=persistent)
        want = dataclasses.replace(want, dq_transposed=True)
        assert TEMPLATE.default_config(problem, H100) == want
        for cfg in (TEMPLATE.known_good_configs(problem, H100)
                    + TEMPLATE.warp_specialized_configs(problem, H100)):
            assert not getattr(cfg, "deterministic", False)
    d64 = Problem(4, 32, 32, 4096, 4096, 64, "bfloat16", "none")
    dqt = dataclasses.replace(ws, dq_transposed=True)
    assert TEMPLATE.known_good_configs(d64, H100)[:3] == [
        dataclasses.replace(dqt, dq_early=True), dqt, dataclasses.replace(dqt, dq_buffers=2)]


@needs_gluon
def test_deterministic_is_offered_and_refused_where_the_order_is_not_defined() -> None:
    from templates.masks.block_mask import DEFAULT_BLOCK_SIZE

    d64 = Problem(4, 32, 32, 4096, 4096, 64, "bfloat16", "none")
    d128 = Problem(4, 16, 16, 4096, 4096, 128, "bfloat16", "top_left")
    gqa = Problem(1, 8, 2, 1000, 3000, 128, "bfloat16", "bottom_right")
    det = GluonBwdConfig(warp_specialize=True, deterministic=True)
    for problem in (d64, d128, gqa):
        assert TEMPLATE.constraint(problem, det, H100) is None
        # Two dQ tiles where they fit (d64), refused by shared memory as without the knob.
        assert TEMPLATE.constraint(problem, dataclasses.replace(det, dq_buffers=2), H100) \
            == TEMPLATE.constraint(problem, GluonBwdConfig(warp_specialize=True, dq_buffers=2),
                                   H100)
    # Each refusal says why in one sentence.
    reason = TEMPLATE.constraint(d64, GluonBwdConfig(deterministic=True), H100)
    assert reason is not None and "deterministic needs warp_specialize" in reason
    block = (DEFAULT_BLOCK_SIZE, DEFAULT_BLOCK_SIZE)
    masked = Problem(1, 2, 2, 1024, 1024, 64, "bfloat16", "none", mask="sliding:256")
    for reason in (TEMPLATE.constraint(masked, det, H100),
                   TEMPLATE.run_constraint(d64, det, H100, block)):
        assert reason is not None and "block mask" in reason and "0 .. k" in reason
    assert TEMPLATE.run_constraint(d64, det, H100, None) is None
    # Its launch: DETERMINISTIC and one int32 counter per (batch, query head, query tile) as
    # the last runtime argument; the default launch passes None there (compiled out).
    from templates.compile.standin_tensor import StandinTensor
    from templates.gluon import bwd_ws_kernel

    launches = TEMPLATE.kernel_launches(gqa, det)
    assert launches is not None
    main, _, args, options = launches[1]
    assert main is bwd_ws_kernel._gluon_bwd_ws_kernel and options["DETERMINISTIC"] is True
    assert len(args) == 9 + 10 + 11 + 1 + 1  # ... the dQ counters, the tiles' order
    assert isinstance(args[-2], StandinTensor) and args[-2].dtype == torch.int32
    assert list(args[-2].shape) == [1 * 8 * math.ceil(1000 / 64)]
    launches = TEMPLATE.kernel_launches(gqa, GluonBwdConfig(warp_specialize=True))
    assert launches is not None
    assert "DETERMINISTIC" not in launches[1][3] and launches[1][2][-2] is None


# ----------------------------------------------------------------------------- offline compile
COMPILE_JOBS = [
    Problem(4, 16, 16, 4096, 4096, 128, "bfloat16", "none"),
    Problem(4, 16, 16, 4096, 4096, 128, "bfloat16", "top_left"),
    Problem(4, 32, 32, 4096, 4096, 64, "float16", "none"),
    Problem(4, 32, 32, 4096, 4096, 64, "bfloat16", "top_left"),
    Problem(1, 8, 2, 1000, 3000, 128, "bfloat16", "bottom_right"),  # GQA, odd lengths
    Problem(1, 4, 1, 333, 333, 64, "float16", "bottom_right"),  # MQA
]
# Stack bytes the offline builds give the d128 default (64 x 128 tiles, at the register
# bound): 48 (dense) and 80 (causal) with triton 3.9 since dS^T is staged in shared memory and
# each step's dQ atomics run under the next step's GEMMs (defer_dq); that default measured
# 1.10-1.16x the speed of the spill-free order on the H200 (notes/gluon_notes.md). d64 has
# none.
D128_STACK = 96
# The warp-specialized kernel's MMA warpgroups at 240 registers: 8-40 bytes at d128 with
# triton 3.9, 40-56 with 3.6, none at d64 (notes/gluon_notes.md, "The warp-specialized
# backward").
WS_D128_STACK = 64


@needs_gluon
def test_default_configs_compile_for_the_h100() -> None:
    jobs: list[dict[str, Any]] = []
    for p in COMPILE_JOBS:
        for cfg in ([TEMPLATE.default_config(p, H100)] + TEMPLATE.known_good_configs(p, H100)
                    + TEMPLATE.warp_specialized_configs(p, H100)):
            jobs.append({"template": "gluon_bwd", "problem": p.to_dict(),
                         "config": cfg.to_dict()})
    outcomes = compile_reports("templates.gluon.bwd", jobs)
    assert len(outcomes) == len(jobs)
    for job, out in zip(jobs, outcomes, strict=True):
        assert out["error"] == "" and out["constraint"] == "", out
        pre, main = out["kernels"]
        assert pre["kernel"] == "_gluon_bwd_preprocess_kernel" and pre["stack_bytes"] == 0
        problem = Problem.from_dict(job["problem"])
        cfg = GluonBwdConfig.from_dict(job["config"])
        if cfg.warp_specialize:
            # The cubin's count is maxnreg (168); the MMA warpgroups run at 240 (setmaxnreg).
            kernel = ("_gluon_bwd_split_kernel" if cfg.split_warpgroups
                      else "_gluon_bwd_ws_kernel")
            assert main["kernel"] == kernel and main["registers"] == 168, out
            allowed = WS_D128_STACK if tile_registers(problem, cfg) >= 192 else 0
        else:
            assert main["kernel"] == "_gluon_bwd_kernel"
            assert 32 < main["registers"] <= 255, out
            allowed = D128_STACK if tile_registers(problem, cfg) >= 192 else 0
        assert main["stack_bytes"] <= allowed, f"registers spilled: {out}"
        assert main["wgmma_serialized"] == "", out  # ptxas keeps the GEMMs asynchronous
        estimate = shared_memory_estimate(problem, cfg)
        assert 0 <= estimate - main["shared_bytes"] <= 1024, (estimate, main)
        assert main["shared_bytes"] <= H100.smem_per_block


@needs_gluon
def test_deterministic_configs_compile_for_the_h100() -> None:
    """The ordered dQ (spin, reduce, full wait, fence, release) fits beside the ``ws``
    kernel: no more stack than its bound, no wgmma serialization, its shared memory."""
    jobs: list[dict[str, Any]] = [
        {"template": "gluon_bwd", "problem": p.to_dict(),
         "config": GluonBwdConfig(warp_specialize=True, deterministic=True,
                                  dq_buffers=n).to_dict()}
        for p, n in ((COMPILE_JOBS[1], 1), (COMPILE_JOBS[4], 1), (COMPILE_JOBS[3], 2))]
    outcomes = compile_reports("templates.gluon.bwd", jobs)
    assert len(outcomes) == len(jobs)
    for job, out in zip(jobs, outcomes, strict=True):
        assert out["error"] == "" and out["constraint"] == "", out
        main = out["kernels"][1]
        problem = Problem.from_dict(job["problem"])
        cfg = GluonBwdConfig.from_dict(job["config"])
        assert main["kernel"] == "_gluon_bwd_ws_kernel" and main["registers"] == 168, out
        allowed = WS_D128_STACK if tile_registers(problem, cfg) >= 192 else 0
        assert main["stack_bytes"] <= allowed, f"registers spilled: {out}"
        assert main["wgmma_serialized"] == "", out
        assert 0 <= shared_memory_estimate(problem, cfg) - main["shared_bytes"] <= 1024


# ----------------------------------------------------------------------------- GPU numerics
# The named configs and odd-shape cases (shared with benchmarks/gluon_bwd_bench.py).
GPU_CASES = CASES


@pytest.mark.gpu
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: Problem(*c).key())
def test_matches_the_reference_on_the_gpu(variant: str, case: tuple[Any, ...],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    if not is_hopper():
        pytest.skip("gluon_bwd needs a Hopper GPU")
    from templates.device import current_device
    from templates.gluon import bwd_kernel as gluon_bwd_kernel

    monkeypatch.setattr(gluon_bwd_kernel, "DEBUG_POISON", True)
    problem = Problem(*case)
    device = current_device()
    data = VARIANTS[variant]
    cfg = TEMPLATE.default_config(problem, device) if data is None else GluonBwdConfig(**data)
    if TEMPLATE.constraint(problem, cfg, device):
        pytest.skip(f"{variant} does not fit {problem.key()}")
    inputs = TEMPLATE.make_inputs(problem, "cuda", seed=3)
    ref = TEMPLATE.reference(inputs)
    runs = [TEMPLATE.run(inputs, cfg) for _ in range(2)]
    for out in runs:
        for grad in out:
            assert not torch.isnan(grad).any()
        err = TEMPLATE.error(out, ref)
        assert err <= TEMPLATE.tolerance(problem), (cfg.key(), err)
    # dk and dv are summed in registers in a fixed order; dq by atomics is not (no check),
    # unless the config orders them.
    assert torch.equal(runs[0][1], runs[1][1]) and torch.equal(runs[0][2], runs[1][2])
    if cfg.deterministic:
        assert torch.equal(runs[0][0], runs[1][0])
    if problem.causal == "bottom_right" and problem.seqlen_q > problem.seqlen_kv:
        blind = problem.seqlen_q - problem.seqlen_kv
        assert torch.all(runs[0][0][..., :blind, :] == 0)
    assert math.isfinite(err)


REPEAT_CASES = [
    (2, 8, 2, 4096, 4096, 128, "bfloat16", "top_left"),  # GQA: 4 query heads per program
    (2, 16, 16, 4096, 4096, 128, "bfloat16", "none"),  # 32 KV tiles per query tile
    (1, 4, 1, 1500, 3000, 64, "float16", "bottom_right"),  # MQA, N_q != N_kv
    (4, 16, 16, 2048, 2048, 64, "bfloat16", "none"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", REPEAT_CASES, ids=lambda c: Problem(*c).key())
def test_deterministic_dq_is_bitwise_repeatable(case: tuple[Any, ...]) -> None:
    """Three runs of the deterministic config on the same inputs: dq (and dk, dv) identical
    bit for bit, and right. Whether ``ws`` (unordered) differs on the same inputs is printed,
    not asserted: it says whether the case could have caught a lost order."""
    if not is_hopper():
        pytest.skip("gluon_bwd needs a Hopper GPU")
    from templates.device import current_device

    problem = Problem(*case)
    device = current_device()
    det = GluonBwdConfig(warp_specialize=True, deterministic=True)
    if TEMPLATE.constraint(problem, det, device):
        pytest.skip(f"deterministic does not fit {problem.key()}")
    inputs = TEMPLATE.make_inputs(problem, "cuda", seed=5)
    runs = [TEMPLATE.run(inputs, det) for _ in range(3)]
    torch.cuda.synchronize()
    for out in runs[1:]:
        for label, a, b in zip(("dq", "dk", "dv"), runs[0], out, strict=True):
            assert torch.equal(a, b), f"{label} differs between runs of {det.key()}"
    err = TEMPLATE.error(runs[0], TEMPLATE.reference(inputs))
    assert err <= TEMPLATE.tolerance(problem), (det.key(), err)
    plain = [TEMPLATE.run(inputs, GluonBwdConfig(warp_specialize=True))[0] for _ in range(3)]
    print(f"{problem.key()}: unordered ws dq bitwise repeatable over 3 runs: "
          f"{all(torch.equal(plain[0], p) for p in plain[1:])}")
