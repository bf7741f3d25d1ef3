"""cuDNN's attention backward, through torch, fed by any exact forward's o and logsumexp.

The backward of FlashAttention needs from its forward only o and the logsumexp of the scaled
scores (one float per query row): it recomputes P = exp(scale q k^T - lse) tile by tile. So a
forward of ours can pair with cuDNN's backward, the fastest backward on the H100 (ours, Triton
and Gluon, run at 0.6x of it: notes/gluon_notes.md): torch exposes it as
``aten._scaled_dot_product_cudnn_attention_backward``, which torch's own ring attention feeds
with logsumexps it merged itself. Its logsumexp is natural-log, (B, H_q, N_q, 1) float32, the
same numbers as ours (the H100 run in notes/gluon_notes.md, "Gluon forward + cuDNN backward":
equal to 1e-6 on every checked shape).

cuDNN's causal mask is SDPA's (top-left); GQA/MQA are taken as they are (H_q a multiple of
H_kv). No dropout, no attention bias, no block mask.
"""

from __future__ import annotations

import torch

DTYPES = (torch.float16, torch.bfloat16)


def cudnn_backward_problem(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                           v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor) -> str | None:
    """Why cuDNN's backward cannot take these tensors (None: it can)."""
    if not q.is_cuda:
        return f"cuDNN's attention backward runs on CUDA tensors, but q is on {q.device}"
    if q.dtype not in DTYPES:
        return f"cuDNN's attention backward takes float16 or bfloat16, but got {q.dtype}"
    for name, t in (("do", do), ("k", k), ("v", v), ("o", o)):
        if t.dtype != q.dtype or t.dim() != 4:
            return (f"{name} must be 4-D (B, H, N, D) in q's dtype {q.dtype}, but got "
                    f"{tuple(t.shape)} {t.dtype}")
    if q.dim() != 4:
        return f"q must be 4-D (B, H_q, N_q, D), but got shape {tuple(q.shape)}"
    if do.shape != q.shape or o.shape != q.shape:
        return (f"do and o must have q's shape {tuple(q.shape)}, but got {tuple(do.shape)} "
                f"and {tuple(o.shape)}")
    if tuple(lse.shape) != tuple(q.shape[:3]) or lse.dtype != torch.float32:
        return (f"lse must be (B, H_q, N_q) = {tuple(q.shape[:3])} float32, but got "
                f"{tuple(lse.shape)} {lse.dtype}")
    if q.shape[1] % k.shape[1]:
        return f"the query heads ({q.shape[1]}) must be a multiple of the kv heads ({k.shape[1]})"
    return None


def cudnn_attention_bwd(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        o: torch.Tensor, lse: torch.Tensor, *, causal: bool,
                        scale: float | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of o = softmax(scale q k^T [causal top-left]) v by cuDNN, given the
    forward's o and ``lse`` (B, H_q, N_q) float32 natural-log logsumexp. dq, dk, dv are laid
    out as ``torch.empty_like`` of q, k, v. ValueError where cuDNN cannot take the inputs."""
    reason = cudnn_backward_problem(do, q, k, v, o, lse)
    if reason:
        raise ValueError(reason)
    if do.stride() != o.stride():
        # One layout for o and dO: the gradient autograd hands over may be laid out otherwise
        # (e.g. contiguous against a (B, N, H, D) o).
        do = torch.empty_like(o).copy_(do)
    none = torch.empty(0, device=q.device)  # no dropout: its seed and offset are unused
    dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        do, q, k, v, o, lse.unsqueeze(-1), none, none, None, None, None, q.shape[2],
        k.shape[2], 0.0, causal, scale=scale)
    return dq, dk, dv
