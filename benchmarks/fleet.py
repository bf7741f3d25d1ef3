"""A fleet of demand workers on one host (issue 45): throughput from 1 to N GPUs, duplicates,
lost or stuck claims, and workers SIGKILLed mid-run.

    # one GPU per worker, 1, 2, 4 then 8 of them, each on a fresh queue of a recording's problems
    python benchmarks/fleet.py --start-postgres --recording job.toml --scaling 1,2,4,8 --json out.json
    python benchmarks/fleet.py --db postgresql://postgres@127.0.0.1/postgres --scaling 8 --kill 2 ...
    # a synthetic recording (tuner.record's format) of 64 tiny problems, for the CPU
    python benchmarks/fleet.py --make-recording tiny.toml --shapes cpu

For each N of ``--scaling``: a new database on the server (``--db``, or a local server started
with ``--start-postgres``), its demand queue filled with the recording's problems (one row per
template x shape bucket, for the device the workers will report), then N ``tuner worker``
processes, each claiming its own GPU through one lock folder (``--gpu-lock-dir``; checked in
/proc/locks: no two on one GPU). The script watches the queue until every row is done or
failed (or ``--max-seconds``), stops the workers (SIGINT) and reads the database
(benchmarks/fleet_ledger.py). With ``--kill K``, K workers holding a claim are SIGKILLed (with
their trial processes) once a quarter of the problems are finished: their rows must be finished
by the others, after their lease (``--lease``) passes. Without a GPU the workers run kernels
under Triton's interpreter and the JSON says ``cpu-interpreter: not GPU timings``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling fleet_* modules
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

from fleet_ledger import read_ledger, read_queue, trials_by_worker  # noqa: E402
from fleet_postgres import local_postgres, scratch_database  # noqa: E402

from db import demand  # noqa: E402
from db.demand import DemandCount  # noqa: E402
from db.session import dispose_engine, init_db, run_in_transaction  # noqa: E402
from templates.base import Problem  # noqa: E402
from templates.registry import get_template  # noqa: E402
from tuner.demand.worker import probe_device  # noqa: E402
from tuner.record import Recorder  # noqa: E402
from tuner.tuning.gpus import lock_path, visible_gpus  # noqa: E402
from tuner.tuning.suites import SweepSpec, load_spec_file  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CPU_LABEL = "cpu-interpreter: not GPU timings"
MIN_PROBLEMS = 64


# ----------------------------------------------------------------------------- recordings
def synthetic_problems(shapes: str) -> list[Problem]:
    """64 problems of distinct shape buckets: tiny ones for the interpreter (``cpu``), or
    training shapes of a few models (``gpu``)."""
    if shapes == "cpu":
        return [Problem(1, 1, 1, sq, skv, d, dtype)
                for sq in (16, 32, 64, 128) for skv in (16, 32, 64, 128)
                for d in (16, 32) for dtype in ("float16", "float32")]
    if shapes == "gpu":
        return [Problem(batch, heads, heads // gqa, n, n, d, "bfloat16",
                        causal="top_left" if causal else "none")
                for batch, heads in ((2, 16), (4, 32)) for gqa in (1, 4)
                for n in (512, 1024, 2048, 4096) for d in (64, 128)
                for causal in (True, False)]
    raise SystemExit(f"error: --shapes must be cpu or gpu, not {shapes!r}")


def make_recording(path: Path, shapes: str, templates: list[str], limit: int = 0) -> None:
    recorder = Recorder(path)
    problems = synthetic_problems(shapes)
    for i, problem in enumerate(problems[:limit] if limit else problems):
        recorder.add(problem, templates, count=1 + i % 5)
    recorder.write()
    print(f"wrote {path}: {recorder.summary()}")


# ----------------------------------------------------------------------------- the queue
def fill_queue(db_url: str, spec: SweepSpec, templates: list[str], device_key: str) -> int:
    counts = []
    for name in templates:
        template = get_template(name)
        seen: set[str] = set()
        for problem in spec.problems:
            key = template.problem_key(problem)
            if key in seen:
                continue
            seen.add(key)
            counts.append(DemandCount(device_key, name, template.version(), key,
                                      problem.to_dict(), spec.counts.get(problem, 1)))
    init_db(db_url)
    run_in_transaction(db_url, lambda s: demand.add_demand(s, counts=counts))
    return len(counts)


# ----------------------------------------------------------------------------- workers
def start_worker(args: argparse.Namespace, db_url: str, lock_dir: Path, gpus: list[str],
                 log_dir: Path, index: int) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "TUNER_TEMPLATE_MODULES": json.dumps(args.template_modules)}
    env.pop("TUNER_URL", None)
    if gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)  # every GPU of this run: each claims one
    command = [sys.executable, "-m", "tuner.cli.app", "worker", "--db", db_url,
               "--trials", str(args.trials), "--finalists", str(args.finalists),
               "--final-repeats", str(args.final_repeats), "--heartbeat", str(args.heartbeat),
               "--lease", str(args.lease), "--poll", str(args.poll), "--timeout",
               str(args.timeout), "--gpu-lock-dir", str(lock_dir), "--json"]
    for name in args.template:
        command += ["--template", name]
    # A session of its own: a SIGKILL of its group takes its trial processes with it.
    return subprocess.Popen(command, env=env, cwd=log_dir, start_new_session=True,
                            stdout=open(log_dir / f"worker-{index}.out", "wb"),  # noqa: SIM115
                            stderr=open(log_dir / f"worker-{index}.err", "wb"))  # noqa: SIM115


def gpu_holders(lock_dir: Path, gpus: list[str]) -> dict[str, list[int]]:
    """GPU id -> pids holding its lock, from /proc/locks (flock: the process that took it)."""
    inodes = {}
    for gpu in gpus:
        path = lock_path(lock_dir, gpu)
        if path.exists():
            inodes[path.stat().st_ino] = gpu
    holders: dict[str, list[int]] = {gpu: [] for gpu in gpus}
    for line in Path("/proc/locks").read_text().splitlines():
        fields = line.split()
        if len(fields) > 5 and fields[1] == "FLOCK" and fields[3] == "WRITE":
            inode = int(fields[5].split(":")[-1])
            if inode in inodes:
                holders[inodes[inode]].append(int(fields[4]))
    return holders


def stop_workers(workers: list[subprocess.Popen[bytes]]) -> None:
    for w in workers:
        if w.poll() is None:
            os.killpg(w.pid, signal.SIGINT)  # gives its claim back, if it holds one
    deadline = time.monotonic() + 60
    for w in workers:
        try:
            w.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(w.pid, signal.SIGKILL)
            w.wait()


def run_fleet(args: argparse.Namespace, server_url: str, spec: SweepSpec, device: dict[str, Any],
              n: int, all_gpus: list[str], out_dir: Path) -> dict[str, Any]:
    name = f"fleet_{os.getpid()}_n{n}"
    log_dir = out_dir / f"n{n}"
    log_dir.mkdir(parents=True, exist_ok=True)
    with scratch_database(server_url, name) as db_url:
        problems = fill_queue(db_url, spec, args.template, device["key"])
        lock_dir = Path(tempfile.mkdtemp(prefix="fleet-locks-"))
        gpus = all_gpus[:n]
        started = time.monotonic()
        workers = [start_worker(args, db_url, lock_dir, gpus, log_dir, i) for i in range(n)]
        hostname = socket.gethostname()
        by_name = {f"{hostname}:{w.pid}": w for w in workers}
        killed: dict[str, list[int]] = {}  # worker -> demand ids it held when killed
        kill_at = problems // 4
        holders: dict[str, list[int]] = {}
        deadline = started + args.max_seconds
        try:
            while time.monotonic() < deadline:
                time.sleep(1.0)
                queue = read_queue(db_url)
                if gpus and not holders and len(set(queue.holders.values())) == n:
                    holders = gpu_holders(lock_dir, gpus)  # every worker has claimed work
                if args.kill and not killed and queue.finished >= kill_at:
                    victims = [w for w in sorted(set(queue.holders.values())) if w in by_name]
                    for worker in victims[:args.kill]:
                        os.killpg(by_name[worker].pid, signal.SIGKILL)
                        by_name[worker].wait()
                        killed[worker] = sorted(i for i, h in queue.holders.items()
                                                if h == worker)
                    if killed:
                        kill_elapsed = time.monotonic() - started
                        kept_at_kill = {w: trials_by_worker(db_url).get(w, 0) for w in killed}
                if queue.settled:
                    break
                dead = [w for w in workers if w.poll() is not None
                        and f"{hostname}:{w.pid}" not in killed]
                if dead:
                    err = (log_dir / f"worker-{workers.index(dead[0])}.err").read_text()[-3000:]
                    raise SystemExit(f"error: a worker exited ({dead[0].returncode}):\n{err}")
            empty_s = time.monotonic() - started
        finally:
            stop_workers(workers)
        dispose_engine(db_url)
        ledger = read_ledger(db_url, final_repeats=args.final_repeats)
        stored_after = trials_by_worker(db_url)
        dispose_engine(db_url)
    summary = ledger.summary()
    span = ((ledger.last_finish - ledger.first_claim).total_seconds()
            if ledger.first_claim and ledger.last_finish else None)
    lost_claims = sum(len(re.findall(r"was taken over by another worker",
                                     (log_dir / f"worker-{i}.err").read_text()))
                      for i, w in enumerate(workers) if f"{hostname}:{w.pid}" not in killed)
    result: dict[str, Any] = {
        "workers": n, "gpus": gpus, "problems": problems,
        "settled": ledger.done + ledger.failed == problems,
        "queue_empty_s": round(empty_s, 1),
        "problems_per_minute": round(60 * (ledger.done + ledger.failed) / empty_s, 2),
        "problems_per_minute_claimed": (round(60 * (ledger.done + ledger.failed) / span, 2)
                                        if span else None),
        "duplicate_measurements": summary["duplicates"],
        "claims_stuck": sum(ledger.not_finished.values()),
        "claims_lost": lost_claims,
        "duplicated_configs": summary["duplicate_measurements"],
        **{k: summary[k] for k in ("done", "failed", "not_finished", "taken_over", "measured",
                                   "stored_trials", "excess_remeasurements",
                                   "measured_not_stored")},
    }
    if gpus:
        result["gpu_lock_holders"] = holders
        result["one_worker_per_gpu"] = bool(holders) and all(
            len(p) == 1 for p in holders.values()) and len(
            {p[0] for p in holders.values()}) == n
    if args.kill:
        result["killed"] = {w: {"held": ids,
                                "finished_by": {i: ledger.finished_by.get(i, "") for i in ids},
                                "trials_stored_at_kill": kept_at_kill[w],
                                "trials_stored_at_end": stored_after.get(w, 0)}
                            for w, ids in killed.items()} if killed else "none killed"
        if killed:
            result["killed_at_s"] = round(kill_elapsed, 1)
            result["killed_problems_finished_by_others"] = all(
                ledger.finished_by.get(i, w) not in ("", w)
                for w, ids in killed.items() for i in ids)
            result["nothing_measured_lost"] = (not ledger.measured_not_stored and all(
                stored_after.get(w, 0) >= kept_at_kill[w] for w in killed))
    return result


# ----------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--make-recording", type=Path, help="write a synthetic recording and exit")
    p.add_argument("--shapes", default="cpu", help="cpu (tiny) or gpu (training shapes)")
    p.add_argument("--problems", type=int, default=0,
                   help="with --make-recording: only the first this many (tests)")
    p.add_argument("--recording", type=Path, help="a recording (tuner.record's TOML)")
    p.add_argument("--template", action="append", default=[],
                   help="tune this template's demand (repeatable; default: the recording's)")
    p.add_argument("--template-modules", default="[]",
                   help="JSON list of modules registering templates (TUNER_TEMPLATE_MODULES)")
    p.add_argument("--db", help="PostgreSQL server URL: each run gets a scratch database there")
    p.add_argument("--start-postgres", action="store_true",
                   help="start a local server (initdb, pg_ctl) for the runs")
    p.add_argument("--scaling", default="", help="worker counts, e.g. 1,2,4,8 (default: "
                   "--workers, else one per visible GPU)")
    p.add_argument("--workers", type=int, default=0, help="workers without GPUs (interpreter)")
    p.add_argument("--kill", type=int, default=0, help="SIGKILL this many workers mid-run")
    p.add_argument("--trials", type=int, default=8)
    p.add_argument("--finalists", type=int, default=0)
    p.add_argument("--final-repeats", type=int, default=2)
    p.add_argument("--heartbeat", type=int, default=5)
    p.add_argument("--lease", type=float, default=20.0)
    p.add_argument("--poll", type=float, default=2.0)
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per trial")
    p.add_argument("--max-seconds", type=float, default=540.0, help="per worker count")
    p.add_argument("--out-dir", type=Path, default=None, help="worker logs (default: a temp dir)")
    p.add_argument("--json", type=Path, help="write the results here")
    args = p.parse_args(argv)
    try:
        args.template_modules = json.loads(args.template_modules)
    except json.JSONDecodeError as exc:
        p.error(f"--template-modules must be a JSON list of module names: {exc}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    SweepSpec(name="fleet", templates=(), problems=(),
              template_modules=tuple(args.template_modules)).import_template_modules()
    if args.make_recording:
        make_recording(args.make_recording, args.shapes, args.template or ["flash_fwd"],
                       args.problems)
        return 0
    if args.recording is None or not (args.db or args.start_postgres):
        print("error: give --recording and one of --db URL or --start-postgres\n"
              "fix: e.g. --recording job.toml --start-postgres", file=sys.stderr)
        return 2
    spec = load_spec_file(args.recording)
    args.template = args.template or list(spec.templates)
    gpus = visible_gpus()
    counts = ([int(c) for c in args.scaling.split(",") if c.strip()] if args.scaling
              else [args.workers or len(gpus)])
    if gpus and max(counts) > len(gpus):
        print(f"error: --scaling asks for {max(counts)} workers, but this host shows "
              f"{len(gpus)} GPU(s)\nfix: at most one worker per GPU", file=sys.stderr)
        return 2
    if not gpus and not all(c >= 1 for c in counts):
        print("error: no GPU in sight: give --workers N (interpreter workers) or --scaling",
              file=sys.stderr)
        return 2
    if len(spec.problems) < MIN_PROBLEMS:
        print(f"warning: the recording holds {len(spec.problems)} problems; issue 45 asks "
              f"for at least {MIN_PROBLEMS}", file=sys.stderr)
    device = probe_device()
    out_dir = args.out_dir or Path(tempfile.mkdtemp(prefix="fleet-"))
    report: dict[str, Any] = {
        "label": "" if gpus else CPU_LABEL, "device": device.get("name"),
        "device_key": device["key"], "recording": str(args.recording),
        "templates": args.template, "trials": args.trials, "lease_s": args.lease,
        "kill": args.kill, "logs": str(out_dir), "runs": []}
    with (local_postgres() if args.start_postgres else _given(args.db)) as server:
        for n in counts:
            run = run_fleet(args, server, spec, device, n, gpus, out_dir)
            report["runs"].append(run)
            print(json.dumps({k: run[k] for k in ("workers", "problems", "queue_empty_s",
                                                  "problems_per_minute",
                                                  "duplicate_measurements", "claims_stuck",
                                                  "claims_lost")}), flush=True)
    rates = {r["workers"]: r["problems_per_minute"] for r in report["runs"]}
    if 1 in rates and rates[1]:
        report["speedup_over_1"] = {n: round(r / rates[1], 2) for n, r in rates.items()}
    text = json.dumps(report, indent=2, default=str)
    if args.json:
        args.json.write_text(text)
    print(text)
    ok = all(r["duplicate_measurements"] == 0 and r["claims_stuck"] == 0 and r["settled"]
             and not r["measured_not_stored"] and r.get("one_worker_per_gpu", True)
             and r.get("killed_problems_finished_by_others", True)
             and r.get("nothing_measured_lost", True) for r in report["runs"])
    return 0 if ok else 1


class _given:
    """The server the user named, as a context like ``local_postgres``."""

    def __init__(self, url: str) -> None:
        self.url = url

    def __enter__(self) -> str:
        return self.url

    def __exit__(self, *exc: object) -> None:
        return None


if __name__ == "__main__":
    sys.exit(main())
