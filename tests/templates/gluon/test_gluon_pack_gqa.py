"""Packed GQA in the Gluon forward (``pack_gqa``): the query heads of each KV head stacked into
one head of rows. On the CPU: the host's causal bounds of packed tiles against a count row by
row, the plan's shapes, the knob's constraints and default, an offline sm_90 compile; on a
Hopper GPU (``gpu`` marker): numerics against the reference."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
import triton

from templates.base import Problem
from templates.compile.offline_target import TARGETS
from templates.compile.standin_tensor import StandinTensor
from templates.gluon.fwd import GLUON_MISSING, TEMPLATE, GluonFwdConfig, packing_fills_rows
from templates.gluon.schedule import causal_tile_costs, query_rows
from tests.templates.gluon.gluon_checks import compile_reports, import_standalone, is_hopper

H100 = TARGETS["h100"]
needs_gluon = pytest.mark.skipif(bool(GLUON_MISSING), reason=GLUON_MISSING or "gluon present")


def kv_blocks_seen(rows: range, q_per_head: int, block_n: int, seqlen_kv: int,
                   offset: int) -> int:
    """KV blocks a causal tile must walk: up to the block of the last key any of its rows
    sees, each row's query being its index within its head (packed) or the row itself."""
    last_key = -1
    for row in rows:
        query = row % q_per_head if q_per_head else row
        last_key = max(last_key, min(seqlen_kv - 1, query + offset))
    return (last_key + 1 + block_n - 1) // block_n if last_key >= 0 else 0


@pytest.mark.parametrize("q_per_head,seqlen_kv,offset", [
    (0, 1000, 0), (16, 4096, 4080), (77, 300, 223), (1, 3000, 2999), (200, 200, 0),
    (128, 4096, 3968), (5, 64, 0)])
def test_packed_causal_bounds_cover_every_rows_keys(q_per_head: int, seqlen_kv: int,
                                                    offset: int) -> None:
    """The host's tile costs (``causal_tile_costs``, which the split and LPT schedules cut by,
    the kernel's ``_query_rows`` twin) walk every block some row of the tile sees, and for a
    tile inside one head no block more."""
    block_m, block_n, group = 128, 128, 4
    rows_total = group * q_per_head if q_per_head else 1000
    n_q_tiles = -(-rows_total // block_m)
    costs = causal_tile_costs(n_q_tiles, block_m, block_n, seqlen_kv, offset, 0, q_per_head)
    for tile, cost in enumerate(costs):
        m0 = tile * block_m
        rows = range(m0, min(m0 + block_m, rows_total))
        needed = kv_blocks_seen(rows, q_per_head, block_n, seqlen_kv, offset)
        assert cost >= needed, (tile, cost, needed)
        first, last = query_rows(m0, block_m, q_per_head)
        if not q_per_head:
            assert (first, last) == (m0, m0 + block_m - 1)
        elif m0 // q_per_head == (m0 + block_m - 1) // q_per_head:
            # Within one head the bound is its rows' own, and no block more.
            assert (first, last) == (m0 % q_per_head, (m0 + block_m - 1) % q_per_head)
            assert cost == needed, (tile, cost, needed)
        else:
            assert (first, last) == (0, q_per_head - 1)


@pytest.mark.parametrize("heads,q_per_head,seqlen_kv", [(8, 16, 4096), (8, 64, 16384),
                                                        (32, 0, 4096), (3, 1, 3000)])
def test_a_causal_grid_of_equal_tiles_is_cut(heads: int, q_per_head: int,
                                             seqlen_kv: int) -> None:
    """One query tile per head (a few queries at the end of a cache, packed or not): every
    tile costs the same, and the schedule still cuts them over the idle SMs, every block of
    each tile in exactly one piece (before ``candidate_caps`` it had no cap to try)."""
    from templates.gluon.schedule import cut_lpt_schedule

    queries = q_per_head or 16
    blocks = causal_tile_costs(1, 128, 128, seqlen_kv, seqlen_kv - queries, 0, q_per_head)
    split = cut_lpt_schedule(1, heads, blocks, 132)
    assert split is not None and split.cut_cost < split.uncut_cost
    pieces: dict[int, list[tuple[int, int]]] = {}
    for mine in split.entries:
        for tile, first, end, _, _, count in mine:
            assert count > 1  # every tile is cut
            pieces.setdefault(tile, []).append((first, end))
    assert sorted(pieces) == list(range(heads))
    for ranges in pieces.values():
        ranges.sort()
        assert ranges[0][0] == 0 and ranges[-1][1] == blocks[0]
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))


