"""``tuner.attention``: a drop-in for ``torch.nn.functional.scaled_dot_product_attention``
that runs the project's Triton kernel with the config tuned for this GPU and problem.

    import tuner
    out = tuner.attention(q, k, v, is_causal=True, enable_gqa=True)

Semantics follow SDPA: ``q`` (..., H_q, L, E), ``k`` (..., H_kv, S, E), ``v`` (..., H_kv, S, E)
with equal leading batch dims; ``is_causal`` masks top-left (query i sees keys j <= i);
``scale`` defaults to 1/sqrt(E); H_q != H_kv only with ``enable_gqa=True`` and H_q a multiple
of H_kv. ``attn_mask`` (bool, True = attend, or float added to the scores) and ``block_mask``
(a ``tuner.BlockMask``: only its blocks are computed) run the masked kernels, both ways, and
eagerly under ``torch.compile``; a row that sees no key gives zeros (SDPA gives NaN). Not (yet)
supported, each raising ``NotImplementedError`` rather than silently running a slow path:
a gradient for a float ``attn_mask`` itself, ``dropout_p > 0``, and a value head dim different
from the query's.

How a call runs:

* eager, no grad needed: a per-shape plan (validated shapes, resolved config) from a dict,
  then the kernel; the first call of a shape resolves its config through ``tuner.lookup``
  (cache -> local database -> service -> default). This is the hot path: keep it tiny.
* under ``torch.compile``, or when an input requires grad: through the custom op
  ``tuner::attention_fwd`` (``torch.library``), which Dynamo keeps in the graph (a fake impl
  gives output shapes) and whose backward is the op ``tuner::attention_bwd``.

The backward runs the ``flash_bwd`` template (from the forward's o and logsumexp) with its
config resolved like the forward's. The op's logsumexp output is not differentiable.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

# Imported now, not at the first call: without CUDA it sets TRITON_INTERPRET before anything
# imports triton. The custom op's first call imports torch._dynamo, which imports triton; were
# that first, triton.language's own jit helpers (tl.zeros, ...) would be compiled-mode objects
# and every interpreted launch would fail.
import templates  # noqa: F401

if TYPE_CHECKING:
    from tuner.lookup import Resolved

__all__ = ["attention", "clear_plans", "plan_for"]

TEMPLATE_NAME = "flash_fwd"
BACKWARD_TEMPLATE_NAME = "flash_bwd"
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Plans are per exact shape; a decode loop makes one per step. Past this many, start over
# (rebuilding a plan is cheap once its shape bucket's config is cached by the resolver).
MAX_PLANS = 4096


# ----------------------------------------------------------------------------- public entry
def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
              is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False,
              *, block_mask: object | None = None) -> torch.Tensor:
    """Scaled dot-product attention with the tuned Triton kernel (see the module docstring)."""
    if dropout_p != 0.0:
        raise NotImplementedError(f"tuner.attention has no dropout: dropout_p must be 0.0, "
                                  f"but got {dropout_p}")
    if attn_mask is not None or block_mask is not None:
        return _masked_attention(query, key, value, attn_mask, is_causal, scale, enable_gqa,
                                 block_mask)
    if torch.compiler.is_compiling() or (torch.is_grad_enabled() and (
            query.requires_grad or key.requires_grad or value.requires_grad)):
        check_inputs(query, key, value, enable_gqa)  # errors at trace time, not in the op
        return torch.ops.tuner.attention_fwd(query, key, value, is_causal, scale, enable_gqa)[0]
    return _forward(query, key, value, is_causal, scale, enable_gqa)[0]


def plan_for(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *,
             is_causal: bool = False, enable_gqa: bool = False) -> Resolved:
    """Which config ``attention`` runs for these inputs, and where it came from."""
    return _resolve(query, key, value, is_causal, enable_gqa)


def clear_plans() -> None:
    """Forget every per-shape plan and every resolved config (e.g. after a new sweep)."""
    from tuner.lookup import get_resolver

    _PLANS.clear()
    _BWD_CONFIGS.clear()
    get_resolver().clear()


# ----------------------------------------------------------------------------- checks
def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, enable_gqa: bool) -> None:
    """SDPA's rules for shapes, dtypes and devices, plus what the kernel cannot do."""
    for name, t in (("query", q), ("key", k), ("value", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, but got {type(t).__name__}")
        if t.dtype not in _DTYPES:
            raise TypeError(f"{name} must be float16, bfloat16 or float32, but got {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"query, key and value must share one dtype, but got {q.dtype}, "
                        f"{k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"query, key and value must be on one device, but got {q.device}, "
                         f"{k.device}, {v.device}")
    if q.dim() < 2 or not (q.dim() == k.dim() == v.dim()):
        raise ValueError(f"query, key and value must have the same number (>= 2) of dims, "
                         f"but got shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"query and key must have the same embedding dim E, but got "
                         f"{q.shape[-1]} and {k.shape[-1]}")
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(f"key and value must have the same sequence length S, but got "
                         f"{k.shape[-2]} and {v.shape[-2]}")
    if v.shape[-1] != q.shape[-1]:
        raise NotImplementedError(f"the flash_fwd kernel needs value's head dim equal to "
                                  f"query's, but got {v.shape[-1]} and {q.shape[-1]}")
    if q.dim() >= 3:
        if not (q.shape[:-3] == k.shape[:-3] == v.shape[:-3]):
            raise ValueError(f"query, key and value must have the same batch dims, but got "
                             f"{tuple(q.shape[:-3])}, {tuple(k.shape[:-3])}, "
                             f"{tuple(v.shape[:-3])} (broadcasting is not supported)")
        hq, hk, hv = q.shape[-3], k.shape[-3], v.shape[-3]
        if hk != hv:
            raise ValueError(f"key and value must have the same number of heads, but got "
                             f"{hk} and {hv}")
        if enable_gqa:
            if hq % hk:
                raise ValueError(f"with enable_gqa=True the query heads ({hq}) must be a "
                                 f"multiple of the key/value heads ({hk})")
        elif hq != hk:
            raise ValueError(f"query has {hq} heads and key/value {hk}: pass enable_gqa=True "
                             f"for grouped-query attention (as with torch SDPA)")
    if q.numel() == 0 or k.numel() == 0:
        raise ValueError(f"query and key must not be empty, but got shapes {tuple(q.shape)} "
                         f"and {tuple(k.shape)}")


# ----------------------------------------------------------------------------- plans
@dataclass(frozen=True, slots=True)
class _Plan:
    run: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    resolved: Resolved
    expires_at: float


_PLANS: dict[tuple[object, ...], _Plan] = {}
_now = time.monotonic


def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
             scale: float | None, enable_gqa: bool) -> tuple[torch.Tensor, torch.Tensor]:
    # The hot path: one tuple, one dict lookup, one clock read, then the kernel's launch plan.
    # The key holds all that flash_fwd's launch plan depends on (strides, 16-byte alignment,
    # scale, and its class: 1 is refused, True too, 1.0 accepted), so the plan calls the launch
    # directly; going through flash_attention_fwd's own key and lookup cost 2.3 us per call
    # more on the dev VM's CPU (benchmarks/attention_overhead.py).
    key = (q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, k.dtype,
           v.dtype, q.device, k.device, v.device,
           (q.data_ptr() | k.data_ptr() | v.data_ptr()) % 16, is_causal, enable_gqa,
           scale.__class__, scale)
    plan = _PLANS.get(key)
    if plan is None or plan.expires_at <= _now():
        plan = _plan(q, k, v, is_causal, enable_gqa, scale, key)
    return plan.run(q, k, v)


def _shapes_4d(q: torch.Tensor, k: torch.Tensor
               ) -> tuple[tuple[int, int, int, int], tuple[int, int, int, int]]:
    """The (B, H_q, L, E) and (B, H_kv, S, E) the kernels see of checked inputs with any
    number of leading dims (folded into B; 2-D inputs are one head)."""
    batch = math.prod(q.shape[:-3])
    heads_q, heads_kv = (q.shape[-3], k.shape[-3]) if q.dim() >= 3 else (1, 1)
    return ((batch, heads_q, q.shape[-2], q.shape[-1]),
            (batch, heads_kv, k.shape[-2], k.shape[-1]))


def _resolve_template(template_name: str, q: torch.Tensor, k: torch.Tensor,
                      is_causal: bool) -> Resolved:
    """The config of ``template_name`` for the problem of these (checked) inputs: cache ->
    database -> service -> default."""
    from templates.base import Problem
    from templates.device import current_device
    from templates.flash_fwd import DTYPE_NAMES
    from templates.registry import get_template
    from tuner.lookup import resolve_config

    (batch, heads_q, seqlen_q, head_dim), (_, heads_kv, seqlen_kv, _) = _shapes_4d(q, k)
    problem = Problem(batch=batch, heads_q=heads_q, heads_kv=heads_kv, seqlen_q=seqlen_q,
                      seqlen_kv=seqlen_kv, head_dim=head_dim, dtype=DTYPE_NAMES[q.dtype],
                      causal="top_left" if is_causal else "none")
    device = current_device(q.device.index) if q.is_cuda else current_device()
    return resolve_config(get_template(template_name), problem, device)


def _resolve(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
             enable_gqa: bool) -> Resolved:
    """Check the inputs; the forward config for their problem."""
    check_inputs(q, k, v, enable_gqa)
    from templates.device import interpreter_active

    if q.device.type != "cuda" and not interpreter_active():
        raise ValueError(f"tuner.attention runs on CUDA tensors (or CPU tensors under "
                         f"TRITON_INTERPRET=1), but the inputs are on {q.device}")
    return _resolve_template(TEMPLATE_NAME, q, k, is_causal)


def _plan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
          enable_gqa: bool, scale: float | None, key: tuple[object, ...]) -> _Plan:
    """The resolved config's launch plan for inputs laid out like these, kept under ``key``."""
    from templates import flash_fwd_kernel
    from templates.flash_fwd import FwdConfig, launch_plan

    resolved = _resolve(q, k, v, is_causal, enable_gqa)
    config = resolved.config
    assert isinstance(config, FwdConfig)
    q4, kv4 = _shapes_4d(q, k)
    out_shape, lse_shape = tuple(q.shape), tuple(q.shape[:-1])
    reshape = q.dim() != 4
    # Inputs laid out alike reshape to views laid out alike: one launch plan serves them all.
    if reshape:
        q, k, v = q.reshape(q4), k.reshape(kv4), v.reshape(kv4)
    # A tuned TMA config needs 16-byte aligned strides; other layouts use pointer loads.
    if config.use_tma and flash_fwd_kernel.tma_inputs_problem(q, k, v):
        config = replace(config, use_tma=False)
    launch = launch_plan(q, k, v, causal="top_left" if is_causal else "none", scale=scale,
                         config=config)

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor]:
        if reshape:
            o, lse = launch(q.reshape(q4), k.reshape(kv4), v.reshape(kv4))
            return o.reshape(out_shape), lse.reshape(lse_shape)
        return launch(q, k, v)

    plan = _Plan(run, resolved, resolved.expires_at)
    if len(_PLANS) >= MAX_PLANS:
        _PLANS.clear()
    _PLANS[key] = plan
    return plan


