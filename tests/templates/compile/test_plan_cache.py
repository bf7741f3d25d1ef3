"""The launch-plan cache of ``flash_attention_fwd``: a repeated call skips the checks, and a
call that differs in anything the checks read never gets another call's plan."""

from __future__ import annotations

import gc
import sys
import weakref
from typing import Any

import pytest
import torch

from templates import BlockMask
from templates.attention_reference import attention_reference
from templates.base import TOLERANCE
from templates.compile.plan_cache import PlanCache
from templates.flash import fwd as flash_fwd
from templates.flash import fwd_kernel as flash_fwd_kernel
from templates.flash.fwd import TEMPLATE, FwdConfig, flash_attention_fwd

SMALL = FwdConfig(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1)
TMA = FwdConfig(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1, use_tma=True)


DEVICE = "cpu"  # the test device (the ``device`` fixture), set per test by fresh_plans


@pytest.fixture(autouse=True)
def fresh_plans(monkeypatch: pytest.MonkeyPatch, device: str) -> None:
    """Each test starts with no plans (and poisoned outputs, as the other kernel tests)."""
    monkeypatch.setattr(sys.modules[__name__], "DEVICE", device)
    monkeypatch.setattr(flash_fwd, "_PLANS", PlanCache(maxsize=64))
    monkeypatch.setattr(flash_fwd_kernel, "DEBUG_POISON", True)


def qkv(shape: tuple[int, int, int, int] = (1, 2, 24, 16), n_kv: int = 24,
        dtype: torch.dtype = torch.float16, seed: int = 0
        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    b, h, n_q, d = shape
    q = torch.randn(b, h, n_q, d, generator=gen, dtype=dtype)
    k = torch.randn(b, h, n_kv, d, generator=gen, dtype=dtype)
    v = torch.randn(b, h, n_kv, d, generator=gen, dtype=dtype)
    return q.to(DEVICE), k.to(DEVICE), v.to(DEVICE)


def check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: Any = False,
          scale: float | None = None, mask: torch.Tensor | None = None, **kwargs: Any) -> None:
    o, lse = flash_attention_fwd(q, k, v, causal=causal, scale=scale, **kwargs)
    mode = flash_fwd_kernel.normalize_causal(causal)
    o_ref, lse_ref = attention_reference(q, k, v, causal=mode, mask=mask,
                                         scale=q.shape[-1] ** -0.5 if scale is None else scale)
    assert o.dtype == q.dtype and o.shape == q.shape
    assert TEMPLATE.error((o, lse), (o_ref, lse_ref)) <= TOLERANCE[flash_fwd.DTYPE_NAMES[q.dtype]]


# ----------------------------------------------------------------------------- the cache
def test_plan_cache_is_bounded_and_gives_hit_entries_a_second_chance() -> None:
    cache: PlanCache[str] = PlanCache(maxsize=3)
    for key in "abc":
        cache.put(key, key.upper())
    cache.put("d", "D")  # every entry is marked when new: the oldest goes, the rest unmarked
    assert len(cache) == 3 and cache.get("a") is None
    assert cache.get("c") == "C"  # marks c
    cache.put("e", "E")  # b is the oldest and unused since the last pass
    assert cache.get("b") is None
    cache.put("f", "F")  # c was used: a second chance; d goes instead
    assert cache.get("d") is None and {cache.get(k) for k in "cef"} == {"C", "E", "F"}
    cache.put(None, "never")
    cache.put(["unhashable"], "never")  # type: ignore[arg-type]
    assert cache.get(None) is None and cache.get(["unhashable"]) is None  # type: ignore[arg-type]
    assert len(cache) == 3
    cache.clear()
    assert len(cache) == 0
    with pytest.raises(ValueError, match="maxsize must be at least 1"):
        PlanCache(maxsize=0)


def test_a_repeated_call_skips_the_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = {"validate_inputs": 0, "constraint": 0}

    def counting(name: str, fn: Any) -> Any:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(flash_fwd_kernel, "validate_inputs",
                        counting("validate_inputs", flash_fwd_kernel.validate_inputs))
    monkeypatch.setattr(TEMPLATE, "constraint", counting("constraint", TEMPLATE.constraint))
    q, k, v = qkv()
    first = flash_attention_fwd(q, k, v, causal=True, config=SMALL)
    assert calls == {"validate_inputs": 1, "constraint": 1}
    q2, k2, v2 = qkv(seed=1)  # other tensors, other values, same layout: a hit
    second = flash_attention_fwd(q2, k2, v2, causal=True, config=SMALL)
    assert calls == {"validate_inputs": 1, "constraint": 1}
    assert not torch.equal(first[0], second[0])
    check(q2, k2, v2, causal=True, config=SMALL)  # the hit computed q2's attention
    # The same config as a mapping is the same plan.
    flash_attention_fwd(q, k, v, causal=True, config=SMALL.to_dict())
    assert calls["constraint"] == 1 and len(flash_fwd._PLANS) == 1


# ----------------------------------------------------------------------------- never stale
def test_same_shape_other_strides_dtype_or_causal_get_their_own_plans() -> None:
    q, k, v = qkv((1, 2, 24, 16), n_kv=40)
    check(q, k, v, config=SMALL)
    # (B, N, H, D) memory seen as (B, H, N, D): same shapes, other strides.
    qt, kt, vt = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    assert qt.shape == q.shape and qt.stride() != q.stride()
    check(qt, kt, vt, config=SMALL)
    check(q.float(), k.float(), v.float(), config=SMALL)
    for causal in (True, "top_left", "bottom_right", "none"):
        check(q, k, v, causal=causal, config=SMALL)
    check(q, k, v, scale=0.3, config=SMALL)
    check(q, k, v, config=None)
    # 9 keys: False and "none" (True and "top_left") differ as keys, not as plans.
    assert len(flash_fwd._PLANS) == 9


