"""gluon_bwd's ``longest_first``: the split kernel's KV tiles under a block mask in order of
decreasing walk (``bwd_bwd_tile_order.TileOrder``). On the CPU: the order against walks counted
from the dense mask, the configs and calls that take the knob, the plan's launch arguments
(the offline sm_90 build is test_gluon_bwd_split.py's); on a Hopper GPU the gradients
(test_gluon_bwd_split.py's mask cases run with the knob)."""

from __future__ import annotations

import dataclasses
import gc

import pytest
import torch

from templates.base import Problem
from templates.compile.offline_target import TARGETS
from templates.compile.standin_tensor import StandinTensor
from templates.gluon import bwd_tile_order
from templates.gluon.bwd import GLUON_MISSING, TEMPLATE, GluonBwdConfig, split_kernel
from templates.gluon.fwd import StandinBlockMask
from templates.masks.block_mask import BlockMask
from tests.templates.gluon.gluon_checks import check_bwd_like, compile_reports, is_hopper

H100 = TARGETS["h100"]
pytestmark = pytest.mark.skipif(bool(GLUON_MISSING), reason=GLUON_MISSING or "gluon present")
SPLIT = GluonBwdConfig(BLOCK_M=64, BLOCK_N=128, stages=3, consumers=2, warp_specialize=True,
                       split_warpgroups=True)
ORDERED = dataclasses.replace(SPLIT, longest_first=True)
DENSE = Problem(1, 16, 16, 4096, 4096, 128, "bfloat16", "none")
SLIDING = Problem(1, 32, 16, 16384, 16384, 128, "bfloat16", "none", "sliding_causal:1024")
DOCS = Problem(1, 32, 16, 16384, 16384, 128, "bfloat16", "none", "documents_causal:2048")


