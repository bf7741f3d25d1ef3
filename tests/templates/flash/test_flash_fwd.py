"""The forward FlashAttention template against the plain-torch reference.

Under the CPU interpreter: small shapes, fp16/fp32 (bf16 runs there through float32 copies:
test_interpreter_dtype.py).
``-m gpu`` runs the GPU matrix on a CUDA device (every combination in bf16, a diagonal in fp16:
tests/templates/gpu_matrix.py).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
from pathlib import Path
from typing import Any

import pytest
import torch

import templates
from templates.attention_reference import attention_reference, lse_error, visible_pairs
from templates.base import TOLERANCE, Problem, relative_error
from templates.device import DeviceInfo
from templates.flash import fwd_kernel as flash_fwd_kernel
from templates.flash.fwd import (
    MAX_LIVE_FP32_PER_THREAD,
    FlashFwdTemplate,
    FwdConfig,
    flash_attention_fwd,
    shared_memory_estimate,
)
from templates.kernel_common import output_strides
from templates.registry import get_template
from tests.templates.gpu_matrix import bf16_product_fp16_diagonal

TEMPLATE = get_template("flash_fwd")
ON_GPU = torch.cuda.is_available() and not templates.current_device().is_interpreter


@pytest.fixture(autouse=True)
def poison_outputs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Outputs start as NaN: any element the kernel fails to write fails the check."""
    monkeypatch.setattr(flash_fwd_kernel, "DEBUG_POISON", True)


