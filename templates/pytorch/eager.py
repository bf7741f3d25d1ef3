"""Eager attention, as transformers runs a model whose scores SDPA cannot compute: the baseline
for softcapped problems (``torch_eager`` forward, ``torch_eager_train`` forward + backward).

Gemma 2 caps its attention scores (``attn_logit_softcapping``: ``cap * tanh(s / cap)``).
torch SDPA has no such option, so transformers runs its eager attention there: a matmul, the
cap, the mask added, a float32 softmax, a matmul, every score materialized. That is what a
user's code runs before ``tuner.attention``, so it is what the dispatcher runs for a capped
call nothing measured faster, and it is measured like any of our kernels (docs/DISPATCH.md).

Problems: softcapped ones only (dense, causal top-left or bottom-right); uncapped problems are
``torch_sdpa``'s. One config: the softmax in float32, as transformers does it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from templates.attention_reference import (
    attention_reference,
    forward_bytes,
    forward_flops,
    random_inputs,
    visible_mask,
)
from templates.base import KernelConfig, Problem, Template, knob
from templates.device import DeviceInfo
from templates.flash.bwd import reference_grads
from templates.kernel_common import normalize_causal
from templates.registry import register

__all__ = ["EagerConfig", "eager_attention"]


def eager_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                    attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                    causal: bool | str = False, scale: float | None = None,
                    softcap: float = 0.0) -> torch.Tensor:
    """softmax(cap(scale * q k^T) [+ mask]) v in plain torch, differentiable, inputs (..., H,
    L, E) with K/V heads repeated to the query's (GQA); the softmax in float32, the output in
    q's dtype. ``attn_mask`` as SDPA's (bool: True = attend; float: added after the cap, as
    transformers adds its mask); rows that see no key give zeros. ``dropout_p`` drops
    probabilities as transformers' eager attention does (in training)."""
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    if k.dim() >= 3 and k.shape[-3] != q.shape[-3]:
        group = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    mode = normalize_causal(causal)
    visible = visible_mask(mode, q.shape[-2], k.shape[-2], q.device)
    if visible is not None:
        scores = scores.masked_fill(~visible, float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        else:
            scores = scores + attn_mask
    # A row of -inf softmaxes to NaN: it saw no key, and gives zeros (as ours and Flex).
    # float32 as transformers computes it; float64 inputs keep their precision.
    softmax_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    probs = torch.softmax(scores, dim=-1, dtype=softmax_dtype).nan_to_num(0.0).to(q.dtype)
    if dropout_p:
        probs = torch.nn.functional.dropout(probs, p=dropout_p, training=True)
    return torch.matmul(probs, v)


@dataclass(frozen=True)
class EagerConfig(KernelConfig):
    """Eager attention has nothing to tune: one config."""

    softmax_float32: bool = knob(True, (True,),
                                 "The softmax in float32, as transformers' eager attention "
                                 "computes it (the only choice).")


class _EagerTemplate(Template):
    config_cls = EagerConfig
    takes_softcap = True

    def unsupported(self, problem: Problem) -> str | None:
        reason = super().unsupported(problem)
        if reason:
            return reason
        if not problem.softcap:
            return (f"{self.name} is the baseline for softcapped problems; uncapped ones are "
                    f"torch_sdpa's")
        if problem.mask != "none":
            return (f"{self.name} takes dense problems; block-sparse pattern "
                    f"{problem.mask!r} is for the block-mask kernels")
        return None

    def constraint(self, problem: Problem, config: KernelConfig, device: DeviceInfo
                   ) -> str | None:
        return self.unsupported(problem)

    def default_config(self, problem: Problem, device: DeviceInfo) -> EagerConfig:
        return EagerConfig()

    def make_inputs(self, problem: Problem, device: str, seed: int = 0) -> dict[str, Any]:
        return random_inputs(problem, device, seed, grad_out=True)

    @staticmethod
    def _call(inputs: Mapping[str, Any], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
              ) -> torch.Tensor:
        return eager_attention(q, k, v, causal=inputs["causal"], scale=inputs["scale"],
                               softcap=inputs.get("softcap", 0.0))


class TorchEagerTemplate(_EagerTemplate):
    name = "torch_eager"
    description = ("eager attention in torch (matmul, softcap, mask, float32 softmax, "
                   "matmul), as transformers runs softcapped models: the baseline of "
                   "softcapped problems.")

    def flops(self, problem: Problem) -> float:
        return forward_flops(problem)

    def bytes_moved(self, problem: Problem) -> float:
        return forward_bytes(problem, lse=False)

    def run(self, inputs: Mapping[str, Any], config: KernelConfig) -> Any:
        return self._call(inputs, inputs["q"], inputs["k"], inputs["v"])

    def reference(self, inputs: Mapping[str, Any]) -> Any:
        return attention_reference(inputs["q"], inputs["k"], inputs["v"],
                                   causal=inputs["causal"], scale=inputs["scale"],
                                   softcap=inputs.get("softcap", 0.0))[0]


class TorchEagerTrainTemplate(_EagerTemplate):
    name = "torch_eager_train"
    description = ("eager attention forward + backward by torch autograd: the baseline of "
                   "softcapped problems that need a gradient.")

    def flops(self, problem: Problem) -> float:
        return 3.5 * forward_flops(problem)  # forward + backward, as torch_sdpa_train

    def bytes_moved(self, problem: Problem) -> float:
        return 2.0 * forward_bytes(problem, lse=False)

    def run(self, inputs: Mapping[str, Any], config: KernelConfig) -> Any:
        q, k, v = (inputs[name].detach().requires_grad_() for name in ("q", "k", "v"))
        with torch.enable_grad():
            o = self._call(inputs, q, k, v)
            return torch.autograd.grad(o, (q, k, v), inputs["do"])

    def reference(self, inputs: Mapping[str, Any]) -> Any:
        return reference_grads(inputs["q"], inputs["k"], inputs["v"], inputs["do"],
                               causal=inputs["causal"], scale=inputs["scale"],
                               softcap=inputs.get("softcap", 0.0))


TORCH_EAGER = register(TorchEagerTemplate())
TORCH_EAGER_TRAIN = register(TorchEagerTrainTemplate())
