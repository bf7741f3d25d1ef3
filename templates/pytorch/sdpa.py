"""torch's own attention as tuning candidates: ``torch_sdpa`` (forward) and ``torch_sdpa_train``
(forward + backward), one config per SDPA backend.

What a user's code runs before switching to ``tuner.attention`` is
``torch.nn.functional.scaled_dot_product_attention`` with torch's default backend choice (cuDNN
on an H100 with torch 2.11). For the dispatcher to promise "never slower than what it
replaces", that must be measured like any of our kernels: in the same trial worker, against the
same reference, with the same timer, stored in the same tables. These templates make it so; a
sweep then answers "which implementation, and which config" (docs/DISPATCH.md).

The one knob is the backend. ``default`` is torch's own choice (what the user had); the others
force one backend through ``torch.nn.attention.sdpa_kernel``. A backend that cannot take a
problem fails its trial (torch raises "No available kernel"), which the tuner stores as a
failed config, not an error.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from templates.attention_reference import (
    attention_reference,
    forward_bytes,
    forward_flops,
    random_inputs,
)
from templates.base import KernelConfig, Problem, Template, knob
from templates.device import DeviceInfo
from templates.flash.bwd import reference_grads
from templates.registry import register

# torch's own function, kept as imported: ``tuner.install()`` may put the dispatcher in its
# place on torch.nn.functional, and the dispatcher's SDPA must stay torch's (no recursion).
TORCH_SDPA_FUNCTION = F.scaled_dot_product_attention

# torch's backends by knob value; "default" leaves the choice to torch.
BACKENDS: dict[str, SDPBackend | None] = {
    "default": None,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
}


@dataclass(frozen=True)
class SdpaConfig(KernelConfig):
    """Which backend of ``torch.nn.functional.scaled_dot_product_attention`` runs."""

    backend: str = knob(
        "default", tuple(BACKENDS),
        "default: torch's own choice for these inputs (what a user's SDPA call runs); cudnn, "
        "flash (FlashAttention-2), efficient (memory-efficient): that backend forced. The "
        "math backend is left out: it materializes the score matrix and never wins.")


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, backend: str = "default",
         attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
         is_causal: bool = False, scale: float | None = None,
         enable_gqa: bool = False) -> torch.Tensor:
    """torch SDPA with ``backend`` forced (``default``: torch's choice, no context manager)."""
    chosen = BACKENDS[backend]
    if chosen is None:
        return TORCH_SDPA_FUNCTION(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p,
                                   is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
    with sdpa_kernel([chosen]):
        return TORCH_SDPA_FUNCTION(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p,
                                   is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)


_BACKEND_OF_CHOICE = {int(b): name for name, b in BACKENDS.items()  # type: ignore[call-overload]
                      if b is not None}


def default_backend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                    is_causal: bool = False, scale: float | None = None,
                    enable_gqa: bool = False) -> str | None:
    """The backend torch's own choice picks for these inputs (None: another one, e.g. math,
    or this torch does not say). A tuned backend equal to it runs as ``default``: the
    ``sdpa_kernel`` context manager costs host time and changes nothing then."""
    try:
        choice = torch._fused_sdp_choice(q, k, v, None, 0.0, is_causal, scale=scale,
                                         enable_gqa=enable_gqa)
    except (AttributeError, RuntimeError, TypeError):
        return None
    return _BACKEND_OF_CHOICE.get(int(choice))


class _SdpaTemplate(Template):
    """What the forward and the training templates share: problems SDPA takes, the space."""

    config_cls = SdpaConfig

    def unsupported(self, problem: Problem) -> str | None:
        reason = super().unsupported(problem)  # a softcapped problem, where it does not cap
        if reason:
            return reason
        if problem.mask != "none":
            return (f"torch_sdpa takes dense problems; block-sparse pattern {problem.mask!r} "
                    f"is for the block-mask kernels")
        if problem.causal == "bottom_right" and problem.seqlen_q != problem.seqlen_kv:
            return ("SDPA's is_causal is top-left aligned; a bottom-right causal problem with "
                    "seqlen_q != seqlen_kv needs an explicit mask")
        return None

    def constraint(self, problem: Problem, config: KernelConfig, device: DeviceInfo
                   ) -> str | None:
        cfg = self.config(config)
        assert isinstance(cfg, SdpaConfig)
        if cfg.backend != "default" and device.is_interpreter:
            return f"SDPA backend {cfg.backend!r} needs a CUDA GPU"
        if cfg.backend in ("cudnn", "flash") and problem.dtype == "float32":
            return f"SDPA backend {cfg.backend!r} takes float16/bfloat16, not float32"
        return None

    def default_config(self, problem: Problem, device: DeviceInfo) -> SdpaConfig:
        return SdpaConfig()

    def make_inputs(self, problem: Problem, device: str, seed: int = 0) -> dict[str, Any]:
        return random_inputs(problem, device, seed, grad_out=True)

    def _call(self, inputs: Mapping[str, Any], config: KernelConfig, q: torch.Tensor,
              k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        cfg = self.config(config)
        assert isinstance(cfg, SdpaConfig)
        return sdpa(q, k, v, backend=cfg.backend, is_causal=inputs["causal"] != "none",
                    scale=inputs["scale"], enable_gqa=q.shape[1] != k.shape[1])


class TorchSdpaTemplate(_SdpaTemplate):
    name = "torch_sdpa"
    description = ("torch.nn.functional.scaled_dot_product_attention forward, one config per "
                   "backend (default dispatch, cuDNN, FlashAttention-2, memory-efficient): the "
                   "baseline every kernel of ours must beat to be chosen.")

    def flops(self, problem: Problem) -> float:
        return forward_flops(problem)

    def bytes_moved(self, problem: Problem) -> float:
        return forward_bytes(problem, lse=False)

    def run(self, inputs: Mapping[str, Any], config: KernelConfig) -> Any:
        return self._call(inputs, config, inputs["q"], inputs["k"], inputs["v"])

    def reference(self, inputs: Mapping[str, Any]) -> Any:
        return attention_reference(inputs["q"], inputs["k"], inputs["v"],
                                   causal=inputs["causal"], scale=inputs["scale"])[0]


class TorchSdpaTrainTemplate(_SdpaTemplate):
    name = "torch_sdpa_train"
    description = ("torch SDPA forward + backward (a training step's attention), one config per "
                   "backend; compared with flash_fwd + flash_bwd by the dispatcher.")

    def flops(self, problem: Problem) -> float:
        # Forward + backward = 3.5 x forward (PROTOCOL.md).
        return 3.5 * forward_flops(problem)

    def bytes_moved(self, problem: Problem) -> float:
        return 2.0 * forward_bytes(problem, lse=False)

    def run(self, inputs: Mapping[str, Any], config: KernelConfig) -> Any:
        q, k, v = (inputs[name].detach().requires_grad_() for name in ("q", "k", "v"))
        with torch.enable_grad():
            o = self._call(inputs, config, q, k, v)
            return torch.autograd.grad(o, (q, k, v), inputs["do"])

    def reference(self, inputs: Mapping[str, Any]) -> Any:
        return reference_grads(inputs["q"], inputs["k"], inputs["v"], inputs["do"],
                               causal=inputs["causal"], scale=inputs["scale"])


TORCH_SDPA = register(TorchSdpaTemplate())
TORCH_SDPA_TRAIN = register(TorchSdpaTrainTemplate())