def test_pack_gqa_constraints_and_default() -> None:
    gqa = Problem(2, 32, 8, 16, 4096, 128, "bfloat16", "bottom_right")
    mha = dataclasses.replace(gqa, heads_kv=32)
    packed = dataclasses.replace(TEMPLATE.default_config(gqa, H100), pack_gqa=True)
    if GLUON_MISSING:
        pytest.skip(GLUON_MISSING)
    assert TEMPLATE.constraint(gqa, packed, H100) is None
    reason = TEMPLATE.constraint(mha, packed, H100)
    assert reason is not None and "heads_q > heads_kv" in reason and "32 of each" in reason
    masked = dataclasses.replace(gqa, mask="sliding:1024", causal="top_left", seqlen_q=4096)
    reason = TEMPLATE.constraint(masked, dataclasses.replace(packed, longest_first=False,
                                                             split_tail=False),
                                 H100)
    assert reason is not None and "pack_gqa" in reason and "block mask" in reason
    # The default packs where the tiles' rows fill clearly better.
    assert TEMPLATE.default_config(gqa, H100).pack_gqa
    assert not TEMPLATE.default_config(mha, H100).pack_gqa
    assert not packing_fills_rows(dataclasses.replace(gqa, seqlen_q=4096, seqlen_kv=4096), 128)
    assert packing_fills_rows(dataclasses.replace(gqa, seqlen_q=1), 128)
    assert packing_fills_rows(dataclasses.replace(gqa, seqlen_q=64), 128)  # 4 -> 2 tiles
    # 8 -> 7 tiles: measured no faster on the H200.
    assert not packing_fills_rows(dataclasses.replace(gqa, seqlen_q=200), 128)
    assert not TEMPLATE.default_config(masked, H100).pack_gqa


@needs_gluon
def test_a_packed_plan_runs_the_kv_heads_rows() -> None:
    from templates.gluon.fwd import kernel

    assert kernel is not None
    q = StandinTensor(torch.bfloat16, [2, 32, 16, 128])
    k = StandinTensor(torch.bfloat16, [2, 8, 4096, 128])
    cfg = dataclasses.replace(GluonFwdConfig(), pack_gqa=True, persistent=True,
                              split_tail=True, longest_first=True)
    plan = kernel.LaunchPlan(q, k, causal_mode="bottom_right", scale=1.0, config=cfg.to_dict())
    assert plan.pack and plan.options["PACK_GQA"]
    assert plan.out_shape == (2, 8, 64, 128) and plan.lse_shape == (2, 8, 64)
    # N_q, N_kv, offset (from the unpacked N_q), H_q, group, tiles per head, tiles, ...,
    # queries per packed head.
    assert plan.scalars[:7] == [64, 4096, 4080, 8, 1, 1, 16]
    assert plan.scalars[-1] == 16
    assert plan.packed(q).shape == [2, 8, 64, 128]
    unpacked = kernel.LaunchPlan(q, k, causal_mode="bottom_right", scale=1.0,
                                 config=dataclasses.replace(cfg, pack_gqa=False).to_dict())
    assert not unpacked.pack and unpacked.scalars[-1] == 0 and unpacked.scalars[6] == 64


@needs_gluon
def test_an_exported_packed_kernel_plans_as_the_template_does(tmp_path: Path) -> None:
    """The standalone source (``tuner export``) of a packed config: its own LaunchPlan packs
    and prices the causal tiles by its own copy of ``query_rows``."""
    problem = Problem(2, 32, 8, 16, 4096, 128, "bfloat16", "bottom_right")
    cfg = TEMPLATE.default_config(problem, H100)
    source = TEMPLATE.standalone_source(cfg)
    assert "'pack_gqa': True" in source and "from templates" not in source
    module = import_standalone(source, tmp_path / "gluon_fwd_packed.py")
    q = StandinTensor(torch.bfloat16, [2, 32, 16, 128])
    k = StandinTensor(torch.bfloat16, [2, 8, 4096, 128])
    plan = module.LaunchPlan(q, k, causal_mode="bottom_right", scale=1.0,
                             config=cfg.to_dict())
    assert plan.pack and plan.out_shape == (2, 8, 64, 128) and plan.scalars[-1] == 16
    assert module.query_rows(0, 128, 16) == (0, 15)


