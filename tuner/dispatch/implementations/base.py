"""The contract every implementation of ``tuner.attention`` keeps (``Implementation``), and
what the dispatcher answers with (``Estimate``, ``Choice``)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from templates.base import KernelConfig
from templates.registry import get_template
from tuner.dispatch.implementations.call import Call
from tuner.dispatch.implementations.mask_args import NO_MASK, Masked
from tuner.dispatch.neighbours import Verdict
from tuner.lookup.resolver import Resolved

__all__ = ["Choice", "Estimate", "Implementation", "Request", "Run"]

Run = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True, slots=True)
class Request:
    """A checked call of ``tuner.attention`` off the hot path (a gradient needed, a mask, a
    softcap, or under torch.compile); ``mask`` is None for a dense call, ``softcap`` 0 for
    uncapped scores."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    is_causal: bool
    scale: float | None
    enable_gqa: bool
    needs_grad: bool
    mask: Masked | None = None
    softcap: float = 0.0

    def op_args(self) -> tuple[object, ...]:
        """What a training op takes after (q, k, v, is_causal, scale, enable_gqa): the mask's
        arguments (none for a dense call), then the softcap where there is one
        (``ops.SOFTCAP_ARG``)."""
        mask = () if self.mask is None else self.mask.op_args()
        if self.softcap:
            return (*(mask or NO_MASK), self.softcap)
        return mask


class Implementation:
    """One way to run calls of ``tuner.attention``. A subclass, registered with
    ``tuner.dispatch.implementations.register_implementation``, is all a new one needs: the public
    entry validates, asks ``tuner.dispatch.rule`` to choose, and runs what the chosen one says.

    Which calls it serves: ``serves(call)`` says why it cannot take one (None: it can); the
    templates below refuse the problems they do not take (``Template.unsupported``).

    The templates that price it: ``forward``, priced for inference (its config is what runs);
    ``training``, whose times add up to a forward and backward (empty: it has no backward and
    serves no call that needs a gradient). The dispatcher runs the fastest priced one.

    How it plans an inference call: ``plan(q, k, v, is_causal, scale, enable_gqa, choice)``
    returns a function of (q, k, v) giving the output, for inputs laid out as these (or of any
    layout, with ``layout_free``). ``tuner.attention`` keeps it in the one plan cache
    (``tuner.dispatch.plans``) and calls only it on later calls of that problem and layout: do every
    check and lookup in ``plan``, none in what it returns.

    Its training op: ``training_op``, called (q, k, v, is_causal, scale, enable_gqa, *mask)
    -> (o, lse): a ``torch.library`` op with its fake and its backward registered by the
    implementation's module, or (what ours are) an ``ops.TrainingOp``, which runs that op
    under torch.compile (Dynamo keeps a custom op in the graph) and its bodies under one
    autograd.Function eagerly. It runs calls that need a gradient and finds its configs
    itself (through ``tuner.dispatch.plans``).

    How it runs a call off the hot path: ``run(request, choice, constant)`` (a gradient, a
    mask, or under torch.compile, where ``choice`` is None and ``constant`` is what
    ``constant(choice)`` fixed at trace time). The default runs the training op for a
    gradient, the op ``tuner::attention_inference`` under torch.compile (which runs this
    implementation's eager path from the graph) and ``masked`` for an eager masked call.

    Repeatable gradients: ``deterministic_backward`` False says its gradients differ between
    runs in the last bits (dQ summed in no fixed order); under
    ``torch.use_deterministic_algorithms(True)`` it then serves no call that needs one.
    Masks: ``runs_masks`` says it takes block masks; ``masked(request, choice)`` runs a masked
    call eagerly; ``mask_refusal`` says why a mask's blocks make it hand the call to the
    block-mask baseline (None: it runs it); ``unnamed_mask_choice`` is its choice, when
    forced, for a mask no measurement prices. Masks travel through ops as tensors
    (``tuner.dispatch.implementations.mask_args``).

    Packed sequences (``tuner.varlen_attention``) are masked calls whose document mask
    carries its offsets (``BlockMask.documents``); ``needs_documents`` says it runs only
    such masks (torch's ``varlen_attn`` takes offsets, not blocks), and a mask without them
    goes to the block-mask baseline (``tuner.dispatch.rule.choose_masked``).

    Softcapped scores (``Request.softcap``, ``Problem.softcap``; Gemma 2): served where every
    template of it takes them (``Template.takes_softcap``; the others refuse the problem by
    name). A dense inference call runs ``softcap_plan``; a masked one ``masked`` (which reads
    ``request.softcap``); a gradient the training op, given the softcap after the mask's
    arguments (``Request.op_args``). Never the hot path: softcap calls are not SDPA's.
    """

    name: str = ""
    forward: str = ""
    training: tuple[str, ...] = ()
    description: str = ""
    layout_free = False  # one plan serves inputs of any strides and alignment
    runs_masks = False
    # Whether it runs only block masks that carry their packed documents' offsets.
    needs_documents = False
    # Whether its gradients are bitwise repeatable (or can be made so under
    # torch.use_deterministic_algorithms); False: not offered for a gradient then.
    deterministic_backward = True
    training_op: Any = None  # what runs calls with a gradient (a TrainingOp or library op)

    def serves(self, call: Call) -> str | None:
        return None

    def templates_for(self, call: Call) -> tuple[str, ...]:
        return self.training if call.needs_grad else (self.forward,)

    def why_not(self, call: Call) -> str | None:
        if call.needs_grad and not self.training:
            return f"{self.name} has no backward"
        if call.needs_grad and not self.deterministic_backward and (
                torch.are_deterministic_algorithms_enabled()):
            return (f"{self.name}'s backward sums dQ in no fixed order (not bitwise "
                    f"repeatable), and torch.use_deterministic_algorithms is on")
        for name in self.templates_for(call):
            reason = get_template(name).unsupported(call.problem)
            if reason:
                return reason
        return self.serves(call)

    def plan(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
             scale: float | None, enable_gqa: bool, choice: Choice) -> Run:
        raise NotImplementedError(f"{self.name} has no inference plan")

    def softcap_plan(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     is_causal: bool, scale: float | None, enable_gqa: bool, softcap: float,
                     choice: Choice) -> Run:
        """``plan`` for scores capped at ``softcap`` (> 0)."""
        raise NotImplementedError(f"{self.name} has no softcap plan")

    def constant(self, choice: Choice) -> str:
        """What of ``choice`` a call traced by torch.compile keeps (a string)."""
        return ""

    def run(self, r: Request, choice: Choice | None, constant: str) -> torch.Tensor:
        mask = r.op_args()  # a dense uncapped call: the 6-argument form
        if r.needs_grad:
            if self.training_op is None:
                raise ValueError(f"{self.name} has no training op")
            return self.training_op(r.q, r.k, r.v, r.is_causal, r.scale,  # type: ignore[no-any-return]
                                    r.enable_gqa, *mask)[0]
        if choice is None:  # traced: the eager path, run from the graph by this op
            return torch.ops.tuner.attention_inference(  # type: ignore[no-any-return]
                r.q, r.k, r.v, r.is_causal, r.scale, r.enable_gqa, self.name, *mask)
        if r.mask is None and r.softcap:
            return self.softcap_plan(r.q, r.k, r.v, r.is_causal, r.scale, r.enable_gqa,
                                     r.softcap, choice)(r.q, r.k, r.v)
        if r.mask is None:  # (eager dense calls take the hot path; this is for completeness)
            return self.plan(r.q, r.k, r.v, r.is_causal, r.scale, r.enable_gqa, choice)(
                r.q, r.k, r.v)
        return self.masked(r, choice)

    def masked(self, r: Request, choice: Choice) -> torch.Tensor:
        raise ValueError(f"{self.name} runs no masked call")

    def mask_refusal(self, block_size: tuple[int, int], needs_grad: bool, choice: Choice
                     ) -> str | None:
        return None

    def unnamed_mask_choice(self, call: Call) -> Choice | None:
        """Its choice when forced on a block mask without a pattern (None: the block-mask
        baseline's)."""
        return None

    def __repr__(self) -> str:
        return f"<implementation {self.name}>"


