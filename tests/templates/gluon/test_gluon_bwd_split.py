"""gluon_bwd's ``split_warpgroups``: the warp-specialized backward with its two MMA
warpgroups as two partitions (templates/gluon/bwd_split_kernel.py). On the CPU: which configs
and problems take it, the shared memory it counts, the offline sm_90 build (dense, causal and
block masks); on a Hopper GPU: gradients against the reference and against the
one-partition kernel."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from templates.base import Problem
from templates.compile.offline_target import TARGETS
from templates.compile.standin_tensor import StandinTensor
from templates.gluon import bwd_tile_order
from templates.gluon.bwd import (
    GLUON_MISSING,
    TEMPLATE,
    GluonBwdConfig,
    shared_memory_estimate,
    split_kernel,
)
from tests.templates.gluon.gluon_checks import compile_reports, import_standalone, is_hopper

H100 = TARGETS["h100"]
needs_gluon = pytest.mark.skipif(bool(GLUON_MISSING), reason=GLUON_MISSING or "gluon present")
SPLIT = GluonBwdConfig(BLOCK_M=64, BLOCK_N=128, stages=3, consumers=2, warp_specialize=True,
                       split_warpgroups=True)
DENSE = Problem(1, 16, 16, 16384, 16384, 128, "bfloat16", "none")
CAUSAL = Problem(1, 32, 32, 16384, 16384, 64, "bfloat16", "top_left")
PERSISTENT = dataclasses.replace(SPLIT, persistent=True)
DK_LATE = dataclasses.replace(SPLIT, dk_after_dq=True)
SLIDING = Problem(1, 32, 16, 16384, 16384, 128, "bfloat16", "none", "sliding_causal:1024")
DOCS = Problem(1, 32, 16, 16384, 16384, 128, "bfloat16", "none", "documents_causal:2048")


@needs_gluon
def test_dense_causal_and_masked_problems_take_it() -> None:
    for problem in (DENSE, CAUSAL, SLIDING):
        assert TEMPLATE.constraint(problem, SPLIT, H100) is None
    assert TEMPLATE.constraint(DOCS, dataclasses.replace(SPLIT, doc_offsets=True), H100) is None
    assert TEMPLATE.run_constraint(DENSE, SPLIT, H100, None) is None
    assert TEMPLATE.run_constraint(DENSE, SPLIT, H100, (128, 128)) is None


@needs_gluon
def test_what_it_does_not_take_is_refused_by_name() -> None:
    for knob in ("deterministic", "dq_early"):
        reason = TEMPLATE.constraint(DENSE, dataclasses.replace(SPLIT, **{knob: True}), H100)
        assert reason is not None and knob in reason, reason
    reason = TEMPLATE.constraint(
        DENSE, dataclasses.replace(SPLIT, warp_specialize=False), H100)
    assert reason is not None and "warp_specialize" in reason


@needs_gluon
def test_persistent_needs_the_split_kernel() -> None:
    for problem in (DENSE, CAUSAL, SLIDING):
        assert TEMPLATE.constraint(problem, PERSISTENT, H100) is None
    for cfg in (dataclasses.replace(PERSISTENT, split_warpgroups=False),
                dataclasses.replace(PERSISTENT, split_warpgroups=False, warp_specialize=False)):
        reason = TEMPLATE.constraint(DENSE, cfg, H100)
        assert reason is not None and "split_warpgroups" in reason, reason


@needs_gluon
def test_dk_after_dq_needs_the_split_kernel() -> None:
    for problem in (DENSE, CAUSAL, SLIDING):
        assert TEMPLATE.constraint(problem, DK_LATE, H100) is None
        assert TEMPLATE.constraint(problem, dataclasses.replace(DK_LATE, persistent=True),
                                   H100) is None
    reason = TEMPLATE.constraint(DENSE, dataclasses.replace(DK_LATE, split_warpgroups=False),
                                 H100)
    assert reason is not None and "dk_after_dq" in reason and "split_warpgroups" in reason


@needs_gluon
def test_dk_after_dq_adds_no_spill_and_keeps_the_gemms_pipelined() -> None:
    """The offline build with dK's GEMM after dQ's: as many stack bytes as without it (no
    register the in-flight dK adds spills), no serialized wgmma, the same shared memory;
    dense, causal on both grids, d64, and both block-mask walks."""
    pairs = [(DENSE, SPLIT), (CAUSAL, SPLIT), (Problem(1, 16, 16, 16384, 16384, 128,
                                                       "bfloat16", "top_left"), PERSISTENT),
             (SLIDING, SPLIT), (DOCS, dataclasses.replace(SPLIT, doc_offsets=True))]
    jobs = [{"template": "gluon_bwd", "problem": p.to_dict(), "config": c.to_dict()}
            for p, base in pairs for c in (base, dataclasses.replace(base, dk_after_dq=True))]
    outs = compile_reports("templates.gluon.bwd", jobs)
    for without, with_it in zip(outs[::2], outs[1::2], strict=True):
        assert with_it["error"] == "" and with_it["constraint"] == "", with_it
        (_, before), (_, after) = without["kernels"], with_it["kernels"]
        assert after["kernel"] == "_gluon_bwd_split_kernel", with_it
        assert after["wgmma_serialized"] == "", with_it
        assert (after["stack_bytes"] or 0) <= (before["stack_bytes"] or 0), (before, after)
        assert after["shared_bytes"] == before["shared_bytes"], (before, after)


@needs_gluon
def test_a_persistent_plan_runs_one_program_per_sm_over_every_tile() -> None:
    def plan(problem: Problem, cfg: GluonBwdConfig, sm_count: int = 132) -> Any:
        q = StandinTensor(torch.bfloat16, [problem.batch, problem.heads_q, problem.seqlen_q,
                                           problem.head_dim])
        k = StandinTensor(torch.bfloat16, [problem.batch, problem.heads_kv,
                                           problem.seqlen_kv, problem.head_dim])
        return split_kernel.SplitLaunchPlan(q, k, causal_mode=problem.causal, scale=0.1,
                                            config=cfg.to_dict(), sm_count=sm_count)

    dense = plan(DENSE, PERSISTENT)
    tiles = 16 * 16384 // 128
    assert dense.grid == (132,) and dense.n_tiles == tiles
    assert dense.options["PERSISTENT"] is True and dense.options["HOST_SCHEDULE"] is True
    _, n_tiles = dense.tail_args("dk", [])
    assert n_tiles == tiles
    # The host's schedule: offsets, then each program's tiles; every tile once, and the
    # programs' work within one tile's of each other.
    table = [int(x) for x in split_kernel.SplitLaunchPlan._host_schedule(
        dense, StandinTensor(torch.bfloat16, [1, 16, 16384, 128]),
        StandinTensor(torch.bfloat16, [1, 16, 16384, 128]), "none")]
    offsets, owned = table[:133], table[133:]
    assert offsets[0] == 0 and offsets[-1] == tiles and sorted(owned) == list(range(tiles))
    counts = [offsets[p + 1] - offsets[p] for p in range(132)]
    assert max(counts) - min(counts) <= 1
    # Causal: the longest walks (the first KV tiles) first, and no program more than a
    # longest tile's work above the least loaded.
    causal = plan(CAUSAL, PERSISTENT)
    table = [int(x) for x in split_kernel.SplitLaunchPlan._host_schedule(
        causal, StandinTensor(torch.bfloat16, [1, 32, 16384, 64]),
        StandinTensor(torch.bfloat16, [1, 32, 16384, 64]), "top_left")]
    offsets, owned = table[:133], table[133:]
    n_kv = 16384 // 128
    assert sorted(owned) == list(range(32 * n_kv))
    steps = [sum(256 - 2 * (t % n_kv) for t in owned[offsets[p]:offsets[p + 1]])
             for p in range(132)]
    assert max(steps) - min(steps) <= 256
    assert owned[offsets[0]] % n_kv == 0  # program 0 starts on a longest tile
    # Under a block mask the walks' lengths are on the GPU: rounds, no host schedule.
    # Fewer tiles than SMs: a program each; without the knob the grid is every tile.
    small = plan(Problem(1, 2, 2, 1000, 1000, 128, "bfloat16", "none"), PERSISTENT)
    assert small.grid == (2 * 8,)
    assert plan(DENSE, SPLIT).grid == (tiles,) and "PERSISTENT" not in plan(DENSE, SPLIT).options


def test_the_head_group_fills_two_rounds_within_the_l2_budget() -> None:
    group = bwd_tile_order.persistent_head_group
    assert group(rows=64, n_kv_tiles=32, programs=132, row_bytes=2 << 20) == 8   # 9 > 8 fit
    assert group(rows=64, n_kv_tiles=128, programs=132, row_bytes=2 << 20) == 3
    assert group(rows=2, n_kv_tiles=32, programs=132, row_bytes=1 << 20) == 2     # all rows
    assert group(rows=64, n_kv_tiles=32, programs=132, row_bytes=64 << 20) == 1   # none fit


def test_the_second_ds_tile_is_counted() -> None:
    one = dataclasses.replace(SPLIT, split_warpgroups=False)
    tile = SPLIT.BLOCK_N * SPLIT.BLOCK_M * 2
    assert shared_memory_estimate(DENSE, SPLIT) - shared_memory_estimate(DENSE, one) == tile
    assert shared_memory_estimate(DENSE, SPLIT) <= H100.smem_per_block


@needs_gluon
def test_it_compiles_for_the_h100_without_serialized_gemms() -> None:
    """The offline build: both MMA partitions' wgmma pipelines intact (no ptxas note), the
    shared memory within the H100's 227 KiB (d128: two dS^T tiles beside the ring)."""
    jobs = [{"template": "gluon_bwd", "problem": p.to_dict(), "config": c.to_dict()}
            for p, c in ((DENSE, SPLIT), (CAUSAL, SPLIT),
                         (CAUSAL, dataclasses.replace(SPLIT, dq_buffers=2)), (SLIDING, SPLIT),
                         (DOCS, dataclasses.replace(SPLIT, doc_offsets=True)),
                         (DENSE, PERSISTENT), (CAUSAL, PERSISTENT), (SLIDING, PERSISTENT),
                         (DOCS, dataclasses.replace(PERSISTENT, doc_offsets=True)),
                         # longest_first: the tiles' order read, both grids; a causal
                         # window by its rows' first keys (doc_offsets' path)
                         (SLIDING, dataclasses.replace(SPLIT, longest_first=True,
                                                       window_offsets=True)),
                         (DOCS, dataclasses.replace(PERSISTENT, doc_offsets=True,
                                                    longest_first=True)))]
    for out in compile_reports("templates.gluon.bwd", jobs):
        assert out["error"] == "" and out["constraint"] == "", out
        _, main = out["kernels"]
        assert main["kernel"] == "_gluon_bwd_split_kernel", out
        assert main["wgmma_serialized"] == "", out
        assert main["shared_bytes"] <= H100.smem_per_block, out


