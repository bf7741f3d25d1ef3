"""``gluon_train``: a training step's attention by our own kernels both ways, the Gluon forward
and the Gluon backward (``templates.gluon_bwd``, its default config), timed together.

The sibling of ``gluon_cudnn_train`` (the same forward, cuDNN's backward): the dispatcher
prices both beside ``torch_sdpa_train`` and runs the fastest measured, so the day our backward
passes cuDNN's on a problem the training step there runs our kernels alone, with no change
anywhere else. Its knobs are the Gluon forward's (``GluonFwdConfig``); the backward takes its
template's default for the problem. Dense and causal problems (top-left, or bottom-right),
head dims the backward takes (64, 128); no block masks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from templates import gluon_bwd
from templates import gluon_fwd as fwd
from templates.attention_reference import forward_bytes, forward_flops, random_inputs
from templates.base import KernelConfig, Problem, Template
from templates.flash_bwd import reference_grads
from templates.registry import register


class GluonTrainTemplate(fwd.GluonFwdTemplate):
    name = "gluon_train"
    description = ("a training step's attention by our kernels both ways: the Gluon forward "
                   "(gluon_fwd's knobs) and the Gluon backward (gluon_bwd's default config) fed "
                   "with its o and logsumexp, timed together; compared with torch_sdpa_train "
                   "and gluon_cudnn_train by the dispatcher.")
    block_masks = False

    def source_modules(self) -> Sequence[str]:
        return [*super().source_modules(), fwd.__name__, gluon_bwd.__name__]

    def unsupported(self, problem: Problem) -> str | None:
        if problem.mask != "none":
            return f"{self.name} takes dense problems: gluon_bwd takes no block mask " \
                   f"(pattern {problem.mask!r})"
        reason = gluon_bwd.TEMPLATE.unsupported(problem)
        return reason or super().unsupported(problem)

    def flops(self, problem: Problem) -> float:
        return 3.5 * forward_flops(problem)  # forward + backward, as torch_sdpa_train

    def bytes_moved(self, problem: Problem) -> float:
        return 2.0 * forward_bytes(problem, lse=False)

    def make_inputs(self, problem: Problem, device: str, seed: int = 0) -> dict[str, Any]:
        return random_inputs(problem, device, seed, grad_out=True)

    def run(self, inputs: Mapping[str, Any], config: KernelConfig) -> Any:
        o, lse = super().run(inputs, config)
        return gluon_bwd.gluon_attention_bwd(inputs["do"], inputs["q"], inputs["k"],
                                             inputs["v"], o, lse, causal=inputs["causal"],
                                             scale=inputs["scale"])

    def reference(self, inputs: Mapping[str, Any]) -> Any:
        return reference_grads(inputs["q"], inputs["k"], inputs["v"], inputs["do"],
                               causal=inputs["causal"], scale=inputs["scale"])

    def error(self, out: Any, ref: Any) -> float:
        return Template.error(self, out, ref)  # the largest of dq's, dk's and dv's

    def standalone_source(self, config: KernelConfig) -> str:
        raise NotImplementedError(
            f"{self.name} pairs two kernels: export gluon_fwd with this config "
            f"({self.config(config).key()}) and gluon_bwd with its default, and feed the "
            f"forward's o and logsumexp to the backward")


TEMPLATE = register(GluonTrainTemplate())
