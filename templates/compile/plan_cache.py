"""``PlanCache``: what checking one call's arguments produced, kept for the next call like it.

A kernel entry point validates its arguments, picks a config and works out the launch (the
forward's took 150-300 us of host time per call on an H100 host, more than the kernel itself
at small shapes). The result depends only on properties of the arguments (shapes, strides,
dtypes, devices, flags), never on tensor values, so the entry keys it by those properties and
a repeated call does only the key and the launch.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Generic, TypeVar

__all__ = ["PlanCache"]

PlanT = TypeVar("PlanT")


class PlanCache(Generic[PlanT]):
    """A bounded map from a call's key to its plan.

    A key must capture everything the plan's checks read, so that a hit is only possible for
    arguments that would have passed them. ``None`` (or an unhashable key) means "do not
    cache": ``get`` misses and ``put`` ignores it.

    Eviction approximates least-recently-used by "second chance": a hit only marks its entry;
    when full, the oldest entry goes unless marked, in which case it is unmarked and moved to
    the back. Moving the entry on every hit instead (an OrderedDict LRU) hashes the key a
    second time, about 1 us per call for a forward key on a CPU of the dev machines.
    """

    def __init__(self, maxsize: int) -> None:
        if maxsize < 1:
            raise ValueError(f"maxsize must be at least 1, but got {maxsize}")
        self.maxsize = maxsize
        self._entries: dict[Hashable, list[object]] = {}  # key -> [plan, used since last pass]

    def get(self, key: Hashable | None) -> PlanT | None:
        if key is None:
            return None
        try:
            entry = self._entries.get(key)
        except TypeError:  # unhashable: an argument of a kind no plan is kept for
            return None
        if entry is None:
            return None
        entry[1] = True
        return entry[0]  # type: ignore[return-value]

    def put(self, key: Hashable | None, plan: PlanT) -> None:
        if key is None:
            return
        try:
            self._entries[key] = [plan, True]  # marked: the oldest goes before the newest
        except TypeError:
            return
        while len(self._entries) > self.maxsize:
            oldest = next(iter(self._entries))
            try:
                entry = self._entries.pop(oldest)
            except KeyError:  # another thread took it
                continue
            if entry[1]:
                entry[1] = False
                self._entries[oldest] = entry

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)
