"""``tuner.attention``: a drop-in for ``torch.nn.functional.scaled_dot_product_attention``
that runs, for each call, the fastest implementation measured on this GPU for its problem.

    import tuner
    out = tuner.attention(q, k, v, is_causal=True, enable_gqa=True)

Semantics follow SDPA: ``q`` (..., H_q, L, E), ``k`` (..., H_kv, S, E), ``v`` (..., H_kv, S, Ev)
with equal leading batch dims; ``is_causal`` masks top-left (query i sees keys j <= i);
``scale`` defaults to 1/sqrt(E); H_q != H_kv only with ``enable_gqa=True`` and H_q a multiple
of H_kv; ``attn_mask`` with ``is_causal=True`` does what this torch's SDPA does with them
(combines them, or raises, depending on the torch version): it runs torch SDPA.

Which implementation runs is ``tuner.dispatch``'s choice (docs/DISPATCH.md): torch SDPA (its
best measured backend), our Triton flash kernels, the split-KV decode kernel for one query
token against a long KV, or on Hopper the Gluon forward (paired, for a gradient, with cuDNN's
backward). Nothing but a stored measurement on this device makes ours run (of
the problem's bucket, or of a neighbouring bucket where torch SDPA was measured too): an
unmeasured problem runs torch SDPA exactly as the user's code would have. Calls no kernel of
ours takes (``dropout_p > 0``, a value head dim other than the query's, float64) and calls
with an elementwise ``attn_mask`` (no measurement can price an arbitrary mask) run torch SDPA
too; ``use_implementation("flash")`` forces ours where it can run (masks included).
``block_mask`` (a ``tuner.BlockMask``) runs our block-sparse kernels, compiled FlexAttention
or, on Hopper without a gradient, the Gluon forward: only its blocks are computed, which SDPA
cannot do; rows that see no key give zeros. Flex and Gluon run only where measured faster on
the mask's named problem (``BlockMask.pattern``; docs/DISPATCH.md, "Block masks").

How a call runs:

* eager, no grad needed: a per-layout plan (checked shapes, the choice, a launch function)
  from a dict, then its launch. This is the hot path: keep it tiny.
* a gradient needed: the choice per layout; torch SDPA is called as such (torch's autograd),
  flash through the custom op ``tuner::attention_fwd`` (``torch.library``), whose backward is
  the op ``tuner::attention_bwd`` running the ``flash_bwd`` template; gluon through
  ``tuner::gluon_attention_fwd``, whose backward is cuDNN's (``tuner::cudnn_attention_bwd``,
  fed the Gluon forward's o and logsumexp: ``templates.cudnn_bwd``).
* under ``torch.compile``: the choice is made at trace time (``assume_constant_result``); SDPA
  is traced as SDPA, ours with a gradient as those custom ops, the forward-only calls (decode,
  gluon without a gradient) as ``tuner::attention_inference`` (custom ops: Dynamo keeps them
  in the graph).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

# Imported now, not at the first call: without CUDA it sets TRITON_INTERPRET before anything
# imports triton. The custom op's first call imports torch._dynamo, which imports triton; were
# that first, triton.language's own jit helpers (tl.zeros, ...) would be compiled-mode objects
# and every interpreted launch would fail.
import templates  # noqa: F401
from templates import gluon_fwd
from templates.base import KernelConfig, Problem
from templates.device import DeviceInfo, cpu_device, current_device, interpreter_active
from templates.flash_fwd import DTYPE_NAMES
from templates.gluon_fwd import GluonFwdConfig
from templates.kernel_common import output_strides
from templates.registry import get_template
from templates.torch_sdpa import SdpaConfig, sdpa
from tuner import implementations
from tuner.decode import clear_decode_plans
from tuner.dispatch import Call, Choice, choose, forced, keep, use_implementation
from tuner.implementations import shapes_4d
from tuner.lookup import Resolved, keep_config, resolve_config

__all__ = ["attention", "clear_plans", "plan_for"]

BACKWARD_TEMPLATE_NAME = "flash_bwd"
# The Gluon implementation's training template: its config runs the Gluon forward of a call
# that needs a gradient (whose backward is cuDNN's, ``templates.cudnn_bwd``).
GLUON_TRAINING_TEMPLATE_NAME = "gluon_cudnn_train"
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Plans are per exact shape; a decode loop makes one per step. Past this many, start over
# (rebuilding a plan is cheap once its shape bucket's config is cached by the resolver).
MAX_PLANS = 4096


# ----------------------------------------------------------------------------- public entry
def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
              is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False,
              *, block_mask: object | None = None) -> torch.Tensor:
    """Scaled dot-product attention by the fastest measured implementation (module docstring)."""
    if attn_mask is None and block_mask is None and dropout_p == 0.0:
        needs_grad = torch.is_grad_enabled() and (
            query.requires_grad or key.requires_grad or value.requires_grad)
        compiling = torch.compiler.is_compiling()
        if not (needs_grad or compiling):  # the hot path: inference, eager
            return _forward(query, key, value, is_causal, scale, enable_gqa)
        if not _kernel_scope(query, key, value):
            return _outside_kernel_scope(query, key, value, None, 0.0, is_causal, scale,
                                         enable_gqa)
        if compiling:
            return _traced(query, key, value, is_causal, scale, enable_gqa, needs_grad)
        choice = keep(_choose(query, key, value, is_causal, enable_gqa, needs_grad=True))
        if choice.implementation.name == "sdpa":
            return _sdpa_with(choice, query, key, value, is_causal, scale, enable_gqa)
        return _training_op(choice.implementation.name)(query, key, value, is_causal, scale,
                                                        enable_gqa)[0]
    if block_mask is not None:
        if attn_mask is not None:
            raise ValueError("pass attn_mask or block_mask, not both")
        return _masked_attention(query, key, value, None, is_causal, scale, enable_gqa,
                                 block_mask)
    return _outside_kernel_scope(query, key, value, attn_mask, dropout_p, is_causal, scale,
                                 enable_gqa)


def plan_for(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *,
             is_causal: bool = False, enable_gqa: bool = False,
             needs_grad: bool = False) -> Choice:
    """Which implementation and config ``attention`` runs for these inputs, and why."""
    return _choose(query, key, value, is_causal, enable_gqa, needs_grad)


def clear_plans() -> None:
    """Forget every per-shape plan and every resolved config (e.g. after a new sweep)."""
    from tuner.lookup import get_resolver

    _PLANS.clear()
    _FLASH_PLANS.clear()
    _GLUON_TRAIN_PLANS.clear()
    _BWD_CONFIGS.clear()
    clear_decode_plans()
    get_resolver().clear()


# ----------------------------------------------------------------------------- checks
def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, enable_gqa: bool) -> None:
    """SDPA's rules for shapes, dtypes and devices, with messages that say what to change."""
    for name, t in (("query", q), ("key", k), ("value", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, but got {type(t).__name__}")
        if not t.dtype.is_floating_point:
            raise TypeError(f"{name} must be a floating-point tensor, but got {t.dtype}")
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


def _kernel_scope(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether any kernel of ours could take these inputs (if not, torch SDPA runs them):
    float16/bfloat16/float32, and a value head dim equal to the query's."""
    return (isinstance(q, torch.Tensor) and isinstance(v, torch.Tensor)
            and q.dtype in _DTYPES and q.shape[-1:] == v.shape[-1:])


def _outside_kernel_scope(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          attn_mask: torch.Tensor | None, dropout_p: float, is_causal: bool,
                          scale: float | None, enable_gqa: bool) -> torch.Tensor:
    """Dropout, an elementwise mask, or inputs no kernel of ours takes: torch SDPA, as the
    user's code ran it; forced to ``flash``, our masked kernels (or an error saying why not)."""
    if forced() != "flash":
        check_inputs(q, k, v, enable_gqa)
        return sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                    scale=scale, enable_gqa=enable_gqa)
    if dropout_p != 0.0:
        raise NotImplementedError(f"the flash kernels have no dropout: dropout_p must be 0.0, "
                                  f"but got {dropout_p}")
    if not _kernel_scope(q, k, v):
        check_inputs(q, k, v, enable_gqa)
        raise NotImplementedError(f"the flash kernels take float16, bfloat16 or float32 with the "
                                  f"value head dim equal to the query's, but got {q.dtype}, "
                                  f"query head dim {q.shape[-1]}, value head dim {v.shape[-1]}")
    return _masked_attention(q, k, v, attn_mask, is_causal, scale, enable_gqa, None)


# ----------------------------------------------------------------------------- choices
def _call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
          enable_gqa: bool, needs_grad: bool) -> Call:
    """Check the inputs; the problem they pose, on their device."""
    check_inputs(q, k, v, enable_gqa)
    # CPU tensors run on the CPU also in a process with a GPU: there only torch SDPA (and,
    # under the interpreter, our kernels) can take them, whatever is stored for the GPU.
    device = current_device(q.device.index) if q.is_cuda else cpu_device()
    return _call_of(tuple(q.shape), tuple(k.shape), q.dtype, is_causal, needs_grad, device)


def _call_of(shape_q: tuple[int, ...], shape_k: tuple[int, ...], dtype: torch.dtype,
             is_causal: bool, needs_grad: bool, device: DeviceInfo) -> Call:
    batch = math.prod(shape_q[:-3])
    heads_q, heads_kv = (shape_q[-3], shape_k[-3]) if len(shape_q) >= 3 else (1, 1)
    problem = Problem(batch=batch, heads_q=heads_q, heads_kv=heads_kv, seqlen_q=shape_q[-2],
                      seqlen_kv=shape_k[-2], head_dim=shape_q[-1], dtype=DTYPE_NAMES[dtype],
                      causal="top_left" if is_causal else "none")
    return Call(problem, needs_grad, device)


def _choose(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
            enable_gqa: bool, needs_grad: bool) -> Choice:
    return choose(_call(q, k, v, is_causal, enable_gqa, needs_grad))


def _sdpa_with(choice: Choice, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               is_causal: bool, scale: float | None, enable_gqa: bool) -> torch.Tensor:
    backend = implementations.sdpa_backend(choice, q, k, v, is_causal, scale, enable_gqa)
    return sdpa(q, k, v, backend=backend, is_causal=is_causal, scale=scale,
                enable_gqa=enable_gqa)


@torch.compiler.assume_constant_result
def _traced_choice(shape_q: str, shape_k: str, dtype: str, device: str, is_causal: bool,
                   needs_grad: bool) -> str:
    """Under torch.compile: the chosen implementation (and SDPA backend), fixed at trace time
    as a constant; arguments are scalars and strings, as Dynamo requires."""
    dev = torch.device(device)
    info = current_device(dev.index) if dev.type == "cuda" else cpu_device()
    choice = keep(choose(_call_of(tuple(int(n) for n in shape_q.split(",")),
                                  tuple(int(n) for n in shape_k.split(",")),
                                  getattr(torch, dtype), is_causal, needs_grad, info)))
    config = choice.config
    return (f"sdpa:{config.backend}" if isinstance(config, SdpaConfig)
            else choice.implementation.name)


def _traced(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
            scale: float | None, enable_gqa: bool, needs_grad: bool) -> torch.Tensor:
    check_inputs(q, k, v, enable_gqa)  # errors at trace time, not in the op
    name = _traced_choice(",".join(str(n) for n in q.shape), ",".join(str(n) for n in k.shape),
                          str(q.dtype).removeprefix("torch."), str(q.device), is_causal,
                          needs_grad)
    if name == "flash" or (needs_grad and name == implementations.GLUON.name):
        # ours with a backward runs as a custom op with autograd, which Dynamo keeps in the graph
        return _training_op(name)(q, k, v, is_causal, scale, enable_gqa)[0]
    if not name.startswith("sdpa:"):  # decode, gluon: forward-only kernels, chosen without grad
        return torch.ops.tuner.attention_inference(q, k, v, is_causal, scale, enable_gqa, name)
    return sdpa(q, k, v, backend=name.removeprefix("sdpa:"), is_causal=is_causal, scale=scale,
                enable_gqa=enable_gqa)


# ----------------------------------------------------------------------------- plans
@dataclass(frozen=True, slots=True)
class _Plan:
    run: Callable[..., object] | None  # None: one run per layout, in ``layouts``
    choice: Choice | Resolved
    expires_at: float
    layouts: dict[tuple[object, ...], Callable[..., object]] | None = None


_PLANS: dict[tuple[object, ...], _Plan] = {}  # inference: the chosen implementation's o
_FLASH_PLANS: dict[tuple[object, ...], _Plan] = {}  # the custom op: flash's (o, lse)
_GLUON_TRAIN_PLANS: dict[tuple[object, ...], _Plan] = {}  # the Gluon training op: (o, lse)
_now = time.monotonic


def _problem_key(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
                 scale: float | None, enable_gqa: bool) -> tuple[object, ...]:
    # All that the choice depends on: shapes, dtypes, devices, scale and its class (1 is
    # refused, True too, 1.0 accepted), and a forced implementation.
    return (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, k.device,
            v.device, is_causal, enable_gqa, scale.__class__, scale, forced())


def _layout_key(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[object, ...]:
    # What a kernel's launch plan depends on beyond the problem: strides, and each pointer's
    # 16-byte alignment (Triton compiles it into the kernel, per argument: q misaligned and k
    # misaligned are two specializations).
    return (q.stride(), k.stride(), v.stride(), q.data_ptr() % 16 == 0,
            k.data_ptr() % 16 == 0, v.data_ptr() % 16 == 0)


def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
             scale: float | None, enable_gqa: bool) -> torch.Tensor:
    # The hot path: one tuple, one dict lookup, one clock read, then the plan's launch (torch
    # SDPA takes any layout; a kernel of ours has a launch plan per layout).
    key = _problem_key(q, k, v, is_causal, scale, enable_gqa)
    plan = _PLANS.get(key)
    if plan is None or plan.expires_at <= _now():
        if not _kernel_scope(q, k, v):  # float64, another value head dim: never kept
            return _outside_kernel_scope(q, k, v, None, 0.0, is_causal, scale, enable_gqa)
        choice = keep(_choose(q, k, v, is_causal, enable_gqa, needs_grad=False))
        impl = choice.implementation
        plan = _keep(_PLANS, key, _Plan(
            impl.build(q, k, v, is_causal, scale, enable_gqa, choice) if impl.layout_free
            else None, choice, choice.expires_at, None if impl.layout_free else {}))
    if plan.run is not None:
        return plan.run(q, k, v)  # type: ignore[return-value]
    assert plan.layouts is not None and isinstance(plan.choice, Choice)
    layout = _layout_key(q, k, v)
    run = plan.layouts.get(layout)
    if run is None:
        run = plan.layouts[layout] = plan.choice.implementation.build(
            q, k, v, is_causal, scale, enable_gqa, plan.choice)
    return run(q, k, v)  # type: ignore[return-value]


def _keep(plans: dict[tuple[object, ...], _Plan], key: tuple[object, ...], plan: _Plan
          ) -> _Plan:
    if len(plans) >= MAX_PLANS:
        plans.clear()
    plans[key] = plan
    return plan


def _resolve_template(template_name: str, q: torch.Tensor, k: torch.Tensor,
                      is_causal: bool) -> Resolved:
    """The config of ``template_name`` (one of our Triton templates) for the problem of these
    inputs, which a kernel is about to run (so kept: ``tuner.lookup.ConfigResolver.keep``)."""
    call = _flash_call(q, k, is_causal)
    return keep_config(resolve_config(get_template(template_name), call.problem, call.device))


def _flash_call(q: torch.Tensor, k: torch.Tensor, is_causal: bool) -> Call:
    """The dense inference call of these inputs, for looking up a flash template's config."""
    if q.device.type != "cuda" and not interpreter_active():
        raise ValueError(f"the flash kernels run on CUDA tensors (or CPU tensors under "
                         f"TRITON_INTERPRET=1), but the inputs are on {q.device}")
    return _call(q, k, k, is_causal, q.shape[-3:-2] != k.shape[-3:-2], needs_grad=False)


def _mask_fallback_config(template_name: str, q: torch.Tensor, k: torch.Tensor,
                          is_causal: bool) -> KernelConfig:
    """The config of ``template_name`` for a masked call that no measurement of its mask
    problem prices: the dense problem's where it is measured (its own bucket), else the
    template's default. A nearest neighbour's config is no proxy here: on the H100 the
    sliding-window training step (8k, 32/8 heads) took 11.8 ms with the flash_bwd config
    tuned for a one-token decode problem (the nearest stored), 5.05 ms with the default."""
    call = _flash_call(q, k, is_causal)
    template = get_template(template_name)
    resolved = resolve_config(template, call.problem, call.device)
    if resolved.match in ("exact", "bucket"):
        return keep_config(resolved).config
    return template.default_config(call.problem, call.device)


def _flash_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
                   scale: float | None, enable_gqa: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, lse) by the flash kernel with its resolved config (the custom op's forward)."""
    key = (*_problem_key(q, k, v, is_causal, scale, enable_gqa), *_layout_key(q, k, v))
    plan = _FLASH_PLANS.get(key)
    if plan is None or plan.expires_at <= _now():
        check_inputs(q, k, v, enable_gqa)
        resolved = _resolve_template("flash_fwd", q, k, is_causal)
        run = implementations.build_flash(q, k, v, is_causal, scale, enable_gqa,
                                          Choice(implementations.FLASH, (resolved,), "op"))
        plan = _keep(_FLASH_PLANS, key, _Plan(run, resolved, resolved.expires_at))
    assert plan.run is not None
    return plan.run(q, k, v)  # type: ignore[return-value]


def _gluon_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
                   scale: float | None, enable_gqa: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, lse) by the Gluon forward with the config its training template
    (``gluon_cudnn_train``) resolves for this problem (the custom op's forward)."""
    key = (*_problem_key(q, k, v, is_causal, scale, enable_gqa), *_layout_key(q, k, v))
    plan = _GLUON_TRAIN_PLANS.get(key)
    if plan is None or plan.expires_at <= _now():
        check_inputs(q, k, v, enable_gqa)
        resolved = _resolve_template(GLUON_TRAINING_TEMPLATE_NAME, q, k, is_causal)
        run = implementations.build_gluon_pair(
            q, k, v, is_causal, scale, enable_gqa,
            Choice(implementations.GLUON, (resolved,), "op"))
        plan = _keep(_GLUON_TRAIN_PLANS, key, _Plan(run, resolved, resolved.expires_at))
    assert plan.run is not None
    return plan.run(q, k, v)  # type: ignore[return-value]


@torch.compiler.disable  # runs eagerly under torch.compile (one graph break per call)
def _masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      attn_mask: torch.Tensor | None, is_causal: bool, scale: float | None,
                      enable_gqa: bool, block_mask: object | None) -> torch.Tensor:
    """attn_mask / block_mask: the dense problem's tuned forward and backward configs, fitted
    to the block mask's tiles, through the masked kernels and ``FlashAttentionFunction``
    (differentiable w.r.t. q, k, v); a block mask may instead run compiled Flex or, without a
    gradient, the Gluon forward (``_block_mask_choice``). Not cached per shape: a mask changes
    every call."""
    from templates import flash_fwd_kernel
    from templates.autograd import flash_attention
    from templates.block_mask import BlockMask
    from templates.flash_bwd import BwdConfig
    from templates.flash_bwd import fit_to_block_mask as fit_bwd_to_block_mask
    from templates.flash_fwd import FwdConfig, check_block_mask, fit_to_block_mask
    from templates.torch_flex import FlexConfig, block_size_problem, flex

    check_inputs(q, k, v, enable_gqa)
    if block_mask is not None:
        if not isinstance(block_mask, BlockMask):
            raise TypeError(f"block_mask must be a tuner.BlockMask, but got "
                            f"{type(block_mask).__name__}")
        if q.dim() != 4:
            raise ValueError(f"block_mask needs 4-D (B, H, L, E) inputs, but query has shape "
                             f"{tuple(q.shape)}")
    q_shape, kv_shape = shapes_4d(q, k)
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
    needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad
                                              or v.requires_grad)
    choice = None
    if block_mask is not None:
        check_block_mask(block_mask, q4, k4)
        choice = _block_mask_choice(q, k, v, is_causal, enable_gqa, needs_grad, block_mask)
        if (choice is not None and choice.implementation.name == "flex"
                and block_size_problem(block_mask) is not None):
            # Flex won the pattern at its sweep's 128-blocks; this mask's smaller blocks are
            # ours alone (the dense problem's configs, fitted to them below).
            choice = None
        if choice is not None and choice.implementation.name == "flex":
            flex_config = choice.config
            assert isinstance(flex_config, FlexConfig)
            return flex(q4, k4, v4, block_mask, causal="top_left" if is_causal else "none",
                        scale=scale, enable_gqa=enable_gqa, config=flex_config).reshape(q.shape)
        if choice is not None and choice.implementation.name == implementations.GLUON.name:
            if needs_grad:
                # Gluon's backward is cuDNN's, which takes no block mask: its training template
                # refuses mask problems, so ``choose`` never picks it for a named mask; forced
                # on a mask without a name, the dense problem's choice is no answer.
                raise ValueError(
                    "use_implementation('gluon') cannot run a block-mask call that needs a "
                    "gradient: the Gluon implementation's backward is cuDNN's, which takes no "
                    "block mask; use 'flash' or 'flex', or call it under torch.no_grad()")
            gluon_config = _gluon_mask_config(choice.config, block_mask.block_size)
            if gluon_config is None:
                # Blocks the Gluon kernel cannot walk (under its 64-row tiles): ours, with the
                # dense problem's configs fitted to them below.
                choice = None
            else:  # k4, v4 keep their H_kv heads: the Gluon kernel groups query heads itself
                o, _ = gluon_fwd.gluon_attention_fwd(
                    q4, k4, v4, causal="top_left" if is_causal else "none", scale=scale,
                    config=gluon_config, block_mask=block_mask)
                return o.reshape(q.shape)
    if choice is not None and all(r.measured for r in choice.resolved):
        # Ours measured on this mask problem: the measured configs (those it was priced by).
        config, bwd_config = choice.resolved[0].config, (
            choice.resolved[1].config if needs_grad else None)
    else:  # the dense problem's tuned configs, fitted to the mask's blocks below
        config = _mask_fallback_config("flash_fwd", q, k, is_causal)
        bwd_config = (_mask_fallback_config(BACKWARD_TEMPLATE_NAME, q, k, is_causal)  # type: ignore[assignment]
                      if needs_grad else None)
    assert isinstance(config, FwdConfig)
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


