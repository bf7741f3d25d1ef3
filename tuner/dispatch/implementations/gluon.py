"""``gluon``: the project's warp-specialized Gluon forward for Hopper (``gluon_fwd``); for a
gradient, paired with torch's cuDNN backward fed its o and logsumexp (``gluon_cudnn_train``).

Its training op ``tuner::gluon_attention_fwd`` (o, lse) has the backward op
``tuner::cudnn_attention_bwd``; cuDNN takes no block mask, so masked calls run it forward only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch

from templates.base import KernelConfig
from templates.gluon import fwd as gluon_fwd
from templates.gluon.fwd import GluonFwdConfig, gluon_attention_fwd
from templates.kernel_common import normalize_causal
from templates.pytorch import cudnn_bwd
from tuner.dispatch.implementations.base import Choice, Implementation, Request, Run
from tuner.dispatch.implementations.call import (
    Call,
    as_shape,
    check_inputs,
    layout_key,
    problem_key,
    shapes_4d,
)
from tuner.dispatch.implementations.flash import Pair, resolved_for
from tuner.dispatch.implementations.ops import (
    TrainingOp,
    grads_fake,
    grads_like,
    in_op_layout,
)
from tuner.dispatch.implementations.registry import register_implementation
from tuner.dispatch.plans import Plan, kept_plan

__all__ = ["Gluon", "backward_of", "forward_plan", "training_forward", "training_plan"]

# Its training template: its config runs the Gluon forward of a call that needs a gradient.
TRAINING_TEMPLATE = "gluon_cudnn_train"


def forward_plan(q: torch.Tensor, k: torch.Tensor, is_causal: bool, scale: float | None,
                 config: KernelConfig) -> Pair:
    """The Gluon forward with ``config``: (o, lse) in the inputs' shape."""
    assert isinstance(config, GluonFwdConfig)
    q4, kv4 = shapes_4d(q, k)
    out_shape, lse_shape = tuple(q.shape), tuple(q.shape[:-1])
    causal = normalize_causal(is_causal)

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor]:
        o, lse = gluon_attention_fwd(as_shape(q, q4), as_shape(k, kv4), as_shape(v, kv4),
                                     causal=causal, scale=scale, config=config)
        return as_shape(o, out_shape), as_shape(lse, lse_shape)

    return run


def mask_config(config: KernelConfig, block_size: tuple[int, int]) -> GluonFwdConfig | None:
    """The Gluon config that runs a block mask of ``block_size``: ``config`` where it walks
    those blocks (one measured on a mask problem walks the sweep's 128-blocks), else fitted to
    them (``gluon_fwd.fit_to_block_mask``: a dense problem's causal config runs longest tiles
    first, which a mask's row order forbids); None where no fitting can."""
    assert isinstance(config, GluonFwdConfig)
    # split_tail passes block_mask_reason but not gluon_fwd's constraint under a mask (a
    # dense problem's default cuts tiles): fitted below.
    if gluon_fwd.block_mask_reason(config, block_size) is None and not config.split_tail:
        return config
    try:
        fitted = gluon_fwd.fit_to_block_mask(config, block_size)
    except ValueError:  # blocks under the kernel's 64-row tiles
        return None
    return None if gluon_fwd.block_mask_reason(fitted, block_size) else fitted


class Gluon(Implementation):
    name = "gluon"
    forward = "gluon_fwd"
    training = (TRAINING_TEMPLATE,)
    description = ("the project's warp-specialized Gluon forward for Hopper (FA3-style "
                   "ping-pong consumer warpgroups, TMA producer warp); for a gradient, with "
                   "torch's cuDNN backward fed its o and logsumexp (gluon_cudnn_train)")
    runs_masks = True
    # cuDNN's backward adds dQ in no fixed order.
    deterministic_backward = False

    def serves(self, call: Call) -> str | None:
        if not call.device.compute_capability.startswith("9."):
            return (f"the Gluon kernels are written for Hopper (compute capability 9.x), but "
                    f"the device is {call.device.name} "
                    f"({call.device.compute_capability or 'no GPU'})")
        return None

    def plan(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
             scale: float | None, enable_gqa: bool, choice: Choice) -> Run:
        run = forward_plan(q, k, is_causal, scale, choice.config)
        return lambda q, k, v: run(q, k, v)[0]

    def mask_refusal(self, block_size: tuple[int, int], needs_grad: bool, choice: Choice
                     ) -> str | None:
        if needs_grad:
            # Its backward is cuDNN's, which takes no block mask: its training template
            # refuses mask problems, so ``choose`` never picks it for a named mask; forced on
            # a mask without a name, the dense problem's choice is no answer.
            raise ValueError(
                "use_implementation('gluon') cannot run a block-mask call that needs a "
                "gradient: the Gluon implementation's backward is cuDNN's, which takes no "
                "block mask; use 'flash' or 'flex', or call it under torch.no_grad()")
        if mask_config(choice.config, block_size) is None:
            return "blocks the Gluon kernel cannot walk (under its 64-row tiles)"
        return None

    def masked(self, r: Request, choice: Choice) -> torch.Tensor:
        assert r.mask is not None and r.mask.block_mask is not None
        config = mask_config(choice.config, r.mask.block_mask.block_size)
        q4, kv4 = shapes_4d(r.q, r.k)  # k, v keep their H_kv heads: the kernel groups them
        # Looked up on the module at each call (tests stand in for it).
        o, _ = gluon_fwd.gluon_attention_fwd(
            as_shape(r.q, q4), as_shape(r.k, kv4), as_shape(r.v, kv4),
            causal=normalize_causal(r.is_causal), scale=r.scale, config=config,
            block_mask=r.mask.block_mask)
        return as_shape(o, r.q.shape)


