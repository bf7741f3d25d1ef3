"""Flash-decoding against the float64/float32 reference: lengths, paging, GQA, splits, errors.

CPU cases run the Triton interpreter and stay tiny; long caches and bf16 are marked gpu.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

import templates
from templates.base import Problem
from templates.decode import kernel as flash_decode_kernel
from templates.decode.kernel import check_decode_inputs, launch_decode, whole_wave_splits
from templates.decode.template import (
    TEMPLATE,
    FlashDecodeConfig,
    decode_reference,
    default_num_splits,
    parse_decode_mask,
    sequence_lengths,
)
from templates.device import CPU_INTERPRETER, DeviceInfo
from templates.registry import get_template

H100 = DeviceInfo(name="NVIDIA H100 80GB HBM3", compute_capability="9.0", sm_count=132,
                  total_memory=80 << 30, smem_per_block=227 * 1024, driver_version="",
                  triton_version="3.6.0", torch_version="2.11.0", cuda_version="12.8")
SMALL_GPU = DeviceInfo(name="small", compute_capability="8.6", sm_count=28,
                       total_memory=8 << 30, smem_per_block=99 * 1024, driver_version="",
                       triton_version="3.6.0", torch_version="2.11.0", cuda_version="12.8")
INTERPRETER = DeviceInfo(name=CPU_INTERPRETER, compute_capability="", sm_count=2,
                         total_memory=0, smem_per_block=228 * 1024, driver_version="",
                         triton_version="", torch_version="", cuda_version="")


def decode_problem(batch: int, heads_q: int, heads_kv: int, n_q: int, seqlen: int,
                   head_dim: int, *, dtype: str = "float16", mask: str = "none") -> Problem:
    return Problem(batch, heads_q, heads_kv, n_q, seqlen, head_dim, dtype=dtype,
                   causal="none" if n_q == 1 else "bottom_right", mask=mask)


def check_against_reference(problem: Problem, config: FlashDecodeConfig | None, device: str,
                            seed: int = 0) -> float:
    inputs = TEMPLATE.make_inputs(problem, device, seed)
    out = templates.flash_decode(inputs["q"], inputs["k_cache"], inputs["v_cache"],
                                 cache_seqlens=inputs["cache_seqlens"],
                                 block_table=inputs["block_table"], config=config)
    o, lse = out
    assert o.dtype == inputs["q"].dtype and lse.dtype == torch.float32
    assert o.shape == inputs["q"].shape and lse.shape == inputs["q"].shape[:3]
    err = TEMPLATE.error(out, TEMPLATE.reference(inputs))
    assert err <= TEMPLATE.tolerance(problem), f"{problem.key()} {config}: error {err}"
    return err


CPU_CASES = [
    # (batch, heads_q, heads_kv, n_q, seqlen, head_dim, mask, num_splits, block_n)
    (2, 2, 2, 1, 1, 64, "none", 1, 16),  # one key
    (2, 8, 2, 1, 17, 64, "none", 2, 16),  # one tile and one key
    (2, 8, 2, 3, 100, 64, "none", 4, 16),  # speculative tokens, GQA 4
    (1, 4, 1, 3, 100, 40, "paged:16", 2, 32),  # tile spans pages, padded head dim
    (2, 4, 4, 1, 100, 64, "paged:32", 4, 16),  # tiles inside pages, GQA 1
    (3, 8, 2, 3, 100, 64, "paged:16+mixed", 2, 16),  # mixed lengths over pages
    (4, 4, 1, 1, 60, 64, "mixed", 4, 16),  # short sequences leave splits empty
    (1, 32, 1, 3, 20, 32, "none", 1, 16),  # 96 rows: the group spans two row tiles
    (1, 2, 1, 1, 100, 256, "none", 32, 16),  # d=256; the combine takes 16 splits per step
]


@pytest.mark.parametrize("case", CPU_CASES, ids=lambda c: "-".join(map(str, c)))
def test_matches_reference(case: tuple[Any, ...]) -> None:
    batch, heads_q, heads_kv, n_q, seqlen, head_dim, mask, splits, block_n = case
    problem = decode_problem(batch, heads_q, heads_kv, n_q, seqlen, head_dim, mask=mask)
    check_against_reference(problem, FlashDecodeConfig(num_splits=splits, block_n=block_n), "cpu")


def test_float32_and_default_config() -> None:
    problem = decode_problem(2, 4, 2, 2, 50, 32, dtype="float32", mask="paged:8")
    check_against_reference(problem, None, "cpu")


def test_split_count_keeps_the_result() -> None:
    problem = decode_problem(2, 4, 2, 2, 90, 64, mask="mixed")
    inputs = TEMPLATE.make_inputs(problem, "cpu", seed=3)
    outs = [TEMPLATE.run(inputs, FlashDecodeConfig(num_splits=s, block_n=16)) for s in (1, 4)]
    # Different split points round differently, but no further apart than each is from
    # the reference.
    assert TEMPLATE.error(outs[0], outs[1]) <= TEMPLATE.tolerance(problem)
    assert not torch.equal(outs[0][1], torch.zeros_like(outs[0][1]))


def test_empty_and_short_sequences() -> None:
    # Length 0: no key at all. Length 2 with 3 new tokens: token 0 sees nothing.
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(3, 4, 3, 32, generator=gen).half()
    k = torch.randn(3, 2, 40, 32, generator=gen).half()
    v = torch.randn(3, 2, 40, 32, generator=gen).half()
    lens = torch.tensor([0, 2, 37], dtype=torch.int32)
    o, lse = templates.flash_decode(q, k, v, cache_seqlens=lens,
                                    config=FlashDecodeConfig(num_splits=2, block_n=16))
    assert torch.equal(o[0], torch.zeros_like(o[0]))
    assert torch.isneginf(lse[0]).all() and torch.isneginf(lse[1, :, 0]).all()
    assert torch.isfinite(lse[1, :, 1:]).all() and torch.isfinite(lse[2]).all()
    assert torch.equal(o[1, :, 0], torch.zeros_like(o[1, :, 0]))
    ref = decode_reference(q, k, v, cache_seqlens=lens)
    assert TEMPLATE.error((o, lse), ref) <= 2e-3


def test_empty_sequence_in_a_paged_cache_reads_no_page() -> None:
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(2, 2, 1, 64, generator=gen).half()
    k = torch.randn(3, 16, 2, 64, generator=gen).half()
    v = torch.randn(3, 16, 2, 64, generator=gen).half()
    # Sequence 0 is empty and its table row is garbage; sequence 1 uses pages 2 then 0.
    table = torch.tensor([[-7, 99], [2, 0]], dtype=torch.int32)
    lens = torch.tensor([0, 20], dtype=torch.int32)
    o, lse = templates.flash_decode(q, k, v, cache_seqlens=lens, block_table=table,
                                    config=FlashDecodeConfig(num_splits=1, block_n=32))
    ref = decode_reference(q, k, v, cache_seqlens=lens, block_table=table)
    assert torch.isneginf(lse[0]).all()
    assert TEMPLATE.error((o, lse), ref) <= 2e-3


def test_strided_inputs_and_scale() -> None:
    gen = torch.Generator().manual_seed(4)
    # q as (B, N_q, H, D) storage seen as (B, H, N_q, D); caches with padded head dims.
    q = torch.randn(2, 3, 4, 64, generator=gen).half().transpose(1, 2)
    k = torch.randn(2, 50, 2, 72, generator=gen).half()[..., :64].transpose(1, 2)
    v = torch.randn(2, 2, 64, 50, generator=gen).half().transpose(2, 3)
    lens = torch.tensor([[50, 7], [33, 7]], dtype=torch.int32)[:, 0]  # a strided view too
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous()
                or lens.is_contiguous())
    cfg = FlashDecodeConfig(num_splits=2, block_n=16)
    out = templates.flash_decode(q, k, v, cache_seqlens=lens, scale=0.3, config=cfg)
    ref = decode_reference(q, k, v, cache_seqlens=lens, scale=0.3)
    assert TEMPLATE.error(out, ref) <= 2e-3
    # The scale is used: the default one gives another answer.
    default = decode_reference(q, k, v, cache_seqlens=lens)
    assert TEMPLATE.error(out, default) > 1e-2


def test_config_as_dict_and_bad_config() -> None:
    problem = decode_problem(1, 2, 1, 1, 40, 64)
    inputs = TEMPLATE.make_inputs(problem, "cpu")
    args = (inputs["q"], inputs["k_cache"], inputs["v_cache"])
    out = templates.flash_decode(*args, cache_seqlens=inputs["cache_seqlens"],
                                 config={"num_splits": 2, "block_n": 16})
    assert TEMPLATE.error(out, TEMPLATE.reference(inputs)) <= 2e-3
    with pytest.raises(ValueError, match="block_n must be one of"):
        templates.flash_decode(*args, cache_seqlens=inputs["cache_seqlens"],
                               config={"block_n": 48})


# ----------------------------------------------------------------------------- fused combine
# Under the interpreter the programs run one after another, so these tests check the logic
# (which program arrives last, what it merges, the counters left at zero), not the memory
# ordering between programs running at once: the GPU tests below exercise that.
FUSED_CASES = [
    # (batch, heads_q, heads_kv, n_q, seqlen, head_dim, dtype, mask, num_splits, block_n)
    (2, 8, 2, 3, 100, 64, "float16", "none", 4, 16),  # GQA 4 x 3 tokens in one row tile
    (1, 32, 1, 3, 20, 32, "float16", "none", 2, 16),  # 96 rows: two row tiles, two counters
    (3, 8, 2, 3, 100, 64, "float16", "paged:16+mixed", 8, 16),  # pages, mixed lengths
    (1, 4, 1, 3, 100, 40, "float32", "paged:16", 2, 32),  # tile spans pages, padded head dim
    (2, 4, 4, 1, 100, 64, "float32", "paged:32", 4, 16),  # tiles inside pages, GQA 1
    (4, 4, 1, 1, 60, 64, "float16", "mixed", 4, 16),  # short sequences leave splits empty
    (1, 2, 1, 1, 100, 256, "float32", "none", 32, 16),  # d=256: merged 16 splits per step
    (2, 8, 2, 2, 50, 32, "float16", "none", 1, 16),  # one split: no combine in either mode
]


def run_both_combines(inputs: dict[str, Any], cfg: FlashDecodeConfig) -> list[Any]:
    return [TEMPLATE.run(inputs, replace(cfg, combine=mode)) for mode in ("separate", "fused")]


def assert_counters_at_zero() -> None:
    for counters in flash_decode_kernel._ARRIVALS.values():
        assert int(counters.abs().sum()) == 0


@pytest.mark.parametrize("case", FUSED_CASES, ids=lambda c: "-".join(map(str, c)))
def test_fused_combine_matches_separate_and_reference(case: tuple[Any, ...]) -> None:
    batch, heads_q, heads_kv, n_q, seqlen, head_dim, dtype, mask, splits, block_n = case
    problem = decode_problem(batch, heads_q, heads_kv, n_q, seqlen, head_dim, dtype=dtype,
                             mask=mask)
    inputs = TEMPLATE.make_inputs(problem, "cpu", seed=2)
    ref = TEMPLATE.reference(inputs)
    separate, fused = run_both_combines(inputs, FlashDecodeConfig(num_splits=splits,
                                                                  block_n=block_n))
    tol = TEMPLATE.tolerance(problem)
    assert TEMPLATE.error(separate, ref) <= tol and TEMPLATE.error(fused, ref) <= tol
    assert TEMPLATE.error(fused, separate) <= tol
    assert_counters_at_zero()


@pytest.mark.parametrize("splits", [2, 3, 5, 8, 33])
def test_fused_combine_with_empty_and_single_tile_sequences(splits: int) -> None:
    # Lengths 0, 1, 16 (one tile), 17 (two), 40 and 100 (7 tiles) of 16-key tiles: with more
    # splits than tiles the first T splits get a tile each and the rest are empty; with none
    # or one the lone split writes the output itself. Odd split counts (as whole_waves makes)
    # go through the launcher, which takes any count.
    gen = torch.Generator().manual_seed(6)
    q = torch.randn(6, 4, 2, 32, generator=gen).half()
    k = torch.randn(6, 2, 100, 32, generator=gen).half()
    v = torch.randn(6, 2, 100, 32, generator=gen).half()
    lens = torch.tensor([0, 1, 16, 17, 40, 100], dtype=torch.int32)
    shape = check_decode_inputs(q, k, v, lens)
    ref = decode_reference(q, k, v, cache_seqlens=lens)
    for mode in ("separate", "fused"):
        o, lse = launch_decode(q, k, v, lens, None, None, shape, num_splits=splits, block_n=16,
                               num_warps=4, num_stages=1, combine=mode)
        assert torch.isneginf(lse[0]).all() and torch.equal(o[0], torch.zeros_like(o[0]))
        assert torch.isneginf(lse[1, :, 0]).all()  # token 0 of a 1-key sequence sees nothing
        assert TEMPLATE.error((o, lse), ref) <= 2e-3, (mode, splits)
    assert_counters_at_zero()


def test_fused_combine_reuses_its_counters() -> None:
    # Twice in a row, then a larger grid (a larger counter set), then the first again: the
    # last program of each row tile leaves its counter at zero for the next call.
    small = decode_problem(2, 8, 2, 1, 90, 64, mask="mixed")
    large = decode_problem(5, 16, 4, 2, 90, 64, mask="paged:16+mixed")
    cfg = FlashDecodeConfig(num_splits=4, block_n=16, combine="fused")
    for problem in (small, small, large, small):
        inputs = TEMPLATE.make_inputs(problem, "cpu", seed=problem.batch)
        err = TEMPLATE.error(TEMPLATE.run(inputs, cfg), TEMPLATE.reference(inputs))
        assert err <= TEMPLATE.tolerance(problem)
        assert_counters_at_zero()


def test_kv_load_hint_keeps_the_result() -> None:
    problem = decode_problem(2, 8, 2, 2, 70, 64, mask="paged:16+mixed")
    check_against_reference(problem, FlashDecodeConfig(num_splits=4, block_n=16,
                                                       kv_load="evict_first"), "cpu")


def test_whole_wave_splits() -> None:
    # 8 KV heads at B=1 on 132 SMs: 264 programs are two per SM.
    assert whole_wave_splits(8, 32, 1024, 132) == 33
    assert whole_wave_splits(8, 64, 1024, 132) == 66
    assert whole_wave_splits(8, 128, 1024, 132) == 132
    assert whole_wave_splits(8, 16, 1024, 132) == 16  # 33 is more than an eighth more
    assert whole_wave_splits(8, 32, 32, 132) == 32  # no more splits than tiles
    assert whole_wave_splits(66, 8, 1024, 132) == 8  # already whole waves
    # On the interpreter (no SM count) the knob changes nothing.
    problem = decode_problem(1, 4, 1, 1, 100, 64)
    check_against_reference(problem, FlashDecodeConfig(num_splits=8, block_n=16,
                                                       whole_waves=True), "cpu")


# ----------------------------------------------------------------------------- bad inputs
def _good() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(5)
    return {"q": torch.randn(2, 4, 1, 32, generator=gen).half(),
            "k_cache": torch.randn(4, 8, 2, 32, generator=gen).half(),
            "v_cache": torch.randn(4, 8, 2, 32, generator=gen).half(),
            "cache_seqlens": torch.tensor([10, 3], dtype=torch.int32),
            "block_table": torch.tensor([[1, 3], [0, -1]], dtype=torch.int32)}


def _contiguous() -> dict[str, Any]:
    args = _good()
    args["k_cache"] = args["k_cache"][:2].permute(0, 2, 1, 3)
    args["v_cache"] = args["v_cache"][:2].permute(0, 2, 1, 3)
    args["block_table"] = None
    return args


BAD_INPUTS = [
    ("length beyond paged capacity", lambda a: a.update(
        cache_seqlens=torch.tensor([17, 3], dtype=torch.int32)), "capacity 16"),
    ("length beyond contiguous capacity", lambda a: a.update(
        _contiguous(), cache_seqlens=torch.tensor([9, 3], dtype=torch.int32)), "capacity 8"),
    ("negative length", lambda a: a.update(
        cache_seqlens=torch.tensor([5, -1], dtype=torch.int32)), "must be >= 0"),
    ("page past the pool", lambda a: a["block_table"].__setitem__((0, 1), 4),
     r"block_table\[0, 1\] = 4"),
    ("negative page in use", lambda a: a["block_table"].__setitem__((1, 0), -2),
     r"into \[0, 4\)"),
    ("int64 lengths", lambda a: a.update(cache_seqlens=a["cache_seqlens"].long()),
     "cache_seqlens must be int32"),
    ("int64 block table", lambda a: a.update(block_table=a["block_table"].long()),
     "block_table must be int32"),
    ("lengths for another batch", lambda a: a.update(
        cache_seqlens=torch.tensor([1, 2, 3], dtype=torch.int32)), r"shape \(2,\)"),
    ("block table for another batch", lambda a: a.update(block_table=a["block_table"][:1]),
     r"\(B=2, max_pages\)"),
    ("k dtype", lambda a: a.update(k_cache=a["k_cache"].float()), "k_cache must have q's dtype"),
    ("int q", lambda a: a.update(q=a["q"].to(torch.int8)), "float16, bfloat16 or float32"),
    ("k and v shapes", lambda a: a.update(v_cache=a["v_cache"][:3]), "one shape"),
    ("head dim mismatch", lambda a: a.update(q=a["q"][..., :16]), "head dim 16 like q"),
    ("heads not a multiple", lambda a: a.update(q=a["q"][:, :3]), r"H_q \(3\) must be a multiple"),
    ("head dim over 256", lambda a: a.update(
        q=torch.randn(2, 4, 1, 320).half(), k_cache=torch.randn(4, 8, 2, 320).half(),
        v_cache=torch.randn(4, 8, 2, 320).half()), "at most 256"),
    ("too many query tokens", lambda a: a.update(q=torch.randn(2, 4, 17, 32).half()),
     "use flash_attention_fwd"),
    ("3-D q", lambda a: a.update(q=a["q"][:, :, 0]), r"q must be \(B, H_q, N_q, D\)"),
    ("contiguous cache batch", lambda a: a.update(
        _contiguous(), q=torch.randn(3, 4, 1, 32).half(),
        cache_seqlens=torch.tensor([1, 2, 3], dtype=torch.int32)), "must have B=3"),
    ("device mismatch", lambda a: a.update(v_cache=a["v_cache"].to("meta")),
     "v_cache must be on q's device"),
    ("lengths on another device", lambda a: a.update(cache_seqlens=a["cache_seqlens"].to("meta")),
     "cache_seqlens must be on q's device"),
]


@pytest.mark.parametrize(("edit", "message"), [(e, m) for _, e, m in BAD_INPUTS],
                         ids=[name for name, _, _ in BAD_INPUTS])
def test_bad_inputs_raise(edit: Any, message: str) -> None:
    args = _good()
    edit(args)
    q, k, v = args.pop("q"), args.pop("k_cache"), args.pop("v_cache")
    with pytest.raises(ValueError, match=message):
        templates.flash_decode(q, k, v, **args)


def test_unused_table_entries_may_be_anything() -> None:
    args = _good()  # block_table[1, 1] = -1 lies past sequence 1's single page
    q, k, v = args.pop("q"), args.pop("k_cache"), args.pop("v_cache")
    out = templates.flash_decode(q, k, v, **args, config=FlashDecodeConfig(block_n=16,
                                                                          num_splits=1))
    ref = decode_reference(q, k, v, **args)
    assert TEMPLATE.error(out, ref) <= 2e-3


def test_config_needing_too_much_shared_memory_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    # templates.flash_decode is the function; the module is reached through sys.modules.
    monkeypatch.setattr(sys.modules["templates.decode.template"], "current_device",
                        lambda *a: SMALL_GPU)
    args = _contiguous()
    args["cache_seqlens"] = torch.tensor([8, 3], dtype=torch.int32)
    q, k, v = args.pop("q"), args.pop("k_cache"), args.pop("v_cache")
    q, k, v = (torch.randn(*t.shape[:-1], 256).half() for t in (q, k, v))
    cfg = FlashDecodeConfig(block_n=256, num_stages=4, num_splits=1)
    with pytest.raises(ValueError, match="shared memory"):
        templates.flash_decode(q, k, v, **args, config=cfg)


# ----------------------------------------------------------------------------- the template
def test_registered_and_problem_convention() -> None:
    assert get_template("flash_decode") is TEMPLATE
    assert parse_decode_mask("none").page_size is None
    layout = parse_decode_mask("paged:256+mixed")
    assert (layout.page_size, layout.mixed) == (256, True)
    for bad in ("paged:0", "paged:x", "random:0.1", "mixed+mixed", "paged:16+paged:32"):
        with pytest.raises(ValueError, match="paged"):
            parse_decode_mask(bad)
    mixed = decode_problem(4, 8, 2, 2, 100, 64, mask="mixed")
    assert sequence_lengths(mixed) == [25, 50, 75, 100]
    assert TEMPLATE.unsupported(mixed) is None
    for problem, why in [
        (decode_problem(1, 4, 1, 32, 100, 64), "flash_attention_fwd"),
        (decode_problem(1, 4, 1, 1, 100, 64, mask="random:0.1"), "masks are"),
        (Problem(1, 4, 1, 3, 100, 64, causal="none"), "bottom-right"),
        (Problem(1, 4, 1, 1, 100, 64, causal="top_left"), "bottom-right"),
        (decode_problem(1, 4, 1, 4, 3, 64), "must be >= seqlen_q"),
        (decode_problem(1, 4, 1, 1, 100, 512), "at most 256"),
    ]:
        assert why in (TEMPLATE.unsupported(problem) or ""), problem


def test_flops_and_bytes_count_the_visible_keys() -> None:
    problem = decode_problem(4, 8, 2, 2, 100, 64, mask="mixed")
    # Lengths 25, 50, 75, 100; token 0 sees length - 1 keys, token 1 all of them.
    visible = sum(2 * n - 1 for n in (25, 50, 75, 100))
    assert TEMPLATE.flops(problem) == 4 * 8 * 64 * visible
    kv = 250 * 2 * 64 * 2 * 2
    assert TEMPLATE.bytes_moved(problem) == kv + 2 * (4 * 8 * 2 * 64 * 2) + 4 * 4 * 8 * 2
    dense = decode_problem(1, 32, 8, 1, 32768, 128, dtype="bfloat16")
    assert TEMPLATE.flops(dense) == 4 * 32 * 32768 * 128


@pytest.mark.parametrize("device", [H100, SMALL_GPU, INTERPRETER], ids=lambda d: d.name)
def test_default_config_satisfies_the_constraints(device: DeviceInfo) -> None:
    for problem in [
        decode_problem(1, 32, 8, 1, 32768, 128, dtype="bfloat16"),
        decode_problem(64, 32, 8, 1, 8192, 128, dtype="bfloat16", mask="mixed"),
        decode_problem(8, 64, 8, 4, 4096, 64, mask="paged:16"),
        decode_problem(2, 8, 8, 16, 16, 256, dtype="float32", mask="paged:256"),
        decode_problem(3, 8, 1, 1, 1, 40),
        decode_problem(1, 4, 4, 1, 131072, 128, mask="paged:64+mixed"),
    ]:
        cfg = TEMPLATE.default_config(problem, device)
        assert TEMPLATE.constraint(problem, cfg, device) is None, (problem.key(), cfg)


def test_known_good_configs_are_the_probes_grids_and_fit() -> None:
    b1 = decode_problem(1, 32, 8, 1, 32768, 128, dtype="bfloat16")
    good = TEMPLATE.known_good_configs(b1, H100)
    # 8 KV heads: 16 splits are one program per SM (128 of 132), 64 four (512 of 528); the
    # default (64 splits of 64-key tiles) is measured anyway and not repeated.
    assert [(c.num_splits, c.block_n, c.combine) for c in good] == [
        (16, 64, "separate"), (16, 128, "separate"), (64, 128, "separate"), (16, 64, "fused")]
    b8 = decode_problem(8, 32, 8, 1, 32768, 128, dtype="bfloat16")
    assert {c.num_splits for c in TEMPLATE.known_good_configs(b8, H100)} == {2, 8}
    default = TEMPLATE.default_config(b1, H100)
    for problem in (b1, b8, decode_problem(64, 32, 8, 1, 4096, 128, dtype="bfloat16"),
                    decode_problem(2, 8, 8, 16, 16, 256, dtype="float32", mask="paged:256")):
        for cfg in TEMPLATE.known_good_configs(problem, H100):
            assert cfg != default and TEMPLATE.constraint(problem, cfg, H100) is None
            assert cfg.combine == "separate" or cfg.num_splits > 1
    assert TEMPLATE.known_good_configs(b1, SMALL_GPU) == []  # measured on Hopper only


def test_fused_merge_loads_the_real_rows_of_a_tile() -> None:
    # GQA 4 x 1 token: BLOCK_M pads to 16 rows for tl.dot, the merge takes the 4 real ones.
    assert flash_decode_kernel.merge_rows(4, 1) == 4
    assert flash_decode_kernel.merge_rows(4, 3) == 16  # 12 rows
    assert flash_decode_kernel.merge_rows(32, 3) == 64  # 96 rows: tiles of at most 64
    # 4 rows of d128 at 32 elements per thread of 4 warps: 8 splits per step.
    assert flash_decode_kernel.merge_split_tile(32, 128, 4, rows=4) == 8
    assert flash_decode_kernel.merge_split_tile(4, 128, 4, rows=4) == 4
    assert flash_decode_kernel.merge_split_tile(32, 256, 4, rows=64) == 1


@pytest.mark.parametrize("mask", ["none", "paged:32+mixed"])
@pytest.mark.parametrize("combine", ["separate", "fused"])
def test_kernel_launches_are_what_a_call_launches(mask: str, combine: str) -> None:
    """The stand-in launches (compile-check, compile-ahead) specialize as a real call does:
    the same kernels, grids, constexprs, options, input layouts and integer arguments."""
    problem = decode_problem(3, 8, 2, 1, 200, 64, dtype="float16", mask=mask)
    config = FlashDecodeConfig(num_splits=4, block_n=32, combine=combine)
    launches = TEMPLATE.kernel_launches(problem, config)
    assert launches is not None
    inputs = TEMPLATE.make_inputs(problem, "cpu")
    args = [inputs[name] for name in ("q", "k_cache", "v_cache", "cache_seqlens")]
    table = inputs["block_table"]
    shape = check_decode_inputs(*args, table)
    plan = flash_decode_kernel.decode_launch_plan(*args, table, shape,
                                                  **config.to_dict())
    expected = [plan.split] + ([plan.combine] if plan.combine is not None else [])
    assert [launch[0] for launch in launches] == [e.kernel for e in expected]
    for (_, grid, _, options), e in zip(launches, expected, strict=True):
        assert grid == e.grid and options == {**e.constexprs, **e.options}
    split_args = launches[0][2]
    for standin, real in zip(split_args[:5], [*args, args[3] if table is None else table],
                             strict=True):
        assert (standin.dtype, tuple(standin.shape[1:]), standin.stride()[1:]) == (
            real.dtype, tuple(real.shape[1:]), real.stride()[1:])
    assert tuple(split_args[11:]) == plan.split_constants
    assert TEMPLATE.kernel_launches(decode_problem(1, 2, 2, 20, 64, 64), config) is None


def test_split_heuristic_fills_the_gpu() -> None:
    b1 = TEMPLATE.default_config(decode_problem(1, 32, 8, 1, 32768, 128, dtype="bfloat16"), H100)
    assert 8 * b1.num_splits >= 2 * H100.sm_count  # 8 KV heads alone fill 8 of 132 SMs
    b64 = TEMPLATE.default_config(decode_problem(64, 32, 8, 1, 4096, 128, dtype="bfloat16"), H100)
    assert b64.num_splits == 1  # 512 programs already
    # On a huge GPU the splits stop at the minimum chunk of 256 keys.
    assert default_num_splits(1, 1, 1, 1000, 64, sm_count=1000) == 2
    assert default_num_splits(1, 1, 1, 4096, 64, sm_count=1000) == 16
    assert default_num_splits(1, 1, 1, 400, 64, sm_count=1000) == 1
    assert default_num_splits(1, 1, 1, 1 << 20, 64, sm_count=1000) == 128  # the largest choice


def test_constraints_give_reasons() -> None:
    problem = decode_problem(1, 32, 8, 1, 1000, 128, dtype="bfloat16")
    short = decode_problem(1, 32, 8, 1, 100, 128, dtype="bfloat16")
    cases = [
        ("shared memory", problem, FlashDecodeConfig(block_n=128, num_stages=3), SMALL_GPU),
        ("spill", problem, FlashDecodeConfig(block_n=256, num_warps=1, num_stages=1), H100),
        ("lanes would idle", decode_problem(1, 32, 8, 1, 1000, 64),
         FlashDecodeConfig(block_n=16, num_warps=8), H100),
        ("no keys", problem, FlashDecodeConfig(block_n=64, num_splits=32), H100),
        ("mostly masked", short, FlashDecodeConfig(block_n=256, num_splits=1, num_stages=1),
         H100),
        ("no combine to fuse", problem, FlashDecodeConfig(num_splits=1, combine="fused"), H100),
        ("less than one split", problem, FlashDecodeConfig(num_splits=4, whole_waves=True),
         H100),
    ]
    for why, target, cfg, device in cases:
        reason = TEMPLATE.constraint(target, cfg, device)
        assert reason is not None and why in reason, (why, reason)
    # The same tile fits a larger shared memory.
    assert TEMPLATE.constraint(problem, FlashDecodeConfig(block_n=128, num_stages=3), H100) is None
    assert TEMPLATE.constraint(problem, FlashDecodeConfig(block_n=64, num_splits=8), H100) is None
    assert TEMPLATE.constraint(problem, FlashDecodeConfig(num_splits=8, combine="fused",
                                                          whole_waves=True,
                                                          kv_load="evict_first"), H100) is None
    bad = decode_problem(1, 4, 1, 32, 100, 64)
    assert "flash_attention_fwd" in (TEMPLATE.constraint(bad, FlashDecodeConfig(), H100) or "")


def test_version_covers_the_kernel_module() -> None:
    assert "templates.decode.kernel" in TEMPLATE.source_modules()
    assert len(TEMPLATE.version()) == 16


def test_standalone_module_runs_without_the_package(tmp_path: Path) -> None:
    cfg = FlashDecodeConfig(num_splits=2, block_n=32, num_warps=2, num_stages=1,
                            combine="fused")
    source = TEMPLATE.standalone_source(cfg)
    assert "import templates" not in source and "from templates" not in source
    assert "NUM_SPLITS = 2" in source and "BLOCK_N = 32" in source
    assert "COMBINE = 'fused'" in source
    path = tmp_path / "decode_export.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("decode_export", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    problem = decode_problem(2, 4, 2, 2, 70, 64, mask="paged:16+mixed")
    inputs = TEMPLATE.make_inputs(problem, "cpu", seed=7)
    out = module.flash_decode(inputs["q"], inputs["k_cache"], inputs["v_cache"],
                              cache_seqlens=inputs["cache_seqlens"],
                              block_table=inputs["block_table"])
    assert TEMPLATE.error(out, TEMPLATE.reference(inputs)) <= 2e-3
    with pytest.raises(ValueError, match="capacity"):
        module.flash_decode(inputs["q"], inputs["k_cache"], inputs["v_cache"],
                            cache_seqlens=inputs["cache_seqlens"] + 1000,
                            block_table=inputs["block_table"])


def test_error_metric_flags_mismatched_empty_rows() -> None:
    o = torch.ones(1, 1, 2, 4)
    lse = torch.tensor([[[0.5, -math.inf]]])
    assert TEMPLATE.error((o, lse), (o, lse)) == 0.0
    assert TEMPLATE.error((o, torch.tensor([[[0.5, 0.0]]])), (o, lse)) == math.inf


# ----------------------------------------------------------------------------- GPU
GPU_CASES = [
    # (batch, heads_q, heads_kv, n_q, seqlen, head_dim, dtype, mask)
    (2, 8, 8, 1, 1000, 128, "float16", "none"),
    (1, 32, 8, 1, 32768, 128, "bfloat16", "none"),
    (1, 32, 8, 1, 32768, 128, "bfloat16", "paged:16"),
    (1, 64, 8, 4, 32768, 128, "bfloat16", "paged:256"),
    (16, 32, 4, 1, 8192, 128, "bfloat16", "mixed"),
    (8, 16, 2, 3, 4096, 64, "float16", "paged:64+mixed"),
    (4, 8, 1, 2, 3000, 256, "bfloat16", "paged:128"),
    (3, 12, 4, 1, 1000, 96, "float16", "mixed"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: "-".join(map(str, c)))
def test_gpu_matches_reference(case: tuple[Any, ...]) -> None:
    batch, heads_q, heads_kv, n_q, seqlen, head_dim, dtype, mask = case
    problem = decode_problem(batch, heads_q, heads_kv, n_q, seqlen, head_dim, dtype=dtype,
                             mask=mask)
    check_against_reference(problem, None, "cuda")
    for splits, block_n in ((1, 64), (16, 128), (128, 32)):
        for combine in ("separate", "fused"):
            cfg = FlashDecodeConfig(num_splits=splits, block_n=block_n, num_warps=4,
                                    num_stages=2, combine=combine)
            if TEMPLATE.constraint(problem, cfg, templates.current_device()) is None:
                check_against_reference(problem, cfg, "cuda", seed=1)


@pytest.mark.gpu
def test_gpu_tiles_warps_and_stages_on_a_small_problem() -> None:
    # Every tile x warps (each compiles its own kernel; num_splits is a run-time value),
    # then every pipelining depth at one tile.
    problem = decode_problem(2, 8, 2, 2, 2048, 128, dtype="bfloat16", mask="paged:32+mixed")
    device = templates.current_device()
    inputs = TEMPLATE.make_inputs(problem, "cuda")
    ref = TEMPLATE.reference(inputs)
    configs = [FlashDecodeConfig(num_splits=s, block_n=b, num_warps=w, num_stages=2)
               for s in (1, 8) for b in (16, 32, 64, 128, 256) for w in (1, 2, 4, 8)]
    configs += [FlashDecodeConfig(num_splits=4, block_n=64, num_warps=4, num_stages=st)
                for st in (1, 3, 4)]
    checked = 0
    for cfg in configs:
        if TEMPLATE.constraint(problem, cfg, device) is None:
            err = TEMPLATE.error(TEMPLATE.run(inputs, cfg), ref)
            assert err <= TEMPLATE.tolerance(problem), (cfg.key(), err)
            checked += 1
    assert checked >= 20


@pytest.mark.gpu
@pytest.mark.parametrize("mask", ["none", "paged:16", "paged:256+mixed"])
def test_gpu_fused_combine_at_32k(mask: str) -> None:
    # The row (B=1, 32k, 32 over 8 heads, bf16) with the fused merge, the hints and
    # whole waves; then one config 50 times over: the merge order is fixed, so every call
    # must give the same bits, and a merge that read a partial before it was visible would
    # not.
    problem = decode_problem(1, 32, 8, 1, 32768, 128, dtype="bfloat16", mask=mask)
    device = templates.current_device()
    inputs = TEMPLATE.make_inputs(problem, "cuda")
    ref = TEMPLATE.reference(inputs)
    configs = [FlashDecodeConfig(num_splits=s, block_n=b, num_warps=4, num_stages=3,
                                 combine="fused", kv_load=kv, whole_waves=waves)
               for s, b in ((32, 32), (64, 64), (128, 64)) for kv in ("default", "evict_first")
               for waves in (False, True)]
    for cfg in configs:
        if TEMPLATE.constraint(problem, cfg, device) is None:
            err = TEMPLATE.error(TEMPLATE.run(inputs, cfg), ref)
            assert err <= TEMPLATE.tolerance(problem), (cfg.key(), err)
    cfg = replace(configs[0], whole_waves=True)
    first = TEMPLATE.run(inputs, cfg)
    outs = [TEMPLATE.run(inputs, cfg) for _ in range(50)]
    torch.cuda.synchronize()
    for o, lse in outs:
        assert torch.equal(o, first[0]) and torch.equal(lse, first[1])
    assert_counters_at_zero()


@pytest.mark.gpu
def test_gpu_fused_combine_on_two_streams_at_once() -> None:
    # Each stream has its own arrival counters: launches running at the same time on two
    # streams must not count each other's programs.
    problems = [decode_problem(1, 32, 8, 1, 16384, 128, dtype="bfloat16"),
                decode_problem(16, 32, 4, 1, 4096, 128, dtype="bfloat16", mask="mixed")]
    cfg = FlashDecodeConfig(num_splits=16, block_n=64, num_warps=4, num_stages=3,
                            combine="fused")
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    inputs = [TEMPLATE.make_inputs(p, "cuda", seed=i) for i, p in enumerate(problems)]
    refs = [TEMPLATE.reference(x) for x in inputs]
    torch.cuda.synchronize()
    outs: list[list[Any]] = [[], []]
    for _ in range(30):
        for i, stream in enumerate(streams):
            with torch.cuda.stream(stream):
                outs[i].append(TEMPLATE.run(inputs[i], cfg))
    torch.cuda.synchronize()
    for problem, ref, results in zip(problems, refs, outs, strict=True):
        for out in results:
            assert TEMPLATE.error(out, ref) <= TEMPLATE.tolerance(problem)
    assert_counters_at_zero()


@pytest.mark.gpu
@pytest.mark.parametrize("combine", ["separate", "fused"])
def test_gpu_precompile_compiles_what_run_launches(combine: str) -> None:
    problem = decode_problem(2, 32, 8, 1, 4096, 128, dtype="bfloat16", mask="paged:64+mixed")
    config = FlashDecodeConfig(num_splits=8, block_n=64, num_stages=3, combine=combine)
    device = torch.cuda.current_device()
    kernels = (flash_decode_kernel._decode_split_kernel,
               flash_decode_kernel._decode_combine_kernel)
    before = [set(k.device_caches[device][0]) for k in kernels]
    assert TEMPLATE.precompile(problem, config)
    precompiled = [set(k.device_caches[device][0]) - b for k, b in zip(kernels, before,
                                                                      strict=True)]
    inputs = TEMPLATE.make_inputs(problem, "cuda")
    out = TEMPLATE.run(inputs, config)
    launched = [set(k.device_caches[device][0]) - b - p
                for k, b, p in zip(kernels, before, precompiled, strict=True)]
    assert launched == [set(), set()], f"run compiled {launched} beyond {precompiled}"
    assert TEMPLATE.error(out, TEMPLATE.reference(inputs)) <= TEMPLATE.tolerance(problem)
