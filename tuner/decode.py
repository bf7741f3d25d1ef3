"""``tuner.decode``: attention of a few new tokens against a KV cache, with the flash_decode
config tuned for this GPU and problem.

    o = tuner.decode(q, k_cache, v_cache, cache_seqlens=lengths)               # contiguous
    o = tuner.decode(q, k_pool, v_pool, cache_seqlens=lengths, block_table=t)  # paged

Layouts and semantics are ``templates.decode.template``'s (q (B, H_q, N_q, D) with N_q <= 16, the
new tokens already in the cache, bottom-right causal among them). The config resolves as
``tuner.attention``'s do (cache -> local database -> service -> default), once per shape
bucket; the checks of shapes, dtypes and devices run once per layout, and the lengths and pages
are not read back from the GPU (no device-to-host sync on this path, so a decode step can be
captured in a CUDA graph): they must be valid, as ``templates.decode.template`` documents.
Under ``torch.compile`` a call is traced as the custom op ``tuner::decode``, which runs this
same path from the compiled graph.
"""

from __future__ import annotations

import time

import torch

from templates.decode.kernel import DecodeShape, check_decode_inputs
from templates.decode.template import TEMPLATE, FlashDecodeConfig, kept_launch, problem_of
from templates.device import cpu_device, current_device
from tuner.dispatch.plans import PLANS, Plan, keep_plan
from tuner.lookup.resolver import Resolved, keep_config, resolve_config
from tuner.record import note, recording

__all__ = ["decode", "decode_plan_for"]



def decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *,
           cache_seqlens: torch.Tensor, block_table: torch.Tensor | None = None,
           scale: float | None = None) -> torch.Tensor:
    """o (B, H_q, N_q, D) in q's dtype: the new tokens' attention over their caches."""
    if torch.compiler.is_compiling():  # traced as one op (Dynamo keeps it in the graph)
        return torch.ops.tuner.decode(q, k_cache, v_cache, cache_seqlens, block_table, scale)
    return _decode(q, k_cache, v_cache, cache_seqlens, block_table, scale)


def _decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            cache_seqlens: torch.Tensor, block_table: torch.Tensor | None,
            scale: float | None) -> torch.Tensor:
    # Everything the checks and the kept launch read: shapes, strides, dtypes, devices and
    # (for the kernels' specialization) 16-byte pointer alignment, as each pointer's offset
    # from a 16-byte boundary (written out: alignment_key's generator took 0.7 us per call on
    # a dev machine, a third of this key).
    table = None if block_table is None else (block_table.shape, block_table.stride(),
                                              block_table.dtype, block_table.device,
                                              block_table.data_ptr() % 16 == 0)
    key = ("decode", q.shape, k_cache.shape, q.stride(), k_cache.stride(), v_cache.stride(), q.dtype,
           k_cache.dtype, v_cache.dtype, q.device, k_cache.device, v_cache.device,
           v_cache.shape, cache_seqlens.shape, cache_seqlens.stride(), cache_seqlens.dtype,
           cache_seqlens.device, table, q.data_ptr() % 16, k_cache.data_ptr() % 16,
           v_cache.data_ptr() % 16, cache_seqlens.data_ptr() % 16)
    plan = PLANS.get(key)  # the one plan cache (tuner.dispatch.plans), mode "decode"
    if plan is None or plan.expires_at <= time.monotonic():
        plan = _plan(q, k_cache, v_cache, cache_seqlens, block_table, key)
    return plan.run(q, k_cache, v_cache, cache_seqlens, block_table, scale)  # type: ignore[misc, return-value]


@torch.library.custom_op("tuner::decode", mutates_args=())
def _decode_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               cache_seqlens: torch.Tensor, block_table: torch.Tensor | None,
               scale: float | None) -> torch.Tensor:
    """``decode`` under torch.compile: the eager path, run from the compiled graph."""
    return _decode(q, k_cache, v_cache, cache_seqlens, block_table, scale)


@_decode_op.register_fake
def _decode_fake(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 cache_seqlens: torch.Tensor, block_table: torch.Tensor | None,
                 scale: float | None) -> torch.Tensor:
    return q.new_empty(q.shape)  # contiguous, as the kernel writes it


def decode_plan_for(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *,
                    cache_seqlens: torch.Tensor,
                    block_table: torch.Tensor | None = None) -> Resolved:
    """The flash_decode config ``decode`` runs for these inputs, and where it came from."""
    shape = check_decode_inputs(q, k_cache, v_cache, cache_seqlens, block_table,
                                check_contents=False)
    return _resolve(q, shape)


def _resolve(q: torch.Tensor, shape: DecodeShape) -> Resolved:
    device = current_device(q.device.index) if q.is_cuda else cpu_device()
    return resolve_config(TEMPLATE, problem_of(q, shape), device)


def _plan(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
          cache_seqlens: torch.Tensor, block_table: torch.Tensor | None,
          key: tuple[object, ...]) -> Plan:
    shape = check_decode_inputs(q, k_cache, v_cache, cache_seqlens, block_table,
                                check_contents=False)
    resolved = keep_config(_resolve(q, shape))  # it runs: kept for the process
    config = resolved.config
    assert isinstance(config, FlashDecodeConfig)
    run = kept_launch(q, k_cache, v_cache, cache_seqlens, block_table, shape, config)
    if recording():
        note(problem_of(q, shape), [TEMPLATE.name])
    return keep_plan(key, Plan(run, resolved, resolved.expires_at))