def _gluon_mask_config(config: KernelConfig, block_size: tuple[int, int]
                       ) -> GluonFwdConfig | None:
    """The Gluon config that runs a block mask of ``block_size``: ``config`` where it walks
    those blocks (one measured on a mask problem walks the sweep's 128-blocks), else fitted to
    them (``gluon_fwd.fit_to_block_mask``: a dense problem's causal config runs longest tiles
    first, which a mask's row order forbids); None where no fitting can."""
    assert isinstance(config, GluonFwdConfig)
    if gluon_fwd.block_mask_reason(config, block_size) is None:
        return config
    try:
        fitted = gluon_fwd.fit_to_block_mask(config, block_size)
    except ValueError:  # blocks under the kernel's 64-row tiles
        return None
    return None if gluon_fwd.block_mask_reason(fitted, block_size) else fitted


def _block_mask_choice(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
                       enable_gqa: bool, needs_grad: bool, block_mask: object) -> Choice | None:
    """Who runs a block-mask call: our block-sparse kernels, compiled FlexAttention or (Hopper,
    no gradient) the Gluon forward, by the stored measurements of the mask's named problem
    (``BlockMask.pattern``: its shapes, causal mode and pattern). None: ours with the dense
    problem's configs, as before Flex was a candidate: a mask with no pattern (no measurement
    can price it), or another implementation than flash, flex or gluon forced.
    ``use_implementation("flex")`` forces Flex; ``"gluon"`` the Gluon forward (on a mask
    without a pattern, with the dense problem's config, fitted to the mask's blocks by
    ``_gluon_mask_config``); forcing ``flash`` on a mask with a pattern runs ours with its
    measurements of that problem where it has some."""
    from templates.block_mask import BlockMask
    from templates.torch_flex import FlexConfig

    assert isinstance(block_mask, BlockMask)
    name = forced()
    if name not in (None, "flex", "flash", implementations.GLUON.name):
        return None
    if block_mask.pattern is None:
        if name == implementations.GLUON.name:  # raises if it cannot run the call
            return keep(choose(_call(q, k, v, is_causal, enable_gqa, needs_grad)))
        if name != "flex":
            return None
        return Choice(implementations.FLEX, (Resolved(FlexConfig(), "default", "default"),),
                      "forced by use_implementation (a mask without a pattern: Flex's "
                      "defaults)")
    call = _call(q, k, v, is_causal, enable_gqa, needs_grad)
    return keep(choose(replace(call, problem=replace(call.problem, mask=block_mask.pattern))))


