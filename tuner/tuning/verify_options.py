"""``tuner verify``'s options: the tolerance and how re-measurements run.

Apart from ``tuner/tuning/verify.py`` so that the ``tuner`` command builds its options without
importing torch and the kernels (``tuner.tuning.verify`` costs 3.2 s on the 2-core CPU machine;
issue 41, item 1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from tuner.errors import TunerError
from tuner.tuning.runner.timing import REP_MS

if TYPE_CHECKING:
    from tuner.lookup.stored_bests import StoredBest

__all__ = ["AUTO", "DEFAULT_TOLERANCE", "VerifyOptions", "parse_tolerance"]

DEFAULT_TOLERANCE = 0.03  # issue 6: re-measured within 3% of the stored time
# The tolerance per stored best: max(DEFAULT_TOLERANCE, the spread of its own readings).
AUTO: Literal["auto"] = "auto"
_TOLERANCE_FIX = f"e.g. --tolerance {DEFAULT_TOLERANCE} (3%), or --tolerance {AUTO}"


def parse_tolerance(text: str) -> float | Literal["auto"]:
    """``--tolerance``'s value: a fraction (0.03 is 3%) or ``auto``."""
    if text.strip().lower() == AUTO:
        return AUTO
    try:
        return float(text)
    except ValueError:
        raise TunerError(f"--tolerance must be a number > 0 or {AUTO!r}, but got {text!r}",
                         _TOLERANCE_FIX) from None


@dataclass(frozen=True)
class VerifyOptions:
    repeats: int = 1  # re-measurements per config; their median time counts
    timeout_s: float = 300.0  # per re-measurement, compile included
    # Largest allowed |re-measured / stored time - 1|; "auto": per stored best, the larger of
    # DEFAULT_TOLERANCE and the spread of its own readings.
    tolerance: float | Literal["auto"] = DEFAULT_TOLERANCE
    seed: int | None = None  # seeds the inputs' seeds; None: fresh random inputs
    rep_ms: float = REP_MS  # ms of timed runs per re-measurement on the GPU (do_bench's rep)

    def __post_init__(self) -> None:
        if self.repeats < 1:
            raise TunerError(f"--repeats must be >= 1, but got {self.repeats}",
                             "e.g. --repeats 3")
        if self.tolerance != AUTO and not (isinstance(self.tolerance, int | float)
                                           and self.tolerance > 0):
            raise TunerError(f"--tolerance must be > 0 or {AUTO!r}, but got {self.tolerance!r}",
                             _TOLERANCE_FIX)
        if not self.timeout_s > 0:
            raise TunerError(f"--timeout must be > 0 seconds, but got {self.timeout_s:g}",
                             "e.g. --timeout 300")
        if not (math.isfinite(self.rep_ms) and self.rep_ms > 0):
            raise TunerError(f"--rep-ms must be > 0 milliseconds, but got {self.rep_ms:g}",
                             f"e.g. --rep-ms {REP_MS} (a sweep's), or 500 to time longer")

    def tolerance_for(self, stored: StoredBest) -> float:
        """The bar one stored best is held to."""
        if self.tolerance == AUTO:
            return max(DEFAULT_TOLERANCE, stored.spread or 0.0)
        return float(self.tolerance)
