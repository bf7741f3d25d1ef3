"""What the ranks of a job and the process driving them share (benchmarks/rank_agreement.py,
tests/tuner/lookup/snapshot_ranks.py): turns taken through files in a folder, and one rank's
answer for one problem in a form every rank can compare."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from templates.base import Problem
from tuner.dispatch.implementations.call import Call
from tuner.dispatch.rule import choose, keep

__all__ = ["WAIT_S", "chosen", "wait_for"]

# Generous: four forked ranks and the service share CI's 2 cores with whatever else runs
# (a clean-clone CI run once took over 60 s for phase 1); a rank that died ends the wait at
# once instead (``alive``).
WAIT_S = 180.0


def wait_for(path: Path, alive: Callable[[], bool] | None = None, wait_s: float = WAIT_S
             ) -> None:
    deadline = time.monotonic() + wait_s
    while not path.exists():
        if alive is not None and not alive():
            raise RuntimeError(f"a rank exited before {path.name} appeared")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {wait_s:g} s")
        time.sleep(0.02)


def chosen(problem: Problem, device: Any) -> list[Any]:
    """The implementation ``tuner.attention`` would run for ``problem`` (forward), kept as a
    running call keeps it, with the match, source and config of each of its templates."""
    choice = keep(choose(Call(problem, False, device)))
    return [choice.implementation.name,
            [[r.match, r.source, r.config.to_dict()] for r in choice.resolved]]
