"""``tuner.decode``: attention of a few new tokens against a KV cache, with the flash_decode
config tuned for this GPU and problem.

    o = tuner.decode(q, k_cache, v_cache, cache_seqlens=lengths)               # contiguous
    o = tuner.decode(q, k_pool, v_pool, cache_seqlens=lengths, block_table=t)  # paged

Layouts and semantics are ``templates.flash_decode``'s (q (B, H_q, N_q, D) with N_q <= 16, the
new tokens already in the cache, bottom-right causal among them). The config resolves as
``tuner.attention``'s do (cache -> local database -> service -> default), once per shape
bucket; the checks of shapes, dtypes and devices run once per layout, and the lengths and pages
are not read back from the GPU (no device-to-host sync on this path, so a decode step can be
captured in a CUDA graph): they must be valid, as ``templates.flash_decode`` documents.
"""

from __future__ import annotations

import time

import torch

from templates.device import cpu_device, current_device
from templates.flash_decode import TEMPLATE, FlashDecodeConfig, launch_with_config, problem_of
from templates.flash_decode_kernel import DecodeShape, check_decode_inputs
from tuner.lookup import Resolved, resolve_config
from tuner.record import note, recording

__all__ = ["decode", "decode_plan_for"]

MAX_PLANS = 4096
_PLANS: dict[tuple[object, ...], tuple[DecodeShape, Resolved]] = {}


def decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *,
           cache_seqlens: torch.Tensor, block_table: torch.Tensor | None = None,
           scale: float | None = None) -> torch.Tensor:
    """o (B, H_q, N_q, D) in q's dtype: the new tokens' attention over their caches."""
    key = (q.shape, k_cache.shape, v_cache.shape, q.stride(), k_cache.stride(),
           v_cache.stride(), q.dtype, k_cache.dtype, v_cache.dtype, q.device, k_cache.device,
           v_cache.device, cache_seqlens.shape, cache_seqlens.dtype, cache_seqlens.device,
           None if block_table is None else (block_table.shape, block_table.dtype,
                                             block_table.device))
    plan = _PLANS.get(key)
    if plan is None or plan[1].expires_at <= time.monotonic():
        plan = _plan(q, k_cache, v_cache, cache_seqlens, block_table, key)
    shape, resolved = plan
    config = resolved.config
    assert isinstance(config, FlashDecodeConfig)
    return launch_with_config(q, k_cache, v_cache, cache_seqlens, block_table, scale, shape,
                              config)[0]


def decode_plan_for(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *,
                    cache_seqlens: torch.Tensor,
                    block_table: torch.Tensor | None = None) -> Resolved:
    """The flash_decode config ``decode`` runs for these inputs, and where it came from."""
    shape = check_decode_inputs(q, k_cache, v_cache, cache_seqlens, block_table,
                                check_contents=False)
    return _resolve(q, shape)


def clear_decode_plans() -> None:
    _PLANS.clear()


def _resolve(q: torch.Tensor, shape: DecodeShape) -> Resolved:
    device = current_device(q.device.index) if q.is_cuda else cpu_device()
    return resolve_config(TEMPLATE, problem_of(q, shape), device)


def _plan(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
          cache_seqlens: torch.Tensor, block_table: torch.Tensor | None,
          key: tuple[object, ...]) -> tuple[DecodeShape, Resolved]:
    shape = check_decode_inputs(q, k_cache, v_cache, cache_seqlens, block_table,
                                check_contents=False)
    plan = (shape, _resolve(q, shape))
    if recording():
        note(problem_of(q, shape), [TEMPLATE.name])
    if len(_PLANS) >= MAX_PLANS:
        _PLANS.clear()
    _PLANS[key] = plan
    return plan