def make_qkv(shape_q: tuple[int, int, int, int], heads_kv: int, seqlen_kv: int,
             dtype: torch.dtype, device: str, *, bnhd: bool = False, seed: int = 0
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random q, k, v; ``bnhd`` builds them as (B, N, H, D) and returns transposed views."""
    gen = torch.Generator(device=device).manual_seed(seed)
    batch, heads_q, seqlen_q, head_dim = shape_q

    def rand(heads: int, seqlen: int) -> torch.Tensor:
        if bnhd:
            t = torch.randn(batch, seqlen, heads, head_dim, generator=gen, device=device,
                            dtype=dtype)
            return t.transpose(1, 2)
        return torch.randn(batch, heads, seqlen, head_dim, generator=gen, device=device,
                           dtype=dtype)

    return rand(heads_q, seqlen_q), rand(heads_kv, seqlen_kv), rand(heads_kv, seqlen_kv)


def check_against_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: str,
                            config: FwdConfig | dict[str, Any] | None, tol: float,
                            scale: float | None = None) -> None:
    o, lse = flash_attention_fwd(q, k, v, causal=causal, scale=scale, config=config)
    assert o.shape == q.shape and o.dtype == q.dtype
    # o is laid out as q where q is a (B, N, H, D) tensor viewed as (B, H, N, D), so that
    # transformers' o.transpose(1, 2).contiguous() is free; contiguous otherwise.
    assert o.stride() == output_strides(tuple(q.shape), tuple(q.stride()))
    assert (o.transpose(1, 2) if q.stride(2) > q.stride(1) else o).is_contiguous()
    assert lse.shape == q.shape[:3] and lse.dtype == torch.float32
    assert not torch.isnan(o).any() and not torch.isnan(lse).any()
    o_ref, lse_ref = attention_reference(
        q, k, v, causal=causal, scale=q.shape[-1] ** -0.5 if scale is None else scale)
    assert relative_error(o, o_ref) <= tol, relative_error(o, o_ref)
    assert lse_error(lse, lse_ref) <= tol, lse_error(lse, lse_ref)


# ----------------------------------------------------------------------------- CPU matrix
SMALL = dict(BLOCK_M=32, BLOCK_N=16, num_warps=4, num_stages=2)
TMA = dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=3, use_tma=True)
REORDERED = dict(BLOCK_M=16, BLOCK_N=32, grid_order="heads_inner", pipeline_masked_loop=False,
                 loop_unroll=2)

# (B, H_q, H_kv, N_q, N_kv, D, causal, config): lengths 1, 17, 100, N_q != N_kv both ways,
# GQA 1 and 4, head dims 64 and padded 40 / 96, the three causal modes, several configs.
CPU_CASES = [
    (1, 2, 2, 100, 100, 64, "none", None),
    (1, 2, 2, 100, 100, 64, "top_left", SMALL),
    (1, 4, 1, 100, 100, 64, "bottom_right", TMA),
    (2, 4, 1, 17, 100, 40, "top_left", None),
    (1, 4, 4, 17, 100, 96, "bottom_right", TMA),
    (1, 4, 1, 100, 17, 64, "bottom_right", REORDERED),
    (1, 2, 1, 100, 17, 40, "top_left", TMA),
    (1, 2, 2, 100, 17, 96, "none", SMALL),
    (2, 2, 2, 1, 1, 64, "top_left", None),
    (1, 4, 1, 1, 100, 64, "bottom_right", SMALL),
    (1, 4, 1, 1, 100, 40, "none", TMA),
    (1, 2, 2, 100, 1, 64, "top_left", REORDERED),
    (1, 2, 2, 17, 17, 64, "none", REORDERED),
    (1, 8, 2, 17, 17, 64, "top_left", dict(TMA, longest_first=True, grid_order="heads_inner")),
]


@pytest.mark.parametrize(("batch", "heads_q", "heads_kv", "seqlen_q", "seqlen_kv", "head_dim",
                          "causal", "config"), CPU_CASES)
def test_matches_reference_fp16(batch: int, heads_q: int, heads_kv: int, seqlen_q: int,
                                seqlen_kv: int, head_dim: int, causal: str,
                                config: dict[str, Any] | None, device: str) -> None:
    q, k, v = make_qkv((batch, heads_q, seqlen_q, head_dim), heads_kv, seqlen_kv,
                       torch.float16, device)
    check_against_reference(q, k, v, causal, config, TOLERANCE["float16"])


@pytest.mark.parametrize("config", [None, SMALL, TMA], ids=["default", "pointer", "tma"])
def test_strided_bnhd_views_need_no_copy(config: dict[str, Any] | None, device: str) -> None:
    q, k, v = make_qkv((2, 4, 33, 64), 2, 50, torch.float16, device, bnhd=True)
    assert not q.is_contiguous() and not k.is_contiguous()
    check_against_reference(q, k, v, "bottom_right", config, TOLERANCE["float16"])


def test_float32_inputs_and_explicit_scale(device: str) -> None:
    q, k, v = make_qkv((1, 2, 40, 32), 1, 70, torch.float32, device)
    check_against_reference(q, k, v, "top_left", SMALL, TOLERANCE["float32"], scale=0.3)


def test_causal_true_means_top_left(device: str) -> None:
    q, k, v = make_qkv((1, 2, 20, 64), 2, 50, torch.float16, device)
    o_true, lse_true = flash_attention_fwd(q, k, v, causal=True)
    o_tl, lse_tl = flash_attention_fwd(q, k, v, causal="top_left")
    o_br, _ = flash_attention_fwd(q, k, v, causal="bottom_right")
    assert torch.equal(o_true, o_tl) and torch.equal(lse_true, lse_tl)
    assert not torch.equal(o_true, o_br)  # N_q != N_kv: the two alignments differ


def test_rows_without_visible_keys_give_zero_and_minus_inf(device: str) -> None:
    # bottom-right with N_q > N_kv: query i sees keys j <= i - 24, so rows 0..23 see none.
    q, k, v = make_qkv((1, 2, 40, 64), 2, 16, torch.float16, device)
    for config in (SMALL, TMA):
        o, lse = flash_attention_fwd(q, k, v, causal="bottom_right", config=config)
        assert torch.equal(o[:, :, :24], torch.zeros_like(o[:, :, :24]))
        assert torch.isneginf(lse[:, :, :24]).all()
        assert torch.isfinite(lse[:, :, 24:]).all() and not torch.isnan(o).any()
        o_ref, lse_ref = attention_reference(q, k, v, causal="bottom_right", scale=0.125)
        assert TEMPLATE.error((o, lse), (o_ref, lse_ref)) <= TOLERANCE["float16"]


def test_error_compares_minus_inf_rows_exactly() -> None:
    ref = torch.tensor([[float("-inf"), 1.0, 2.0]])
    assert lse_error(ref.clone(), ref) == 0.0
    assert lse_error(torch.tensor([[0.0, 1.0, 2.0]]), ref) == math.inf
    assert lse_error(torch.tensor([[float("nan"), 1.0, 2.0]]), ref) == math.inf
    assert lse_error(torch.tensor([[float("-inf"), 1.0, 2.2]]), ref) == pytest.approx(
        0.2 / math.sqrt(5.0))


# ----------------------------------------------------------------------------- bad input
def _qkv(**changes: Any) -> dict[str, Any]:
    # CPU tensors on any host: every case fails in validation, before the device matters.
    q, k, v = make_qkv((1, 4, 8, 64), 2, 8, torch.float16, "cpu")
    return {"q": q, "k": k, "v": v, **changes}


@pytest.mark.parametrize(("changes", "error", "needle"), [
    ({"q": torch.randn(4, 8, 64, dtype=torch.float16)}, ValueError, "q must be 4-D"),
    ({"k": torch.randn(1, 2, 8, 64, dtype=torch.float32)}, TypeError, "share one dtype"),
    ({"q": torch.randint(0, 3, (1, 4, 8, 64))}, TypeError, "float16, bfloat16 or float32"),
    ({"q": torch.randn(1, 4, 8, 64, dtype=torch.float64)}, TypeError, "torch.float64"),
    ({"q": [1.0]}, TypeError, "q must be a torch.Tensor"),
    ({"q": torch.randn(2, 4, 8, 64, dtype=torch.float16)}, ValueError, "same batch size"),
    ({"q": torch.randn(1, 4, 8, 32, dtype=torch.float16)}, ValueError, "same head_dim"),
    ({"q": torch.randn(1, 3, 8, 64, dtype=torch.float16)}, ValueError, "multiple of heads"),
    ({"v": torch.randn(1, 2, 9, 64, dtype=torch.float16)}, ValueError, "k and v must have"),
    ({"q": torch.randn(1, 4, 0, 64, dtype=torch.float16)}, ValueError, "must not be empty"),
    ({"q": torch.randn(1, 2, 8, 320, dtype=torch.float16),
      "k": torch.randn(1, 2, 8, 320, dtype=torch.float16),
      "v": torch.randn(1, 2, 8, 320, dtype=torch.float16)}, ValueError, "at most 256"),
    ({"causal": "diagonal"}, ValueError, "causal must be a bool or one of"),
    ({"scale": float("nan")}, ValueError, "scale must be a finite number"),
    ({"config": {"BLOCK_M": 48}}, ValueError, r"FwdConfig.BLOCK_M must be one of \[16, 32"),
    ({"config": {"block_m": 64}}, ValueError, "has no field"),
    ({"config": {"use_tma": 1}}, ValueError, "use_tma must be one of"),
    ({"config": [("BLOCK_M", 64)]}, TypeError, "config must be an FwdConfig"),
])
def test_bad_arguments_raise_naming_the_problem(changes: dict[str, Any], error: type,
                                                needle: str) -> None:
    args = _qkv(**changes)
    kwargs = {name: args.pop(name) for name in ("causal", "scale", "config") if name in args}
    with pytest.raises(error, match=needle):
        flash_attention_fwd(args["q"], args["k"], args["v"], **kwargs)


def test_config_violating_a_constraint_is_refused_with_the_reason(device: str) -> None:
    q, k, v = make_qkv((1, 2, 8, 256), 2, 8, torch.float16, device)
    oversized = dict(BLOCK_M=256, BLOCK_N=256, num_warps=8, num_stages=5)
    with pytest.raises(ValueError, match="KiB of shared memory"):
        flash_attention_fwd(q, k, v, config=oversized)
    with pytest.raises(ValueError, match="registers would spill"):
        flash_attention_fwd(q, k, v, config=dict(BLOCK_M=256, BLOCK_N=16, num_warps=4,
                                                 num_stages=1))
    with pytest.raises(ValueError, match="longest_first only reorders causal"):
        flash_attention_fwd(q, k, v, config=dict(SMALL, longest_first=True))


def test_tma_refuses_unaligned_layouts_unless_the_config_is_the_default(device: str) -> None:
    # Rows of 44 halves (88 bytes) cannot be TMA strides; k/v are slices of them.
    q, _, _ = make_qkv((1, 2, 24, 40), 2, 24, torch.float16, device)
    wide = torch.randn(1, 2, 24, 44, dtype=torch.float16, device=device)
    k, v = wide[..., :40], wide[..., 4:]
    with pytest.raises(ValueError, match="multiple of 16 bytes.*use_tma=False"):
        flash_attention_fwd(q, k, v, config=TMA)
    o, lse = flash_attention_fwd(q, k, v, config=None)  # the default falls back to pointers
    o_ref, lse_ref = attention_reference(q, k, v, causal="none", scale=40 ** -0.5)
    assert TEMPLATE.error((o, lse), (o_ref, lse_ref)) <= TOLERANCE["float16"]
    q36, k36, v36 = make_qkv((1, 2, 8, 36), 2, 8, torch.float16, device)
    with pytest.raises(ValueError, match="head_dim 36 in float16 is 72 bytes"):
        flash_attention_fwd(q36, k36, v36, config=TMA)


# ----------------------------------------------------------------------------- the template
H100 = DeviceInfo(name="NVIDIA H100 80GB HBM3", compute_capability="9.0", sm_count=132,
                  total_memory=80 << 30, smem_per_block=227 * 1024, driver_version="",
                  triton_version="3.6.0", torch_version="2.11.0", cuda_version="12.8")
A100 = dataclasses.replace(H100, name="NVIDIA A100-SXM4-80GB", compute_capability="8.0",
                           smem_per_block=163 * 1024)
RTX4090 = dataclasses.replace(H100, name="NVIDIA GeForce RTX 4090", compute_capability="8.9",
                              smem_per_block=99 * 1024)
B200 = dataclasses.replace(H100, name="NVIDIA B200", compute_capability="10.0")
DEVICES = [H100, A100, RTX4090, B200, templates.current_device()]


@pytest.mark.parametrize("device_info", DEVICES, ids=lambda d: d.name)
def test_default_config_satisfies_the_constraints(device_info: DeviceInfo) -> None:
    for head_dim in (8, 40, 64, 96, 128, 256):
        for dtype in ("float16", "bfloat16", "float32"):
            for seqlens in ((1, 4096), (17, 17), (4096, 4096), (3333, 1000)):
                for causal in ("none", "top_left", "bottom_right"):
                    problem = Problem(2, 8, 2, *seqlens, head_dim, dtype, causal)
                    config = TEMPLATE.default_config(problem, device_info)
                    assert TEMPLATE.constraint(problem, config, device_info) is None


def test_constraints_reject_what_cannot_fit_and_keep_good_configs() -> None:
    p128 = Problem(4, 16, 16, 4096, 4096, 128, "bfloat16", "top_left")
    good = FwdConfig(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3, use_tma=True)
    assert TEMPLATE.constraint(p128, good, H100) is None
    assert "TMA" in str(TEMPLATE.constraint(p128, good, A100))
    assert "Blackwell" in str(TEMPLATE.constraint(
        p128, dataclasses.replace(good, warp_specialize=True), H100))
    assert TEMPLATE.constraint(p128, dataclasses.replace(good, warp_specialize=True),
                               B200) is None
    assert "shared memory" in str(TEMPLATE.constraint(
        p128, dataclasses.replace(good, BLOCK_N=256, num_stages=4), H100))
    assert "reported to fault" in str(TEMPLATE.constraint(
        p128, dataclasses.replace(good, loop_unroll=2), H100))
    sparse = dataclasses.replace(p128, mask="random:0.10")
    assert TEMPLATE.unsupported(sparse) is None
    assert "malformed mask pattern" in str(TEMPLATE.unsupported(
        dataclasses.replace(p128, mask="random:2")))
    assert "must divide the block mask's block size" in str(TEMPLATE.constraint(
        sparse, dataclasses.replace(good, BLOCK_N=256, num_stages=1), H100))
    assert "only apply to the dense KV loop" in str(TEMPLATE.constraint(
        sparse, dataclasses.replace(good, loop_unroll=2, use_tma=False), H100))
    # The space is wide on purpose; the constraints cut it down before anything compiles.
    kept = [c for c in FwdConfig.grid() if TEMPLATE.constraint(p128, c, H100) is None]
    assert 0 < len(kept) < FwdConfig.grid_size() / 2
    assert all(c.BLOCK_M * (128 + c.BLOCK_N) // (32 * c.num_warps) <= MAX_LIVE_FP32_PER_THREAD
               for c in kept)


@pytest.mark.parametrize(("head_dim", "tile", "stages", "unroll", "tma", "measured"), [
    # Triton 3.6 on H100 (benchmarks/fwd_quick.py --compile-sweep and variants), bf16.
    (64, (64, 32), 1, 1, False, 12288),
    (64, (64, 32), 3, 1, True, 33792),
    (128, (128, 128), 3, 1, False, 229376),
    (128, (128, 64), 2, 1, True, 98336),
    (128, (128, 128), 3, 2, False, 425984),
    (256, (128, 64), 2, 2, False, 327680),
    (256, (64, 128), 4, 1, True, 558080),
])
def test_shared_memory_estimate_matches_triton(head_dim: int, tile: tuple[int, int],
                                               stages: int, unroll: int, tma: bool,
                                               measured: int) -> None:
    problem = Problem(4, 16, 16, 4096, 4096, head_dim, "bfloat16")
    config = FwdConfig(BLOCK_M=tile[0], BLOCK_N=tile[1], num_stages=stages, loop_unroll=unroll,
                       use_tma=tma, num_warps=8)
    assert 0 <= shared_memory_estimate(problem, config) - measured <= 1024


def test_known_good_configs_fit_and_differ_from_the_default() -> None:
    for head_dim in (64, 128, 256):
        problem = Problem(1, 16, 16, 16384, 16384, head_dim, "bfloat16", "top_left")
        default = TEMPLATE.default_config(problem, H100)
        good = TEMPLATE.known_good_configs(problem, H100)
        assert good and default not in good
        assert all(TEMPLATE.constraint(problem, c, H100) is None for c in good)
    assert TEMPLATE.known_good_configs(problem, A100) == []


def test_every_knob_documents_what_it_trades() -> None:
    knobs = {k.name: k for k in FwdConfig.knobs()}
    assert {"BLOCK_M", "BLOCK_N", "num_warps", "num_stages", "use_tma"} <= set(knobs)
    assert all(len(k.doc) > 40 and len(k.choices) >= 2 for k in knobs.values())
    assert not FwdConfig().warp_specialize
    assert FwdConfig.from_dict(FwdConfig(BLOCK_M=128).to_dict()) == FwdConfig(BLOCK_M=128)


@pytest.mark.parametrize("mode", ["none", "top_left", "bottom_right"])
def test_visible_pairs_match_a_brute_force_count(mode: str) -> None:
    for seqlen_q in (1, 5, 17, 40):
        for seqlen_kv in (1, 5, 16, 40):
            o_ref, _ = attention_reference(torch.zeros(1, 1, seqlen_q, 1),
                                           torch.zeros(1, 1, seqlen_kv, 1),
                                           torch.ones(1, 1, seqlen_kv, 1), causal=mode,
                                           scale=1.0)
            mask = torch.ones(seqlen_q, seqlen_kv, dtype=torch.bool)
            if mode != "none":
                offset = seqlen_kv - seqlen_q if mode == "bottom_right" else 0
                mask = torch.ones_like(mask).tril(offset)
            assert visible_pairs(mode, seqlen_q, seqlen_kv) == int(mask.sum())
            assert o_ref.sum().item() == pytest.approx(int(mask.any(dim=1).sum()))


def test_flops_and_bytes() -> None:
    dense = Problem(2, 16, 4, 4096, 4096, 128, "bfloat16")
    assert TEMPLATE.flops(dense) == 4 * 2 * 16 * 4096 * 4096 * 128
    causal = dataclasses.replace(dense, causal="top_left")
    assert TEMPLATE.flops(causal) == TEMPLATE.flops(dense) / 2  # the papers' convention
    prefill = Problem(1, 8, 8, 100, 1000, 64, "float16", "bottom_right")
    assert TEMPLATE.flops(prefill) == 4 * 8 * 64 * sum(min(1000, i + 901) for i in range(100))
    q_bytes = 2 * 2 * 16 * 4096 * 128
    kv_bytes = 2 * 2 * 4 * 4096 * 128
    assert TEMPLATE.bytes_moved(dense) == 2 * q_bytes + 2 * kv_bytes + 4 * 2 * 16 * 4096


def test_make_inputs_are_random_reproducible_and_run() -> None:
    problem = Problem(1, 4, 2, 30, 45, 40, "float16", "bottom_right")
    inputs = TEMPLATE.make_inputs(problem, "cpu", seed=3)
    assert inputs["q"].shape == (1, 4, 30, 40) and inputs["k"].shape == (1, 2, 45, 40)
    assert inputs["v"].dtype == torch.float16 and inputs["causal"] == "bottom_right"
    assert all(inputs[n].abs().sum() > 0 for n in ("q", "k", "v"))
    assert torch.equal(TEMPLATE.make_inputs(problem, "cpu", seed=3)["k"], inputs["k"])
    assert not torch.equal(TEMPLATE.make_inputs(problem, "cpu", seed=4)["k"], inputs["k"])
    config = FwdConfig(BLOCK_M=32, BLOCK_N=32)
    err = TEMPLATE.error(TEMPLATE.run(inputs, config), TEMPLATE.reference(inputs))
    assert err <= TEMPLATE.tolerance(problem)


def test_template_is_registered_with_a_source_version() -> None:
    assert isinstance(TEMPLATE, FlashFwdTemplate)
    assert set(TEMPLATE.source_modules()) == {"templates.flash.fwd", "templates.flash.fwd_kernel",
                                              "templates.kernel_common",
                                              "templates.masks.listed_blocks",
                                              "templates.masks.row_ranges",
                                              "templates.flash.softcap",
                                              "templates.compile.direct_launch",
                                              "templates.compile.tensor_maps"}
    assert len(TEMPLATE.version()) == 16


def test_standalone_source_imports_and_matches_the_template(tmp_path: Path,
                                                            device: str) -> None:
    config = FwdConfig(BLOCK_M=32, BLOCK_N=16, use_tma=True, num_stages=3)
    path = tmp_path / "attention_fwd_generated.py"
    path.write_text(TEMPLATE.standalone_source(config))
    assert "from templates" not in path.read_text() and "import templates" not in path.read_text()
    spec = importlib.util.spec_from_file_location("attention_fwd_generated", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert config.to_dict() == module.CONFIG
    q, k, v = make_qkv((1, 4, 40, 64), 2, 50, torch.float16, device)
    got = module.flash_attention_fwd(q, k, v, causal="bottom_right")
    want = flash_attention_fwd(q, k, v, causal="bottom_right", config=config)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    # A layout TMA cannot read falls back to pointer loads instead of failing.
    wide = torch.randn(1, 2, 50, 72, dtype=torch.float16, device=device)
    o, lse = module.flash_attention_fwd(q, wide[..., :64], wide[..., 8:], causal=True)
    o_ref, lse_ref = attention_reference(q, wide[..., :64], wide[..., 8:], causal="top_left",
                                         scale=0.125)
    assert TEMPLATE.error((o, lse), (o_ref, lse_ref)) <= TOLERANCE["float16"]


# ----------------------------------------------------------------------------- GPU matrix
GPU_SHAPES = [  # (B, H_q, H_kv, N_q, N_kv)
    (2, 8, 8, 17, 17),
    (1, 8, 2, 1000, 1000),
    (1, 8, 1, 3333, 1000),
    (2, 4, 1, 1000, 3333),
    (1, 8, 8, 1, 3333),
    (1, 4, 4, 3333, 1),
    (1, 8, 1, 3333, 3333),
]


def gpu_configs(head_dim: int) -> dict[str, dict[str, Any] | None]:
    return {
        "default": None,
        "pointer": dict(BLOCK_M=64, BLOCK_N=32 if head_dim == 256 else 64, num_warps=4,
                        num_stages=2, grid_order="heads_inner"),
        "tma": dict(BLOCK_M=128, BLOCK_N=64 if head_dim == 256 else 128, num_warps=8,
                    num_stages=2, use_tma=True, pipeline_masked_loop=False),
    }


@pytest.mark.gpu
@pytest.mark.parametrize(("dtype", "head_dim", "causal", "config_name"),
                         bf16_product_fp16_diagonal((64, 128, 256),
                                                    ("none", "top_left", "bottom_right"),
                                                    ("default", "pointer", "tma")))
def test_gpu_matrix(dtype: torch.dtype, head_dim: int, causal: str, config_name: str) -> None:
    config = gpu_configs(head_dim)[config_name]
    tol = TOLERANCE["float16" if dtype == torch.float16 else "bfloat16"]
    for batch, heads_q, heads_kv, seqlen_q, seqlen_kv in GPU_SHAPES:
        q, k, v = make_qkv((batch, heads_q, seqlen_q, head_dim), heads_kv, seqlen_kv, dtype,
                           "cuda")
        check_against_reference(q, k, v, causal, config, tol)


@pytest.mark.gpu
@pytest.mark.parametrize("config_name", ["default", "pointer", "tma"])
def test_gpu_strided_and_padded_head_dims(config_name: str) -> None:
    for head_dim in (40, 96, 128):
        config = gpu_configs(head_dim)[config_name]
        q, k, v = make_qkv((2, 8, 1000, head_dim), 2, 1500, torch.bfloat16, "cuda", bnhd=True)
        check_against_reference(q, k, v, "bottom_right", config, TOLERANCE["bfloat16"])


@pytest.mark.gpu
def test_gpu_float32_and_longest_first() -> None:
    q, k, v = make_qkv((1, 4, 300, 64), 2, 500, torch.float32, "cuda")
    check_against_reference(q, k, v, "top_left", SMALL, TOLERANCE["float32"])
    q, k, v = make_qkv((2, 8, 2000, 128), 2, 2000, torch.bfloat16, "cuda")
    cfg = dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3, use_tma=True,
               longest_first=True)
    check_against_reference(q, k, v, "top_left", cfg, TOLERANCE["bfloat16"])


@pytest.mark.gpu
def test_gpu_precompile_compiles_what_run_launches() -> None:
    problem = Problem(2, 8, 2, 1000, 1500, 128, "bfloat16", "bottom_right")
    device_index = torch.cuda.current_device()
    for use_tma in (False, True):
        config = FwdConfig(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2, use_tma=use_tma)
        cache = flash_fwd_kernel._flash_fwd_kernel.device_caches[device_index][0]
        before = set(cache)
        assert TEMPLATE.precompile(problem, config)
        precompiled = set(cache) - before
        inputs = TEMPLATE.make_inputs(problem, "cuda")
        out = TEMPLATE.run(inputs, config)
        launched = set(cache) - before - precompiled
        assert not launched, f"run compiled {launched}, precompile had compiled {precompiled}"
        assert TEMPLATE.error(out, TEMPLATE.reference(inputs)) <= TOLERANCE["bfloat16"]
