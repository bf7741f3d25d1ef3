"""Plain-torch attention that the kernels are checked against, and its error measure.

Explicit matmul + softmax (no fused SDPA) so the reference shares no code path with anything
under test. GQA repeats K/V here only; the kernels never do.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from templates.base import Problem

# Above this many score elements a float64 reference on a GPU gets slow (float64 matmul runs
# at a small fraction of the float32 rate); float32 is then plenty to check 16-bit kernels.
FLOAT64_SCORE_LIMIT = 1 << 24
# Score elements the reference holds at once (1 GiB in float32; the softmax keeps a few such
# tensors alive): larger problems are computed a chunk of query rows at a time.
REFERENCE_CHUNK_SCORES = 1 << 28


def causal_offset(mode: str, seqlen_q: int, seqlen_kv: int) -> int:
    """Row i may see keys j <= i + offset: 0 top-left (SDPA), N_kv - N_q bottom-right (FA2)."""
    return seqlen_kv - seqlen_q if mode == "bottom_right" else 0


def visible_mask(mode: str, seqlen_q: int, seqlen_kv: int, device: torch.device | str
                 ) -> torch.Tensor | None:
    """(N_q, N_kv) bool mask of the visible keys, None when every key is visible."""
    if mode == "none":
        return None
    rows = torch.arange(seqlen_q, device=device)[:, None]
    cols = torch.arange(seqlen_kv, device=device)[None, :]
    return cols <= rows + causal_offset(mode, seqlen_q, seqlen_kv)


def visible_pairs(mode: str, seqlen_q: int, seqlen_kv: int) -> int:
    """Number of (query, key) pairs a causal mode lets through, in closed form."""
    if mode == "none":
        return seqlen_q * seqlen_kv
    offset = causal_offset(mode, seqlen_q, seqlen_kv)
    # Row i sees clamp(i + offset + 1, 0, N_kv) keys: zero up to row `first`, a ramp up to
    # row `full`, then every key.
    first = min(seqlen_q, max(0, -offset))
    full = min(seqlen_q, max(first, seqlen_kv - offset - 1))
    ramp = sum_range(first + offset + 1, full + offset + 1)
    return ramp + (seqlen_q - full) * seqlen_kv


def forward_flops(problem: Problem) -> float:
    """4 * B * H_q * D * pairs: PROTOCOL.md's forward FLOPs. Equal lengths follow the
    FlashAttention papers' convention (causal = half of dense), so TFLOP/s compare with
    published numbers; otherwise the visible (query, key) pairs are counted exactly."""
    if problem.causal != "none" and problem.seqlen_q == problem.seqlen_kv:
        pairs: float = problem.seqlen_q * problem.seqlen_kv / 2
    else:
        pairs = visible_pairs(problem.causal, problem.seqlen_q, problem.seqlen_kv)
    return 4.0 * problem.batch * problem.heads_q * problem.head_dim * pairs


def forward_bytes(problem: Problem, *, lse: bool = True) -> float:
    """Fewest bytes a forward moves: q, k, v read once, o written once, and (``lse``) the
    float32 logsumexp written."""
    esize = torch.empty((), dtype=getattr(torch, problem.dtype)).element_size()
    q_or_o = problem.batch * problem.heads_q * problem.seqlen_q * problem.head_dim
    k_or_v = problem.batch * problem.heads_kv * problem.seqlen_kv * problem.head_dim
    rows = problem.batch * problem.heads_q * problem.seqlen_q if lse else 0
    return float(esize * (2 * q_or_o + 2 * k_or_v) + 4 * rows)


def random_inputs(problem: Problem, device: str, seed: int = 0, *, grad_out: bool = False
                  ) -> dict[str, object]:
    """Fresh random q, k, v (B, H, N, D) of ``problem`` (never zeros), with its causal mode and
    1/sqrt(D) scale; with ``grad_out``, also ``do``, an output gradient like q (drawn after v,
    so q, k, v are the same tensors either way)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    dtype = getattr(torch, problem.dtype)

    def randn(heads: int, seqlen: int) -> torch.Tensor:
        shape = (problem.batch, heads, seqlen, problem.head_dim)
        return torch.randn(shape, generator=gen, device=device, dtype=dtype)

    inputs: dict[str, object] = {"q": randn(problem.heads_q, problem.seqlen_q),
                                 "k": randn(problem.heads_kv, problem.seqlen_kv),
                                 "v": randn(problem.heads_kv, problem.seqlen_kv)}
    if grad_out:
        inputs["do"] = randn(problem.heads_q, problem.seqlen_q)
    inputs.update(causal=problem.causal, scale=1.0 / math.sqrt(problem.head_dim))
    if problem.softcap:  # only where set: templates that cap read it, no others see it
        inputs["softcap"] = problem.softcap
    return inputs


