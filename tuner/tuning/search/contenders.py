"""Which implementations of a problem are still worth searching (issue 42): one measured
clearly slower than another on the same problem, in every call it could serve (inference, a
training step), stops being searched, and the sweep's time goes to the contenders.

"Clearly" is the head-to-head's rule for telling two implementations apart
(``tuner.dispatch.close_calls.decided``) on each one's readings of its best config so far (its first
reading and its re-measurements): the ranges are apart, the leader's slowest price faster than
the other's fastest (these readings were not taken round by round, so there is nothing for the
sign test to pair); and, as the readings are of configs still to be searched, the other's
median price is behind by more than ``PRUNE_MARGIN``, more than a search gains over a
template's first configs (the largest tuned-over-default gain of the H100 grid study was
1.04x, docs/TUNING.md). An implementation is priced as the dispatcher prices it, the sum over
its templates (``tuner.tuning.head_to_head.priced_by``); a template is dropped only where every
implementation it takes part in, in every call, is beaten so.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence

from templates.base import Problem
from templates.device import DeviceInfo
from tuner.dispatch.close_calls import decided
from tuner.tuning.head_to_head import priced_by

__all__ = ["PRUNE_MARGIN", "beaten_templates"]

PRUNE_MARGIN = 0.10


def beaten_templates(problem: Problem, readings: Mapping[str, Sequence[float]],
                     device: DeviceInfo, margin: float = PRUNE_MARGIN) -> dict[str, str]:
    """Template -> why it stops being searched, from each template's readings (ms) of its best
    config so far on ``problem`` (module docstring); templates without readings are left be."""
    measured = [name for name, ms in readings.items() if ms]
    verdicts: dict[str, list[str | None]] = {}
    for call in priced_by(problem, measured, device):
        prices = {impl: _price(impl, readings) for impl in call}
        leader = min(prices, key=lambda impl: prices[impl][1])
        for impl, price in prices.items():
            why = None if impl == leader else _beaten(impl, price, leader, prices[leader],
                                                      margin)
            for name in impl:
                verdicts.setdefault(name, []).append(why)
    return {name: "; ".join(dict.fromkeys(w for w in whys if w))
            for name, whys in verdicts.items() if whys and all(whys)}


def _price(impl: tuple[str, ...], readings: Mapping[str, Sequence[float]]
           ) -> tuple[float, float, float]:
    """(fastest, median, slowest) price of an implementation: sums over its templates."""
    return (sum(min(readings[t]) for t in impl),
            sum(statistics.median(readings[t]) for t in impl),
            sum(max(readings[t]) for t in impl))


def _beaten(impl: tuple[str, ...], price: tuple[float, float, float],
            leader: tuple[str, ...], leader_price: tuple[float, float, float],
            margin: float) -> str | None:
    # Unpaired readings: only decided()'s ranges test can hold (no round is in both).
    apart = decided({0: leader_price[0], 1: leader_price[2]}, {2: price[0], 3: price[2]})
    if not apart or price[1] < (1 + margin) * leader_price[1]:
        return None
    return (f"{'+'.join(impl)} measured {price[1] / leader_price[1]:.2f}x the time of "
            f"{'+'.join(leader)} ({price[1]:.4g} against {leader_price[1]:.4g} ms, readings "
            f"apart)")