@torch.compiler.disable  # runs eagerly under torch.compile (one graph break per call)
def _masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      attn_mask: torch.Tensor | None, is_causal: bool, scale: float | None,
                      enable_gqa: bool, block_mask: object | None) -> torch.Tensor:
    """attn_mask / block_mask: the dense problem's tuned forward and backward configs, fitted
    to the block mask's tiles, through the masked kernels and ``FlashAttentionFunction``
    (differentiable w.r.t. q, k, v). Not cached per shape: a mask changes every call."""
    from templates import flash_fwd_kernel
    from templates.autograd import flash_attention
    from templates.block_mask import BlockMask
    from templates.flash_bwd import BwdConfig
    from templates.flash_bwd import fit_to_block_mask as fit_bwd_to_block_mask
    from templates.flash_fwd import FwdConfig, fit_to_block_mask

    check_inputs(q, k, v, enable_gqa)
    if block_mask is not None:
        if not isinstance(block_mask, BlockMask):
            raise TypeError(f"block_mask must be a tuner.BlockMask, but got "
                            f"{type(block_mask).__name__}")
        if q.dim() != 4:
            raise ValueError(f"block_mask needs 4-D (B, H, L, E) inputs, but query has shape "
                             f"{tuple(q.shape)}")
    q_shape, kv_shape = _shapes_4d(q, k)
    q4, k4, v4 = q.reshape(q_shape), k.reshape(kv_shape), v.reshape(kv_shape)
    mask4 = None
    if attn_mask is not None:
        if not isinstance(attn_mask, torch.Tensor):
            raise TypeError(f"attn_mask must be a torch.Tensor, but got "
                            f"{type(attn_mask).__name__}")
        full = (*q.shape[:-1], k.shape[-2])
        try:
            mask4 = attn_mask.expand(full) if q.dim() == 4 else (
                attn_mask.expand(full).reshape(q4.shape[:-1] + (k.shape[-2],)))
        except RuntimeError:
            raise ValueError(f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast "
                             f"to {full}") from None
    config = _resolve(q, k, v, is_causal, enable_gqa).config
    assert isinstance(config, FwdConfig)
    needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad
                                              or v.requires_grad)
    bwd_config = _backward_config(q, k, is_causal) if needs_grad else None
    assert bwd_config is None or isinstance(bwd_config, BwdConfig)
    if block_mask is not None:
        config = fit_to_block_mask(config, block_mask.block_size)
        if bwd_config is not None:
            bwd_config = fit_bwd_to_block_mask(bwd_config, block_mask.block_size)
    if config.use_tma and flash_fwd_kernel.tma_inputs_problem(q4, k4, v4):
        config = replace(config, use_tma=False)
    o = flash_attention(q4, k4, v4, causal="top_left" if is_causal else "none",
                        attn_mask=mask4, block_mask=block_mask, scale=scale,
                        fwd_config=config, bwd_config=bwd_config)
    return o.reshape(q.shape)


