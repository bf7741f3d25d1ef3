"""Autotuned FlashAttention: the one public import surface of the project.

The public names are imported when first used, not by ``import tuner``: the ``tuner`` command
lives in this package, and importing torch and the kernels first cost every command (``--help``
and error paths included) about 4 s of the 4.8 s that ``python -X importtime -c "import
tuner.cli.app"`` measured on the 2-core CPU machine (issue 41, item 1).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import os
import sys
import types
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from templates.masks.block_mask import BlockMask
    from tuner.attention import attention
    from tuner.client import TunerClient
    from tuner.decode import decode
    from tuner.dispatch.rule import use_implementation
    from tuner.install import install, installed, uninstall
    from tuner.record import record, record_from_environment  # noqa: F401
    from tuner.varlen import varlen_attention

__all__: list[str] = ["BlockMask", "TunerClient", "attention", "decode", "install", "installed",
                       "record", "uninstall", "use_implementation", "varlen_attention"]

# Public name -> the module that defines it.
_PUBLIC = {
    "BlockMask": "templates.masks.block_mask",
    "TunerClient": "tuner.client",
    "attention": "tuner.attention",
    "decode": "tuner.decode",
    "install": "tuner.install",
    "installed": "tuner.install",
    "record": "tuner.record",
    "record_from_environment": "tuner.record",
    "uninstall": "tuner.install",
    "use_implementation": "tuner.dispatch.rule",
    "varlen_attention": "tuner.varlen",
}


class _Package(types.ModuleType):
    """``tuner.attention``, ``tuner.decode`` and ``tuner.record`` are functions named like the
    submodules that define them. Importing a submodule binds it on its package; here that
    binding is dropped for those names, so the function (fetched by ``__getattr__``) stays
    what ``tuner.attention`` is, as when the package imported them eagerly."""

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, types.ModuleType) and _PUBLIC.get(name) == f"{__name__}.{name}":
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'tuner' has no attribute {name!r}")
    if module != "tuner.client":
        # All of the entry at once, in the order the eager imports had: tuner.attention
        # registers the implementations that use_implementation names.
        for entry in ("templates.masks.block_mask", "tuner.attention", "tuner.decode",
                      "tuner.dispatch.rule", "tuner.record"):
            importlib.import_module(entry)
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC})


class _InterpreterBeforeTriton(importlib.abc.MetaPathFinder):
    """On a machine without CUDA, Triton's interpreter must be switched on before triton is
    imported (its own jit functions are built at import; templates/device.py). ``import tuner``
    promised that switch; done here, when triton is first imported by anyone, it needs torch
    (1.6 s) only in processes that use triton at all."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> None:
        if fullname == "triton":
            sys.meta_path.remove(self)
            if "TRITON_INTERPRET" not in os.environ:
                import torch  # does not import triton (checked with torch 2.11 and 2.13)

                if not torch.cuda.is_available():
                    os.environ["TRITON_INTERPRET"] = "1"
        return None


if "triton" not in sys.modules and "TRITON_INTERPRET" not in os.environ:
    sys.meta_path.insert(0, _InterpreterBeforeTriton())


def _log_level_from_environment() -> None:
    # Only when asked for: a library leaves logging to its application (tuner/logs.py).
    if "TUNER_LOG_LEVEL" not in os.environ:
        return
    # lazy: pydantic-settings, read only where TUNER_LOG_LEVEL is set (`import tuner` stays bare)
    from tuner.logs import configure_logging
    from tuner.settings import SettingsError, load_log_settings

    # A bad value is reported where the settings are read whole, with the variable's name:
    # the `tuner` command's start, and the first config lookup of tuner.attention.
    with contextlib.suppress(SettingsError):
        configure_logging(load_log_settings().log_level)


_log_level_from_environment()

# TUNER_RECORD=path (tuner/record.py's ENV_VAR): this process's problems, written at exit.
# Checked here so that a process that does not record does not import torch for it.
if os.environ.get("TUNER_RECORD"):
    importlib.import_module("tuner.record").record_from_environment()
