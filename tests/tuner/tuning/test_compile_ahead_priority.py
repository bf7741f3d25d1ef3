"""The compile-ahead pool runs below the sweep's priority, so a trial's timing gets the cores
first where both want more than there are (a small call's paced reading is host time)."""

from __future__ import annotations

import multiprocessing as mp
import os
from concurrent.futures import ProcessPoolExecutor

from tuner.tuning.runner.compile_ahead import COMPILE_NICENESS, _init_pool


def _niceness() -> int:
    return os.nice(0)


def test_pool_processes_are_niced_below_the_sweep() -> None:
    mine = os.nice(0)
    with ProcessPoolExecutor(max_workers=1, mp_context=mp.get_context("spawn"),
                             initializer=_init_pool, initargs=({},)) as pool:
        theirs = pool.submit(_niceness).result(timeout=120)
    assert theirs == min(19, mine + COMPILE_NICENESS)
    assert os.nice(0) == mine  # the sweep's own priority is untouched