@dataclass(frozen=True)
class Estimate:
    """One implementation's price for a call: resolved configs and the time they add up to."""

    implementation: str
    resolved: tuple[Resolved, ...]  # one per template of ``templates_for``
    ms: float | None  # None: some template has no measurement for this problem

    def to_dict(self) -> dict[str, object]:
        return {"implementation": self.implementation, "ms": self.ms,
                "matches": [r.match for r in self.resolved]}


@dataclass(frozen=True)
class Choice:
    """The implementation that runs, its configs, why, and the prices it was chosen among."""

    implementation: Implementation
    resolved: tuple[Resolved, ...]
    why: str
    estimates: tuple[Estimate, ...] = field(default=())
    # The neighbouring bucket (problem key) the choice was decided on (None: this problem's
    # own measurements, or none).
    neighbour: str | None = None
    # What the measurements on that neighbour decided, every implementation's time there.
    verdict: Verdict | None = field(default=None, compare=False, repr=False)

    @property
    def config(self) -> KernelConfig:
        """The forward template's config (the first resolved)."""
        return self.resolved[0].config

    @property
    def match(self) -> str:
        return self.resolved[0].match

    @property
    def source(self) -> str:
        """Where the config comes from; a config taken from a neighbour names it."""
        r = self.resolved[0]
        return r.source if r.neighbour is None else f"{r.source}, neighbour {r.neighbour}"

    @property
    def expires_at(self) -> float:
        """Ask again once any resolved config may change (an untuned answer expires)."""
        return min((r.expires_at for r in self.resolved), default=math.inf)

    @property
    def measured(self) -> bool:
        """Every config it runs was measured on this problem."""
        return bool(self.resolved) and all(r.measured for r in self.resolved)