def _walks(dense: torch.Tensor, batch: int, heads_q: int, heads_kv: int, block_n: int
           ) -> list[list[int]]:
    """Per (batch, kv head) row, per KV tile of ``block_n`` keys: the 128-row query blocks
    that see any of the tile's 128-key block, summed over the row's query heads, counted
    from the dense mask (B|1, H|1, N_q, N_kv) itself."""
    dense = dense.expand(batch, heads_q, *dense.shape[2:])
    n_q, n_kv = dense.shape[2:]
    group = heads_q // heads_kv
    walks = []
    for b in range(batch):
        for kv_h in range(heads_kv):
            row = []
            for t in range(-(-n_kv // block_n)):
                kb = t * block_n // 128
                row.append(sum(
                    bool(dense[b, kv_h * group + g, qb * 128:(qb + 1) * 128,
                               kb * 128:(kb + 1) * 128].any())
                    for g in range(group) for qb in range(-(-n_q // 128))))
            walks.append(row)
    return walks


def _order(mask: BlockMask, *, batch: int, heads_q: int, heads_kv: int, block_n: int,
           rows_per_group: int) -> bwd_tile_order.TileOrder:
    kv_major = mask.transposed
    n_kv_tiles = -(-mask.seqlen_kv // block_n)
    return bwd_tile_order.TileOrder(
        batch=batch, heads_q=heads_q, heads_kv=heads_kv, n_kv_tiles=n_kv_tiles,
        block_n=block_n, mask_block_kv=kv_major.block_size[0],
        strides=tuple(kv_major.kernel_args()[6:8]), rows_per_group=rows_per_group)


@pytest.mark.parametrize(("mask_batch", "mask_heads", "block_n"),
                         [(2, 4, 128), (1, 1, 128), (2, 1, 64)])
def test_the_tiles_go_longest_walk_first_within_head_groups(
        mask_batch: int, mask_heads: int, block_n: int) -> None:
    batch, heads_q, heads_kv, n = 2, 4, 2, 1000
    gen = torch.Generator().manual_seed(7)
    blocks = torch.rand(mask_batch, mask_heads, 8, 8, generator=gen) < 0.4
    dense = blocks.repeat_interleave(128, 2).repeat_interleave(128, 3)[:, :, :n, :n].clone()
    dense |= torch.eye(n, dtype=torch.bool)  # every query sees a key
    mask = BlockMask.from_dense(dense)
    order = _order(mask, batch=batch, heads_q=heads_q, heads_kv=heads_kv, block_n=block_n,
                   rows_per_group=3)
    kv_major = mask.transposed.kernel_args()
    got = order(kv_major[0], kv_major[2])
    assert got.dtype == torch.int32

    walks = _walks(dense, batch, heads_q, heads_kv, block_n)
    n_kv_tiles = len(walks[0])
    tiles = [(row, t) for row in range(len(walks)) for t in range(n_kv_tiles)]
    want = sorted(tiles, key=lambda rt: (rt[0] // 3, -walks[rt[0]][rt[1]], rt))
    assert got.tolist() == [row * n_kv_tiles + t for row, t in want]
    assert len({w for row in walks for w in row}) > 2  # unequal walks: the order tells


def test_each_mask_keeps_its_order_while_it_lives() -> None:
    dense = torch.tril(torch.ones(640, 640, dtype=torch.bool))
    mask = BlockMask.from_dense(dense)
    order = _order(mask, batch=1, heads_q=2, heads_kv=2, block_n=128, rows_per_group=2)
    kv_major = mask.transposed
    args = kv_major.kernel_args()
    first = order(args[0], args[2], kv_major)
    assert order(args[0], args[2], kv_major) is first
    # Causal, seen from the keys: KV block t is seen by the query blocks t .. 4; the two
    # heads' rows are one group, equal walks in tile order.
    assert first.tolist() == [0, 5, 1, 6, 2, 7, 3, 8, 4, 9]
    # Another mask of the geometry: its own order; without a mask, worked out every call.
    other = BlockMask.from_dense(torch.ones(640, 640, dtype=torch.bool)).transposed
    other_args = other.kernel_args()
    assert order(other_args[0], other_args[2], other) is not first
    assert order(args[0], args[2]) is not first
    assert len(bwd_tile_order._ORDERS) >= 2
    before = len(bwd_tile_order._ORDERS)
    del other, other_args
    gc.collect()
    assert len(bwd_tile_order._ORDERS) == before - 1  # dropped with its mask


def test_longest_first_needs_a_block_mask_and_a_warp_specialized_kernel() -> None:
    one = dataclasses.replace(ORDERED, split_warpgroups=False)  # one MMA partition
    for problem in (SLIDING, DOCS):
        for cfg in (ORDERED, one):
            assert TEMPLATE.constraint(problem, cfg, H100) is None
    reason = TEMPLATE.constraint(DENSE, ORDERED, H100)
    assert reason is not None and "longest_first" in reason and "mask" in reason, reason
    plain = dataclasses.replace(one, warp_specialize=False)
    reason = TEMPLATE.constraint(SLIDING, plain, H100)
    assert reason is not None and "warp_specialize" in reason, reason
    # A call: its problem names no mask; the mask's blocks say whether it has one.
    call = dataclasses.replace(SLIDING, mask="none")
    assert TEMPLATE.run_constraint(call, ORDERED, H100, (128, 128)) is None
    assert TEMPLATE.run_constraint(call, one, H100, (128, 128)) is None
    reason = TEMPLATE.run_constraint(call, ORDERED, H100, None)
    assert reason is not None and "longest_first" in reason, reason
    reason = TEMPLATE.run_constraint(call, plain, H100, (128, 128))
    assert reason is not None and "warp_specialize" in reason, reason


def test_it_is_d128s_default_under_block_masks_only() -> None:
    for problem in (SLIDING, DOCS):
        assert TEMPLATE.default_config(problem, H100).longest_first
        call = dataclasses.replace(problem, mask="none")
        assert TEMPLATE.run_default(call, H100, (128, 128)).longest_first
        assert not TEMPLATE.run_default(call, H100, None).longest_first
        # The sweep measures the split kernel in tile order too, and the order on the
        # persistent grid (one group: not measured yet).
        known = TEMPLATE.known_good_configs(problem, H100)
        assert any(c.split_warpgroups and not c.longest_first for c in known)
        assert any(c.persistent and c.longest_first for c in known)
    d64 = dataclasses.replace(SLIDING, head_dim=64, heads_q=32, heads_kv=32)
    assert not TEMPLATE.default_config(d64, H100).longest_first
    assert not TEMPLATE.default_config(DENSE, H100).longest_first


@pytest.mark.parametrize("persistent", [False, True])
def test_the_plan_passes_the_order_where_the_schedule_goes(persistent: bool) -> None:
    q = StandinTensor(torch.bfloat16, [1, 32, 16384, 128])
    k = StandinTensor(torch.bfloat16, [1, 16, 16384, 128])
    cfg = dataclasses.replace(ORDERED, persistent=persistent).to_dict()
    plan = split_kernel.SplitLaunchPlan(q, k, causal_mode="none", scale=0.1, config=cfg,
                                        kv_major_mask=StandinBlockMask(16384, 16384),
                                        sm_count=132)
    tiles = 16 * 16384 // 128
    assert plan.options["TILE_ORDER"] is True and "HOST_SCHEDULE" not in plan.options
    assert plan.grid == ((132,) if persistent else (tiles,))
    mask = StandinBlockMask(16384, 16384).kernel_args()[:6]
    order, n_tiles = plan.tail_args("dk", mask)
    assert list(order.shape) == [tiles] and order.dtype == torch.int32 and n_tiles == tiles
    with pytest.raises(ValueError, match="longest_first"):
        split_kernel.SplitLaunchPlan(q, k, causal_mode="none", scale=0.1, config=cfg,
                                     sm_count=132)



def test_the_one_partition_kernel_compiles_with_it_for_the_h100() -> None:
    """d64's default under masks (one MMA partition, dq_early) with the order: it builds, the
    wgmma pipeline intact (the split kernel's builds are test_gluon_bwd_split.py's)."""
    d64 = Problem(1, 32, 32, 16384, 16384, 64, "bfloat16", "none", "sliding_causal:1024")
    cfg = dataclasses.replace(TEMPLATE.default_config(d64, H100), longest_first=True)
    assert not cfg.split_warpgroups
    [out] = compile_reports("templates.gluon.bwd", [
        {"template": "gluon_bwd", "problem": d64.to_dict(), "config": cfg.to_dict()}])
    assert out["error"] == "" and out["constraint"] == "", out
    _, main = out["kernels"]
    assert main["kernel"] == "_gluon_bwd_ws_kernel" and main["wgmma_serialized"] == "", out


# ----------------------------------------------------------------------------- GPU numerics
GPU_CASES = [
    (1, 8, 2, 2048, 2048, 64, "bfloat16", "none", "documents_causal:256"),  # GQA, d64
    (2, 4, 4, 1000, 1000, 128, "float16", "none", "random:0.3"),  # odd length
    (4, 8, 8, 2048, 2048, 128, "bfloat16", "none", "sliding_causal:512"),  # 512 KV tiles
]


@pytest.mark.gpu
@pytest.mark.parametrize("split", [False, True], ids=["one_partition", "split"])
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: Problem(*c).key())
def test_the_order_changes_no_gradient(case: tuple[object, ...], split: bool,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Right against the reference, and dK/dV bitwise those of the tile order (each tile's
    sums are its own, in a fixed order; dq's atomics come in any order)."""
    if not is_hopper():
        pytest.skip("gluon_bwd needs a Hopper GPU")
    from templates.gluon import bwd_kernel as gluon_bwd_kernel

    monkeypatch.setattr(gluon_bwd_kernel, "DEBUG_POISON", True)  # unwritten dk/dv read NaN
    problem = Problem(*case)  # type: ignore[arg-type]
    base = GluonBwdConfig(warp_specialize=True, split_warpgroups=split)
    ordered = dataclasses.replace(base, longest_first=True)
    if TEMPLATE.constraint(problem, ordered, H100):
        pytest.skip(f"{ordered.key()} does not fit {problem.key()}")
    check_bwd_like(TEMPLATE, TEMPLATE.make_inputs(problem, "cuda", seed=9), problem, ordered,
                   base)


def test_a_persistent_grid_orders_all_rows_as_one_group() -> None:
    """Its static rounds balance one descending list; a launch's dynamic order keeps the
    head groups that hold Q and dO in L2."""
    q = StandinTensor(torch.bfloat16, [1, 32, 16384, 128])
    k = StandinTensor(torch.bfloat16, [1, 16, 16384, 128])
    groups = {}
    for persistent in (False, True):
        plan = split_kernel.SplitLaunchPlan(
            q, k, causal_mode="none", scale=0.1,
            config=dataclasses.replace(ORDERED, persistent=persistent).to_dict(),
            kv_major_mask=StandinBlockMask(16384, 16384), sm_count=132)
        groups[persistent] = plan.tile_order.rows_per_group
    # (A row's Q and dO, its two query heads', are 16 MiB: the L2 budget holds one row.)
    assert groups == {False: 1, True: 16}
