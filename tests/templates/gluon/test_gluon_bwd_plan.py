"""The Gluon backward's kept plans (``templates.gluon.bwd_plan``): on the CPU, stand-in kernels
record what each launch gets: the first call goes through the JIT with the launch plan's own
arguments, later ones to the compiled launchers with the same arguments (plain pointers as
addresses, descriptors made from the kept ones); misaligned pointers keep the JIT's path; the
entry's plan cache tells layouts, configs and masks apart. The GPU tests
(``test_gluon_bwd.py``) compare the gradients with the reference through this path."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from templates.gluon import bwd as gluon_bwd
from tests.templates.flash.test_direct_launch_fwd import _Kernel

pytestmark = pytest.mark.skipif(gluon_bwd.kernel is None, reason="this triton has no Gluon")


class _ParamKernel(_Kernel):
    """A stand-in that also shows the real kernel's parameters (their defaults)."""

    def __init__(self, real: Any) -> None:
        super().__init__(real.arg_names)
        if hasattr(real, "params"):
            self.params = real.params


def _inputs(seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q, do, o = (torch.randn(1, 4, 96, 64, generator=gen).half() for _ in range(3))
    k, v = (torch.randn(1, 2, 160, 64, generator=gen).half() for _ in range(2))
    return do, q, k, v, o, torch.randn(1, 4, 96, generator=gen)


@pytest.mark.parametrize(("warp_specialize", "deterministic"),
                         [(False, False), (True, False), (True, True)])
def test_launches_go_direct_after_the_first_with_the_jits_arguments(
        monkeypatch: pytest.MonkeyPatch, warp_specialize: bool, deterministic: bool) -> None:
    from templates.gluon.bwd_plan import GluonBackwardPlan

    module = gluon_bwd.ws_kernel if warp_specialize else gluon_bwd.kernel
    assert module is not None and gluon_bwd.kernel is not None
    pre = _ParamKernel(gluon_bwd.kernel._gluon_bwd_preprocess_kernel)
    main_name = "_gluon_bwd_ws_kernel" if warp_specialize else "_gluon_bwd_kernel"
    main = _ParamKernel(getattr(module, main_name))
    monkeypatch.setattr(module, main_name, main)
    do, q, k, v, o, lse = _inputs()
    config = gluon_bwd.GluonBwdConfig(warp_specialize=warp_specialize,
                                      deterministic=deterministic).to_dict()
    plan_cls = module.WsLaunchPlan if warp_specialize else module.LaunchPlan
    launch_plan = plan_cls(q, k, causal_mode="top_left", scale=0.125, config=config)
    counters: list[Any] = []
    if warp_specialize:
        made = launch_plan.dq_counters

        def recorded(t: torch.Tensor) -> Any:
            out = made(t)
            counters.append(out)
            return out

        monkeypatch.setattr(launch_plan, "dq_counters", recorded)
    plan = GluonBackwardPlan(launch_plan, pre, warp_specialized=warp_specialize)
    plan(do, q, k, v, o, lse)
    plan(do, q, k, v, o, lse)
    if deterministic:
        # A new zeroed int32 counter per (batch, query head, query tile) for every call: a
        # kept plan never hands the kernel counters an earlier call has counted up.
        assert len(counters) == 2 and counters[0] is not counters[1]
        for c in counters:
            assert c.dtype == torch.int32 and c.shape == (1 * 4 * 2,) and not c.any()
        # The counters: the runtime argument before the tiles' order, the last (the direct
        # launcher's come after 9 of its own).
        last = 9 + len(main.calls[0][1]) - 2
        assert main.calls[0][1][-2] is counters[0]
        assert main.calls[1][1][last] == counters[1].data_ptr()
        assert main.calls[0][2]["DETERMINISTIC"] is True
    elif warp_specialize:
        # The default kernel's counters are None (a constexpr: compiled out).
        assert counters == [None, None]
        last = 9 + len(main.calls[0][1]) - 2
        assert main.calls[0][1][-2] is None and main.calls[1][1][last] is None
        assert "DETERMINISTIC" not in launch_plan.options
    for kernel, launch in ((pre, plan.preprocess), (main, plan.main)):
        (jit_tag, jit_args, _), (direct_tag, direct_args) = kernel.calls
        assert (jit_tag, direct_tag) == ("jit", "direct")
        assert launch.direct_launches == 1
        launched = direct_args[9:9 + len(jit_args)]
        for position, (jit_arg, arg) in enumerate(zip(jit_args, launched, strict=True)):
            if position in launch.descriptors:  # made from the kept one, the same layout
                assert type(arg) is type(jit_arg) and arg.block_shape == jit_arg.block_shape
                assert (arg.shape, arg.strides, arg.layout) == (jit_arg.shape, jit_arg.strides,
                                                                jit_arg.layout)
            elif isinstance(jit_arg, torch.Tensor):
                assert isinstance(arg, int) and arg % 16 == 0
            else:
                assert arg == jit_arg
    # The JIT's first call got what the launch plan's own path passes.
    (_, main_args, main_kwargs) = main.calls[0]
    assert main_kwargs == {**launch_plan.options, **main_kwargs}
    assert list(main_args[9:9 + len(launch_plan.scalars)]) == launch_plan.scalars
    assert [a.block_shape for a in main_args[:6]] == [launch_plan.q_block, launch_plan.kv_block,
                                                      launch_plan.kv_block, launch_plan.q_block,
                                                      launch_plan.kv_block, launch_plan.kv_block]


def test_misaligned_pointers_keep_the_jit_path(monkeypatch: pytest.MonkeyPatch) -> None:
    from templates.gluon.bwd_plan import GluonBackwardPlan

    module = gluon_bwd.kernel
    assert module is not None
    pre = _ParamKernel(module._gluon_bwd_preprocess_kernel)
    main = _ParamKernel(module._gluon_bwd_kernel)
    monkeypatch.setattr(module, "_gluon_bwd_kernel", main)
    do, q, k, v, o, lse = _inputs()
    launch_plan = module.LaunchPlan(q, k, causal_mode="none", scale=0.125,
                                    config=gluon_bwd.GluonBwdConfig().to_dict())
    plan = GluonBackwardPlan(launch_plan, pre, warp_specialized=False)
    plan(do, q, k, v, o, lse)
    shifted = torch.randn(o.numel() + 1).half()[1:].view(o.shape)
    plan(do, q, k, v, shifted, lse)
    assert [c[0] for c in pre.calls] == ["jit", "jit"] and pre.calls[1][1][0] is shifted
    assert [c[0] for c in main.calls] == ["jit", "jit"]


def test_keys_tell_apart_layouts_configs_and_masks() -> None:
    from templates.flash.fwd import pattern_mask

    do, q, k, v, o, lse = _inputs()

    def key(**kw: Any) -> Any:
        args = dict(do=do, q=q, k=k, v=v, o=o, lse=lse, causal=True, scale=None, config=None,
                    block_mask=None)
        args.update(kw)
        return gluon_bwd._plan_key(**args)

    base = key()
    assert base == key(do=_inputs(1)[0])
    mask = pattern_mask("sliding_causal:64", 96, 160, "cpu")
    others = [key(k=torch.randn(1, 2, 64, 160).half().transpose(2, 3)),
              key(q=q.float(), do=do.float(), k=k.float(), v=v.float(), o=o.float()),
              key(q=torch.randn(q.numel() + 1).half()[1:].view(q.shape)),
              key(causal="bottom_right"),
              key(config=gluon_bwd.GluonBwdConfig(warp_specialize=True)),
              key(causal=False, block_mask=mask)]
    assert base not in others and len(set(others)) == len(others)


def test_a_kept_plan_passes_each_masks_tile_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """longest_first: the last runtime argument is the order kept with the call's mask, the
    tensor on the JIT's path and its address on the direct one."""
    from templates.flash.fwd import pattern_mask
    from templates.gluon.bwd_plan import GluonBackwardPlan

    module = gluon_bwd.ws_kernel
    assert module is not None and gluon_bwd.kernel is not None
    pre = _ParamKernel(gluon_bwd.kernel._gluon_bwd_preprocess_kernel)
    main = _ParamKernel(module._gluon_bwd_ws_kernel)
    monkeypatch.setattr(module, "_gluon_bwd_ws_kernel", main)
    do, q, k, v, o, lse = _inputs()
    mask = pattern_mask("sliding_causal:64", 96, 160, "cpu")
    config = gluon_bwd.GluonBwdConfig(warp_specialize=True, longest_first=True).to_dict()
    launch_plan = module.WsLaunchPlan(q, k, causal_mode="none", scale=0.125, config=config,
                                      kv_major_mask=mask.transposed, sm_count=132)
    assert launch_plan.options["TILE_ORDER"] is True
    plan = GluonBackwardPlan(launch_plan, pre, warp_specialized=True)
    plan(do, q, k, v, o, lse, mask)
    plan(do, q, k, v, o, lse, mask)
    (jit_tag, jit_args, _), (direct_tag, direct_args) = main.calls
    assert (jit_tag, direct_tag) == ("jit", "direct")
    args = mask.transposed.kernel_args()
    order = launch_plan.tile_order(args[0], args[2], mask.transposed)
    # (The direct launcher's runtime arguments come after 9 of its own.)
    assert jit_args[-1] is order and direct_args[9 + len(jit_args) - 1] == order.data_ptr()
    assert sorted(order.tolist()) == list(range(2 * 2))  # every (kv head, KV tile) once


@pytest.mark.parametrize("seqlen_q", [96, 50])
def test_the_preprocess_zeroes_the_dq_accumulator_it_is_handed(
        seqlen_q: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The row-major dQ accumulator is made empty and zeroed by the preprocess (no fill kernel
    of its own): a NaN-filled one comes out all zeros, with delta and lse2 right, for a length
    that is not a whole number of its tiles too; the transposed accumulator keeps its fill."""
    module = gluon_bwd.kernel
    assert module is not None and gluon_bwd.ws_kernel is not None
    gen = torch.Generator().manual_seed(3)
    o, do = (torch.randn(1, 4, seqlen_q, 64, generator=gen) for _ in range(2))
    lse = torch.randn(1, 4, seqlen_q, generator=gen)
    lse[0, 1, 3] = float("-inf")
    k = torch.randn(1, 2, 160, 64, generator=gen)
    plan = module.LaunchPlan(o, k, causal_mode="none", scale=0.125,
                             config=gluon_bwd.GluonBwdConfig().to_dict())
    assert plan.zero_dq_in_preprocess and plan.preprocess_options()["ZERO_DQ"] is True
    delta, lse2 = (torch.full(plan.rows_shape, float("nan")) for _ in range(2))
    dq_accum = torch.full(o.shape, float("nan"))
    module._gluon_bwd_preprocess_kernel[plan.pre_grid](
        *plan.preprocess_args(o, do, lse, delta, lse2, dq_accum), **plan.preprocess_options())
    assert torch.equal(dq_accum, torch.zeros_like(dq_accum))
    torch.testing.assert_close(delta[..., :seqlen_q], (o * do).sum(-1))
    assert not delta[..., seqlen_q:].any()
    expected = torch.where(lse == float("-inf"), float("inf"), lse * math.log2(math.e))
    torch.testing.assert_close(lse2[..., :seqlen_q], expected)
    assert bool((lse2[..., seqlen_q:] == float("inf")).all())
    transposed = gluon_bwd.ws_kernel.WsLaunchPlan(
        o, k, causal_mode="none", scale=0.125,
        config=gluon_bwd.GluonBwdConfig(warp_specialize=True, dq_transposed=True).to_dict())
    assert not transposed.zero_dq_in_preprocess
    assert "ZERO_DQ" not in transposed.preprocess_options()
    zeroed: list[tuple[int, ...]] = []
    zeros = torch.zeros

    def recorded(*args: Any, **kwargs: Any) -> torch.Tensor:
        out = zeros(*args, **kwargs)
        zeroed.append(tuple(out.shape))
        return out

    monkeypatch.setattr(torch, "zeros", recorded)
    made = transposed.buffers(o, k, k)[2]
    assert not made.any() and made.shape == (1, 4, 64, transposed.dq_columns)
    assert zeroed == [made.shape]  # its accumulator only: no row-major one made and dropped