# ----------------------------------------------------------------------------- torch.library
@torch.library.custom_op("tuner::attention_fwd", mutates_args=())
def _attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
                   scale: float | None, enable_gqa: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, lse): o like q (value's head dim), lse (..., H_q, L) float32 natural log."""
    return _forward(q, k, v, is_causal, scale, enable_gqa)


@_attention_fwd.register_fake
def _attention_fwd_fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
                        scale: float | None, enable_gqa: bool
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    return (q.new_empty((*q.shape[:-1], v.shape[-1])),
            q.new_empty(q.shape[:-1], dtype=torch.float32))


@torch.library.custom_op("tuner::attention_bwd", mutates_args=())
def _attention_bwd(grad_o: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   o: torch.Tensor, lse: torch.Tensor, is_causal: bool, scale: float | None,
                   enable_gqa: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) by the flash_bwd kernel from the forward's o and lse."""
    return _kernel_backward(grad_o, q, k, v, o, lse, is_causal, scale)


@_attention_bwd.register_fake
def _attention_bwd_fake(grad_o: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                        v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor, is_causal: bool,
                        scale: float | None, enable_gqa: bool
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx: torch.autograd.function.FunctionCtx, inputs: tuple[object, ...],
                   output: tuple[torch.Tensor, torch.Tensor]) -> None:
    q, k, v, is_causal, scale, enable_gqa = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse)  # type: ignore[arg-type]
    ctx.mark_non_differentiable(lse)  # the kernel computes no lse gradient
    ctx.set_materialize_grads(False)
    ctx.is_causal, ctx.scale, ctx.enable_gqa = is_causal, scale, enable_gqa  # type: ignore[attr-defined]


