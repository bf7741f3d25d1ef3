"""What the Gluon forward's training templates share: a training step's attention made of the
Gluon forward (its knobs are the template's) and a backward fed the forward's o and
logsumexp, timed together and priced at 3.5x the forward's FLOPs, as ``torch_sdpa_train``
(``gluon_cudnn_train``: cuDNN's backward; ``gluon_train``: ours). Dense problems only."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from templates.attention_reference import forward_bytes, forward_flops, random_inputs
from templates.base import KernelConfig, Problem, Template
from templates.flash.bwd import reference_grads
from templates.gluon import fwd


class GluonTrainingTemplate(fwd.GluonFwdTemplate):
    """The Gluon forward, then ``backward`` on its o and lse; a subclass names the backward."""

    block_masks = False

    def backward(self, inputs: Mapping[str, Any], o: torch.Tensor, lse: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def unsupported(self, problem: Problem) -> str | None:
        if problem.mask != "none":
            return (f"{self.name} takes dense problems: its backward takes no block mask "
                    f"(pattern {problem.mask!r})")
        return super().unsupported(problem)

    def flops(self, problem: Problem) -> float:
        return 3.5 * forward_flops(problem)  # forward + backward, as torch_sdpa_train

    def bytes_moved(self, problem: Problem) -> float:
        return 2.0 * forward_bytes(problem, lse=False)

    def make_inputs(self, problem: Problem, device: str, seed: int = 0) -> dict[str, Any]:
        return random_inputs(problem, device, seed, grad_out=True)

    def run(self, inputs: Mapping[str, Any], config: KernelConfig) -> Any:
        o, lse = super().run(inputs, config)
        return self.backward(inputs, o, lse)

    def reference(self, inputs: Mapping[str, Any]) -> Any:
        return reference_grads(inputs["q"], inputs["k"], inputs["v"], inputs["do"],
                               causal=inputs["causal"], scale=inputs["scale"])

    def error(self, out: Any, ref: Any) -> float:
        return Template.error(self, out, ref)  # the largest of dq's, dk's and dv's
