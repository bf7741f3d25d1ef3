"""torch's own packed-sequence attention as tuning candidates: ``torch_varlen`` (forward) and
``torch_varlen_train`` (forward + backward), ``torch.nn.attention.varlen.varlen_attn``
(FlashAttention-2 on CUDA) run on a document mask's offsets.

A user with packed documents (FlashAttention's ``cu_seqlens``) who does not use
``tuner.varlen_attention`` runs torch's ``varlen_attn`` where the torch at hand has it. For
the dispatcher to promise "never slower than what the user would otherwise run", it is
measured like our kernels and Flex: in the same trial worker, on the same problem (a
``documents[_causal]:<L>`` block mask, whose ``BlockMask.documents`` are the offsets this
runs), against the same reference, stored in the same tables.

Its signature changed between torch releases, so the call adapts to the one present
(``varlen_call``): causality by ``is_causal`` (torch 2.10/2.11) or ``window_size=(-1, 0)``
(later); the scale by ``scale`` where it is taken, else folded into q; grouped K/V heads by
``enable_gqa`` where it is taken, else repeated. Causal documents are FlashAttention's
varlen rule, bottom-right per document (``templates.masks.document_offsets``), which is ours.

Problems: the documents patterns only (``document:<n>``, ``documents:<L>``,
``documents_causal:<L>``, causality in the mask: the problem's ``causal`` is "none"),
float16/bfloat16, head dims FlashAttention-2 takes; CUDA only (a constraint, so a CPU sweep
skips it by name). Nothing to tune: one config.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from templates.attention_reference import (
    attention_reference,
    forward_bytes,
    forward_flops,
    random_inputs,
)
from templates.base import KernelConfig, Problem, Template, knob
from templates.device import DeviceInfo
from templates.flash.bwd import reference_grads
from templates.flash.fwd import pattern_mask
from templates.masks.document_offsets import DocumentOffsets
from templates.masks.patterns import parse_pattern
from templates.registry import register

__all__ = ["DOCUMENT_PATTERNS", "VARLEN_DTYPES", "VarlenConfig", "packed_offsets",
           "run_documents", "varlen_attn_function", "varlen_call", "varlen_problem"]

DOCUMENT_PATTERNS = ("document", "documents", "documents_causal")
VARLEN_DTYPES = ("float16", "bfloat16")
MAX_HEAD_DIM = 256  # FlashAttention-2's largest; head dims must also be multiples of 8
HEAD_DIM_MULTIPLE = 8


def varlen_attn_function() -> Callable[..., torch.Tensor] | None:
    """torch's ``varlen_attn``, or None where this torch has none (looked up at each call on
    this module, so tests can stand in for it)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    # (its type says it may return a tuple: only when asked for the lse, which we never do)
    return varlen_attn  # type: ignore[return-value]


@functools.lru_cache(maxsize=4)
def _parameters(function: Callable[..., Any]) -> frozenset[str]:
    return frozenset(inspect.signature(function).parameters)


def varlen_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, *,
                causal: bool, scale: float | None = None,
                function: Callable[..., torch.Tensor] | None = None) -> torch.Tensor:
    """``varlen_attn`` (``function``, default this torch's) of packed (T, H, D) inputs, its
    signature adapted (module docstring); differentiable (torch's op has a backward)."""
    function = function or varlen_attn_function()
    if function is None:
        raise RuntimeError(f"torch {torch.__version__} has no "
                           f"torch.nn.attention.varlen.varlen_attn")
    params = _parameters(function)
    kwargs: dict[str, Any] = {}
    if "is_causal" in params:
        kwargs["is_causal"] = causal
    elif "window_size" in params:
        if causal:
            kwargs["window_size"] = (-1, 0)
    elif causal:
        raise RuntimeError("this torch's varlen_attn takes neither is_causal nor window_size: "
                           "it cannot run causal documents")
    head_dim = q.shape[-1]
    if scale is not None and not math.isclose(scale, head_dim ** -0.5, rel_tol=1e-6):
        if "scale" in params:
            kwargs["scale"] = scale
        else:  # varlen_attn scales by 1/sqrt(D): q pre-scaled gives the asked scale
            q = q * (scale * math.sqrt(head_dim))
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:
            group = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    return function(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **kwargs)


