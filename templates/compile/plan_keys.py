"""Pieces of a kernel entry point's plan key (``templates.compile.plan_cache``): what a plan
reads of its tensors and of its config, computed alike by every entry that keeps plans."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["NO_PLAN", "config_key", "layout_key"]

# ``config_key``'s answer for a config no plan is kept for (the entry's full path then
# raises the right error).
NO_PLAN = object()


def layout_key(*tensors: Any) -> tuple[object, ...]:
    """Class, shape, strides, dtype and device of each tensor, in order: all a launch plan
    reads of them (values never enter). Raises AttributeError/TypeError/RuntimeError for
    arguments that are not tensors or have no strides (fake tensors): the caller's key is
    then None."""
    return tuple((t.__class__, t.shape, t.stride(), t.dtype, t.device) for t in tensors)


def config_key(template: Any, config: Any, config_cls: type) -> Any:
    """``config`` as the key holds it: None (the default) or a ``config_cls`` as given, a
    mapping validated into one (on every call: pass a ``config_cls`` to skip that), else
    ``NO_PLAN``."""
    if config is None or isinstance(config, config_cls):
        return config
    if not isinstance(config, Mapping):
        return NO_PLAN
    try:
        return template.config(config)
    except (TypeError, ValueError):
        return NO_PLAN