# ----------------------------------------------------------------------------- torch.library
def _op_output_strides(q: torch.Tensor, value_dim: int) -> tuple[int, ...]:
    """The strides of the ops' o: the kernels' layout (``output_strides``: laid out as a 4-D q
    that is a (B, N, H, D) tensor viewed as (B, H, N, D), else contiguous). The fake and the
    real op must agree on them under torch.compile."""
    shape = (*q.shape[:-1], value_dim)
    if q.dim() == 4:
        return output_strides(shape, tuple(q.stride()))
    return torch.empty(shape, device="meta").stride()


def _in_op_layout(o: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``o`` itself where it is laid out as the fakes say (every kernel of ours on 4-D
    inputs), else a copy so laid out."""
    return _with_strides(o, _op_output_strides(q, o.shape[-1]))


def _with_strides(t: torch.Tensor, strides: tuple[int, ...]) -> torch.Tensor:
    """``t`` itself where it has ``strides`` (what an op's fake says), else a copy with them."""
    if t.stride() == tuple(strides):
        return t
    return torch.empty_strided(t.shape, strides, dtype=t.dtype, device=t.device).copy_(t)


@torch.library.custom_op("tuner::attention_fwd", mutates_args=())
def _attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
                   scale: float | None, enable_gqa: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, lse): o like q (value's head dim; ``_op_output_strides``), lse (..., H_q, L)
    float32 natural log."""
    o, lse = _flash_forward(q, k, v, is_causal, scale, enable_gqa)
    return _in_op_layout(o, q), lse


@_attention_fwd.register_fake
def _attention_fwd_fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
                        scale: float | None, enable_gqa: bool
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (*q.shape[:-1], v.shape[-1])
    return (q.new_empty_strided(shape, _op_output_strides(q, v.shape[-1])),
            q.new_empty(q.shape[:-1], dtype=torch.float32))


@torch.library.custom_op("tuner::attention_inference", mutates_args=())
def _attention_inference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
                         scale: float | None, enable_gqa: bool, implementation: str
                         ) -> torch.Tensor:
    """o by ``implementation``, one of ours without a backward (decode, gluon), as the trace
    chose it: the eager path's plan for the call, with that implementation forced."""
    with use_implementation(implementation):
        return _in_op_layout(_forward(q, k, v, is_causal, scale, enable_gqa), q)


@_attention_inference.register_fake
def _attention_inference_fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              is_causal: bool, scale: float | None, enable_gqa: bool,
                              implementation: str) -> torch.Tensor:
    shape = (*q.shape[:-1], v.shape[-1])
    return q.new_empty_strided(shape, _op_output_strides(q, v.shape[-1]))


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
    # flash_attention_bwd returns its gradients contiguous, whatever the inputs' layout.
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape))