GLUON = register_implementation(Gluon())


def training_plan(implementation: Implementation, template: str, q: torch.Tensor,
                  k: torch.Tensor, v: torch.Tensor, is_causal: bool, scale: float | None,
                  enable_gqa: bool) -> Plan:
    """The Gluon forward of a call that needs a gradient, with the config ``template`` (the
    implementation's training template, whose knobs are the forward's) resolves, kept per
    problem and layout."""
    key = (template, *problem_key(q, k, v, is_causal, scale, enable_gqa, None),
           *layout_key(q, k, v))
    def make() -> Plan:
        check_inputs(q, k, v, enable_gqa)
        resolved = resolved_for(template, q, k, is_causal)
        return Plan(forward_plan(q, k, is_causal, scale, resolved.config),
                    Choice(implementation, (resolved,), "its training op"), resolved.expires_at)

    return kept_plan(key, make)


def training_forward(implementation: Implementation, template: str, q: torch.Tensor,
                     k: torch.Tensor, v: torch.Tensor, is_causal: bool, scale: float | None,
                     enable_gqa: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The body of a Gluon training op's forward: (o, lse), o laid out as the fakes say."""
    run = training_plan(implementation, template, q, k, v, is_causal, scale, enable_gqa).run
    assert run is not None
    o, lse = cast(tuple[torch.Tensor, torch.Tensor], run(q, k, v))
    return in_op_layout(o, q), lse


def backward_of(kernel: Callable[..., tuple[torch.Tensor, ...]], grad_o: torch.Tensor,
                q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                lse: torch.Tensor, is_causal: bool | str, scale: float | None,
                **kernel_args: object
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The body of a backward op fed a forward's o and lse: ``kernel`` on the 4-D views
    (``is_causal`` as its ``causal``: a bool or a mode name; ``kernel_args``: a block mask, a
    config), (dq, dk, dv) laid out as ``torch.empty_like`` of q, k, v."""
    q4, kv4 = shapes_4d(q, k)
    grads = kernel(as_shape(grad_o, q4), as_shape(q, q4), as_shape(k, kv4), as_shape(v, kv4),
                   as_shape(o, q4), as_shape(lse, q4[:-1]), causal=is_causal, scale=scale,
                   **kernel_args)
    return grads_like(grads, q, k, v)


def _gluon_attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
                         scale: float | None, enable_gqa: bool
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, lse) by the Gluon forward, as ``tuner::attention_fwd``'s; its backward is cuDNN's
    (``tuner::cudnn_attention_bwd``)."""
    return training_forward(GLUON, TRAINING_TEMPLATE, q, k, v, is_causal, scale, enable_gqa)


def _cudnn_attention_bwd(grad_o: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                         v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor, is_causal: bool,
                         scale: float | None, enable_gqa: bool
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) by cuDNN's backward from the Gluon forward's o and lse, laid out as
    ``torch.empty_like`` of q, k, v."""
    # Looked up on the module at each call (tests stand in for it).
    return backward_of(cudnn_bwd.cudnn_attention_bwd, grad_o, q, k, v, o, lse, is_causal, scale)


def _cudnn_attention_bwd_fake(grad_o: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                              v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
                              is_causal: bool, scale: float | None, enable_gqa: bool
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return grads_fake(q, k, v)


GLUON.training_op = TrainingOp.define("gluon_attention_fwd", _gluon_attention_fwd,
                                      "cudnn_attention_bwd", _cudnn_attention_bwd,
                                      _cudnn_attention_bwd_fake)
