"""``torch_varlen``: torch's own ``torch.nn.attention.varlen.varlen_attn`` (FlashAttention-2's
varlen kernels) for packed documents, where this torch has it; a candidate beside ours and
Flex, priced by its templates ``torch_varlen`` / ``torch_varlen_train``
(``templates.pytorch.varlen``, which also adapts to the torch release's signature).

How a packed call reaches it. ``tuner.varlen_attention`` (and ``tuner.hf``'s packed layers, and
a dense mask recognized as documents) run as ``tuner.attention`` with a document ``BlockMask``
named ``documents[_causal]:<L>``; the dispatcher decides that mask problem among the
implementations serving it. Blocks alone cannot be handed to ``varlen_attn``, which takes
offsets, so the extension is the smallest that carries them: a mask built from documents
keeps them (``BlockMask.documents``, a ``DocumentOffsets``: the cu_seqlens of one row and
whether each document is causal), and an implementation that needs them says so
(``Implementation.needs_documents``). ``choose_masked`` is told whether the call's mask
carries documents and hands a mask without them (a user's own mask named by a documents
pattern) to the block-mask baseline, as it does a mask whose blocks an implementation cannot
walk (``mask_refusal``). Nothing else changed: the choice is made on the mask problem's own
bucket, as for Flex.

It runs a call as it is, eager or compiled, with a gradient or without: ``varlen_attn`` is a
``torch.library`` op with its own backward, so there is no training op of ours; rows of a
(B, H, L, D) call are packed one after another with the documents repeated per row (free for
the packed layouts ``tuner.varlen_attention`` and transformers pass). Under torch.compile the
call is one graph break (the offsets are read off the mask object), as Flex's gradient is.

It refuses by name: the CPU and GPUs before compute capability 8.0, a torch without
``varlen_attn`` (``serves``); softcapped scores, non-document masks, a causal call on top of
the mask, dtypes other than float16/bfloat16, head dims FlashAttention-2 does not take (its
templates' ``unsupported``); and under ``torch.use_deterministic_algorithms(True)`` calls
that need a gradient (FlashAttention-2's backward accumulates dQ atomically).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from templates.masks.document_offsets import DocumentOffsets
from templates.pytorch import varlen as torch_varlen_templates
from templates.pytorch.varlen import VarlenConfig
from tuner.dispatch.implementations.base import Choice, Implementation, Request, Run
from tuner.dispatch.implementations.call import Call
from tuner.dispatch.implementations.registry import register_implementation
from tuner.lookup.resolver import Resolved

__all__ = ["TorchVarlen"]

MIN_COMPUTE_CAPABILITY = 8  # FlashAttention-2


class TorchVarlen(Implementation):
    name = "torch_varlen"
    forward = "torch_varlen"
    training = ("torch_varlen_train",)
    description = ("torch.nn.attention.varlen.varlen_attn (FlashAttention-2 varlen) on a "
                   "document mask's offsets; a candidate for packed documents beside ours and "
                   "Flex, where this torch has it")
    runs_masks = True
    needs_documents = True
    deterministic_backward = False  # FlashAttention-2 adds dQ up atomically

    def serves(self, call: Call) -> str | None:
        capability = call.device.compute_capability
        if not capability:
            return "torch's varlen_attn is a CUDA kernel; this call is on the CPU"
        if int(capability.split(".")[0]) < MIN_COMPUTE_CAPABILITY:
            return (f"torch's varlen_attn (FlashAttention-2) needs compute capability "
                    f"{MIN_COMPUTE_CAPABILITY}.0 or newer, but this GPU has {capability}")
        if torch_varlen_templates.varlen_attn_function() is None:
            return f"torch {torch.__version__} has no torch.nn.attention.varlen.varlen_attn"
        return None

    def plan(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
             scale: float | None, enable_gqa: bool, choice: Choice) -> Run:
        raise ValueError("torch_varlen runs packed documents only (tuner.varlen_attention, or "
                         "tuner.attention with a document block_mask); dense calls are torch "
                         "SDPA's")

    def run(self, r: Request, choice: Choice | None, constant: str) -> torch.Tensor:
        """torch's op, its own autograd, eager or traced (module docstring)."""
        documents = None if r.mask is None or r.mask.block_mask is None else (
            r.mask.block_mask.documents)
        if documents is None:  # choose_masked never gives it such a call
            raise ValueError("torch_varlen needs a block mask that carries its documents "
                             "(BlockMask.documents: tuner.varlen_attention's masks do)")
        if r.is_causal:
            raise ValueError("torch_varlen takes causality from the documents, not is_causal")
        return _run_documents(r.q, r.k, r.v, documents, r.scale)

    def masked(self, r: Request, choice: Choice) -> torch.Tensor:
        return self.run(r, choice, "")

    def unnamed_mask_choice(self, call: Call) -> Choice | None:
        """Forced on documents no pattern names (queries and keys packed differently, or
        other blocks than the sweeps'): its one config, after the checks a documents problem
        gets (the pattern's length matters to none of them)."""
        reason = self.why_not(replace(call, problem=replace(call.problem, mask="documents:1")))
        if reason:
            raise ValueError(f"implementation {self.name!r} was forced but cannot run "
                             f"{call.problem.key()} with its mask: {reason}")
        return Choice(self, (Resolved(VarlenConfig(), "default", "default"),),
                      "forced by use_implementation (documents without a pattern: its one "
                      "config)")


@torch.compiler.disable
def _run_documents(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   documents: DocumentOffsets, scale: float | None) -> torch.Tensor:
    # Looked up on the module at each call (tests stand in for varlen_attn there).
    return torch_varlen_templates.run_documents(q, k, v, documents, scale)


TORCH_VARLEN = register_implementation(TorchVarlen())