@needs_gluon
def test_packed_configs_compile_for_the_h100_without_spills() -> None:
    problems = [Problem(2, 32, 8, 16, 4096, 128, "bfloat16", "bottom_right"),
                Problem(1, 8, 1, 1, 3000, 64, "float16", "none")]
    jobs: list[dict[str, Any]] = [
        {"template": "gluon_fwd", "problem": p.to_dict(),
         "config": TEMPLATE.default_config(p, H100).to_dict()} for p in problems]
    outcomes = compile_reports("templates.gluon.fwd", jobs)
    for job, out in zip(jobs, outcomes, strict=True):
        assert job["config"]["pack_gqa"]
        assert out["error"] == "" and out["constraint"] == "", out
        (compiled,) = out["kernels"]
        # triton 3.6 (the GPU machines'): no spill. 3.9 allocates otherwise: 112 bytes with
        # a dense grid's split tails (test_gluon_fwd's bound), 136 with a causal grid's cut
        # tiles (this bottom-right grid of one tile per head is cut).
        allowed = 0 if triton.__version__.startswith("3.6") else 160
        assert compiled["stack_bytes"] <= allowed, out


# ----------------------------------------------------------------------------- GPU numerics
PACKED_CASES = [
    (2, 32, 8, 16, 4096, 128, "bfloat16", "bottom_right"),  # a few new tokens of a cache
    (2, 32, 8, 16, 4096, 128, "float16", "none"),
    (1, 8, 1, 1, 3000, 64, "bfloat16", "none"),  # MQA decode: 8 rows in one tile
    (1, 8, 1, 1, 3000, 128, "bfloat16", "bottom_right"),
    (1, 12, 4, 77, 300, 128, "float16", "top_left"),  # tiles span heads; rows see no key
    (3, 8, 2, 200, 1000, 64, "bfloat16", "bottom_right"),
    (1, 8, 2, 1000, 700, 128, "bfloat16", "top_left"),  # N_q > N_kv: top-left, many tiles
]


@pytest.mark.gpu
@pytest.mark.parametrize("persistent", [True, False])
@pytest.mark.parametrize("case", PACKED_CASES, ids=lambda c: Problem(*c).key())
def test_packed_gqa_matches_the_reference_on_the_gpu(case: tuple[Any, ...], persistent: bool,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    if not is_hopper():
        pytest.skip("gluon_fwd needs a Hopper GPU")
    from templates.device import current_device
    from templates.gluon import fwd_kernel as gluon_fwd_kernel

    monkeypatch.setattr(gluon_fwd_kernel, "DEBUG_POISON", True)
    problem = Problem(*case)
    device = current_device()
    cfg = dataclasses.replace(TEMPLATE.default_config(problem, device), pack_gqa=True,
                              persistent=persistent)
    if not persistent:
        cfg = dataclasses.replace(cfg, split_tail=False)
    assert TEMPLATE.constraint(problem, cfg, device) is None
    inputs = TEMPLATE.make_inputs(problem, "cuda", seed=5)
    ref = TEMPLATE.reference(inputs)
    runs = [TEMPLATE.run(inputs, cfg) for _ in range(3)]
    o, lse = runs[0]
    assert o.shape == inputs["q"].shape and lse.shape == inputs["q"].shape[:3]
    err = TEMPLATE.error(runs[0], ref)
    assert err <= TEMPLATE.tolerance(problem), (cfg.key(), err)
    for o_again, lse_again in runs[1:]:  # a result that moves between runs is a race
        assert torch.equal(o_again, o) and torch.equal(lse_again, lse)
    if problem.causal == "top_left" and problem.seqlen_q > problem.seqlen_kv:
        assert torch.all(torch.isfinite(lse))  # top-left: every row sees key 0
    unpacked = TEMPLATE.run(inputs, dataclasses.replace(cfg, pack_gqa=False))
    assert TEMPLATE.error(unpacked, ref) <= TEMPLATE.tolerance(problem)
