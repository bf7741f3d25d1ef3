"""The backward FlashAttention template and the autograd Function against torch autograd
through the plain-torch reference.

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
from templates.attention_reference import attention_reference
from templates.base import TOLERANCE, Problem, relative_error
from templates.device import DeviceInfo
from templates.flash import bwd_kernel as flash_bwd_kernel
from templates.flash import fwd_kernel as flash_fwd_kernel
from templates.flash.autograd import FlashAttentionFunction, flash_attention
from templates.flash.bwd import (
    MAX_REGISTERS_PER_THREAD,
    BwdConfig,
    FlashBwdTemplate,
    flash_attention_bwd,
    reference_grads,
    registers_estimate,
)
from templates.kernel_common import normalize_causal
from templates.registry import get_template
from tests.templates.gpu_matrix import bf16_product_fp16_diagonal

TEMPLATE = get_template("flash_bwd")
DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}


@pytest.fixture(autouse=True)
def poison_outputs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Outputs start as NaN: any element a kernel fails to write fails the check."""
    monkeypatch.setattr(flash_bwd_kernel, "DEBUG_POISON", True)
    monkeypatch.setattr(flash_fwd_kernel, "DEBUG_POISON", True)


def make_inputs(shape_q: tuple[int, int, int, int], heads_kv: int, seqlen_kv: int,
                dtype: torch.dtype, device: str, *, bnhd: bool = False, seed: int = 0
                ) -> dict[str, torch.Tensor]:
    """Random q, k, v, do; ``bnhd`` builds them as (B, N, H, D) and returns transposed views."""
    gen = torch.Generator(device=device).manual_seed(seed)
    batch, heads_q, seqlen_q, head_dim = shape_q

    def rand(heads: int, seqlen: int) -> torch.Tensor:
        if bnhd:
            t = torch.randn(batch, seqlen, heads, head_dim, generator=gen, device=device,
                            dtype=dtype)
            return t.transpose(1, 2)
        return torch.randn(batch, heads, seqlen, head_dim, generator=gen, device=device,
                           dtype=dtype)

    return {"q": rand(heads_q, seqlen_q), "k": rand(heads_kv, seqlen_kv),
            "v": rand(heads_kv, seqlen_kv), "do": rand(heads_q, seqlen_q)}


def reference_forward(t: dict[str, torch.Tensor], causal: str, scale: float
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, lse) as the forward kernel would hand them over: o in the inputs' dtype."""
    o, lse = attention_reference(t["q"], t["k"], t["v"], causal=causal, scale=scale)
    return o.to(t["q"].dtype), lse.to(torch.float32)


