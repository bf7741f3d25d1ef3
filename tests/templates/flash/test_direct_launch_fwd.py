"""The forward launch plans through ``DirectLaunch``: the first dense call compiles through the
JIT, later ones go straight to the compiled launcher with the same arguments (pointers as
addresses, the compiled-out mask arguments null), and the outputs are the JIT's.

On the CPU a stand-in kernel records what each path passes (the interpreter compiles
nothing, so there every call takes the JIT's path: checked too); the GPU tests compare the
direct launches' outputs with the JIT's bits, TMA and pointer loads, on fresh and reused
addresses, and the Gluon forward on Hopper.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from templates.attention_reference import attention_reference
from templates.compile import direct_launch
from templates.device import interpreter_active
from templates.flash import fwd_kernel as flash_fwd_kernel
from templates.flash.fwd import FwdConfig, launch_plan

CONFIG = dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=2, grid_order="tiles_inner",
              longest_first=False, pipeline_masked_loop=True, loop_unroll=1,
              warp_specialize=False, use_tma=False)


class _Compiled:
    function, packed_metadata = "function", "metadata"

    def __init__(self, calls: list[tuple[Any, ...]]) -> None:
        self.calls = calls

    def run(self, *args: Any) -> None:
        self.calls.append(("direct", args))


class _Kernel:
    """Stands in for a JIT kernel (``arg_names``, its parameters): records each call, returns
    one compiled kernel."""

    def __init__(self, arg_names: list[str]) -> None:
        self.arg_names = arg_names
        self.calls: list[tuple[Any, ...]] = []
        self.compiled = _Compiled(self.calls)

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        def launch(*args: Any, **kwargs: Any) -> _Compiled:
            self.calls.append(("jit", args, kwargs))
            return self.compiled
        return launch


def _qkv(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 4, 32, 16, generator=gen)
    k = torch.randn(1, 2, 48, 16, generator=gen)
    v = torch.randn(1, 2, 48, 16, generator=gen)
    return q, k, v


def _plan(monkeypatch: pytest.MonkeyPatch, use_tma: bool
          ) -> tuple[flash_fwd_kernel.LaunchPlan, _Kernel]:
    kernel = _Kernel(flash_fwd_kernel._flash_fwd_kernel.arg_names)
    monkeypatch.setattr(flash_fwd_kernel, "_flash_fwd_kernel", kernel)
    q, k, v = _qkv()
    plan = flash_fwd_kernel.LaunchPlan(q, k, v, causal_mode="top_left", scale=0.25,
                                       config={**CONFIG, "use_tma": use_tma})
    return plan, kernel


@pytest.mark.parametrize("use_tma", [False, True])
def test_a_dense_plan_launches_directly_after_its_first_call(
        monkeypatch: pytest.MonkeyPatch, use_tma: bool) -> None:
    plan, kernel = _plan(monkeypatch, use_tma)
    q, k, v = _qkv()
    plan(q, k, v)
    plan(q, k, v)
    (jit_tag, jit_args, jit_kwargs), (direct_tag, direct_args) = kernel.calls
    assert (jit_tag, direct_tag) == ("jit", "direct")
    assert jit_kwargs == plan.options
    assert direct_args[:9] == (*plan._dense.grid, 0, "function", "metadata", None, None, None)
    launched = direct_args[9:9 + len(jit_args)]
    constexprs = direct_args[9 + len(jit_args):]
    assert constexprs == tuple(v for name, v in plan.options.items()
                               if name not in flash_fwd_kernel.LAUNCH_OPTIONS)
    lse = jit_args[4]
    for position, (jit_arg, arg) in enumerate(zip(jit_args, launched, strict=True)):
        if use_tma and position < 4:  # descriptors, made over the second call's tensors
            assert type(arg) is type(jit_arg) and arg.block_shape == jit_arg.block_shape
            assert (arg.shape, arg.strides) == (jit_arg.shape, jit_arg.strides)
        elif position < 3:  # q, k, v: the same tensors, as addresses
            assert arg == jit_arg.data_ptr()
        elif position < 5:  # o, lse: the second call's own, as aligned addresses
            assert isinstance(arg, int) and arg % 16 == 0
        elif jit_arg is lse:  # a mask argument, compiled out: null
            assert arg is None
        else:  # the scalars
            assert arg == jit_arg
    assert plan._dense.direct_launches == 1


def test_masks_and_misaligned_pointers_keep_the_jit_path(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    plan, kernel = _plan(monkeypatch, use_tma=False)
    q, k, v = _qkv()
    plan(q, k, v)
    flat = torch.randn(q.numel() + 1)
    shifted = flat[1:].view(q.shape)  # one element off a 16-byte boundary: another kernel
    plan(shifted, k, v)
    mask = torch.ones(32, 48, dtype=torch.uint8).expand(1, 4, 32, 48)
    plan(q, k, v, None, mask)
    assert [c[0] for c in kernel.calls] == ["jit", "jit", "jit"]
    assert kernel.calls[1][1][0] is shifted and kernel.calls[2][1][-5] is mask


def test_direct_launch_switched_off_or_a_hook_keeps_the_jit_path(
        monkeypatch: pytest.MonkeyPatch) -> None:
    plan, kernel = _plan(monkeypatch, use_tma=False)
    q, k, v = _qkv()
    plan(q, k, v)
    monkeypatch.setattr(direct_launch, "ENABLED", False)
    plan(q, k, v)
    monkeypatch.setattr(direct_launch, "ENABLED", True)
    monkeypatch.setattr(direct_launch, "_launch_hooks_set", lambda: True)
    plan(q, k, v)
    assert [c[0] for c in kernel.calls] == ["jit", "jit", "jit"]


@pytest.mark.parametrize("persistent", [False, True])
def test_a_gluon_plan_launches_directly_after_its_first_call(
        monkeypatch: pytest.MonkeyPatch, persistent: bool) -> None:
    """Dense launches pass LSE for the block mask's six tensors, (without a persistent
    causal schedule) for the schedule and (without a split) for the split workspace: the
    kernel never reads them."""
    from templates.gluon.fwd import GluonFwdConfig
    from templates.gluon.fwd import kernel as gluon

    if gluon is None:
        pytest.skip("this triton has no Gluon")
    kernel = _Kernel(gluon._gluon_fwd_kernel.arg_names)
    monkeypatch.setattr(gluon, "_gluon_fwd_kernel", kernel)
    q = torch.randn(1, 4, 128, 64, dtype=torch.float16)
    k, v = (torch.randn(1, 2, 192, 64, dtype=torch.float16) for _ in range(2))
    config = GluonFwdConfig(persistent=persistent, longest_first=persistent)
    plan = gluon.LaunchPlan(q, k, causal_mode="top_left", scale=0.125, config=config.to_dict(),
                            sm_count=132)
    assert (plan.schedule is not None) == persistent
    plan(q, k, v)
    plan(q, k, v)
    (_, jit_args, jit_kwargs), (_, direct_args) = kernel.calls
    assert jit_kwargs == plan.options  # num_warps once: a constexpr and an option
    assert direct_args[:9] == (*plan._launch.grid, 0, "function", "metadata", None, None, None)
    launched = direct_args[9:9 + len(jit_args)]
    for desc, jit_desc, tensor in zip(launched[:4], jit_args[:4], (q, k, v), strict=False):
        assert type(desc) is type(jit_desc) and desc.base is tensor
        assert (desc.block_shape, desc.layout) == (jit_desc.block_shape, jit_desc.layout)
    # Out, LSE, the block mask's six tensors (LSE, compiled out in a dense launch) and the
    # schedule (LSE where there is none).
    assert all(isinstance(p, int) and p % 16 == 0 for p in launched[4:13])
    assert launched[5:12] == (launched[5],) * 7
    assert all(t is jit_args[5] for t in jit_args[6:12])
    if persistent:
        assert jit_args[12] is plan.schedule and launched[12] == plan.schedule.data_ptr()
    else:
        assert jit_args[12] is jit_args[5] and launched[12] == launched[5]
    # The split workspace (partials, counters): LSE where the grid is not split.
    assert plan.split is None
    assert all(t is jit_args[5] for t in jit_args[13:15]) and launched[13:15] == (
        launched[5],) * 2
    assert launched[15:] == tuple(jit_args[15:]) == (*plan.scalars, *plan.mask_strides)
    assert direct_args[9 + len(jit_args):] == tuple(
        v for name, v in plan.options.items() if name != "maxnreg")


@pytest.mark.skipif(not interpreter_active(), reason="runs the kernel under the interpreter")
def test_interpreter_plans_never_go_direct_and_stay_right() -> None:
    q, k, v = _qkv()
    plan = launch_plan(q, k, v, causal="top_left", config=FwdConfig(**CONFIG))
    for _ in range(2):
        o, lse = plan(q, k, v)
    ref, _ = attention_reference(q, k, v, causal="top_left", scale=0.25)
    torch.testing.assert_close(o, ref.to(o.dtype), atol=1e-4, rtol=1e-4)
    assert plan._dense.direct_launches == 0


# -- on the GPU ----------------------------------------------------------------------------
def _gpu_qkv(seed: int, heads_kv: int = 2) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(2, 8, 200, 64, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(2, heads_kv, 300, 64, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(2, heads_kv, 300, 64, device="cuda", dtype=torch.bfloat16, generator=gen)
    return q, k, v


def _jit_outputs(plan: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 monkeypatch: pytest.MonkeyPatch) -> tuple[torch.Tensor, torch.Tensor]:
    with monkeypatch.context() as m:
        m.setattr(direct_launch, "ENABLED", False)
        return plan(q, k, v)


@pytest.mark.gpu
@pytest.mark.parametrize("use_tma", [False, True])
def test_gpu_direct_launches_give_the_jit_bits(monkeypatch: pytest.MonkeyPatch,
                                               use_tma: bool) -> None:
    config = FwdConfig(**{**CONFIG, "BLOCK_M": 64, "BLOCK_N": 64, "use_tma": use_tma})
    inputs = [_gpu_qkv(seed) for seed in range(3)]
    plan = launch_plan(*inputs[0], causal="top_left", config=config)
    assert plan._dense.descriptors if use_tma else not plan._dense.descriptors
    plan(*inputs[0])  # compiles, adopts the launcher
    for _ in range(2):  # new addresses, then the same addresses again (kept tensor maps)
        for q, k, v in inputs:
            o, lse = plan(q, k, v)
            o_jit, lse_jit = _jit_outputs(plan, q, k, v, monkeypatch)
            torch.cuda.synchronize()
            assert torch.equal(o, o_jit) and torch.equal(lse, lse_jit)
    assert plan._dense.direct_launches >= 6
    if use_tma:  # an H100 with triton 3.6 or 3.9: the tensor maps are kept per pointer
        assert plan._dense.keeps_tensor_maps
    ref, _ = attention_reference(*(t.float() for t in inputs[-1]), causal="top_left",
                                scale=0.125)
    assert (o.float() - ref).abs().max().item() < 2e-2


@pytest.mark.gpu
def test_gpu_a_reused_address_never_reads_a_stale_tensor(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    # k and v freed and new ones made at the same addresses with other values: the kept
    # tensor maps address them, and the outputs follow the new values.
    config = FwdConfig(**{**CONFIG, "BLOCK_M": 64, "BLOCK_N": 64, "use_tma": True})
    q, k, v = _gpu_qkv(0)
    plan = launch_plan(q, k, v, causal="none", config=config)
    first, _ = plan(q, k, v)
    first, _ = plan(q, k, v)
    k_ptr, v_ptr = k.data_ptr(), v.data_ptr()
    del k, v
    _, k, v = _gpu_qkv(1)
    second, _ = plan(q, k, v)
    jit, _ = _jit_outputs(plan, q, k, v, monkeypatch)
    torch.cuda.synchronize()
    assert torch.equal(second, jit) and not torch.equal(second, first)
    if (k.data_ptr(), v.data_ptr()) != (k_ptr, v_ptr):
        pytest.skip("the allocator gave other addresses: the reuse was not exercised")


@pytest.mark.gpu
def test_gpu_gluon_direct_launches_give_the_jit_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon forward needs a Hopper GPU")
    from templates.gluon.fwd import gluon_attention_fwd, kernel

    assert kernel is not None
    inputs = [tuple(t.contiguous() for t in _gpu_qkv(seed)) for seed in range(3)]
    outs = [gluon_attention_fwd(*qkv, causal=True) for qkv in inputs + inputs]
    with monkeypatch.context() as m:
        m.setattr(direct_launch, "ENABLED", False)
        jit = [gluon_attention_fwd(*qkv, causal=True) for qkv in inputs]
    torch.cuda.synchronize()
    for (o, lse), (o_jit, lse_jit) in zip(outs, jit + jit, strict=True):
        assert torch.equal(o, o_jit) and torch.equal(lse, lse_jit)
    plans = [p[0] for p in kernel_plans()]
    assert plans and max(p._launch.direct_launches for p in plans) >= 5


def kernel_plans() -> list[list[Any]]:
    from templates.gluon import fwd as gluon_fwd

    return list(gluon_fwd._PLANS._entries.values())
