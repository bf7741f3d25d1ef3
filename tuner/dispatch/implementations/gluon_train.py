"""``gluon_train``: calls that need a gradient, by our kernels both ways on Hopper: the Gluon
forward and the Gluon backward (``templates.gluon.bwd``), priced together by the
``gluon_train`` template beside ``torch_sdpa_train`` and ``gluon_cudnn_train``.

Inference calls are the ``gluon`` implementation's (the same forward). Its training op
``tuner::gluon_train_fwd`` (o, lse) has the backward op ``tuner::gluon_attention_bwd``; no
block masks (the Gluon backward walks none yet).
"""

from __future__ import annotations

import torch

from templates.gluon.bwd import gluon_attention_bwd
from tuner.dispatch.implementations.base import Implementation
from tuner.dispatch.implementations.call import Call
from tuner.dispatch.implementations.gluon import GLUON, backward_of, training_forward
from tuner.dispatch.implementations.ops import (
    backward_by,
    grads_fake,
    setup_context,
    training_fake,
)
from tuner.dispatch.implementations.registry import register_implementation

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
    return training_forward(GLUON_TRAIN, TRAINING_TEMPLATE, q, k, v, is_causal, scale,
                            enable_gqa)


_gluon_train_fwd.register_fake(training_fake)


@torch.library.custom_op("tuner::gluon_attention_bwd", mutates_args=())
def _gluon_attention_bwd(grad_o: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                         v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor, is_causal: bool,
                         scale: float | None, enable_gqa: bool
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) by the Gluon backward (its template's default config) from the forward's
    o and lse, laid out as ``torch.empty_like`` of q, k, v."""
    # Looked up on the module at each call (tests stand in for it).
    return backward_of(gluon_attention_bwd, grad_o, q, k, v, o, lse, is_causal, scale)


@_gluon_attention_bwd.register_fake
def _gluon_attention_bwd_fake(grad_o: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                              v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
                              is_causal: bool, scale: float | None, enable_gqa: bool
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return grads_fake(q, k, v)


_gluon_train_fwd.register_autograd(backward_by("gluon_attention_bwd"),
                                   setup_context=setup_context)
GLUON_TRAIN.training_op = torch.ops.tuner.gluon_train_fwd
