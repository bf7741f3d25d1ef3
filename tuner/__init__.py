"""Autotuned FlashAttention: the one public import surface of the project."""

from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING, Any

# Imported eagerly: a lazily imported submodule named `attention` would replace this function
# with itself as `tuner.attention` on first import. Costs importing torch and the templates
# (triton): about 0.5 s over torch alone.
from templates.block_mask import BlockMask
from tuner.attention import attention
from tuner.decode import decode
from tuner.dispatch import use_implementation
from tuner.record import record, record_from_environment
from tuner.varlen import varlen_attention

if TYPE_CHECKING:
    from tuner.client import TunerClient


def _log_level_from_environment() -> None:
    # Only when asked for: a library leaves logging to its application (tuner/logs.py).
    if "TUNER_LOG_LEVEL" not in os.environ:
        return
    from tuner.logs import configure_logging
    from tuner.settings import SettingsError, load_log_settings

    # A bad value is reported where the settings are read whole, with the variable's name:
    # the `tuner` command's start, and the first config lookup of tuner.attention.
    with contextlib.suppress(SettingsError):
        configure_logging(load_log_settings().log_level)


_log_level_from_environment()

__all__: list[str] = ["BlockMask", "TunerClient", "attention", "decode", "record",
                       "use_implementation", "varlen_attention"]

record_from_environment()  # TUNER_RECORD=path: this process's problems, written at exit


def __getattr__(name: str) -> Any:
    # The HTTP client (httpx, pydantic) only when asked for.
    if name == "TunerClient":
        from tuner.client import TunerClient

        return TunerClient
    raise AttributeError(f"module 'tuner' has no attribute {name!r}")
