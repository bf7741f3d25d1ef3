"""``eager``: attention as transformers computes it where SDPA cannot (matmul, softcap, mask,
float32 softmax, matmul, in torch; ``templates.pytorch.eager``). The baseline of softcapped
calls: it runs every one that nothing measured faster, as the user's model ran it, and it is
differentiable by torch's autograd (no op of its own: under torch.compile it traces as the
torch operations it is)."""

from __future__ import annotations

import torch

from templates.pytorch.eager import eager_attention
from tuner.dispatch.implementations.base import Choice, Implementation, Request, Run
from tuner.dispatch.implementations.call import Call
from tuner.dispatch.implementations.registry import register_implementation

__all__ = ["Eager"]


class Eager(Implementation):
    name = "eager"
    forward = "torch_eager"
    training = ("torch_eager_train",)
    description = ("eager attention in torch (matmul, softcap, mask, float32 softmax, "
                   "matmul), as transformers runs softcapped models: the baseline of "
                   "softcapped calls")
    layout_free = True
    runs_masks = False

    def serves(self, call: Call) -> str | None:
        # Its templates refuse uncapped problems (SDPA's) and block masks by name; this
        # says so once more for a caller that reads only serves.
        if not call.problem.softcap:
            return "eager is the baseline for softcapped calls only; SDPA serves the rest"
        return None

    def softcap_plan(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     is_causal: bool, scale: float | None, enable_gqa: bool, softcap: float,
                     choice: Choice) -> Run:
        def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return eager_attention(q, k, v, causal=is_causal, scale=scale, softcap=softcap)

        return run

    def run(self, r: Request, choice: Choice | None, constant: str) -> torch.Tensor:
        """Eager, with a gradient or without, traced or not: the same torch operations."""
        attn_mask = None if r.mask is None else r.mask.attn_mask
        return eager_attention(r.q, r.k, r.v, attn_mask=attn_mask, causal=r.is_causal,
                               scale=r.scale, softcap=r.softcap)


EAGER = register_implementation(Eager())
