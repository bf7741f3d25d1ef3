"""Autotuned FlashAttention: the one public import surface of the project."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

# Imported eagerly: a lazily imported submodule named `attention` would replace this function
# with itself as `tuner.attention` on first import. Costs importing torch and the templates
# (triton): about 0.5 s over torch alone.
from templates.block_mask import BlockMask
from tuner.attention import attention
from tuner.decode import decode
from tuner.dispatch import use_implementation

if TYPE_CHECKING:
    from tuner.client import TunerClient

__all__: list[str] = ["BlockMask", "TunerClient", "attention", "decode", "use_implementation"]


def __getattr__(name: str) -> Any:
    # The HTTP client (httpx, pydantic) only when asked for.
    if name == "TunerClient":
        from tuner.client import TunerClient

        return TunerClient
    raise AttributeError(f"module 'tuner' has no attribute {name!r}")
