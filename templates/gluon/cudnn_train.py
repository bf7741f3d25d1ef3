"""``gluon_cudnn_train``: a training step's attention by our Gluon forward and cuDNN's backward.

Our own backwards (Triton ``flash_bwd``, Gluon ``gluon_bwd``) run at about 0.6x cuDNN's on the
H100, while the Gluon forward beats cuDNN's forward on some problems (d128 causal: 1.07-1.11x).
A training step made of the Gluon forward and cuDNN's backward (``templates.pytorch.cudnn_bwd``, fed
with the forward's o and logsumexp) is then faster than torch SDPA's cuDNN forward + backward
there, and the dispatcher can only know where by measuring the pair as it runs: this template
times the forward and the backward together, as ``torch_sdpa_train`` times SDPA's, so the two
are compared on equal terms (a sum of separately timed parts read up to 3% off the pair on
the H100). Its knobs are the Gluon forward's (``GluonFwdConfig``): the backward has none.

Dense and causal problems only (cuDNN's causal is top-left: bottom-right runs only where
N_q = N_kv, where the two agree); no block masks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from templates.base import KernelConfig, Problem
from templates.gluon import fwd
from templates.gluon import training as gluon_training
from templates.gluon.training import GluonTrainingTemplate
from templates.pytorch import cudnn_bwd
from templates.registry import register


class GluonCudnnTrainTemplate(GluonTrainingTemplate):
    name = "gluon_cudnn_train"
    description = ("a training step's attention: the Gluon forward (gluon_fwd's knobs) and "
                   "torch's cuDNN backward fed with its o and logsumexp, timed together; "
                   "compared with torch_sdpa_train (cuDNN both ways) by the dispatcher.")

    def source_modules(self) -> Sequence[str]:
        return [*super().source_modules(), fwd.__name__, gluon_training.__name__,
                cudnn_bwd.__name__]

    def unsupported(self, problem: Problem) -> str | None:
        if (problem.mask == "none" and problem.causal == "bottom_right"
                and problem.seqlen_q != problem.seqlen_kv):
            return ("cuDNN's causal mask is top-left aligned; a bottom-right causal problem "
                    "with seqlen_q != seqlen_kv is not one it computes")
        return super().unsupported(problem)

    def backward(self, inputs: Mapping[str, Any], o: torch.Tensor, lse: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return cudnn_bwd.cudnn_attention_bwd(inputs["do"], inputs["q"], inputs["k"],
                                             inputs["v"], o, lse,
                                             causal=inputs["causal"] != "none",
                                             scale=inputs["scale"])

    def standalone_source(self, config: KernelConfig) -> str:
        raise NotImplementedError(
            f"{self.name} pairs gluon_fwd's kernel with torch's cuDNN backward, which is not "
            f"ours to export: export gluon_fwd with this config ({self.config(config).key()}) "
            f"and call torch.ops.aten._scaled_dot_product_cudnn_attention_backward with its "
            f"o and logsumexp")


TEMPLATE = register(GluonCudnnTrainTemplate())
