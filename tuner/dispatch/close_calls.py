"""Whether a head-to-head's readings decide which of its two fastest candidates is faster, so
that a close call gets more rounds instead of being settled by noise
(``tuner.tuning.head_to_head``).

Five rotated rounds left rows a few percent apart to noise on the H200: gluon against cuDNN
at d128 2k dense read 0.997x in session #17's `standard` sweep and 1.011x in session #18's
A/B, and in session #18's sweep 6 rows with median gaps of 0.6-3.7% stayed undecided over 10
rounds (notes/gluon_notes.md). Two tests, either of which settles the call:

- the ranges are apart: the leader's slowest reading is faster than the runner-up's fastest;
- a sign test over the rounds both ran: the leader (the faster median) was faster in so many
  of them that a coin would do as well with probability ``SIGNIFICANCE`` or less (two-sided;
  a tie counts against the leader). Paired by round, so a drift of the GPU's clock over the
  session moves both readings of a round alike and does not decide.

Neither holds: the candidates are within noise of each other, so far, and another round is
worth its time. The caller caps the rounds: a true tie never settles.
"""

from __future__ import annotations

from collections.abc import Mapping
from math import comb

__all__ = ["SIGNIFICANCE", "decided", "sign_test_p"]

SIGNIFICANCE = 0.05


def sign_test_p(wins: int, rounds: int) -> float:
    """Two-sided p-value of ``wins`` or more (or as few) of ``rounds`` fair coin tosses."""
    if not 0 <= wins <= rounds:
        raise ValueError(f"wins must be within 0..rounds ({rounds}), but got {wins}")
    extreme = max(wins, rounds - wins)
    tail = sum(comb(rounds, k) for k in range(extreme, rounds + 1)) / 2 ** rounds
    return min(1.0, 2 * tail)


def decided(leader: Mapping[int, float], runner_up: Mapping[int, float]) -> bool:
    """Whether ``leader``'s readings (round -> ms; the faster median) settle it as faster
    than ``runner_up``'s (module docstring). No readings on a side: nothing to decide."""
    if not leader or not runner_up:
        return True
    if max(leader.values()) < min(runner_up.values()):
        return True
    paired = [r for r in leader if r in runner_up]
    wins = sum(leader[r] < runner_up[r] for r in paired)
    return wins * 2 > len(paired) and sign_test_p(wins, len(paired)) <= SIGNIFICANCE