def _setup_context(ctx: torch.autograd.function.FunctionCtx, inputs: tuple[object, ...],
                   output: tuple[torch.Tensor, torch.Tensor]) -> None:
    q, k, v, is_causal, scale, enable_gqa = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse)  # type: ignore[arg-type]
    ctx.mark_non_differentiable(lse)  # the kernel computes no lse gradient
    ctx.set_materialize_grads(False)
    ctx.is_causal, ctx.scale, ctx.enable_gqa = is_causal, scale, enable_gqa  # type: ignore[attr-defined]


def _backward_by(op_name: str) -> Callable[..., tuple[torch.Tensor | None, ...]]:
    """The autograd backward of a forward op of ours: the backward op ``tuner::<op_name>``
    on what ``_setup_context`` saved."""

    def backward(ctx: torch.autograd.function.FunctionCtx, grad_o: torch.Tensor | None,
                 grad_lse: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        if grad_o is None:  # o did not reach the loss
            return None, None, None, None, None, None
        q, k, v, o, lse = ctx.saved_tensors  # type: ignore[attr-defined]
        op = getattr(torch.ops.tuner, op_name)
        dq, dk, dv = op(grad_o, q, k, v, o, lse, ctx.is_causal,  # type: ignore[attr-defined]
                        ctx.scale, ctx.enable_gqa)  # type: ignore[attr-defined]
        return dq, dk, dv, None, None, None

    return backward


_attention_fwd.register_autograd(_backward_by("attention_bwd"), setup_context=_setup_context)


@torch.library.custom_op("tuner::gluon_attention_fwd", mutates_args=())
def _gluon_attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
                         scale: float | None, enable_gqa: bool
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, lse) by the Gluon forward, as ``tuner::attention_fwd``'s; its backward is cuDNN's
    (``tuner::cudnn_attention_bwd``)."""
    o, lse = _gluon_forward(q, k, v, is_causal, scale, enable_gqa)
    return _in_op_layout(o, q), lse


_gluon_attention_fwd.register_fake(_attention_fwd_fake)


@torch.library.custom_op("tuner::cudnn_attention_bwd", mutates_args=())
def _cudnn_attention_bwd(grad_o: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                         v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor, is_causal: bool,
                         scale: float | None, enable_gqa: bool
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) by cuDNN's backward from the Gluon forward's o and lse, laid out as
    ``torch.empty_like`` of q, k, v."""
    from templates.cudnn_bwd import cudnn_attention_bwd

    q4, kv4 = shapes_4d(q, k)
    grads = cudnn_attention_bwd(grad_o.reshape(q4), q.reshape(q4), k.reshape(kv4),
                                v.reshape(kv4), o.reshape(q4), lse.reshape(q4[:-1]),
                                causal=is_causal, scale=scale)
    # Laid out as the fake's torch.empty_like (its strides read off a meta tensor).
    return tuple(_with_strides(g.reshape(t.shape),  # type: ignore[return-value]
                               torch.empty_like(t, device="meta").stride())
                 for g, t in zip(grads, (q, k, v), strict=True))


@_cudnn_attention_bwd.register_fake
def _cudnn_attention_bwd_fake(grad_o: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                              v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
                              is_causal: bool, scale: float | None, enable_gqa: bool
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


_gluon_attention_fwd.register_autograd(_backward_by("cudnn_attention_bwd"),
                                       setup_context=_setup_context)


def _training_op(implementation: str) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """The custom op (with its autograd) that runs a call needing a gradient by one of ours:
    flash both ways, or the Gluon forward with cuDNN's backward."""
    if implementation == implementations.GLUON.name:
        return torch.ops.tuner.gluon_attention_fwd  # type: ignore[no-any-return]
    assert implementation == implementations.FLASH.name, (
        f"{implementation} has no training op: the dispatcher chooses it without a gradient")
    return torch.ops.tuner.attention_fwd  # type: ignore[no-any-return]


_BWD_CONFIGS: dict[tuple[object, ...], tuple[object, float]] = {}


def _kernel_backward(grad_o: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     o: torch.Tensor, lse: torch.Tensor, is_causal: bool, scale: float | None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from templates.flash_bwd import flash_attention_bwd

    q4, kv4 = shapes_4d(q, k)
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
