"""A key for a transformers mask rule that says it is the same rule as one seen before, so
what was read off it (``tuner.dispatch.hf_mask``: its BlockMask, or that it is plain causal)
is reused instead of evaluating the rule again on every forward.

transformers composes a new closure per forward (``and_masks(sliding_window_overlay(w),
causal_mask_function)``), so identity says nothing. What does: the code of every function in
the composition and the values its closures hold. Two rules with equal keys compute the same
thing, provided their code reads nothing else that changes (transformers' mask functions read
only their arguments and their closures). A closure holding anything but plain values and
functions (a tensor: the padding, packed-sequence or chunk-offset masks, whose contents change
per batch) has no key: such a rule is read afresh on every call.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Hashable

__all__ = ["rule_key"]

# How deep a composition is followed (transformers nests two or three levels).
MAX_DEPTH = 8
_PLAIN = (int, float, bool, str, bytes, type(None))


def rule_key(rule: object) -> Hashable | None:
    """The rule's key (module docstring), or None where it has none."""
    return _key(rule, MAX_DEPTH)


def _key(obj: object, depth: int) -> Hashable | None:
    if depth < 0:
        return None
    if isinstance(obj, _PLAIN):
        return (type(obj).__name__, obj)
    if isinstance(obj, tuple | list):
        parts = [_key(item, depth - 1) for item in obj]
        return None if any(p is None for p in parts) else ("seq", *parts)
    if isinstance(obj, functools.partial):
        parts = [_key(obj.func, depth - 1), _key(obj.args, depth - 1),
                 _key(sorted(obj.keywords.items()), depth - 1)]
        return None if any(p is None for p in parts) else ("partial", *parts)
    if isinstance(obj, types.FunctionType):
        cells = []
        for cell in obj.__closure__ or ():
            try:
                contents = cell.cell_contents
            except ValueError:  # an empty cell: a name bound after the function was made
                return None
            cells.append(_key(contents, depth - 1))
        defaults = _key(obj.__defaults__ or (), depth - 1)
        if defaults is None or any(c is None for c in cells):
            return None
        # The module too: equal code reading another module's globals is another rule.
        return ("function", obj.__module__, obj.__code__, defaults, *cells)
    return None
