"""Issue 18, "Done when": four processes (torch.distributed, gloo, CPU) pinned to one snapshot
resolve identical configs for 50 shapes while the service is stopped and restarted under
them, and while the database moves on; a restarted job resolves them again, identically.

The service is the real app under uvicorn on 127.0.0.1 (in a thread of this process, on one
port for both of its lives); the ranks are forked from this process (a fresh interpreter per
rank would spend ~7 s importing torch on a small machine) before the service first starts,
so that none of them holds its listening socket.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp
import uvicorn

from api.main import create_app
from db.session import dispose_engine
from templates.base import Problem
from tests.api.serving_data import (
    FWD,
    TOKEN,
    free_port,
    interpreter,
    item,
    problem,
    store,
    tuned_config,
)
from tests.tuner.lookup.snapshot_ranks import run_rank, wait_for
from tuner.client import TunerClient
from tuner.lookup.resolver import ConfigResolver
from tuner.settings import load_settings

WORLD = 4


def shapes() -> list[Problem]:
    """50 shapes of a few families: tuned ones, others of their buckets, nearest, untuned."""
    out = []
    for head_dim in (16, 32):
        for dtype in ("float16", "float32"):
            for seqlen in (16, 24, 32, 40, 64, 96, 128, 200, 256, 384, 512, 1024):
                out.append(problem(seqlen, batch=1, heads=2, head_dim=head_dim, dtype=dtype))
    out += [problem(64, batch=2, heads=4, head_dim=64, dtype="float16"),
            problem(128, batch=1, heads=4, heads_kv=2, head_dim=16, dtype="float16")]
    assert len(out) == 50
    return out


def tuned(p: Problem, tflops: float, *, other: bool = False) -> dict[str, Any]:
    """A stored best for ``p``: a config other than the default (``other``: another one)."""
    config = tuned_config(p, interpreter())
    if other:
        config = {**config, "pipeline_masked_loop": not config["pipeline_masked_loop"]}
    return item(p, device=interpreter(), config=config, tflops=tflops, default_tflops=None)




class Service:
    """The app under uvicorn on one fixed port, started and stopped at will; records the
    method and path of every request it serves."""

    def __init__(self, database_url: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.settings = load_settings(database_url=database_url, token=TOKEN, url=None)
        self.requests: list[str] = []
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        app = create_app(self.settings)

        async def recorded(scope: Any, receive: Any, send: Any) -> None:
            if scope["type"] == "http":
                self.requests.append(f"{scope['method']} {scope['path']}")
            await app(scope, receive, send)

        self._server = uvicorn.Server(uvicorn.Config(recorded, host="127.0.0.1",
                                                     port=self.port, log_level="error",
                                                     lifespan="off"))
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            assert time.monotonic() < deadline and self._thread.is_alive(), "no service"
            time.sleep(0.02)

    def stop(self) -> None:
        assert self._server is not None and self._thread is not None
        self._server.should_exit = True
        self._thread.join(timeout=10)
        assert not self._thread.is_alive()


@contextlib.contextmanager
def ranks(folder: Path, problems: list[Problem], database_url: str) -> Iterator[Any]:
    context = mp.start_processes(
        run_rank, args=(WORLD, str(folder), [p.to_dict() for p in problems], database_url),
        nprocs=WORLD, join=False, start_method="fork")
    try:
        yield context
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()


def test_four_ranks_pinned_to_a_snapshot_resolve_identical_configs_whatever_the_service_does(
        tmp_path: Path) -> None:
    problems = shapes()
    db_url = f"sqlite:///{tmp_path / 'service.db'}"
    # Tuned: a few shapes of each family (the others match by bucket, nearest or default).
    first = [tuned(p, 100.0 + i) for i, p in enumerate(problems) if i % 5 == 0]
    store(db_url, *first)
    service = Service(db_url)
    rank_db = f"sqlite:///{tmp_path / 'absent.db'}"  # the ranks have no database of their own

    with ranks(tmp_path, problems, rank_db) as context:
        def alive() -> bool:
            return all(process.is_alive() for process in context.processes)

        service.start()
        with TunerClient(service.url, token=TOKEN) as client:
            snapshot = client.create_snapshot().id
        (tmp_path / "go.json").write_text(json.dumps({"snapshot": snapshot,
                                                      "url": service.url}))
        wait_for(tmp_path / "phase-1", alive)
        service.stop()
        # The database moves on while the service is down: faster configs, more shapes.
        store(db_url, *(tuned(p, 900.0, other=True) for i, p in enumerate(problems) if i % 3 == 0))
        (tmp_path / "stopped").touch()
        wait_for(tmp_path / "phase-2", alive)
        service.start()  # a new service process, on the database as it is now
        (tmp_path / "restarted").touch()
        deadline = time.monotonic() + 120
        while not context.join(timeout=1):
            assert time.monotonic() < deadline, "the ranks did not finish"
        service.stop()

    results = json.loads((tmp_path / "results.json").read_text())
    assert sorted(r["rank"] for r in results) == list(range(WORLD))
    answers = results[0]["answers"]
    assert len(answers) == 50
    for r in results:
        assert r["answers"] == answers and r["again"] == answers, f"rank {r['rank']} differs"
    # The answers are the snapshot's: its tuned configs for the shapes it holds, ...
    for stored in first:
        i = problems.index(Problem.from_dict(stored["problem"]))
        assert answers[i] == ["exact", "snapshot", stored["config"]]
    kinds = {a[0] for a in answers}
    assert {"exact", "bucket", "nearest", "default"} <= kinds, kinds
    # ... not what the database says now.
    now = [ConfigResolver(load_settings(database_url=db_url, url=None)).resolve(
        FWD, p, interpreter()).config.to_dict() for p in problems]
    assert sum(a[2] != c for a, c in zip(answers, now, strict=True)) >= 10
    # Each rank's resolver asked the service once (the job and its restart), nothing else.
    assert sorted(service.requests) == sorted(
        ["POST /v1/snapshots"] + [f"GET /v1/snapshots/{snapshot}"] * (2 * WORLD))
    dispose_engine(db_url)