@needs_gluon
def test_its_standalone_source_runs_the_split_kernel(tmp_path: Path) -> None:
    source = TEMPLATE.standalone_source(SPLIT)
    assert "from templates" not in source and "import templates" not in source
    module = import_standalone(source, tmp_path / "gluon_bwd_split_standalone.py")
    assert module.launch.__doc__ and "split kernel" in module.launch.__doc__
    assert module.CONFIG["split_warpgroups"] is True
    assert module.SplitLaunchPlan.main_kernel(None) is module._gluon_bwd_split_kernel


# ----------------------------------------------------------------------------- GPU numerics
GPU_CASES = [
    (1, 2, 2, 333, 333, 128, "bfloat16", "none"),
    (2, 4, 2, 1000, 1000, 128, "bfloat16", "top_left"),  # GQA
    (1, 3, 1, 300, 1100, 64, "float16", "bottom_right"),  # MQA, N_q < N_kv
    (1, 2, 2, 1100, 300, 128, "float16", "bottom_right"),  # 800 rows see no key
    (2, 8, 8, 2048, 2048, 128, "bfloat16", "top_left"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dk_after_dq", [False, True], ids=["dk_first", "dk_after_dq"])
@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: Problem(*c).key())
def test_split_matches_the_reference_and_the_one_partition_kernel(
        case: tuple[Any, ...], persistent: bool, dk_after_dq: bool,
        monkeypatch: pytest.MonkeyPatch) -> None:
    if not is_hopper():
        pytest.skip("gluon_bwd needs a Hopper GPU")
    from templates.gluon import bwd_kernel as gluon_bwd_kernel

    monkeypatch.setattr(gluon_bwd_kernel, "DEBUG_POISON", True)  # unwritten dk/dv read NaN
    problem = Problem(*case)
    inputs = TEMPLATE.make_inputs(problem, "cuda", seed=3)
    ref = TEMPLATE.reference(inputs)
    one = TEMPLATE.run(inputs, dataclasses.replace(SPLIT, split_warpgroups=False))
    cfg = dataclasses.replace(PERSISTENT if persistent else SPLIT, dk_after_dq=dk_after_dq)
    runs = [TEMPLATE.run(inputs, cfg) for _ in range(2)]
    for out in runs:
        for grad in out:
            assert not torch.isnan(grad).any()
        assert TEMPLATE.error(out, ref) <= TEMPLATE.tolerance(problem)
    # dK and dV: the same GEMMs in the same order per key row as the one-partition kernel.
    assert torch.equal(runs[0][1], one[1]) and torch.equal(runs[0][2], one[2])
    assert torch.equal(runs[0][1], runs[1][1]) and torch.equal(runs[0][2], runs[1][2])


MASK_CASES = [
    (1, 8, 2, 2048, 2048, 128, "bfloat16", "none", "sliding_causal:512"),  # GQA
    (1, 2, 2, 1500, 1500, 64, "float16", "none", "documents_causal:256"),  # odd length
    (2, 4, 4, 1000, 1000, 128, "float16", "none", "random:0.3"),
    (4, 8, 8, 2048, 2048, 128, "bfloat16", "none", "sliding_causal:512"),  # 512 KV tiles
]


@pytest.mark.gpu
@pytest.mark.parametrize(("longest_first", "dk_after_dq"), [(False, False), (True, False),
                                                            (False, True)],
                         ids=["natural_order", "longest_first", "dk_after_dq"])
@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("doc_offsets", [False, True])
@pytest.mark.parametrize("case", MASK_CASES, ids=lambda c: Problem(*c).key())
def test_split_walks_block_masks(case: tuple[Any, ...], doc_offsets: bool, persistent: bool,
                                 longest_first: bool, dk_after_dq: bool,
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    if not is_hopper():
        pytest.skip("gluon_bwd needs a Hopper GPU")
    from templates.gluon import bwd_kernel as gluon_bwd_kernel

    monkeypatch.setattr(gluon_bwd_kernel, "DEBUG_POISON", True)
    problem = Problem(*case)
    cfg = dataclasses.replace(SPLIT, doc_offsets=doc_offsets, persistent=persistent,
                              longest_first=longest_first, dk_after_dq=dk_after_dq)
    if TEMPLATE.constraint(problem, cfg, H100):
        pytest.skip(f"{cfg.key()} does not fit {problem.key()}")
    inputs = TEMPLATE.make_inputs(problem, "cuda", seed=3)
    ref = TEMPLATE.reference(inputs)
    out = TEMPLATE.run(inputs, cfg)
    one = TEMPLATE.run(inputs, dataclasses.replace(cfg, split_warpgroups=False,
                                                   persistent=False, longest_first=False,
                                                   dk_after_dq=False))
    for grad in out:
        assert not torch.isnan(grad).any()
    assert TEMPLATE.error(out, ref) <= TEMPLATE.tolerance(problem)
    assert torch.equal(out[1], one[1]) and torch.equal(out[2], one[2])
