"""What the implementations' ``torch.library`` ops share: the output layout their fakes and
real bodies agree on, and the autograd that joins a training op to its backward op."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from templates.kernel_common import output_strides
from tuner.dispatch.implementations.mask_args import NO_MASK

# Where a training op that caps scores takes its softcap: after the mask's arguments
# (``mask_args.OpMask``), so ops without one keep their schema.
SOFTCAP_ARG = len(NO_MASK)

__all__ = ["SOFTCAP_ARG", "TrainingOp", "backward_by", "grads_fake", "grads_like", "in_op_layout",
           "op_output_strides", "output_fake", "setup_context", "with_strides"]


def op_output_strides(q: torch.Tensor, value_dim: int) -> tuple[int, ...]:
    """The strides of the ops' o: the kernels' layout (``output_strides``: laid out as a 4-D q
    that is a (B, N, H, D) tensor viewed as (B, H, N, D), else contiguous). The fake and the
    real op must agree on them under torch.compile."""
    shape = (*q.shape[:-1], value_dim)
    if q.dim() == 4:
        return output_strides(shape, tuple(q.stride()))
    return torch.empty(shape, device="meta").stride()


def with_strides(t: torch.Tensor, strides: tuple[int, ...]) -> torch.Tensor:
    """``t`` itself where it has ``strides`` (what an op's fake says), else a copy with them."""
    if t.stride() == tuple(strides):
        return t
    return torch.empty_strided(t.shape, strides, dtype=t.dtype, device=t.device).copy_(t)


def grads_like(grads: tuple[torch.Tensor, ...], q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A backward op's (dq, dk, dv), each in its input's shape and laid out as
    ``torch.empty_like`` of it (what the backward ops' fakes say; strides read off a meta
    tensor)."""
    dq, dk, dv = (with_strides(g.reshape(t.shape), torch.empty_like(t, device="meta").stride())
                  for g, t in zip(grads, (q, k, v), strict=True))
    return dq, dk, dv


def grads_fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What ``grads_like`` returns, for a backward op's fake."""
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def in_op_layout(o: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``o`` itself where it is laid out as the fakes say (every kernel of ours on 4-D
    inputs), else a copy so laid out."""
    return with_strides(o, op_output_strides(q, o.shape[-1]))


def output_fake(q: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    shape = (*q.shape[:-1], v.shape[-1])
    return q.new_empty_strided(shape, op_output_strides(q, v.shape[-1]))


def training_fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
                  scale: float | None, enable_gqa: bool, *mask: object
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """A training op's (o, lse): o as ``output_fake``, lse (..., H_q, L) float32."""
    return output_fake(q, v), q.new_empty(q.shape[:-1], dtype=torch.float32)


def setup_context(ctx: torch.autograd.function.FunctionCtx, inputs: tuple[object, ...],
                  output: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Save what a backward op takes: q, k, v, o, lse, the mask's tensors and, for an op that
    takes one after the mask's arguments, the softcap (``SOFTCAP_ARG``)."""
    q, k, v, is_causal, scale, enable_gqa, *given = inputs
    mask = (*given, *NO_MASK[len(given):])
    softcap = given[SOFTCAP_ARG] if len(given) > SOFTCAP_ARG else 0.0
    o, lse = output
    # The mask's tensors saved as tensors (autograd keeps them alive and checks versions).
    ctx.save_for_backward(q, k, v, o, lse, *mask[:6], mask[8])  # type: ignore[arg-type]
    ctx.mark_non_differentiable(lse)  # the kernels compute no lse gradient
    ctx.set_materialize_grads(False)
    ctx.args = (is_causal, scale, enable_gqa)  # type: ignore[attr-defined]
    ctx.mask = (mask[6], mask[7], len(given), softcap)  # type: ignore[attr-defined]


def backward_by(op_name: str) -> Callable[..., tuple[torch.Tensor | None, ...]]:
    """The autograd backward of a training op: the backward op ``tuner::<op_name>`` on what
    ``setup_context`` saved (the mask's arguments only to an op that takes them)."""

    def backward(ctx: torch.autograd.function.FunctionCtx, grad_o: torch.Tensor | None,
                 grad_lse: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        return backward_with(ctx, grad_o, getattr(torch.ops.tuner, op_name))

    return backward


def backward_with(ctx: torch.autograd.function.FunctionCtx, grad_o: torch.Tensor | None,
                  backward: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
                  ) -> tuple[torch.Tensor | None, ...]:
    """The gradients of a training op's inputs: ``backward`` (the backward op, or its body)
    on what ``setup_context`` saved (the mask's arguments only to an op that takes them);
    None for o that did not reach the loss."""
    geometry, pattern, n_mask, softcap = ctx.mask  # type: ignore[attr-defined]
    if grad_o is None:
        return (None,) * (6 + n_mask)
    q, k, v, o, lse, *tensors, attn_mask = ctx.saved_tensors  # type: ignore[attr-defined]
    mask = (*tensors, geometry, pattern, attn_mask, softcap)[:n_mask]
    dq, dk, dv = backward(grad_o, q, k, v, o, lse, *ctx.args, *mask)  # type: ignore[attr-defined]
    return (dq, dk, dv) + (None,) * (3 + n_mask)


class _EagerTraining(torch.autograd.Function):
    """A training op's forward and backward bodies joined by autograd without the library
    op's dispatch: what ``TrainingOp`` runs outside torch.compile."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, op: TrainingOp,
                *inputs: object) -> tuple[torch.Tensor, torch.Tensor]:
        output = op.forward(*inputs)
        setup_context(ctx, inputs, output)
        ctx.op = op  # type: ignore[attr-defined]
        return output

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: torch.autograd.function.FunctionCtx, grad_o: torch.Tensor | None,
                 grad_lse: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        return (None, *backward_with(ctx, grad_o, ctx.op.backward))  # type: ignore[attr-defined]


def _library_op_needed(tensors: tuple[object, ...]) -> bool:
    """Whether a call must go through the library op: traced by torch.compile or export,
    under a functorch transform or a dispatch mode (fake tensors, a flop counter), or given
    tensor subclasses; those are what the op's fake and registrations are for."""
    if torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active():
        return True
    if _get_current_dispatch_mode() is not None:
        return True
    return any(type(t) is not torch.Tensor for t in tensors)


class TrainingOp:
    """A training op in its two forms. ``library``: the ``torch.library`` op
    (``tuner::<name>``, with its fake and its autograd by the backward op), what torch.compile
    traces. Called eagerly, the same Python bodies run joined by one ``torch.autograd.Function``
    instead: the library op's dispatch (defaults filled, autograd and backend wrappers in
    Python, twice per step with the backward op) is host time a step need not spend. On the
    H200 host (2026-11-29, attention_overhead.py --train-only, 4 x 16 x 4k x 128, dense
    causal, launches skipped) tuner.attention's forward + backward took 842 -> 295 us running
    flash and 1011 -> 627 us running gluon_train once the eager calls skipped it."""

    def __init__(self, library: Any, forward: Callable[..., tuple[torch.Tensor, torch.Tensor]],
                 backward: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
                 ) -> None:
        self.library = library
        self.forward = forward
        self.backward = backward

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 *args: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if _library_op_needed((q, k, v)):
            return self.library(q, k, v, *args)  # type: ignore[no-any-return]
        return _EagerTraining.apply(self, q, k, v, *args)  # type: ignore[no-any-return]

    @classmethod
    def define(cls, name: str, forward: Callable[..., tuple[torch.Tensor, torch.Tensor]],
               backward_name: str,
               backward: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
               backward_fake: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
               ) -> TrainingOp:
        """Register ``tuner::<name>`` (body ``forward``, fake ``training_fake``) and
        ``tuner::<backward_name>`` (``backward``, ``backward_fake``), join them by autograd,
        and return the pair as a ``TrainingOp``."""
        forward_op = torch.library.custom_op(f"tuner::{name}", forward, mutates_args=())
        forward_op.register_fake(training_fake)
        backward_op = torch.library.custom_op(f"tuner::{backward_name}", backward,
                                              mutates_args=())
        backward_op.register_fake(backward_fake)
        forward_op.register_autograd(backward_by(backward_name), setup_context=setup_context)
        return cls(getattr(torch.ops.tuner, name), forward, backward)
