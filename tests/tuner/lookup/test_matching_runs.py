"""Serving passes a stored config to another shape when it can run there, even where a
search would not try it (a tile larger than a short sequence needs): on the H200 a
neighbour's flash_bwd config measured 10x faster than the default was refused that way for a
slightly shorter call, which then ran SDPA."""

from __future__ import annotations

import dataclasses

from templates.base import Problem
from templates.device import current_device
from templates.flash.bwd import BwdConfig
from templates.registry import get_template
from tuner.lookup.matching import Candidate, match_candidates, neighbours_of

BWD = get_template("flash_bwd")
STORED = Problem(1, 4, 4, 512, 512, 64, "float16", "none")
CALL = dataclasses.replace(STORED, seqlen_q=40, seqlen_kv=40)  # another bucket, same family


def candidate(config: BwdConfig) -> Candidate:
    return Candidate(source="stored", problem=STORED, problem_key=BWD.problem_key(STORED),
                     config=config, tflops=100.0)


def test_a_wasteful_but_runnable_config_is_served_to_a_neighbour() -> None:
    device = current_device()
    wide = BwdConfig(BLOCK_M1=128, BLOCK_N1=128, dq_mode="atomic", num_warps=8)
    assert BWD.constraint(STORED, wide, device) is None
    waste = BWD.constraint(CALL, wide, device)
    assert waste is not None and "larger than" in waste  # a search would not try it here
    assert BWD.hard_constraint(CALL, wide, device) is None  # but it runs
    match = match_candidates(BWD, CALL, device, [candidate(wide)])
    assert match is not None and match.kind == "nearest" and match.config == wide
    assert list(neighbours_of(BWD, CALL, device, [candidate(wide)])) == [
        BWD.problem_key(STORED)]
    # A search's transfer prior offers only what it would try.
    assert neighbours_of(BWD, CALL, device, [candidate(wide)], for_search=True) == {}


def test_a_config_that_cannot_run_is_still_passed_over() -> None:
    small = dataclasses.replace(current_device(), smem_per_block=16 * 1024)  # a small GPU
    wide = BwdConfig(BLOCK_M1=128, BLOCK_N1=128, dq_mode="atomic", num_warps=8)
    reason = BWD.hard_constraint(CALL, wide, small)
    assert reason is not None and "shared memory" in reason
    assert match_candidates(BWD, CALL, small, [candidate(wide)]) is None
    assert neighbours_of(BWD, CALL, small, [candidate(wide)]) == {}