def check_grads(t: dict[str, torch.Tensor], causal: str, config: BwdConfig | dict[str, Any] | None,
                tol: float, *, scale: float | None = None,
                forward: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run the backward on ``t`` and compare each gradient with the autograd reference."""
    scale_value = t["q"].shape[-1] ** -0.5 if scale is None else scale
    o, lse = forward if forward is not None else reference_forward(t, causal, scale_value)
    grads = flash_attention_bwd(t["do"], t["q"], t["k"], t["v"], o, lse, causal=causal,
                                scale=scale, config=config)
    refs = reference_grads(t["q"], t["k"], t["v"], t["do"], causal=causal, scale=scale_value)
    for name, got, like, ref in zip(("dq", "dk", "dv"), grads, (t["q"], t["k"], t["v"]), refs,
                                    strict=True):
        # Laid out as its input (torch.empty_like): a packed caller's gradients need no copy.
        assert got.shape == like.shape and got.dtype == like.dtype
        assert got.stride() == torch.empty_like(like).stride(), name
        assert not torch.isnan(got).any(), f"{name} has NaN"
        err = relative_error(got, ref)
        assert err <= tol, f"{name}: relative error {err:.3g} > {tol:.3g}"
    return grads


# ----------------------------------------------------------------------------- CPU matrix
# Tiles smaller than the shapes, so every walk has full and partial tiles.
ATOMIC = dict(BLOCK_M1=16, BLOCK_N1=32, num_warps=4, num_stages=2, dq_mode="atomic")
SEPARATE = dict(BLOCK_M1=32, BLOCK_N1=16, BLOCK_M2=16, BLOCK_N2=32, num_warps=4,
                num_stages=1, dq_mode="separate")
CONFIGS = {"atomic": ATOMIC, "separate": SEPARATE, "default": None}

# (B, H_q, H_kv, N_q, N_kv, D, causal): lengths 1, 17, 100, N_q != N_kv both ways (with
# bottom-right rows that see no key), GQA 1 and 4, head dims 64 and padded 40.
SHAPES = [
    (2, 4, 1, 17, 17, 40, "top_left"),
    (1, 4, 1, 100, 100, 64, "top_left"),
    (1, 2, 2, 100, 37, 64, "bottom_right"),
    (1, 4, 1, 37, 100, 40, "bottom_right"),
    (1, 2, 1, 33, 70, 64, "none"),
]
# Length 1 allows only 16-row tiles: the default config.
CPU_CASES = ([(*shape, mode) for shape in SHAPES for mode in ("atomic", "separate")]
             + [(1, 2, 2, 1, 1, 64, "none", "default"),
                (1, 2, 1, 1, 17, 64, "bottom_right", "default"),
                (1, 2, 1, 17, 1, 64, "top_left", "default")])


@pytest.mark.parametrize(("batch", "heads_q", "heads_kv", "seqlen_q", "seqlen_kv", "head_dim",
                          "causal", "config_name"), CPU_CASES)
def test_grads_match_reference_fp16(batch: int, heads_q: int, heads_kv: int, seqlen_q: int,
                                    seqlen_kv: int, head_dim: int, causal: str,
                                    config_name: str, device: str) -> None:
    t = make_inputs((batch, heads_q, seqlen_q, head_dim), heads_kv, seqlen_kv, torch.float16,
                    device)
    check_grads(t, causal, CONFIGS[config_name], TOLERANCE["float16"])


@pytest.mark.parametrize("config_name", ["atomic", "separate", "default"])
def test_strided_bnhd_views_match_contiguous_inputs(config_name: str, device: str) -> None:
    t = make_inputs((2, 4, 45, 40), 2, 30, torch.float16, device, bnhd=True)
    assert not t["q"].is_contiguous()
    o, lse = reference_forward(t, "bottom_right", 40 ** -0.5)
    o_strided = o.transpose(1, 2).contiguous().transpose(1, 2)
    config = CONFIGS[config_name]
    got = check_grads(t, "bottom_right", config, TOLERANCE["float16"],
                      forward=(o_strided, lse))
    dense = {name: x.contiguous() for name, x in t.items()}
    want = flash_attention_bwd(dense["do"], dense["q"], dense["k"], dense["v"], o, lse,
                               causal="bottom_right", config=config)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_broadcast_gradient_and_lse_views(device: str) -> None:
    """do as from ``o.sum().backward()`` (stride 0 everywhere) and a non-contiguous lse."""
    t = make_inputs((1, 2, 20, 64), 1, 24, torch.float16, device)
    t["do"] = torch.ones(1, 1, 1, 1, dtype=torch.float16, device=device).expand(1, 2, 20, 64)
    o, lse = reference_forward(t, "top_left", 0.125)
    lse_view = lse.transpose(1, 2).contiguous().transpose(1, 2)
    check_grads(t, "top_left", SEPARATE, TOLERANCE["float16"], forward=(o, lse_view))


def test_float32_inputs_explicit_scale_and_configs(device: str) -> None:
    t = make_inputs((1, 4, 50, 32), 2, 40, torch.float32, device, seed=1)
    for config in (ATOMIC, SEPARATE, dict(SEPARATE, BLOCK_M1=16, BLOCK_N1=16, BLOCK_M2=32,
                                          BLOCK_N2=16, num_warps=4, num_stages=3)):
        check_grads(t, "top_left", config, TOLERANCE["float32"], scale=0.3)


def test_causal_true_means_top_left(device: str) -> None:
    t = make_inputs((1, 2, 20, 16), 2, 30, torch.float32, device)
    o, lse = reference_forward(t, "top_left", 0.25)
    args = (t["do"], t["q"], t["k"], t["v"], o, lse)
    got = flash_attention_bwd(*args, causal=True, config=ATOMIC)
    want = flash_attention_bwd(*args, causal="top_left", config=ATOMIC)
    other = flash_attention_bwd(*args, causal="bottom_right", config=ATOMIC)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert not torch.equal(got[0], other[0])


def test_rows_without_visible_keys_get_zero_gradients(device: str) -> None:
    # bottom-right with N_q > N_kv: the first N_q - N_kv rows see no key (lse = -inf).
    t = make_inputs((1, 2, 40, 16), 1, 20, torch.float16, device)
    o, lse = reference_forward(t, "bottom_right", 0.25)
    assert torch.isinf(lse[:, :, :20]).all() and torch.isfinite(lse[:, :, 20:]).all()
    for config in (ATOMIC, SEPARATE):
        dq, dk, dv = flash_attention_bwd(t["do"], t["q"], t["k"], t["v"], o, lse,
                                         causal="bottom_right", config=config)
        assert torch.isfinite(dq).all() and torch.isfinite(dk).all() and torch.isfinite(dv).all()
        assert (dq[:, :, :20] == 0).all() and (dq[:, :, 20:] != 0).any()
        assert (dk != 0).any() and (dv != 0).any()


@pytest.mark.filterwarnings("error::RuntimeWarning")
def test_large_scores_neither_overflow_nor_lose_accuracy(device: str) -> None:
    """Peaked softmax (scores of std ~30): masked scores are never exponentiated."""
    t = make_inputs((1, 2, 40, 64), 1, 30, torch.float16, device, seed=2)
    t["q"] = t["q"] * 4
    for config in (ATOMIC, SEPARATE):
        check_grads(t, "bottom_right", config, TOLERANCE["float16"], scale=1.0)


def test_autograd_function_matches_reference(device: str) -> None:
    cases = [((1, 4, 33, 40), 2, 50, "bottom_right", torch.float16),
             ((2, 2, 20, 64), 2, 20, "top_left", torch.float32),
             ((1, 4, 25, 64), 1, 17, "none", torch.float16)]
    for shape_q, heads_kv, seqlen_kv, causal, dtype in cases:
        t = make_inputs(shape_q, heads_kv, seqlen_kv, dtype, device)
        leaves = [t[n].detach().clone().requires_grad_() for n in ("q", "k", "v")]
        o = flash_attention(*leaves, causal=causal, bwd_config=SEPARATE)
        o.backward(t["do"])
        scale = shape_q[-1] ** -0.5
        o_ref, _ = attention_reference(t["q"], t["k"], t["v"], causal=causal, scale=scale)
        tol = TOLERANCE[DTYPE_NAMES[dtype]]
        assert relative_error(o, o_ref) <= tol
        refs = reference_grads(t["q"], t["k"], t["v"], t["do"], causal=causal, scale=scale)
        for leaf, ref in zip(leaves, refs, strict=True):
            assert leaf.grad is not None and leaf.grad.dtype == dtype
            assert relative_error(leaf.grad, ref) <= tol


def test_autograd_through_a_loss_with_configs_and_strides(device: str) -> None:
    """Gradients of a scalar loss of o, as gradcheck would compare them: flash vs reference,
    with (B, N, H, D) views, causal=True and explicit configs both ways."""
    t = make_inputs((1, 4, 30, 32), 2, 30, torch.float32, device, bnhd=True, seed=5)
    leaves = [t[n].detach().requires_grad_() for n in ("q", "k", "v")]
    weight = torch.randn(30, 32, device=device)
    loss = (flash_attention(*leaves, causal=True, scale=0.2,
                            fwd_config=dict(BLOCK_M=16, BLOCK_N=16),
                            bwd_config=ATOMIC) * weight).square().sum()
    grads = torch.autograd.grad(loss, leaves)
    ref_leaves = [t[n].detach().double().requires_grad_() for n in ("q", "k", "v")]
    o_ref, _ = attention_reference(*ref_leaves, causal="top_left", scale=0.2)
    ref_grads = torch.autograd.grad((o_ref * weight.double()).square().sum(), ref_leaves)
    for got, ref in zip(grads, ref_grads, strict=True):
        assert relative_error(got, ref) <= TOLERANCE["float32"]
    assert FlashAttentionFunction.apply(*leaves, False, None, None, None).requires_grad


# ----------------------------------------------------------------------------- errors
def _valid_args(device: str) -> dict[str, Any]:
    t = make_inputs((1, 2, 8, 16), 1, 8, torch.float16, device)
    o, lse = reference_forward(t, "none", 0.25)
    return {**t, "o": o, "lse": lse}


@pytest.mark.parametrize(("changes", "error", "match"), [
    ({"q": "not a tensor"}, TypeError, "q must be a torch.Tensor"),
    ({"k": torch.randn(1, 1, 8)}, ValueError, "k must be 4-D"),
    ({"v": torch.randn(1, 1, 8, 16, dtype=torch.float32)}, TypeError, "share one dtype"),
    ({"lse": torch.randn(1, 2, 8, dtype=torch.float16)}, TypeError, "lse must be float32"),
    ({"lse": torch.randn(1, 2, 9)}, ValueError, "lse must have shape"),
    ({"do": torch.randn(1, 2, 9, 16, dtype=torch.float16)}, ValueError, "o and do must have"),
    ({"k": torch.randn(1, 3, 8, 16, dtype=torch.float16),
      "v": torch.randn(1, 3, 8, 16, dtype=torch.float16)}, ValueError, "multiple of heads"),
    ({"q": torch.randint(0, 5, (1, 2, 8, 16), dtype=torch.int32)}, TypeError, "must be float16"),
    ({"causal": "diagonal"}, ValueError, "causal must be"),
    ({"scale": float("nan")}, ValueError, "scale must be a finite"),
    ({"config": {"BLOCK_M1": 24}}, ValueError, "BLOCK_M1 must be one of"),
    ({"config": {"block_m1": 32}}, ValueError, "no field"),
    ({"config": 7}, TypeError, "config must be a BwdConfig"),
])
def test_bad_arguments_raise_naming_the_problem(changes: dict[str, Any], error: type,
                                                match: str, device: str) -> None:
    args = _valid_args(device)
    kwargs: dict[str, Any] = {"causal": False, "scale": None, "config": None}
    for name, value in changes.items():
        if name in kwargs:
            kwargs[name] = value
        else:
            args[name] = value.to(device) if isinstance(value, torch.Tensor) else value
    with pytest.raises(error, match=match):
        flash_attention_bwd(args["do"], args["q"], args["k"], args["v"], args["o"],
                            args["lse"], **kwargs)


def test_explicit_configs_must_run_but_may_be_wasteful(device: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    args = _valid_args(device)
    positional = [args[n] for n in ("do", "q", "k", "v", "o", "lse")]
    problem = Problem(1, 2, 1, 8, 8, 16, "float16")
    device_info = templates.current_device()
    # Wasteful for 8 tokens (the tuner never tries it), but it runs and is right.
    wasteful = BwdConfig(BLOCK_M1=16, BLOCK_N1=64, BLOCK_M2=16, BLOCK_N2=16, num_warps=4)
    assert "BLOCK_N1=64 is larger than seqlen_kv=8 needs" in str(
        TEMPLATE.constraint(problem, wasteful, device_info))
    assert TEMPLATE.hard_constraint(problem, wasteful, device_info) is None
    t = {n: args[n] for n in ("q", "k", "v", "do")}
    check_grads(t, "none", wasteful, TOLERANCE["float16"], forward=(args["o"], args["lse"]))
    # A config that cannot fit the device is refused before anything compiles.
    tiny_smem = dataclasses.replace(device_info, smem_per_block=16 * 1024)
    monkeypatch.setattr("templates.flash.bwd.current_device", lambda *_: tiny_smem)
    with pytest.raises(ValueError, match=r"needs about \d+ KiB of shared memory"):
        flash_attention_bwd(*positional, config=dict(BLOCK_M1=64, BLOCK_N1=128, num_stages=4))
    with pytest.raises(ValueError, match="head_dim must be at most 256"):
        wide = torch.randn(1, 1, 4, 264, dtype=torch.float16, device=device)
        flash_attention_bwd(wide, wide, wide, wide, wide, torch.zeros(1, 1, 4, device=device))


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
            for seqlens in ((1, 4096), (17, 17), (4096, 4096), (3333, 1000), (1, 1)):
                for causal in ("none", "bottom_right"):
                    problem = Problem(2, 8, 2, *seqlens, head_dim, dtype, causal)
                    config = TEMPLATE.default_config(problem, device_info)
                    assert TEMPLATE.constraint(problem, config, device_info) is None


def test_default_heuristic_per_family() -> None:
    p64 = Problem(4, 32, 32, 4096, 4096, 64, "bfloat16")
    p128 = dataclasses.replace(p64, heads_q=16, heads_kv=16, head_dim=128)
    p256 = dataclasses.replace(p64, heads_q=8, heads_kv=8, head_dim=256)
    # On Hopper the starting points fit as they are (no fallback search).
    assert TEMPLATE.default_config(p64, H100) == BwdConfig(
        BLOCK_M1=32, BLOCK_N1=128, BLOCK_M2=128, BLOCK_N2=32, num_warps=4, num_stages=5)
    assert TEMPLATE.default_config(p128, H100) == BwdConfig()
    assert TEMPLATE.default_config(p256, H100).to_dict()["BLOCK_N1"] == 64
    # Less shared memory: a smaller config, still valid.
    small = TEMPLATE.default_config(p128, RTX4090)
    assert TEMPLATE.constraint(p128, small, RTX4090) is None
    assert TEMPLATE.constraint(p128, TEMPLATE.default_config(p128, H100), RTX4090) is not None
    # Short sequences never get tiles larger than they need.
    tiny = TEMPLATE.default_config(dataclasses.replace(p64, seqlen_q=17, seqlen_kv=9), H100)
    assert isinstance(tiny, BwdConfig) and tiny.BLOCK_M1 <= 32 and tiny.BLOCK_N1 == 16
    interp = TEMPLATE.default_config(p64, templates.current_device())
    assert isinstance(interp, BwdConfig)
    if templates.current_device().is_interpreter:
        assert (interp.BLOCK_M1, interp.BLOCK_N1, interp.dq_mode) == (32, 32, "atomic")


def test_constraints_reject_what_cannot_fit_and_keep_good_configs() -> None:
    p128 = Problem(4, 16, 16, 4096, 4096, 128, "bfloat16", "top_left")
    good = BwdConfig()
    assert TEMPLATE.constraint(p128, good, H100) is None
    assert "shared memory" in str(TEMPLATE.constraint(
        p128, dataclasses.replace(good, BLOCK_M1=128, num_stages=5), H100))
    assert "registers would spill" in str(TEMPLATE.constraint(
        p128, dataclasses.replace(good, num_warps=4), H100))
    assert "fewer than two elements" in str(TEMPLATE.constraint(
        p128, dataclasses.replace(good, BLOCK_M2=16, BLOCK_N2=16), H100))
    assert "unused with dq_mode='atomic'" in str(TEMPLATE.constraint(
        p128, dataclasses.replace(good, dq_mode="atomic", BLOCK_M2=64), H100))
    assert TEMPLATE.constraint(p128, dataclasses.replace(good, dq_mode="atomic"), H100) is None
    sparse = dataclasses.replace(p128, mask="random:0.10")
    assert TEMPLATE.unsupported(sparse) is None  # block-sparse problems are tuned too
    assert TEMPLATE.constraint(sparse, good, H100) is None
    assert "mask pattern" in str(TEMPLATE.unsupported(dataclasses.replace(p128, mask="nope")))
    # The space is wide on purpose; the constraints cut it down before anything compiles.
    kept = [c for c in BwdConfig.grid() if TEMPLATE.constraint(p128, c, H100) is None]
    assert 20 < len(kept) < BwdConfig.grid_size() / 2
    assert all(max(registers_estimate(p128, c).values()) <= MAX_REGISTERS_PER_THREAD
               for c in kept)
    assert {c.dq_mode for c in kept} == {"atomic", "separate"}


def test_every_knob_documents_what_it_trades() -> None:
    knobs = {k.name: k for k in BwdConfig.knobs()}
    assert set(knobs) == {"BLOCK_M1", "BLOCK_N1", "BLOCK_M2", "BLOCK_N2", "num_warps",
                          "num_stages", "dq_mode"}
    assert all(len(k.doc) > 40 and len(k.choices) >= 2 for k in knobs.values())
    tiles = [c for n in ("BLOCK_M1", "BLOCK_N1", "BLOCK_M2", "BLOCK_N2")
             for c in knobs[n].choices]
    assert all(isinstance(c, int) and c >= 16 for c in tiles)
    assert BwdConfig.from_dict(BwdConfig(dq_mode="atomic").to_dict()) == BwdConfig(
        dq_mode="atomic")


def test_flops_are_two_and_a_half_forwards_and_bytes() -> None:
    fwd = get_template("flash_fwd")
    for problem in (Problem(2, 16, 4, 4096, 4096, 128, "bfloat16"),
                    Problem(2, 16, 4, 4096, 4096, 128, "bfloat16", "top_left"),
                    Problem(1, 8, 8, 100, 1000, 64, "float16", "bottom_right"),
                    Problem(1, 8, 8, 1000, 100, 64, "float16", "top_left")):
        assert TEMPLATE.flops(problem) == 2.5 * fwd.flops(problem)
    dense = Problem(2, 16, 4, 4096, 4096, 128, "bfloat16")
    assert TEMPLATE.flops(dense) == 2.5 * 4 * 2 * 16 * 4096 * 4096 * 128
    q_like = 2 * 2 * 16 * 4096 * 128
    kv_like = 2 * 2 * 4 * 4096 * 128
    assert TEMPLATE.bytes_moved(dense) == 4 * q_like + 4 * kv_like + 4 * 2 * 16 * 4096


def test_make_inputs_are_random_reproducible_and_run() -> None:
    problem = Problem(1, 4, 2, 30, 45, 40, "float16", "bottom_right")
    inputs = TEMPLATE.make_inputs(problem, "cpu", seed=3)
    assert inputs["q"].shape == inputs["do"].shape == inputs["o"].shape == (1, 4, 30, 40)
    assert inputs["k"].shape == inputs["v"].shape == (1, 2, 45, 40)
    assert inputs["lse"].shape == (1, 4, 30) and inputs["lse"].dtype == torch.float32
    assert all(inputs[n].abs().sum() > 0 for n in ("q", "k", "v", "do", "o"))
    assert torch.equal(TEMPLATE.make_inputs(problem, "cpu", seed=3)["do"], inputs["do"])
    assert not torch.equal(TEMPLATE.make_inputs(problem, "cpu", seed=4)["do"], inputs["do"])
    for config in (BwdConfig(BLOCK_M1=16, BLOCK_N1=32, dq_mode="atomic"),
                   BwdConfig(BLOCK_M1=32, BLOCK_N1=16, BLOCK_M2=16, BLOCK_N2=32, num_warps=4)):
        assert TEMPLATE.constraint(problem, config, templates.current_device()) is None
        err = TEMPLATE.error(TEMPLATE.run(inputs, config), TEMPLATE.reference(inputs))
        assert err <= TEMPLATE.tolerance(problem)


def test_reference_in_chunks_equals_one_piece(monkeypatch: pytest.MonkeyPatch) -> None:
    t = make_inputs((2, 4, 12, 8), 2, 10, torch.float32, "cpu")
    whole = reference_grads(t["q"], t["k"], t["v"], t["do"], causal="bottom_right", scale=0.3)
    monkeypatch.setattr("templates.flash.bwd.REFERENCE_CHUNK_SCORES", 1)  # one kv head a chunk
    chunked = reference_grads(t["q"], t["k"], t["v"], t["do"], causal="bottom_right", scale=0.3)
    assert all(torch.allclose(a, b, rtol=1e-12, atol=1e-12)
               for a, b in zip(whole, chunked, strict=True))


def test_template_is_registered_with_a_source_version() -> None:
    assert isinstance(TEMPLATE, FlashBwdTemplate)
    assert set(TEMPLATE.source_modules()) == {"templates.flash.bwd", "templates.flash.bwd_kernel",
                                              "templates.kernel_common",
                                              "templates.masks.listed_blocks",
                                              "templates.flash.softcap"}
    assert len(TEMPLATE.version()) == 16
    assert templates.flash_attention_bwd is flash_attention_bwd
    assert templates.flash_attention is flash_attention


def test_standalone_source_imports_and_matches_the_template(tmp_path: Path,
                                                            device: str) -> None:
    config = BwdConfig(BLOCK_M1=16, BLOCK_N1=32, BLOCK_M2=32, BLOCK_N2=16, num_warps=4,
                       num_stages=2)
    path = tmp_path / "attention_bwd_generated.py"
    path.write_text(TEMPLATE.standalone_source(config))
    assert "from templates" not in path.read_text() and "import templates" not in path.read_text()
    spec = importlib.util.spec_from_file_location("attention_bwd_generated", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert config.to_dict() == module.CONFIG
    t = make_inputs((1, 4, 40, 64), 2, 50, torch.float16, device)
    o, lse = reference_forward(t, "bottom_right", 0.125)
    args = (t["do"], t["q"], t["k"], t["v"], o, lse)
    got = module.flash_attention_bwd(*args, causal="bottom_right")
    want = flash_attention_bwd(*args, causal="bottom_right", config=config)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_precompile_is_declined_under_the_interpreter() -> None:
    if not templates.current_device().is_interpreter:
        pytest.skip("on a GPU precompile compiles (see the gpu test)")
    assert TEMPLATE.precompile(Problem(1, 2, 2, 64, 64, 64, "float16"), BwdConfig()) is False


# ----------------------------------------------------------------------------- GPU matrix
GPU_SHAPES = [  # (B, H_q, H_kv, N_q, N_kv)
    (2, 8, 8, 17, 17),
    (1, 8, 1, 1000, 1000),
    (1, 8, 1, 3333, 1000),
    (2, 4, 1, 1000, 3333),
    (1, 8, 8, 1, 3333),
    (1, 4, 4, 3333, 1),
    (1, 16, 2, 3333, 3333),
]


def gpu_configs(head_dim: int) -> dict[str, dict[str, Any] | None]:
    wide = head_dim > 128
    return {
        "default": None,
        "atomic": dict(BLOCK_M1=32, BLOCK_N1=64 if wide else 128, num_warps=8, num_stages=2,
                       dq_mode="atomic"),
        "separate": dict(BLOCK_M1=64, BLOCK_N1=64, BLOCK_M2=64, BLOCK_N2=64 if wide else 32,
                         num_warps=8, num_stages=2),
    }


@pytest.mark.gpu
@pytest.mark.parametrize(("dtype", "head_dim", "causal"),
                         bf16_product_fp16_diagonal((64, 128, 256),
                                                    ("none", "top_left", "bottom_right")))
def test_gpu_matrix(dtype: torch.dtype, head_dim: int, causal: str) -> None:
    tol = TOLERANCE[DTYPE_NAMES[dtype]]
    names = ["default", "atomic", "separate"]
    for i, (batch, heads_q, heads_kv, seqlen_q, seqlen_kv) in enumerate(GPU_SHAPES):
        t = make_inputs((batch, heads_q, seqlen_q, head_dim), heads_kv, seqlen_kv, dtype, "cuda")
        # The configs take turns over the shapes (each one compiles its own kernels).
        config = gpu_configs(head_dim)[names[i % len(names)]]
        if config is not None and min(seqlen_q, seqlen_kv) < 128:
            config = None  # the fixed configs' tiles are too large for these lengths
        check_grads(t, causal, config, tol)


@pytest.mark.gpu
@pytest.mark.parametrize("config_name", ["default", "atomic", "separate"])
def test_gpu_strided_padded_head_dims_with_the_forward_kernel(config_name: str) -> None:
    for head_dim in (40, 96, 128):
        t = make_inputs((2, 8, 1000, head_dim), 2, 1500, torch.bfloat16, "cuda", bnhd=True)
        o, lse = templates.flash_attention_fwd(t["q"], t["k"], t["v"], causal="bottom_right")
        check_grads(t, "bottom_right", gpu_configs(head_dim)[config_name],
                    TOLERANCE["bfloat16"], forward=(o, lse))


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_autograd_matches_reference(causal: bool) -> None:
    for dtype in (torch.float16, torch.bfloat16):
        t = make_inputs((2, 16, 2048, 128), 4, 2048, dtype, "cuda")
        leaves = [t[n].detach().clone().requires_grad_() for n in ("q", "k", "v")]
        flash_attention(*leaves, causal=causal).backward(t["do"])
        mode = normalize_causal(causal)
        refs = reference_grads(t["q"], t["k"], t["v"], t["do"], causal=mode, scale=128 ** -0.5)
        for leaf, ref in zip(leaves, refs, strict=True):
            assert leaf.grad is not None
            assert relative_error(leaf.grad, ref) <= TOLERANCE[DTYPE_NAMES[dtype]]


@pytest.mark.gpu
def test_gpu_float32_and_separate_mode_is_deterministic() -> None:
    t = make_inputs((1, 4, 300, 64), 2, 500, torch.float32, "cuda")
    check_grads(t, "top_left", SEPARATE, TOLERANCE["float32"])
    t = make_inputs((2, 8, 2000, 128), 2, 2000, torch.bfloat16, "cuda")
    o, lse = reference_forward(t, "top_left", 128 ** -0.5)
    args = (t["do"], t["q"], t["k"], t["v"], o, lse)
    first = flash_attention_bwd(*args, causal=True, config=gpu_configs(128)["separate"])
    second = flash_attention_bwd(*args, causal=True, config=gpu_configs(128)["separate"])
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


@pytest.mark.gpu
def test_gpu_precompile_compiles_what_run_launches() -> None:
    problem = Problem(2, 8, 2, 1000, 1500, 128, "bfloat16", "bottom_right")
    kernels = (flash_bwd_kernel._flash_bwd_preprocess_kernel,
               flash_bwd_kernel._flash_bwd_dkdv_kernel, flash_bwd_kernel._flash_bwd_dq_kernel)
    for dq_mode in ("atomic", "separate"):
        config = BwdConfig(BLOCK_M1=32, BLOCK_N1=64, num_warps=8, num_stages=2, dq_mode=dq_mode)
        assert TEMPLATE.precompile(problem, config)
        device = torch.cuda.current_device()
        compiled = [len(k.device_caches[device][0]) for k in kernels]
        inputs = TEMPLATE.make_inputs(problem, "cuda", seed=0)
        out = TEMPLATE.run(inputs, config)
        assert TEMPLATE.error(out, TEMPLATE.reference(inputs)) <= TOLERANCE["bfloat16"]
        assert [len(k.device_caches[device][0]) for k in kernels] == compiled, (
            "run compiled a kernel precompile did not")


@pytest.mark.gpu
def test_gpu_scale_and_no_nan_for_large_scores() -> None:
    """Large scores (scale 1) and a very negative lse range must not overflow exp2."""
    t = make_inputs((1, 4, 1000, 64), 4, 777, torch.float16, "cuda")
    t["q"] = t["q"] * 4
    check_grads(t, "bottom_right", None, TOLERANCE["float16"], scale=1.0)
    assert math.isfinite(TEMPLATE.flops(Problem(1, 4, 4, 1000, 777, 64, "float16")))
