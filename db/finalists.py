"""How a problem's best config is chosen from its measurements, and which configs are its
finalists (measured again at the end of a search).

A search measures each config once, and the fastest of ~100 noisy single readings is biased
to a lucky one: the winner's curse (issue 6: a stored best re-measured 5.5% slower on the
H100). So the finalists -- the K configs with the fastest first readings, plus the default
config -- are measured again, and compete by the median of all their readings.

The best, among a problem's OK configs (a config whose re-measurement failed is disqualified):

- while no config has re-measurements: the fastest single reading (the rule before finalists);
- then: the fastest finalist by its median; a config measured once competes only if its single
  reading is faster than every finalist's first reading (found after the finalists were
  measured, by a longer sweep: single readings compete with single readings only), and stands
  until it is re-measured in turn.

The default config's number is its median when it was re-measured (with finalists on it always
is), so the speedup over the default compares like with like: median with median.

The time a best is stored at, and priced at by the dispatcher (``priced_readings``): the median
of its readings as above, unless the config took part in a finished head-to-head
(``tuner.tuning.head_to_head``: the bests of every implementation of the problem measured side by
side, rotated over rounds); then the median of its readings in the latest one. Two
implementations' bests are then compared by readings of one session, not by two searches'
readings taken minutes apart. Those readings do not choose among a template's own configs
(they exist for its best only); a failed one disqualifies the config, as a failed
re-measurement does.

Plain data in, plain data out: the database (``db.crud.refresh_best``) and the in-memory
store of replays and tests (``tuner.tuning.search.store.MemoryStore``) use the same rule.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["Choice", "Measured", "Readings", "SideBySide", "choose_best", "pick_finalists"]


@dataclass(frozen=True)
class SideBySide:
    """A config's OK readings in the latest finished head-to-head it took part in."""

    session: int  # the head-to-head's id
    times_ms: tuple[float, ...]
    gflop: float  # the problem's work: TFLOP/s x ms of any one of the readings
    rounds: tuple[int, ...] = ()  # the round of each reading (pairs it with the others')

    @property
    def median_ms(self) -> float:
        return statistics.median(self.times_ms)

    @property
    def tflops(self) -> float:
        return self.gflop / self.median_ms

    def readings(self) -> Readings:
        """These readings as a stored best rests on them (``Readings``)."""
        return Readings(self.times_ms, self.session, self.rounds)


@dataclass(frozen=True)
class Measured:
    """One config of a problem whose first measurement was OK, and its re-measurements."""

    ref: int | str  # what the caller knows the config by: a trial id, a config key
    order: int  # ties go to the lower (the earlier trial)
    first_ms: float
    first_tflops: float
    is_default: bool = False
    remeasured_ms: tuple[float, ...] = ()  # the OK re-measurements
    failed: str | None = None  # why a re-measurement failed: the config is disqualified
    side_by_side: SideBySide | None = None  # its latest finished head-to-head's readings

    @property
    def readings(self) -> Readings:
        return Readings((self.first_ms, *self.remeasured_ms))

    @property
    def runs(self) -> int:
        """Readings behind ``median_ms``."""
        return self.readings.count

    @property
    def median_ms(self) -> float:
        return self.readings.median_ms

    @property
    def tflops(self) -> float:
        """TFLOP/s at the median time (the problem's FLOPs over it)."""
        median = self.median_ms
        if median == self.first_ms:
            return self.first_tflops  # as stored: x * t / t may differ from x in the last bit
        return self.first_tflops * self.first_ms / median

    @property
    def priced_readings(self) -> Readings:
        """The readings its stored time is the median of: its head-to-head's, else its own."""
        if self.side_by_side is not None:
            return self.side_by_side.readings()
        return self.readings

    @property
    def priced_median_ms(self) -> float:
        return self.priced_readings.median_ms

    @property
    def priced_tflops(self) -> float:
        """TFLOP/s at ``priced_median_ms``: what the best is stored and compared at."""
        if self.side_by_side is not None:
            return self.side_by_side.tflops
        return self.tflops


@dataclass(frozen=True)
class Readings:
    """The times a stored best rests on: its trial's first reading and its OK re-measurements
    (a failed re-measurement gives no time). What a reader needs to judge a stored median: how
    many readings it is the median of, and how far apart they lie."""

    times_ms: tuple[float, ...]
    # The head-to-head (session id) they were read in, side by side with the problem's other
    # implementations (None: its own first reading and re-measurements).
    head_to_head: int | None = None
    # There: the round of each reading, so that two implementations' readings pair up.
    rounds: tuple[int, ...] = ()

    def by_round(self) -> dict[int, float]:
        """Round -> time, of a head-to-head's readings ({} for a search's own)."""
        return dict(zip(self.rounds, self.times_ms, strict=True)) if self.rounds else {}

    @property
    def count(self) -> int:
        return len(self.times_ms)

    @property
    def median_ms(self) -> float:
        """The time a config is stored and chosen by."""
        return statistics.median(self.times_ms)

    @property
    def spread(self) -> float | None:
        """(slowest - fastest) / median of the readings; None with fewer than two (a single
        reading shows no spread, which is not the same as none)."""
        if len(self.times_ms) < 2:
            return None
        return (max(self.times_ms) - min(self.times_ms)) / self.median_ms


@dataclass(frozen=True)
class Choice:
    best: Measured
    default: Measured | None

    @property
    def speedup(self) -> float | None:
        return self.best.tflops / self.default.tflops if self.default else None


def _fastest_first(config: Measured) -> tuple[float, float, int]:
    return (-config.first_tflops, config.first_ms, config.order)


def _fastest(config: Measured) -> tuple[float, float, int]:
    return (-config.tflops, config.median_ms, config.order)


def _default(configs: Iterable[Measured]) -> Measured | None:
    return min((c for c in configs if c.is_default and c.failed is None),
               key=lambda c: c.order, default=None)


def choose_best(configs: Iterable[Measured]) -> Choice | None:
    """The best config by the rule of the module docstring; None when none qualifies."""
    configs = list(configs)
    eligible = [c for c in configs if c.failed is None]
    finalists = [c for c in eligible if c.remeasured_ms]
    if finalists:
        bar = max(c.first_tflops for c in finalists)
        eligible = finalists + [c for c in eligible
                                if not c.remeasured_ms and c.first_tflops > bar]
    if not eligible:
        return None
    return Choice(best=min(eligible, key=_fastest), default=_default(configs))


def pick_finalists(configs: Iterable[Measured], k: int) -> list[Measured]:
    """The ``k`` configs with the fastest first readings, fastest first, then the default
    config if it is not one of them; disqualified configs are passed over (the next one takes
    the place)."""
    if k <= 0:
        return []
    eligible = [c for c in configs if c.failed is None]
    finalists = sorted(eligible, key=_fastest_first)[:k]
    default = _default(eligible)
    if default is not None and default not in finalists:
        finalists.append(default)
    return finalists
