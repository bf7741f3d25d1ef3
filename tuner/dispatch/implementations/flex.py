"""``flex``: compiled FlexAttention (``torch.compile(flex_attention)``) under the call's block
mask, converted exactly; a candidate for block-mask calls beside ours, with its own autograd."""

from __future__ import annotations

import json
from types import SimpleNamespace

import torch

from templates.kernel_common import normalize_causal
from templates.pytorch import flex as torch_flex
from templates.pytorch.flex import FlexConfig, block_size_problem
from tuner.dispatch.implementations.base import Choice, Implementation, Request, Run
from tuner.dispatch.implementations.call import Call, as_shape, shapes_4d
from tuner.dispatch.implementations.registry import register_implementation
from tuner.lookup.resolver import Resolved

__all__ = ["Flex"]


class Flex(Implementation):
    name = "flex"
    forward = "torch_flex"
    training = ("torch_flex_train",)
    description = ("compiled FlexAttention (torch.compile(flex_attention)) under the call's "
                   "block mask, converted exactly; a candidate for block-mask calls beside ours")
    runs_masks = True

    def serves(self, call: Call) -> str | None:
        # Its templates take block-mask problems only (dense ones are torch SDPA's).
        if call.needs_grad and not call.device.compute_capability:
            return "FlexAttention has no backward on the CPU"
        return None

    def plan(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
             scale: float | None, enable_gqa: bool, choice: Choice) -> Run:
        raise ValueError("flex runs calls with a block_mask only (tuner.attention(..., "
                         "block_mask=...)); dense calls are torch SDPA's")

    def constant(self, choice: Choice) -> str:
        return json.dumps(choice.config.to_dict())

    def run(self, r: Request, choice: Choice | None, constant: str) -> torch.Tensor:
        if r.needs_grad:  # Flex's own autograd (under torch.compile, one graph break)
            config = choice.config if choice is not None else FlexConfig(**json.loads(constant))
            assert isinstance(config, FlexConfig)
            return _flex_with_grad(r, config)
        return super().run(r, choice, constant)

    def masked(self, r: Request, choice: Choice) -> torch.Tensor:
        config = choice.config
        assert isinstance(config, FlexConfig)
        return _flex(r, config)

    def mask_refusal(self, block_size: tuple[int, int], needs_grad: bool, choice: Choice
                     ) -> str | None:
        # Flex won the pattern at its sweep's 128-blocks; smaller blocks are ours alone
        # (block_size_problem reads only the mask's block_size).
        return block_size_problem(SimpleNamespace(block_size=block_size))  # type: ignore[arg-type]

    def unnamed_mask_choice(self, call: Call) -> Choice | None:
        return Choice(self, (Resolved(FlexConfig(), "default", "default"),),
                      "forced by use_implementation (a mask without a pattern: Flex's "
                      "defaults)")


def _flex(r: Request, config: FlexConfig) -> torch.Tensor:
    assert r.mask is not None and r.mask.block_mask is not None
    q4, kv4 = shapes_4d(r.q, r.k)
    # Looked up on the module at each call (tests stand in for it).
    return torch_flex.flex(as_shape(r.q, q4), as_shape(r.k, kv4), as_shape(r.v, kv4),
                           r.mask.block_mask, causal=normalize_causal(r.is_causal), scale=r.scale,
                           enable_gqa=r.enable_gqa, config=config,
                           softcap=r.softcap).reshape(r.q.shape)


@torch.compiler.disable
def _flex_with_grad(r: Request, config: FlexConfig) -> torch.Tensor:
    return _flex(r, config)


FLEX = register_implementation(Flex())
