"""``decode``: the split-KV flash-decoding kernel (``flash_decode``) for one query token
against a long KV, inference only."""

from __future__ import annotations

import torch

from templates.decode.kernel import MAX_QUERY_TOKENS, check_decode_inputs
from templates.decode.template import FlashDecodeConfig, kept_launch
from tuner.dispatch.implementations.base import Choice, Implementation, Run
from tuner.dispatch.implementations.call import Call, shapes_4d
from tuner.dispatch.implementations.flash import runs_triton
from tuner.dispatch.implementations.registry import register_implementation

__all__ = ["Decode"]


class Decode(Implementation):
    name = "decode"
    forward = "flash_decode"
    description = (f"the split-KV flash-decoding kernel, for one query token (of at most "
                   f"{MAX_QUERY_TOKENS}) against a long KV")

    def serves(self, call: Call) -> str | None:
        p = call.problem
        if p.seqlen_q != 1 or p.causal != "none":
            return (f"decode takes one query token without causal masking (SDPA's top-left "
                    f"is_causal hides every key but the first from it), but got seqlen_q="
                    f"{p.seqlen_q}, causal={p.causal!r}")
        return runs_triton(call)

    def plan(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
             scale: float | None, enable_gqa: bool, choice: Choice) -> Run:
        """flash_decode over a contiguous cache that every sequence fills: (B, H, 1, D)
        queries. Built once per layout, so its kept launch serves every call of the layout."""
        config = choice.config
        assert isinstance(config, FlashDecodeConfig)
        q4, kv4 = shapes_4d(q, k)
        out_shape = q.shape
        lengths = torch.full((q4[0],), kv4[2], dtype=torch.int32, device=q.device)
        as_4d = q.dim() == 4 and k.dim() == 4  # then no reshape: each costs host time per call
        q, k, v = (q, k, v) if as_4d else (q.reshape(q4), k.reshape(kv4), v.reshape(kv4))
        shape = check_decode_inputs(q, k, v, lengths, check_contents=False)  # all full: ours
        launch = kept_launch(q, k, v, lengths, None, shape, config)
        if as_4d:
            return lambda q, k, v: launch(q, k, v, lengths, None, scale)
        return lambda q, k, v: launch(q.reshape(q4), k.reshape(kv4), v.reshape(kv4), lengths,
                                      None, scale).reshape(out_shape)


DECODE = register_implementation(Decode())