def test_errors_are_raised_after_a_similar_call_succeeded() -> None:
    q, k, v = qkv()
    flash_attention_fwd(q, k, v, causal=True, scale=1.0, config=SMALL)
    with pytest.raises(ValueError, match="causal must be a bool or one of"):
        flash_attention_fwd(q, k, v, causal=1, scale=1.0, config=SMALL)  # 1 == True
    with pytest.raises(ValueError, match="scale must be a finite number"):
        flash_attention_fwd(q, k, v, causal=True, scale=True, config=SMALL)  # True == 1.0
    flash_attention_fwd(q, k, v, config={"use_tma": True, "BLOCK_M": 16, "BLOCK_N": 16})
    with pytest.raises(ValueError, match="use_tma must be one of"):
        flash_attention_fwd(q, k, v, config={"use_tma": 1, "BLOCK_M": 16, "BLOCK_N": 16})
    with pytest.raises(ValueError, match="longest_first only reorders causal"):
        flash_attention_fwd(q, k, v, config=FwdConfig(BLOCK_M=16, BLOCK_N=16,
                                                      longest_first=True))
    with pytest.raises(TypeError, match="share one dtype"):
        flash_attention_fwd(q, k.float(), v, causal=True, scale=1.0, config=SMALL)
    with pytest.raises(ValueError, match="k and v must have the same shape"):
        flash_attention_fwd(q, k, v[:, :, :-1], causal=True, scale=1.0, config=SMALL)
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        flash_attention_fwd(q.tolist(), k, v, causal=True, scale=1.0, config=SMALL)  # type: ignore[arg-type]


def test_tma_plans_follow_the_layout_and_the_alignment() -> None:
    q, k, v = qkv((1, 2, 24, 32))
    check(q, k, v, config=TMA)
    q2, k2, v2 = qkv((1, 2, 24, 32), seed=1)
    check(q2, k2, v2, config=TMA)  # rebuilt descriptors point at the new tensors
    # Same shapes and strides, q two bytes off a 16-byte boundary.
    shifted = torch.empty(q.numel() + 1, dtype=q.dtype, device=q.device)[1:].view(q.shape)
    shifted.copy_(q)
    assert shifted.stride() == q.stride() and shifted.data_ptr() % 16
    with pytest.raises(ValueError, match="16-byte aligned address.*use_tma=False"):
        flash_attention_fwd(shifted, k, v, config=TMA)
    check(shifted, k, v, config=dict(TMA.to_dict(), use_tma=False))  # pointer loads take it
    # Rows of 36 halves (72 bytes) as k/v: slices of a wider tensor, strides TMA cannot take.
    wide = torch.randn(1, 2, 24, 36, dtype=q.dtype, device=q.device)
    with pytest.raises(ValueError, match="multiple of 16 bytes.*use_tma=False"):
        flash_attention_fwd(q, wide[..., :32], wide[..., 4:], config=TMA)
    check(q, wide[..., :32], wide[..., 4:], config=dict(TMA.to_dict(), use_tma=False))


def test_a_plan_keeps_no_tensor_of_its_first_call_alive() -> None:
    q, k, v = qkv((1, 2, 24, 32))
    flash_attention_fwd(q, k, v, config=TMA)
    ref = weakref.ref(q)
    del q
    gc.collect()
    assert ref() is None


def test_masks_of_another_kind_or_geometry_get_their_own_plans() -> None:
    q, k, v = qkv((1, 2, 64, 16), n_kv=64)
    gen = torch.Generator().manual_seed(0)
    allowed = (torch.rand(1, 2, 64, 64, generator=gen) < 0.7).to(DEVICE)
    check(q, k, v, attn_mask=allowed, mask=allowed, config=SMALL)
    bias = torch.randn(64, 64, generator=gen).to(DEVICE)
    check(q, k, v, attn_mask=bias.half(), mask=bias.half(), config=SMALL)  # float: added
    check(q, k, v, attn_mask=bias.half()[:1], mask=bias.half()[:1], config=SMALL)
    with pytest.raises(ValueError, match="does not broadcast"):
        flash_attention_fwd(q, k, v, attn_mask=bias.half()[:3], config=SMALL)
    with pytest.raises(TypeError, match="attn_mask must be bool"):
        flash_attention_fwd(q, k, v, attn_mask=bias.double(), config=SMALL)

    blocks = (torch.rand(1, 1, 64, 64, generator=gen) < 0.5).to(DEVICE)
    tile = FwdConfig(BLOCK_M=32, BLOCK_N=32, num_warps=4, num_stages=1)
    check(q, k, v, block_mask=BlockMask.from_dense(blocks, 64), mask=blocks, config=tile)
    check(q, k, v, block_mask=BlockMask.from_dense(blocks, 32), mask=blocks, config=tile)
    with pytest.raises(ValueError, match="must divide the block mask's block size"):
        flash_attention_fwd(q, k, v, block_mask=BlockMask.from_dense(blocks, 16), config=tile)
    with pytest.raises(ValueError, match="block_mask is for"):
        flash_attention_fwd(q[:, :, :32], k, v, block_mask=BlockMask.from_dense(blocks, 32),
                            config=tile)
