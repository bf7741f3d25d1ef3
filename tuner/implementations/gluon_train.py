"""``gluon_train``: calls that need a gradient, by our kernels both ways on Hopper: the Gluon
forward and the Gluon backward (``templates.gluon_bwd``), priced together by the
``gluon_train`` template beside ``torch_sdpa_train`` and ``gluon_cudnn_train``.

Inference calls are the ``gluon`` implementation's (the same forward). Its training op
``tuner::gluon_train_fwd`` (o, lse) has the backward op ``tuner::gluon_attention_bwd``; no
block masks (the Gluon backward walks none yet).
"""

from __future__ import annotations

from typing import cast

import torch

from templates.gluon_bwd import gluon_attention_bwd
from tuner.implementations.base import Implementation
from tuner.implementations.call import Call, shapes_4d
from tuner.implementations.gluon import GLUON, training_plan
from tuner.implementations.ops import (
    backward_by,
    grads_fake,
    grads_like,
    in_op_layout,
    setup_context,
    training_fake,
)
from tuner.implementations.registry import register_implementation

__all__ = ["GluonTrain"]

TRAINING_TEMPLATE = "gluon_train"


class GluonTrain(Implementation):
    name = "gluon_train"
    forward = "gluon_fwd"
    training = (TRAINING_TEMPLATE,)
    description = ("for a gradient on Hopper, our kernels both ways: the Gluon forward and the "
                   "Gluon backward fed its o and logsumexp (gluon_train); inference is gluon's")
    deterministic_backward = False  # dQ by fp32 atomics in any order

    def serves(self, call: Call) -> str | None:
        if not call.needs_grad:
            return "it serves calls that need a gradient (inference is the gluon implementation's)"
        return GLUON.serves(call)


GLUON_TRAIN = register_implementation(GluonTrain())


@torch.library.custom_op("tuner::gluon_train_fwd", mutates_args=())
def _gluon_train_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
                     scale: float | None, enable_gqa: bool
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, lse) by the Gluon forward with gluon_train's config; its backward is the Gluon
    backward (``tuner::gluon_attention_bwd``)."""
    run = training_plan(GLUON_TRAIN, TRAINING_TEMPLATE, q, k, v, is_causal, scale,
                        enable_gqa).run
    assert run is not None
    o, lse = cast(tuple[torch.Tensor, torch.Tensor], run(q, k, v))
    return in_op_layout(o, q), lse


_gluon_train_fwd.register_fake(training_fake)


@torch.library.custom_op("tuner::gluon_attention_bwd", mutates_args=())
def _gluon_attention_bwd(grad_o: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                         v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor, is_causal: bool,
                         scale: float | None, enable_gqa: bool
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) by the Gluon backward (its template's default config) from the forward's
    o and lse, laid out as ``torch.empty_like`` of q, k, v."""
    q4, kv4 = shapes_4d(q, k)
    grads = gluon_attention_bwd(grad_o.reshape(q4), q.reshape(q4), k.reshape(kv4),
                                v.reshape(kv4), o.reshape(q4), lse.reshape(q4[:-1]),
                                causal=is_causal, scale=scale)
    return grads_like(grads, q, k, v)


@_gluon_attention_bwd.register_fake
def _gluon_attention_bwd_fake(grad_o: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                              v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
                              is_causal: bool, scale: float | None, enable_gqa: bool
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return grads_fake(q, k, v)


_gluon_train_fwd.register_autograd(backward_by("gluon_attention_bwd"),
                                   setup_context=setup_context)
GLUON_TRAIN.training_op = torch.ops.tuner.gluon_train_fwd
