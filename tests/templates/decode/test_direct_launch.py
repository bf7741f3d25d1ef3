"""DirectLaunch: the first call goes through the JIT, later ones straight to its launcher.

The CPU tests drive it with a stand-in kernel that records what it is called with (the
interpreter returns no compiled kernel, so there every call takes the JIT path); the GPU
tests check, on the decode kernels, that the direct path is taken and gives the JIT's bits,
and that a misaligned cache gets a plan of its own.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import triton

from templates.compile import direct_launch
from templates.compile.direct_launch import DirectLaunch, alignment_key
from templates.decode import kernel as flash_decode_kernel
from templates.decode.kernel import check_decode_inputs, launch_decode
from templates.decode.template import TEMPLATE, FlashDecodeConfig, decode_reference
from templates.device import interpreter_active


class _Compiled:
    def __init__(self, calls: list[tuple[Any, ...]]) -> None:
        self.function, self.packed_metadata = "function", "metadata"
        self.calls = calls

    def run(self, *args: Any) -> None:
        self.calls.append(("direct", *args))


class _Kernel:
    """A stand-in JIT function: ``kernel[grid](*args, **kwargs)`` records the call and
    returns one compiled kernel."""
    arg_names = ["X", "n", "scale", "BLOCK", "EVEN"]

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.compiled = _Compiled(self.calls)

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        def launch(*args: Any, **kwargs: Any) -> _Compiled:
            self.calls.append(("jit", grid, args, kwargs))
            return self.compiled
        return launch


def test_first_call_compiles_through_the_jit_then_launches_directly() -> None:
    kernel = _Kernel()
    # constexprs given out of the kernel's order: the launcher takes them in its order
    launch = DirectLaunch(kernel, (7, 2), {"EVEN": True, "BLOCK": 64}, {"num_warps": 4})
    launch.launch_on(1234, "x", 10, 0.5)
    launch.launch_on(1234, "y", 10, 0.25)
    assert kernel.calls[0] == ("jit", (7, 2, 1), ("x", 10, 0.5),
                               {"EVEN": True, "BLOCK": 64, "num_warps": 4})
    assert kernel.calls[1] == ("direct", 7, 2, 1, 1234, "function", "metadata", None, None,
                               None, "y", 10, 0.25, 64, True)
    assert launch.direct_launches == 1
    assert launch._compiled is kernel.compiled  # its module stays loaded (triton 3.9 unloads)


def test_a_launch_hook_sends_every_call_through_the_jit(monkeypatch: pytest.MonkeyPatch) -> None:
    kernel = _Kernel()
    launch = DirectLaunch(kernel, (1,), {"BLOCK": 64, "EVEN": False}, {})
    launch.launch_on(1234, "x", 1, 1.0)
    monkeypatch.setattr(direct_launch, "_launch_hooks_set", lambda: True)
    launch.launch_on(1234, "y", 1, 1.0)
    assert [c[0] for c in kernel.calls] == ["jit", "jit"]
    assert launch.direct_launches == 0


def test_launch_hooks_are_read_from_tritons_knobs() -> None:
    hooks = triton.knobs.runtime.launch_enter_hook
    assert not direct_launch._launch_hooks_set()
    hooks.add(print)
    try:
        assert direct_launch._launch_hooks_set()
    finally:
        hooks.remove(print)
    assert not direct_launch._launch_hooks_set()


def test_constexprs_that_do_not_end_the_signature_keep_the_jit_path() -> None:
    kernel = _Kernel()
    # "n" is a runtime argument passed as a keyword, "scale" positionally after it: the
    # launcher's order cannot be rebuilt from positional arguments then constexprs
    launch = DirectLaunch(kernel, (1,), {"n": 1, "BLOCK": 64, "EVEN": False}, {})
    launch.launch_on(1234, "x", 1.0)
    launch.launch_on(1234, "y", 1.0)
    assert [c[0] for c in kernel.calls] == ["jit", "jit"]


def test_alignment_key_reads_16_byte_alignment() -> None:
    base = torch.zeros(64, dtype=torch.float16)
    assert alignment_key(base, base[8:], base[1:]) == (True, True, False)


@pytest.mark.skipif(not interpreter_active(), reason="runs the kernels under the interpreter")
def test_interpreter_launches_never_go_direct() -> None:
    # Under the interpreter a launch returns no compiled kernel: the plan keeps the JIT path
    # and the result still matches the reference.
    q = torch.randn(1, 4, 1, 32)
    k = torch.randn(1, 2, 64, 32)
    v = torch.randn(1, 2, 64, 32)
    lengths = torch.tensor([50], dtype=torch.int32)
    shape = check_decode_inputs(q, k, v, lengths)
    for _ in range(2):
        o, _ = launch_decode(q, k, v, lengths, None, None, shape, num_splits=2, block_n=16,
                             num_warps=1, num_stages=1)
    ref, _ = decode_reference(q, k, v, cache_seqlens=lengths)
    torch.testing.assert_close(o, ref.to(o.dtype), atol=1e-4, rtol=1e-4)
    plans = list(flash_decode_kernel._LAUNCH_PLANS._entries.values())
    assert plans and all(p[0].split.direct_launches == 0 for p in plans)


# -- on the GPU ----------------------------------------------------------------------------
def _decode_inputs(batch: int, seqlen: int, offset: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(batch, 32, 1, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    kv = torch.randn(2 * batch * 8 * seqlen * 128 + offset, device="cuda", dtype=torch.bfloat16,
                     generator=gen)
    k = kv[offset:offset + batch * 8 * seqlen * 128].view(batch, 8, seqlen, 128)
    v = kv[offset + batch * 8 * seqlen * 128:].view(batch, 8, seqlen, 128)
    lengths = torch.full((batch,), seqlen - 3, dtype=torch.int32, device="cuda")
    return q, k, v, lengths


def _plan_for(*args: Any) -> flash_decode_kernel.DecodeLaunchPlan:
    plan = flash_decode_kernel._LAUNCH_PLANS.get(flash_decode_kernel._plan_key(*args))
    assert plan is not None
    return plan


@pytest.mark.gpu
@pytest.mark.parametrize("combine", ["separate", "fused"])
def test_gpu_direct_launches_give_the_jit_bits(combine: str) -> None:
    q, k, v, lengths = _decode_inputs(2, 4096)
    shape = check_decode_inputs(q, k, v, lengths)
    cfg = FlashDecodeConfig(num_splits=8, block_n=64, num_warps=4, num_stages=3,
                            combine=combine)
    first = TEMPLATE.run({"q": q, "k_cache": k, "v_cache": v, "cache_seqlens": lengths,
                          "block_table": None, "scale": None}, cfg)
    outs = [TEMPLATE.run({"q": q, "k_cache": k, "v_cache": v, "cache_seqlens": lengths,
                          "block_table": None, "scale": None}, cfg) for _ in range(5)]
    torch.cuda.synchronize()
    knobs = (8, 64, 4, 3, combine, "default", False)
    plan = _plan_for(q, k, v, lengths, None, shape, knobs)
    assert plan.split.direct_launches >= 5
    if plan.combine is not None:
        assert plan.combine.direct_launches >= 5
    for o, lse in outs:
        assert torch.equal(o, first[0]) and torch.equal(lse, first[1])
    ref, _ = decode_reference(q, k, v, cache_seqlens=lengths)
    assert (first[0].float() - ref.float()).abs().max().item() < 2e-2


@pytest.mark.gpu
def test_gpu_a_misaligned_cache_gets_its_own_plan() -> None:
    # A cache view one element off a 16-byte boundary: Triton compiles another
    # specialization, so a plan kept for aligned caches must not launch it.
    aligned = _decode_inputs(1, 2048)
    shifted = _decode_inputs(1, 2048, offset=1)
    assert alignment_key(shifted[1]) == (False,)
    for q, k, v, lengths in (aligned, shifted, aligned, shifted):
        shape = check_decode_inputs(q, k, v, lengths)
        o, _ = launch_decode(q, k, v, lengths, None, None, shape, num_splits=4, block_n=64,
                             num_warps=4, num_stages=2)
        ref, _ = decode_reference(q, k, v, cache_seqlens=lengths)
        assert (o.float() - ref.float()).abs().max().item() < 2e-2
    keys = {flash_decode_kernel._plan_key(q, k, v, lengths, None,
                                          check_decode_inputs(q, k, v, lengths),
                                          (4, 64, 4, 2, "separate", "default", False))
            for q, k, v, lengths in (aligned, shifted)}
    assert len(keys) == 2
