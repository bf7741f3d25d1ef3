"""One rank of the pinned-job test (tests/tuner/lookup/test_snapshot_ranks.py): a torch.distributed
process (gloo, CPU) whose lookups are pinned to one snapshot, resolving its shapes in phases
while the test stops, changes and restarts the service under it.

The test and the ranks take turns through files in ``folder``: the test writes ``go.json``
(snapshot id and service URL), ``stopped`` and ``restarted``; rank 0 writes ``phase-N`` once
every rank has finished phase N (a gloo barrier), and ``results.json`` (every rank's answers,
gathered with gloo) at the end.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from tests.benchmarks.benchmark_scripts import load_benchmark_script

# benchmarks/rank_choices.py: shared with the torchrun rank check (benchmarks/rank_agreement.py)
wait_for = load_benchmark_script("rank_choices").wait_for


def run_rank(rank: int, world: int, folder: str, shapes: list[dict[str, Any]],
             database_url: str) -> None:
    import torch.distributed as dist

    from templates.base import Problem
    from templates.device import current_device
    from templates.registry import get_template
    from tuner.lookup.resolver import ConfigResolver
    from tuner.settings import load_settings

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    base = Path(folder)
    dist.init_process_group("gloo", init_method=f"file://{base / 'rendezvous'}", rank=rank,
                            world_size=world)
    template, device = get_template("flash_fwd"), current_device()
    problems = [Problem.from_dict(s) for s in shapes]

    wait_for(base / "go.json")
    go = json.loads((base / "go.json").read_text())

    def pinned_resolver() -> ConfigResolver:
        # This rank's own database does not exist: the snapshot comes from the service.
        return ConfigResolver(load_settings(database_url=database_url, url=go["url"],
                                            token=None, snapshot=go["snapshot"]))

    def answer(r: ConfigResolver, p: Problem) -> list[Any]:
        got = r.resolve(template, p, device)
        return [got.match, got.source, got.config.to_dict()]

    def phase_done(n: int) -> None:
        dist.barrier()
        if rank == 0:
            (base / f"phase-{n}").touch()

    resolver = pinned_resolver()
    answers = [answer(resolver, p) for p in problems[:20]]  # service up: loads the snapshot
    phase_done(1)
    wait_for(base / "stopped")
    answers += [answer(resolver, p) for p in problems[20:35]]  # service down, database changed
    phase_done(2)
    wait_for(base / "restarted")
    answers += [answer(resolver, p) for p in problems[35:]]  # a new service process
    restarted_job = pinned_resolver()  # the job restarted: loads the snapshot again
    again = [answer(restarted_job, p) for p in reversed(problems)][::-1]

    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, {"rank": rank, "answers": answers, "again": again})
    if rank == 0:
        (base / "results.json").write_text(json.dumps(gathered))
    dist.barrier()
    dist.destroy_process_group()
