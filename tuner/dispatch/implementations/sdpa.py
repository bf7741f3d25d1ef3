"""``sdpa``: torch's own ``scaled_dot_product_attention``, with its best measured backend. The
baseline: it runs every call nothing measured faster, as the user's code ran it."""

from __future__ import annotations

import torch

from templates.pytorch.sdpa import SdpaConfig, default_backend, sdpa
from tuner.dispatch.implementations.base import Choice, Implementation, Request, Run
from tuner.dispatch.implementations.registry import register_implementation

__all__ = ["Sdpa", "sdpa_backend"]


def sdpa_backend(choice: Choice, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 is_causal: bool, scale: float | None, enable_gqa: bool) -> str:
    """The chosen SDPA backend, as ``default`` where torch picks it anyway (then no
    ``sdpa_kernel`` context manager runs on every call)."""
    config = choice.config
    assert isinstance(config, SdpaConfig)
    if config.backend != "default" and config.backend == default_backend(
            q, k, v, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa):
        return "default"
    return config.backend


class Sdpa(Implementation):
    name = "sdpa"
    forward = "torch_sdpa"
    training = ("torch_sdpa_train",)
    description = ("torch.nn.functional.scaled_dot_product_attention, its best measured "
                   "backend (or torch's own choice where nothing is measured)")
    layout_free = True

    def plan(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
             scale: float | None, enable_gqa: bool, choice: Choice) -> Run:
        backend = sdpa_backend(choice, q, k, v, is_causal, scale, enable_gqa)

        def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return sdpa(q, k, v, backend=backend, is_causal=is_causal, scale=scale,
                        enable_gqa=enable_gqa)

        return run

    def constant(self, choice: Choice) -> str:
        config = choice.config
        assert isinstance(config, SdpaConfig)
        return config.backend

    def run(self, r: Request, choice: Choice | None, constant: str) -> torch.Tensor:
        """torch's autograd and, under torch.compile, SDPA traced as SDPA (never masked: the
        dispatcher gives masked calls to implementations that skip blocks)."""
        backend = constant if choice is None else sdpa_backend(
            choice, r.q, r.k, r.v, r.is_causal, r.scale, r.enable_gqa)
        return sdpa(r.q, r.k, r.v, backend=backend, is_causal=r.is_causal, scale=r.scale,
                    enable_gqa=r.enable_gqa)


SDPA = register_implementation(Sdpa())
