"""Every rank of a torchrun job runs the same kernels (issue 45): R ranks resolve the
implementation and configs of every problem of a recording, pinned to a snapshot and then
asking a live service, while a worker stores new bests mid-job; the choices are gathered
(``all_gather_object``) and must agree across ranks, and must not change under the job.

    python benchmarks/rank_agreement.py --recording job.toml --ranks 8 --backend nccl --json out.json

The script: a SQLite database seeded with stored bests of ``flash_fwd`` and ``torch_sdpa`` for
most of the recording's problems (so that choices differ between problems: some SDPA, some
ours, some defaults), ``tuner serve`` on a free loopback port, a snapshot of it, then
``torchrun --nproc-per-node R`` of this script's rank side (``TUNER_URL``, ``TUNER_REFRESH=off``,
no database of the ranks' own). Each rank resolves every problem pinned to the snapshot
(``TUNER_SNAPSHOT``), then through the live service: the first half, then (after rank 0 says so
and this script stores faster bests for every problem, as a worker would) the second half and
every problem again. The check: all ranks' answers equal, per phase; the live answers of the
first pass equal those of the second (nothing changed under the job); the stored change was
real (a fresh resolver after the job answers differently). Exit 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling rank_choices
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

from rank_choices import chosen, wait_for  # noqa: E402

from db.session import session_scope  # noqa: E402
from templates.base import Problem  # noqa: E402
from templates.device import current_device  # noqa: E402
from templates.registry import get_template  # noqa: E402
from tuner.lookup.bundle import (  # noqa: E402
    BUNDLE_FORMAT,
    BundleDevice,
    store_bundle,
    validate_bundle,
)
from tuner.lookup.resolver import ConfigResolver, set_resolver  # noqa: E402
from tuner.settings import load_settings  # noqa: E402
from tuner.tuning.suites import load_spec_file  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "rank-agreement-" + os.urandom(12).hex()


# ----------------------------------------------------------------------------- stored bests
def best_item(template: str, p: Problem, device: Any, tflops: float, *, other: bool = False
              ) -> dict[str, Any]:
    t = get_template(template)
    config = t.default_config(p, device).to_dict()
    if other:  # a config other than the default (flash_fwd: the pipelining of masked tiles)
        config = {**config, "pipeline_masked_loop": not config["pipeline_masked_loop"]}
    return {"device": BundleDevice.of(device).model_dump(), "template": t.name,
            "template_version": t.version(), "problem": p.to_dict(), "config": config,
            "tflops": tflops, "median_ms": t.flops(p) / (tflops * 1e9), "sweep": "ranks"}


def store(db_url: str, items: list[dict[str, Any]]) -> None:
    """As a worker's sweep stores them: straight into the database."""
    data = {"format": BUNDLE_FORMAT, "version": 1, "items": items, "host": "rank-check"}
    with session_scope(db_url) as s:
        store_bundle(s, validate_bundle(data))


def seed(problems: list[Problem], device: Any) -> list[dict[str, Any]]:
    """Every third problem untuned; of the rest, SDPA faster on half, ours on the others."""
    items = []
    for i, p in enumerate(problems):
        if i % 3 == 2:
            continue
        items.append(best_item("flash_fwd", p, device, 100.0))
        items.append(best_item("torch_sdpa", p, device, 150.0 if i % 2 else 50.0))
    return items


