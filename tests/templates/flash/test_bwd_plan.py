"""The flash backward's kept plans (``templates.flash.bwd_plan``, ``flash_attention_bwd``'s plan
cache): a call laid out like an earlier one reuses its plan, anything the launches depend on
(strides, dtype, alignment, mask, causal mode, config) gets another; planned results are the
unplanned launcher's bits under the interpreter; after the first call the three launches go
to the compiled launchers directly, with the JIT's arguments (a stand-in kernel records them).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from templates.flash import bwd, bwd_kernel
from templates.flash.bwd_plan import BackwardPlan
from templates.flash.fwd import flash_attention_fwd, pattern_mask
from tests.templates.flash.test_direct_launch_fwd import _Kernel

CONFIG = bwd.BwdConfig(BLOCK_M1=16, BLOCK_N1=16, BLOCK_M2=16, BLOCK_N2=16, num_warps=4,
                       num_stages=1)
KERNELS = ("_flash_bwd_preprocess_kernel", "_flash_bwd_dkdv_kernel", "_flash_bwd_dq_kernel")


def _inputs(dtype: torch.dtype = torch.float32, n: int = 37, n_kv: int = 45, seed: int = 0
            ) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q, do = (torch.randn(1, 4, n, 16, generator=gen).to(dtype) for _ in range(2))
    k, v = (torch.randn(1, 2, n_kv, 16, generator=gen).to(dtype) for _ in range(2))
    return do, q, k, v


def _key(do: Any, q: Any, k: Any, v: Any, *rest: Any, causal: Any = True, config: Any = CONFIG,
         block_mask: Any = None, o: Any = None, lse: Any = None) -> Any:
    o = q if o is None else o
    lse = torch.empty(q.shape[:3]) if lse is None else lse
    return bwd._plan_key(do, q, k, v, o, lse, causal, None, config, None, block_mask, None)


def test_keys_tell_apart_what_the_launches_depend_on() -> None:
    do, q, k, v = _inputs()
    base = _key(do, q, k, v)
    assert base == _key(*_inputs(seed=1))  # other values, same layout: the same plan
    strided = torch.randn(1, 2, 16, 45).transpose(2, 3)  # same shape, other strides
    flat = torch.randn(q.numel() + 1)
    shifted = flat[1:].view(q.shape)  # one element off a 16-byte boundary
    mask = pattern_mask("sliding_causal:9", 37, 37, "cpu")
    square = _inputs(n_kv=37)[:4]
    others = [
        _key(do, q, strided, v),
        _key(*_inputs(torch.float16)),
        _key(do, shifted, k, v),
        _key(do, q, k, v, causal="bottom_right"),
        _key(do, q, k, v, causal=False),
        _key(do, q, k, v, config=bwd.BwdConfig(BLOCK_M1=32, BLOCK_N1=16, BLOCK_M2=16,
                                                BLOCK_N2=16, num_warps=4, num_stages=1)),
        _key(*square, block_mask=mask),
    ]
    assert base not in others and len(set(others)) == len(others)
    other_mask = pattern_mask("sliding_causal:30", 37, 37, "cpu")  # same geometry, other lists
    assert _key(*square, block_mask=mask) == _key(*square, block_mask=other_mask)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", ["dense", "causal", "block mask", "attn_mask", "atomic"])
def test_planned_results_are_the_unplanned_launchers_bits(case: str, dtype: torch.dtype
                                                          ) -> None:
    n_kv = 37 if case == "block mask" else 45
    do, q, k, v = _inputs(dtype, n_kv=n_kv)
    causal = case in ("causal", "atomic")
    block_mask = pattern_mask("sliding_causal:9", 37, 37, "cpu") if case == "block mask" else None
    attn_mask = (torch.rand(37, n_kv, generator=torch.Generator().manual_seed(3)) > 0.3
                 if case == "attn_mask" else None)
    config = (bwd.dataclasses.replace(CONFIG, dq_mode="atomic") if case == "atomic"
              else CONFIG)
    o, lse = flash_attention_fwd(q, k, v, causal=causal, block_mask=block_mask,
                                 attn_mask=attn_mask)
    want = bwd_kernel.launch(
        do, q, k, v, o, lse, causal_mode="top_left" if causal else "none", scale=0.25,
        config=config.to_dict(), block_mask=block_mask,
        attn_mask=None if attn_mask is None else bwd.attn_mask_view(attn_mask, q, k))
    bwd._PLANS.clear()
    for _ in range(2):  # made, then kept
        got = bwd.flash_attention_bwd(do, q, k, v, o, lse, causal=causal, config=config,
                                      block_mask=block_mask, attn_mask=attn_mask)
        for name, a, b in zip(("dq", "dk", "dv"), got, want, strict=True):
            assert torch.equal(a, b), name
    assert len(bwd._PLANS) == 1


def test_a_plan_serves_another_mask_of_the_same_geometry() -> None:
    do, q, k, v = _inputs(n_kv=37)
    bwd._PLANS.clear()
    for window in (9, 30):
        mask = pattern_mask(f"sliding_causal:{window}", 37, 37, "cpu")
        o, lse = flash_attention_fwd(q, k, v, block_mask=mask)
        want = bwd_kernel.launch(do, q, k, v, o, lse, causal_mode="none", scale=0.25,
                                 config=CONFIG.to_dict(), block_mask=mask)
        got = bwd.flash_attention_bwd(do, q, k, v, o, lse, config=CONFIG, block_mask=mask)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert len(bwd._PLANS) == 1


def _standin_plan(monkeypatch: pytest.MonkeyPatch) -> tuple[BackwardPlan, list[_Kernel]]:
    kernels = [_Kernel(getattr(bwd_kernel, name).arg_names) for name in KERNELS]
    for name, kernel in zip(KERNELS, kernels, strict=True):
        monkeypatch.setattr(bwd_kernel, name, kernel)
    do, q, k, v = _inputs()
    plan = BackwardPlan(do, q, k, v, q, torch.empty(q.shape[:3]), causal_mode="top_left",
                        scale=0.25, config=CONFIG.to_dict())
    return plan, kernels


def test_launches_go_direct_after_the_first_with_the_jits_arguments(
        monkeypatch: pytest.MonkeyPatch) -> None:
    plan, kernels = _standin_plan(monkeypatch)
    do, q, k, v = _inputs()
    lse = torch.empty(q.shape[:3])
    plan(do, q, k, v, q, lse)
    plan(do, q, k, v, q, lse)
    for kernel, launch in zip(kernels, plan.launches, strict=True):
        (jit_tag, jit_args, jit_kwargs), (direct_tag, direct_args) = kernel.calls
        assert (jit_tag, direct_tag) == ("jit", "direct")
        assert jit_kwargs == launch.options
        launched = direct_args[9:9 + len(jit_args)]
        for jit_arg, arg in zip(jit_args, launched, strict=True):
            if isinstance(jit_arg, torch.Tensor):  # the second call's tensors, as addresses
                assert isinstance(arg, int) and arg % 16 == 0
                if jit_arg is lse or jit_arg is q or jit_arg is do:
                    assert arg == jit_arg.data_ptr()
            else:
                assert arg == jit_arg
        assert launch.direct.direct_launches == 1


def test_misaligned_pointers_keep_the_jit_path(monkeypatch: pytest.MonkeyPatch) -> None:
    plan, kernels = _standin_plan(monkeypatch)
    do, q, k, v = _inputs()
    lse = torch.empty(q.shape[:3])
    plan(do, q, k, v, q, lse)
    shifted = torch.randn(q.numel() + 1)[1:].view(q.shape)
    plan(do, shifted, k, v, q, lse)
    assert all([c[0] for c in kernel.calls] == ["jit", "jit"] for kernel in kernels)
    assert kernels[1].calls[1][1][0] is shifted
