"""``gluon_train``: a training step's attention by our own kernels both ways, the Gluon forward
and the Gluon backward (``templates.gluon.bwd``, its default config), timed together.

The sibling of ``gluon_cudnn_train`` (the same forward, cuDNN's backward): the dispatcher
prices both beside ``torch_sdpa_train`` and runs the fastest measured, so the day our backward
passes cuDNN's on a problem the training step there runs our kernels alone, with no change
anywhere else. Its knobs are the Gluon forward's (``GluonFwdConfig``); the backward takes its
template's default for the problem. Dense and causal problems (top-left, or bottom-right),
head dims the backward takes (64, 128, 256; 256 without a block mask), and block masks of the
named patterns with causal "none" (the mask carries its causality): the Gluon forward and the
warp-specialized Gluon backward both walk the mask's blocks (128 x 128).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from templates.base import KernelConfig, Problem
from templates.flash.bwd import reference_grads
from templates.gluon import bwd as gluon_bwd
from templates.gluon import fwd
from templates.gluon import training as gluon_training
from templates.gluon.training import GluonTrainingTemplate
from templates.registry import register


class GluonTrainTemplate(GluonTrainingTemplate):
    name = "gluon_train"
    description = ("a training step's attention by our kernels both ways: the Gluon forward "
                   "(gluon_fwd's knobs) and the Gluon backward (gluon_bwd's default config) fed "
                   "with its o and logsumexp, timed together; compared with torch_sdpa_train "
                   "and gluon_cudnn_train by the dispatcher.")

    def source_modules(self) -> Sequence[str]:
        return [*super().source_modules(), fwd.__name__, gluon_training.__name__,
                gluon_bwd.__name__]

    # Both kernels walk block masks (the backward: its warp-specialized kernel).
    block_masks = True

    def unsupported(self, problem: Problem) -> str | None:
        # The Gluon forward's refusals (GluonTrainingTemplate's "dense only" is cuDNN's
        # backward's), then the backward's: causal "none" under a mask, head dims 64/128/256
        # (256 dense and causal only).
        reason = fwd.GluonFwdTemplate.unsupported(self, problem)
        return reason or gluon_bwd.TEMPLATE.unsupported(problem)

    def make_inputs(self, problem: Problem, device: str, seed: int = 0) -> dict[str, Any]:
        """Random q, k, v and do, and the block mask of ``problem.mask`` (if any) under
        ``block_mask``, as gluon_fwd's."""
        inputs = super().make_inputs(problem, device, seed)
        if problem.mask != "none":
            inputs["block_mask"] = fwd.pattern_mask(problem.mask, problem.seqlen_q,
                                                    problem.seqlen_kv, str(device))
        return inputs

    def backward(self, inputs: Mapping[str, Any], o: torch.Tensor, lse: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return gluon_bwd.gluon_attention_bwd(inputs["do"], inputs["q"], inputs["k"],
                                             inputs["v"], o, lse, causal=inputs["causal"],
                                             scale=inputs["scale"],
                                             block_mask=inputs.get("block_mask"))

    def reference(self, inputs: Mapping[str, Any]) -> Any:
        block_mask = inputs.get("block_mask")
        return reference_grads(inputs["q"], inputs["k"], inputs["v"], inputs["do"],
                               causal=inputs["causal"], scale=inputs["scale"],
                               mask=None if block_mask is None else block_mask.to_dense())

    def standalone_source(self, config: KernelConfig) -> str:
        raise NotImplementedError(
            f"{self.name} pairs two kernels: export gluon_fwd with this config "
            f"({self.config(config).key()}) and gluon_bwd with its default, and feed the "
            f"forward's o and logsumexp to the backward")


TEMPLATE = register(GluonTrainTemplate())
