"""Named gluon_bwd configs and the odd-shape problems they are checked on: one table for the
GPU tests (tests/templates/gluon/test_gluon_bwd.py) and the bench
(benchmarks/gluon_bwd_bench.py), so that every variant the bench times is one the tests
check, by the same name. ``None``: the template's default for the problem."""

from __future__ import annotations

from typing import Any

_TILES = {"BLOCK_M": 64, "BLOCK_N": 128, "stages": 3, "consumers": 2}
_WS = {**_TILES, "warp_specialize": True, "dq_buffers": 1}

VARIANTS: dict[str, dict[str, Any] | None] = {
    "default": None,
    # Without warp specialization: a step's dQ added by atomics during the next step's GEMMs
    # (defer_dq, the default), or after its own.
    "eager_dq": {**_TILES, "defer_dq": False},
    # FA3's structure: load warp, dQ warp (TMA reduce), two MMA warpgroups at 240 registers;
    # one dQ staging tile, or two (d64 only: shared memory).
    "ws": _WS,
    "ws_dq2": {**_WS, "dq_buffers": 2},
    # dQ added in KV-tile order (a counter per query tile): dq bitwise repeatable too.
    "ws_det": {**_WS, "deterministic": True},
    "ws_det_dq2": {**_WS, "dq_buffers": 2, "deterministic": True},
    # The dQ GEMM before dK's, its tile stored while dK's GEMM runs.
    "ws_dqe": {**_WS, "dq_early": True},
    "ws_dqe_dq2": {**_WS, "dq_buffers": 2, "dq_early": True},
    # The two MMA warpgroups as two partitions (templates/gluon/bwd_split_kernel.py) ...
    "ws_split": {**_WS, "split_warpgroups": True},
    "ws_split_dq2": {**_WS, "dq_buffers": 2, "split_warpgroups": True},
    # ... on a persistent grid (one program per SM walking its tiles in turn).
    "ws_split_pers": {**_WS, "split_warpgroups": True, "persistent": True},
    # ... with dK's GEMM issued after dQ's, under the dQ tile's hand-over (FA3's order).
    "ws_split_dkl": {**_WS, "split_warpgroups": True, "dk_after_dq": True},
    "ws_split_pers_dkl": {**_WS, "split_warpgroups": True, "persistent": True,
                          "dk_after_dq": True},
    # 128-query steps (d64 only: registers), with dq_early too.
    "ws_m128": {**_WS, "BLOCK_M": 128},
    "ws_m128_dqe": {**_WS, "BLOCK_M": 128, "dq_early": True},
}
# The warp-specialized variants of one dQ staging tile with it D-major (``dq_transposed``).
VARIANTS.update({f"{name}_dqt": {**knobs, "dq_transposed": True}
                 for name, knobs in list(VARIANTS.items())
                 if knobs and knobs.get("warp_specialize") and knobs.get("dq_buffers") != 2})

# The d256 kernel (templates/gluon/bwd_d256_kernel.py): 64 x 64 tiles,
# the two warpgroups splitting dK/dV/dQ by columns; a ring of one and its dQ staging tile
# D-major (the d256 default) or row-major, or a ring of two and dQ by atomics. Checked on
# ``D256_CASES``.
_D256 = {"BLOCK_M": 64, "BLOCK_N": 64, "stages": 1, "consumers": 2, "warp_specialize": True,
         "split_warpgroups": True, "dq_buffers": 1}
D256_VARIANTS = {
    "ws_d256": {**_D256, "dq_transposed": True},
    "ws_d256_row": {**_D256, "dq_transposed": False},
    # no staging tile and no dQ warp: dQ by the MMA warps' fp32 atomics, a ring of two
    "ws_d256_atomic": {**_D256, "stages": 2, "dq_buffers": 0, "dq_transposed": False},
}
VARIANTS.update(D256_VARIANTS)

# (batch, query heads, kv heads, N_q, N_kv, D, dtype, causal): odd lengths, GQA and MQA, both
# causal alignments, rows that see no key.
CASES: list[tuple[Any, ...]] = [
    (1, 2, 2, 1, 1, 64, "bfloat16", "none"),
    (1, 2, 2, 333, 333, 128, "bfloat16", "none"),
    (2, 4, 2, 1000, 1000, 128, "bfloat16", "top_left"),  # GQA
    (1, 3, 1, 300, 1100, 64, "float16", "bottom_right"),  # MQA, N_q < N_kv
    (1, 2, 2, 1100, 300, 128, "float16", "bottom_right"),  # 800 rows see no key
    (1, 2, 2, 700, 200, 64, "bfloat16", "top_left"),
    (1, 2, 2, 1000, 333, 64, "float16", "none"),
    (2, 8, 8, 2048, 2048, 128, "float16", "top_left"),
]

# The d256 kernel's cases (the variants above; the others are refused at D 256): N = 1, lengths
# not a multiple of 64, N_q != N_kv both ways with rows that see no key, GQA 8:1 and MQA,
# both causal alignments, bf16 and fp16.
D256_CASES: list[tuple[Any, ...]] = [
    (1, 2, 2, 1, 1, 256, "bfloat16", "none"),
    (1, 2, 2, 333, 333, 256, "bfloat16", "none"),
    (1, 2, 2, 333, 333, 256, "float16", "top_left"),
    (2, 8, 1, 1000, 1000, 256, "bfloat16", "top_left"),  # GQA 8:1
    (1, 8, 1, 515, 515, 256, "float16", "none"),  # GQA 8:1
    (1, 3, 1, 300, 1100, 256, "float16", "bottom_right"),  # MQA, N_q < N_kv
    (1, 2, 2, 1100, 300, 256, "bfloat16", "bottom_right"),  # 800 rows see no key
    (1, 2, 2, 700, 200, 256, "bfloat16", "top_left"),
    (1, 2, 2, 200, 700, 256, "float16", "none"),
    (2, 4, 4, 2048, 2048, 256, "bfloat16", "top_left"),
]


def cases_of(name: str) -> list[tuple[Any, ...]]:
    """The cases variant ``name`` is checked on."""
    return D256_CASES if name in D256_VARIANTS else CASES