@functools.lru_cache(maxsize=16)
def packed_offsets(documents: DocumentOffsets, rows: int, seqlen_q: int, seqlen_k: int,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(cu_seqlens_q, cu_seqlens_k) int32 on ``device`` of ``rows`` batch rows packed one
    after another, each holding ``documents``; kept, as a model's layers share them."""
    def offsets(one: tuple[int, ...], length: int) -> torch.Tensor:
        row = torch.tensor(one, dtype=torch.int32)
        shifted = [row[:-1] + r * length for r in range(rows)]
        return torch.cat([*shifted, torch.tensor([rows * length], dtype=torch.int32)]).to(device)

    return offsets(documents.offsets_q, seqlen_q), offsets(documents.offsets_k, seqlen_k)


def run_documents(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  documents: DocumentOffsets, scale: float | None = None) -> torch.Tensor:
    """Attention of (B, H, L, D) inputs within ``documents`` (every batch row packed alike)
    by ``varlen_attn``; (B, H, L, D) out, laid out as (B, L, H, D), as our kernels' output
    for q viewed from a (B, L, H, D) tensor. The rows are packed one after another: a view
    where q, k, v are such views (``tuner.varlen_attention``'s, transformers'), else a copy."""
    batch, _, seqlen_q, _ = q.shape
    seqlen_k = k.shape[2]
    cu_q, cu_k = packed_offsets(documents, batch, seqlen_q, seqlen_k, q.device)
    pq, pk, pv = (t.transpose(1, 2).reshape(batch * t.shape[2], t.shape[1], t.shape[3])
                  for t in (q, k, v))
    out = varlen_call(pq, pk, pv, cu_q, cu_k, documents.max_q, documents.max_k,
                      causal=documents.causal, scale=scale)
    return out.view(batch, seqlen_q, q.shape[1], v.shape[-1]).transpose(1, 2)


def varlen_problem(problem: Problem) -> str | None:
    """Why ``varlen_attn`` cannot run ``problem`` (None if it can)."""
    name, _ = parse_pattern(problem.mask)
    if name not in DOCUMENT_PATTERNS:
        return (f"torch's varlen_attn runs packed documents only (masks "
                f"{[p + ':<n>' for p in DOCUMENT_PATTERNS]}), not mask {problem.mask!r}")
    if problem.causal != "none":
        return (f"torch's varlen_attn takes causality from the documents (documents_causal:<L>"
                f"), not a causal={problem.causal!r} call on top of the mask")
    if problem.dtype not in VARLEN_DTYPES:
        return f"torch's varlen_attn takes {list(VARLEN_DTYPES)}, not {problem.dtype}"
    if problem.head_dim > MAX_HEAD_DIM or problem.head_dim % HEAD_DIM_MULTIPLE:
        return (f"torch's varlen_attn (FlashAttention-2) takes head dims that are multiples "
                f"of {HEAD_DIM_MULTIPLE} up to {MAX_HEAD_DIM}, not {problem.head_dim}")
    return None


@dataclass(frozen=True)
class VarlenConfig(KernelConfig):
    """torch's varlen_attn has nothing to tune: one config."""

    backend: str = knob("flash", ("flash",),
                        "FlashAttention-2's varlen kernels, as torch runs them (the only "
                        "choice).")


class _VarlenTemplate(Template):
    config_cls = VarlenConfig

    def unsupported(self, problem: Problem) -> str | None:
        return super().unsupported(problem) or varlen_problem(problem)

    def constraint(self, problem: Problem, config: KernelConfig, device: DeviceInfo
                   ) -> str | None:
        if device.is_interpreter:
            return "torch's varlen_attn is a CUDA kernel (no CPU or interpreter run)"
        major = int(device.compute_capability.split(".")[0])
        if major < 8:
            return (f"torch's varlen_attn (FlashAttention-2) needs compute capability 8.0 or "
                    f"newer, but this device has {device.compute_capability}")
        if varlen_attn_function() is None:
            return f"torch {torch.__version__} has no torch.nn.attention.varlen.varlen_attn"
        return self.unsupported(problem)

    def default_config(self, problem: Problem, device: DeviceInfo) -> VarlenConfig:
        return VarlenConfig()

    def make_inputs(self, problem: Problem, device: str, seed: int = 0) -> dict[str, Any]:
        inputs = random_inputs(problem, device, seed, grad_out=True)
        # The sweep's mask for the pattern (shared with flash_fwd's and Flex's), which carries
        # its documents.
        inputs["block_mask"] = pattern_mask(problem.mask, problem.seqlen_q, problem.seqlen_kv,
                                             str(device))
        # Laid out as packed (B, L, H, D) tensors viewed as (B, H, L, D), as the packed calls
        # the dispatcher gives this implementation are: packing them is then free.
        for name in ("q", "k", "v", "do"):
            t = inputs[name]
            assert isinstance(t, torch.Tensor)
            inputs[name] = t.transpose(1, 2).contiguous().transpose(1, 2)
        return inputs

    @staticmethod
    def _call(inputs: Mapping[str, Any], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
              ) -> torch.Tensor:
        documents = inputs["block_mask"].documents
        assert documents is not None, "the sweep's documents masks carry their documents"
        return run_documents(q, k, v, documents, inputs["scale"])

    @staticmethod
    def _dense_mask(inputs: Mapping[str, Any]) -> torch.Tensor:
        return inputs["block_mask"].to_dense()  # type: ignore[no-any-return]


class TorchVarlenTemplate(_VarlenTemplate):
    name = "torch_varlen"
    description = ("torch.nn.attention.varlen.varlen_attn (FlashAttention-2's varlen forward) "
                   "on the problem's packed documents: what a user without tuner runs for "
                   "packed sequences, priced against our block-sparse kernels and Flex.")

    def flops(self, problem: Problem) -> float:
        # Dense-equivalent, as flash_fwd and torch_flex count block-sparse problems.
        return forward_flops(problem)

    def bytes_moved(self, problem: Problem) -> float:
        return forward_bytes(problem, lse=False)

    def run(self, inputs: Mapping[str, Any], config: KernelConfig) -> Any:
        return self._call(inputs, inputs["q"], inputs["k"], inputs["v"])

    def reference(self, inputs: Mapping[str, Any]) -> Any:
        return attention_reference(inputs["q"], inputs["k"], inputs["v"],
                                   causal=inputs["causal"], scale=inputs["scale"],
                                   mask=self._dense_mask(inputs))[0]


class TorchVarlenTrainTemplate(_VarlenTemplate):
    name = "torch_varlen_train"
    description = ("torch's varlen_attn forward + backward (its own autograd) on the "
                   "problem's packed documents; compared with flash_fwd + flash_bwd and "
                   "torch_flex_train for packed calls that need a gradient.")

    def flops(self, problem: Problem) -> float:
        return 3.5 * forward_flops(problem)  # forward + backward, as torch_flex_train

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
                               mask=self._dense_mask(inputs))


TORCH_VARLEN = register(TorchVarlenTemplate())
TORCH_VARLEN_TRAIN = register(TorchVarlenTrainTemplate())