# ----------------------------------------------------------------------------- one rank
def rank_main(folder: Path, recording: Path, backend: str) -> None:
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(backend)
    device = current_device()
    problems = list(load_spec_file(recording).problems)
    go = json.loads((folder / "go.json").read_text())

    set_resolver(ConfigResolver(load_settings(snapshot=go["snapshot"])))
    pinned = [chosen(p, device) for p in problems]
    set_resolver(ConfigResolver(load_settings(snapshot=None)))
    half = len(problems) // 2
    live = [chosen(p, device) for p in problems[:half]]
    dist.barrier()
    if rank == 0:
        (folder / "half").touch()
    wait_for(folder / "stored", wait_s=600)  # the new bests are in the database now
    live += [chosen(p, device) for p in problems[half:]]
    again = [chosen(p, device) for p in problems]

    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, {"rank": rank, "device": device.key, "pinned": pinned,
                                      "live": live, "again": again})
    if rank == 0:
        (folder / "results.json").write_text(json.dumps(gathered))
    dist.barrier()
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- the driver
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serve(db_url: str, folder: Path) -> tuple[subprocess.Popen[bytes], str]:
    from tuner.client import TunerClient

    port = free_port()
    env = {**os.environ, "TUNER_DATABASE_URL": db_url, "TUNER_TOKEN": TOKEN,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    service = subprocess.Popen([sys.executable, "-m", "tuner.cli.app", "serve", "--port",
                                str(port)], env=env, stdout=open(folder / "serve.log", "wb"),  # noqa: SIM115
                               stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    with TunerClient(url, token=TOKEN) as client:
        while True:
            try:
                client.health()
                return service, url
            except Exception:
                if service.poll() is not None or time.monotonic() > deadline:
                    service.kill()
                    raise SystemExit("error: tuner serve did not start:\n"
                                     + (folder / "serve.log").read_text()[-3000:]) from None
                time.sleep(0.3)


def _kernels(answer: list[Any]) -> list[Any]:
    """An answer's implementation and configs, without its match and source."""
    return [answer[0], [r[2] for r in answer[1]]]


def check(results: list[dict[str, Any]], ranks: int, fresh: list[Any]) -> dict[str, Any]:
    first = results[0]
    half = len(first["pinned"]) // 2  # as the ranks split the live pass
    agree = {phase: all(r[phase] == first[phase] for r in results)
             for phase in ("pinned", "live", "again")}
    sources = sorted({a[1][0][1] for a in first["pinned"]})
    return {
        "ranks": len(results), "ranks_wanted": ranks, "problems": len(first["pinned"]),
        "devices": sorted({r["device"] for r in results}),
        "agree": agree,
        "unchanged_under_the_job": all(r["again"] == r["live"] for r in results),
        # Before the store, the same kernels and configs, wherever the answers came from;
        # after it, the live answers of problems not run before are the new bests.
        "pinned_equals_live_before_the_store": [_kernels(a) for a in first["pinned"][:half]]
        == [_kernels(a) for a in first["live"][:half]],
        "live_after_the_store_differs_from_pinned": sum(
            _kernels(a) != _kernels(b) for a, b in zip(first["pinned"][half:],
                                                       first["live"][half:], strict=True)),
        "pinned_sources": sources,
        "implementations": {name: sum(a[0] == name for a in first["live"])
                            for name in sorted({a[0] for a in first["live"]})},
        "changed_in_database_after": sum(a != f for a, f in zip(first["live"], fresh,
                                                                  strict=True)),
    }


def driver(args: argparse.Namespace) -> int:
    from tuner.client import TunerClient

    folder = Path(tempfile.mkdtemp(prefix="ranks-"))
    db_url = f"sqlite:///{folder / 'service.db'}"
    problems = list(load_spec_file(args.recording).problems)
    device = current_device()
    store(db_url, seed(problems, device))
    service, url = serve(db_url, folder)
    try:
        with TunerClient(url, token=TOKEN) as client:
            snapshot = client.create_snapshot().id
        (folder / "go.json").write_text(json.dumps({"snapshot": snapshot}))
        env = {**os.environ, "TUNER_URL": url, "TUNER_REFRESH": "off", "TUNER_DEMAND": "off",
               "TUNER_DATABASE_URL": f"sqlite:///{folder / 'absent.db'}",
               "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
               "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT),
                                                          os.environ.get("PYTHONPATH")]))}
        env.pop("TUNER_TOKEN", None)  # a job reads without a token
        env.pop("TUNER_SNAPSHOT", None)
        job = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.ranks),
             "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
             str(Path(__file__).resolve()), "--rank-job", str(folder), "--recording",
             str(args.recording), "--backend", args.backend], env=env)
        wait_for(folder / "half", lambda: job.poll() is None, wait_s=args.max_seconds)
        # A worker stores faster bests for every problem: ours, with another config.
        store(db_url, [best_item("flash_fwd", p, device, 999.0, other=True) for p in problems])
        (folder / "stored").touch()
        code = job.wait(timeout=args.max_seconds)
        if code != 0:
            print(f"error: the torchrun job exited {code}", file=sys.stderr)
            return 1
    finally:
        service.terminate()
        service.wait(timeout=30)
    results = json.loads((folder / "results.json").read_text())
    set_resolver(ConfigResolver(load_settings(database_url=db_url, url=None, snapshot=None)))
    fresh = [chosen(p, device) for p in problems]
    report = {"backend": args.backend, "snapshot": snapshot, "recording": str(args.recording),
              "label": "" if device.name != "cpu-interpreter" else
              "cpu-interpreter: ranks on the CPU", **check(results, args.ranks, fresh)}
    text = json.dumps(report, indent=2)
    if args.json:
        args.json.write_text(text)
    print(text)
    ok = (report["ranks"] == args.ranks and all(report["agree"].values())
          and report["unchanged_under_the_job"] and report["changed_in_database_after"] > 0)
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recording", type=Path, required=True, help="tuner.record's TOML")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--backend", default="gloo", help="gloo, or nccl (one GPU per rank)")
    p.add_argument("--max-seconds", type=float, default=540.0)
    p.add_argument("--json", type=Path)
    p.add_argument("--rank-job", type=Path, help=argparse.SUPPRESS)  # torchrun's side
    args = p.parse_args(argv)
    if args.backend not in ("gloo", "nccl"):
        p.error(f"--backend must be gloo or nccl, not {args.backend!r}")
    if args.rank_job is not None:
        rank_main(args.rank_job, args.recording, args.backend)
        return 0
    return driver(args)


if __name__ == "__main__":
    sys.exit(main())