def _backward(ctx: torch.autograd.function.FunctionCtx, grad_o: torch.Tensor | None,
              grad_lse: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    if grad_o is None:  # o did not reach the loss
        return None, None, None, None, None, None
    q, k, v, o, lse = ctx.saved_tensors  # type: ignore[attr-defined]
    dq, dk, dv = torch.ops.tuner.attention_bwd(grad_o, q, k, v, o, lse,
                                               ctx.is_causal, ctx.scale,  # type: ignore[attr-defined]
                                               ctx.enable_gqa)  # type: ignore[attr-defined]
    return dq, dk, dv, None, None, None


_attention_fwd.register_autograd(_backward, setup_context=_setup_context)


_BWD_CONFIGS: dict[tuple[object, ...], tuple[object, float]] = {}


def _kernel_backward(grad_o: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     o: torch.Tensor, lse: torch.Tensor, is_causal: bool, scale: float | None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from templates.flash_bwd import flash_attention_bwd

    q4, kv4 = _shapes_4d(q, k)
    dq, dk, dv = flash_attention_bwd(
        grad_o.reshape(q4), q.reshape(q4), k.reshape(kv4), v.reshape(kv4), o.reshape(q4),
        lse.reshape(q4[:-1]), causal="top_left" if is_causal else "none", scale=scale,
        config=_backward_config(q, k, is_causal))  # type: ignore[arg-type]
    return dq.reshape(q.shape), dk.reshape(k.shape), dv.reshape(v.shape)


def _backward_config(q: torch.Tensor, k: torch.Tensor, is_causal: bool) -> object:
    """The flash_bwd config for this problem (cache -> database -> service -> default),
    remembered per shape until the resolver's answer expires."""
    key = (q.shape, k.shape, q.dtype, q.device, is_causal)
    hit = _BWD_CONFIGS.get(key)
    if hit is not None and hit[1] > _now():
        return hit[0]
    resolved = _resolve_template(BACKWARD_TEMPLATE_NAME, q, k, is_causal)
    if len(_BWD_CONFIGS) >= MAX_PLANS:
        _BWD_CONFIGS.clear()
    _BWD_CONFIGS[key] = (resolved.config, resolved.expires_at)
    return resolved.config