def sum_range(lo: int, hi: int) -> int:
    """lo + (lo + 1) + ... + (hi - 1); 0 when hi <= lo."""
    return (hi - lo) * (lo + hi - 1) // 2 if hi > lo else 0


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: str,
                        scale: float, compute_dtype: torch.dtype | None = None,
                        mask: torch.Tensor | None = None, softcap: float = 0.0
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, lse) of softmax(scale * q k^T, masked) v in ``compute_dtype``.

    ``softcap`` > 0 caps the scaled scores first, ``softcap * tanh(s / softcap)`` (Gemma 2),
    before any mask applies.

    ``mask`` broadcasts to (B, H_q, N_q, N_kv): bool (True = attend, e.g. a BlockMask's
    ``to_dense()``) or float (added to the scaled scores), on top of ``causal``.
    ``compute_dtype`` None picks float64, or float32 on a GPU for large problems. Rows that see
    no key give o = 0 and lse = -inf.
    """
    if compute_dtype is None:
        scores = q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2]
        big_on_gpu = q.is_cuda and scores > FLOAT64_SCORE_LIMIT
        compute_dtype = torch.float32 if big_on_gpu else torch.float64
    group = q.shape[1] // k.shape[1]
    qc = q.to(compute_dtype)
    kc = k.to(compute_dtype).repeat_interleave(group, dim=1)
    vc = v.to(compute_dtype).repeat_interleave(group, dim=1)
    causal_mask = visible_mask(causal, q.shape[2], k.shape[2], q.device)
    # The scores of a chunk of query rows at a time: all of them at once is B*H*N_q*N_kv
    # elements, 32 GiB in float32 at B1 H32 16k (twice over with the softmax), which no GPU
    # of ours holds beside the kernel's own tensors.
    rows = max(1, REFERENCE_CHUNK_SCORES // max(1, q.shape[0] * q.shape[1] * k.shape[2]))
    outs, lses = [], []
    for first in range(0, q.shape[2], rows):
        chunk = slice(first, min(first + rows, q.shape[2]))
        s = torch.matmul(qc[:, :, chunk], kc.transpose(-1, -2)) * scale
        if softcap:
            s = torch.tanh(s / softcap) * softcap
        if causal_mask is not None:
            s = s.masked_fill(~causal_mask[chunk], float("-inf"))
        if mask is not None:
            part = mask[..., chunk, :] if mask.dim() >= 2 and mask.shape[-2] != 1 else mask
            if part.dtype == torch.bool:
                s = s.masked_fill(~part.to(s.device), float("-inf"))
            else:
                s = s + part.to(s.device, compute_dtype)
        lse = torch.logsumexp(s, dim=-1)
        seen = torch.isfinite(lse)
        p = torch.exp(s - torch.where(seen, lse, 0.0)[..., None])
        p = torch.where(seen[..., None], p, 0.0)
        outs.append(torch.matmul(p, vc))
        lses.append(lse)
    if len(outs) == 1:
        return outs[0], lses[0]
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)


def lse_error(lse: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative error of the finite entries; inf if NaN appears or the -inf rows differ."""
    out = lse.detach().to(torch.float64)
    want = ref.detach().to(out.device, torch.float64)
    if out.shape != want.shape:
        raise ValueError(f"lse shape {tuple(out.shape)} differs from reference {tuple(want.shape)}")
    if torch.isnan(out).any():
        return math.inf
    finite = torch.isfinite(want)
    if not torch.equal(torch.isfinite(out), finite) or not torch.equal(
            out[~finite], want[~finite]):
        return math.inf
    denom = torch.linalg.vector_norm(want[finite]).item()
    diff = torch.linalg.vector_norm(out[finite] - want[finite]).item()
    return diff / denom if denom > 0 else diff
