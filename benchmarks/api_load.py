"""Load test of GET /v1/best: read latency at a fixed rate, alone or beside writers and probes.

    python benchmarks/api_load.py                       # 500 req/s for 10 s, reads only
    python benchmarks/api_load.py --rate 500 --duration 5 --uploads 1 --unauth-clients 16 \
        --random-devices 300                            # the hostile mix of issue 19
    python benchmarks/api_load.py --huge-bundle         # one 4M-integer bundle mid-run
    python benchmarks/api_load.py --big-upload 8000     # one 8,000-item upload mid-run
    python benchmarks/api_load.py --demand-clients 8    # 10,000 demand reports/s beside the reads

Starts the service as its own process (``tuner serve``, ``--workers`` processes) on a free
loopback port, over a fresh SQLite file holding ``--configs`` tuned best configs of
``flash_fwd``, then sends best-config lookups at ``--rate`` per second, open loop: request i is
sent at start + i / rate whether or not earlier ones have finished, and its latency counts from
that planned moment, so a stalled server shows up in the tail instead of slowing the sender
down (no coordinated omission). The lookups cycle through exact, same-bucket, nearest-shape and
untuned (default) problems.

Beside the readers, each optional and measured on its own: ``--uploads`` authenticated uploads
per second of ``--upload-items`` new best configs of the readers' device (each changes what
the readers' device has tuned); ``--unauth-clients`` clients that keep sending 8 MB bodies
without a token (timed to the answer's status line, not to the end of the body: the service
should refuse before reading it); ``--random-devices`` lookups per second for made-up device
keys; ``--huge-bundle``, one authenticated bundle of 4,000,000 integers as items;
``--big-upload N``, one authenticated upload of N valid items; ``--demand-clients N``, N
jobs reporting demand (``POST /v1/demand``, no token), each from a loopback address of its
own (127.0.0.2, 127.0.0.3, ...: the service rate-limits per address), ``--demand-rate``
requests per second each, ``--demand-items`` items per request drawn from
``--demand-problems`` distinct problems (jobs report the same shapes again and again), each
item carrying ``--demand-count`` reports; with the defaults 8 x 5 x 250 x 1 = 10,000 reports a
second, every one an item of its own (``tuner.demand.reporter`` adds up repeats: ``--demand-rate 1
--demand-items 50 --demand-count 25`` is 10,000 reports a second as it sends them). The clients
send at the same moments unless ``--demand-spread``; ``--demand-path /healthz`` sends the same
requests where they are answered 405 unread: the load of the transport alone, a baseline. Loopback only; bounded by --duration,
--max-requests and a per-request timeout. Targets (issues 7, 18 and 19): reads p99 <= 5 ms at
500 req/s, with or without the others; beside 10,000 demand reports/s, unchanged within the
noise.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TOKEN = "load-test-token-5d1e9a"
HOST = "127.0.0.1"
UNAUTH_BODY_BYTES = 8 * 1024 * 1024
HUGE_BUNDLE_INTEGERS = 4_000_000


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def h100() -> Any:
    from templates.device import DeviceInfo

    return DeviceInfo(name="NVIDIA H100 80GB HBM3", compute_capability="9.0", sm_count=132,
                      total_memory=85_520_809_984, smem_per_block=232_448,
                      driver_version="570.86", triton_version="3.6.0", torch_version="2.11.0",
                      cuda_version="12.8")


def reader_problems(n: int) -> list[Any]:
    """The ``n`` problems the readers look up (at most 48: the standard suite's shapes)."""
    from templates.base import Problem

    problems = []
    for head_dim in (64, 128):
        for causal in ("none", "top_left"):
            for dtype in ("bfloat16", "float16"):
                for exp in range(9, 15):  # 512 .. 16k, the standard suite's tokens per batch
                    s = 1 << exp
                    problems.append(Problem(batch=max(1, 16384 // s), heads_q=2048 // head_dim,
                                            heads_kv=2048 // head_dim, seqlen_q=s, seqlen_kv=s,
                                            head_dim=head_dim, dtype=dtype, causal=causal))
    return problems[:n]


def writer_problems(n: int, taken: set[str]) -> list[Any]:
    """``n`` problems of other buckets than ``taken``: what uploads bring that is new."""
    from templates.base import Problem

    out: list[Any] = []
    if n == 0:
        return out
    for heads in range(1, 4096):
        for head_dim in (64, 128):
            for causal in ("none", "top_left"):
                for dtype in ("bfloat16", "float16"):
                    for exp in range(7, 15):
                        p = Problem(batch=1, heads_q=heads, heads_kv=heads, seqlen_q=1 << exp,
                                    seqlen_kv=1 << exp, head_dim=head_dim, dtype=dtype,
                                    causal=causal)
                        if p.bucket_key() not in taken:
                            taken.add(p.bucket_key())
                            out.append(p)
                            if len(out) == n:
                                return out
    raise ValueError(f"cannot make {n} distinct problems")


def items_for(problems: list[Any], tflops: float = 400.0) -> list[dict[str, Any]]:
    from templates.registry import get_template
    from tuner.lookup.bundle import BundleDevice

    fwd, dev = get_template("flash_fwd"), h100()
    device = BundleDevice.of(dev).model_dump()
    version = fwd.version()
    return [{"device": device, "template": fwd.name, "template_version": version,
             "problem": p.to_dict(), "config": fwd.default_config(p, dev).to_dict(),
             "tflops": tflops, "median_ms": fwd.flops(p) / (tflops * 1e9),
             "default_tflops": 300.0} for p in problems]


def bundle_bytes(items: list[Any]) -> bytes:
    from tuner.lookup.bundle import BUNDLE_FORMAT

    return json.dumps({"format": BUNDLE_FORMAT, "version": 1, "host": "load",
                       "items": items}).encode()


def populate(url: str, n_configs: int) -> list[dict[str, Any]]:
    """Store ``n_configs`` best configs; return the lookup queries to cycle through."""
    from db.session import dispose_engine, session_scope
    from templates.registry import get_template
    from tuner.lookup.bundle import store_bundle, validate_bundle

    fwd, dev = get_template("flash_fwd"), h100()
    problems = reader_problems(n_configs)
    with session_scope(url) as s:
        store_bundle(s, validate_bundle(json.loads(bundle_bytes(items_for(problems)))))
    dispose_engine(url)

    queries = []
    for i, p in enumerate(problems):
        q = {"device": dev.key, "template": fwd.name, **p.to_dict()}
        kind = i % 4
        if kind == 1:  # same bucket, other exact shape
            q["seqlen_q"] = q["seqlen_kv"] = p.seqlen_q - 7
        elif kind == 2:  # nearest: a bucket nothing was tuned for
            q["seqlen_q"] = q["seqlen_kv"] = p.seqlen_q * 64
        elif kind == 3:  # untuned family: the default heuristic
            q["head_dim"] = 96
            q["heads_q"] = q["heads_kv"] = 16
        queries.append(q)
    return queries


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system) of process ``pid`` and its descendants (uvicorn's workers, the
    upload store process of each), from /proc; 0 where there is no /proc."""
    return sum(cpu_seconds_by_process(pid).values())


def cpu_seconds_by_process(pid: int) -> dict[int, float]:
    """``cpu_seconds`` per process: ``pid`` and each of its descendants."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    parents: dict[int, int] = {}
    used: dict[int, float] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        child = int(stat.parent.name)
        parents[child] = int(fields[1])  # fields[1]: the parent
        used[child] = (int(fields[11]) + int(fields[12])) / tick
    family = {pid}
    grew = True
    while grew:  # a child is listed before or after its parent: until no new one is found
        more = {child for child, parent in parents.items() if parent in family} - family
        family |= more
        grew = bool(more)
    return {p: used[p] for p in family if p in used}


def demand_bodies(n_problems: int, per_request: int, count: int = 1,
                  bodies: int = 64) -> list[bytes]:
    """``bodies`` report bodies of ``per_request`` items each, drawn from ``n_problems``
    distinct flash_fwd problems (a few of its buckets, on a few device keys), each item
    carrying ``count`` reports (a client adds up repeats of a problem into one item)."""
    from dataclasses import replace

    from templates.base import Problem
    from templates.registry import get_template

    fwd = get_template("flash_fwd")
    version = fwd.version()
    devices = [replace(h100(), name=f"NVIDIA H100 80GB HBM3 #{i}").key for i in range(4)]
    pool = []
    for i in range(n_problems):
        p = Problem(batch=1 + i % 8, heads_q=16, heads_kv=16, seqlen_q=512 + 64 * (i // 8),
                    seqlen_kv=512 + 64 * (i // 8), head_dim=128, dtype="bfloat16")
        pool.append({"template": fwd.name, "template_version": version,
                     "device": devices[i % len(devices)], "problem": p.to_dict(),
                     "count": count})
    rng = random.Random(1)
    return [json.dumps({"items": rng.sample(pool, min(per_request, len(pool)))}).encode()
            for _ in range(bodies)]


async def demand_client(port: int, source: str, rate: float, bodies: list[bytes], until: float,
                        timeout: float, stats: Stats, path: str = "/v1/demand",
                        offset: float = 0.0) -> None:
    """One job's reports at ``rate`` a second from the address ``source``, open loop, the
    first ``offset`` seconds after the start."""
    conn = Connection(port, local_host=source)
    start = time.perf_counter() + offset
    i = 0
    while (planned := start + i / rate) < until:
        delay = planned - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        try:
            status, _ = await conn.request("POST", path, timeout, bodies[i % len(bodies)],
                                           "Content-Type: application/json\r\n")
            stats.latencies.append(time.perf_counter() - planned)
            stats.statuses[str(status)] = stats.statuses.get(str(status), 0) + 1
        except (TimeoutError, OSError, asyncio.IncompleteReadError) as exc:
            stats.error(type(exc).__name__)
        i += 1
    conn.close()


def start_server(url: str, port: int, workers: int, demand_rate_limit: float | None = None,
                 cores: list[int] | None = None) -> subprocess.Popen[bytes]:
    """``tuner serve`` over ``url`` on ``port``, answering /healthz and idle; on ``cores``
    (its workers inherit them) where given."""
    env = {**os.environ, "TUNER_DATABASE_URL": url, "TUNER_TOKEN": TOKEN,
           "TUNER_LOG_LEVEL": "WARNING",
           # this tree first, then what the caller's path holds (e.g. wheels unpacked aside)
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH"))
                                         if p)}
    if demand_rate_limit is not None:
        env["TUNER_DEMAND_RATE_LIMIT"] = str(demand_rate_limit)
    env.pop("TUNER_URL", None)
    cmd = [sys.executable, "-m", "tuner.cli.app", "serve", "--host", HOST, "--port", str(port)]
    if workers != 1:
        cmd += ["--workers", str(workers)]
    pin = (lambda: os.sched_setaffinity(0, cores)) if cores else None
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, preexec_fn=pin)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the service exited with {proc.returncode} before answering")
        try:
            if httpx.get(f"http://{HOST}:{port}/healthz", timeout=1).status_code == 200:
                wait_until_idle(proc.pid, deadline)
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.terminate()
    raise RuntimeError("the service did not answer /healthz within 60 s")


def wait_until_idle(pid: int, deadline: float, window: float = 0.5) -> None:
    """Wait until the service's processes use under a fifth of a core: with ``--workers N``
    the first worker answers /healthz while the others may still be importing (seconds of
    CPU each), which a measurement started then would count against the reads."""
    used = cpu_seconds(pid)
    while time.monotonic() < deadline:
        time.sleep(window)
        now = cpu_seconds(pid)
        if now - used < 0.2 * window:
            return
        used = now


class Connection:
    """One keep-alive HTTP/1.1 connection speaking just enough protocol for these requests.

    httpx's async client spends ~1-2 ms of CPU per request on this class of machine, as much
    as the server it measures; on a 2-core box the load generator then starves the server.
    Raw streams cost tens of microseconds per request.
    """

    def __init__(self, port: int, local_host: str | None = None) -> None:
        self.port = port
        self.local_host = local_host  # the client's own address (any 127.x.y.z on Linux)
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def request(self, method: str, target: str, timeout: float, body: bytes = b"",
                      headers: str = "") -> tuple[int, bytes]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.wait_for(asyncio.open_connection(
                HOST, self.port, local_addr=(self.local_host, 0) if self.local_host else None),
                timeout)
        assert self.reader is not None and self.writer is not None
        length = f"Content-Length: {len(body)}\r\n" if method == "POST" else ""
        self.writer.write(f"{method} {target} HTTP/1.1\r\nHost: {HOST}\r\n{headers}{length}"
                          "\r\n".encode() + body)
        try:
            head = await asyncio.wait_for(self.reader.readuntil(b"\r\n\r\n"), timeout)
            status = int(head.split(b" ", 2)[1])
            size, close = 0, False
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    size = int(value)
                if name.strip().lower() == b"connection" and b"close" in value.lower():
                    close = True
            answer = await asyncio.wait_for(self.reader.readexactly(size), timeout)
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError):
            self.close()
            raise
        if close:
            self.close()
        return status, answer

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


class Stats:
    def __init__(self) -> None:
        self.latencies: list[float] = []
        self.errors: dict[str, int] = {}
        self.statuses: dict[str, int] = {}

    def error(self, what: str) -> None:
        self.errors[what] = self.errors.get(what, 0) + 1

    def summary(self, elapsed: float) -> dict[str, Any]:
        ms = sorted(x * 1e3 for x in self.latencies)

        def pct(p: float) -> float:
            return round(ms[min(len(ms) - 1, int(p / 100 * len(ms)))], 3) if ms else float("nan")

        return {"completed": len(ms), "rate": round(len(ms) / elapsed, 1),
                "errors": self.errors, "statuses": self.statuses, "p50_ms": pct(50),
                "p90_ms": pct(90), "p99_ms": pct(99),
                "max_ms": round(ms[-1], 3) if ms else None,
                "mean_ms": round(statistics.fmean(ms), 3) if ms else None}


async def open_loop(port: int, rate: float, total: int, next_target: Callable[[int], str],
                    connections: int, timeout: float, stats: Stats,
                    matches: dict[str, int] | None = None) -> None:
    """``total`` GETs at ``rate`` per second over ``connections`` keep-alive connections."""
    queue: asyncio.Queue[tuple[int, float] | None] = asyncio.Queue()

    async def worker() -> None:
        conn = Connection(port)
        while (job := await queue.get()) is not None:
            i, planned = job
            try:
                status, answer = await conn.request("GET", next_target(i), timeout)
                stats.latencies.append(time.perf_counter() - planned)
                stats.statuses[str(status)] = stats.statuses.get(str(status), 0) + 1
                if status == 200 and matches is not None:
                    m = json.loads(answer)["match"]
                    matches[m] = matches.get(m, 0) + 1
            except (TimeoutError, OSError, asyncio.IncompleteReadError) as exc:
                stats.error(type(exc).__name__)
        conn.close()

    workers = [asyncio.create_task(worker()) for _ in range(connections)]
    start = time.perf_counter()
    for i in range(total):
        planned = start + i / rate
        delay = planned - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        queue.put_nowait((i, planned))
    for _ in workers:
        queue.put_nowait(None)
    await asyncio.gather(*workers)


async def post_once(port: int, body: bytes, timeout: float, stats: Stats,
                    answers: list[str]) -> None:
    """One authenticated upload, timed from its first byte to the end of its answer."""
    conn = Connection(port)
    start = time.perf_counter()
    try:
        status, answer = await conn.request(
            "POST", "/v1/results", timeout, body,
            f"Authorization: Bearer {TOKEN}\r\nContent-Type: application/json\r\n")
        stats.latencies.append(time.perf_counter() - start)
        stats.statuses[str(status)] = stats.statuses.get(str(status), 0) + 1
        answers.append(answer[:300].decode(errors="replace"))
    except (TimeoutError, OSError, asyncio.IncompleteReadError) as exc:
        stats.error(type(exc).__name__)
    finally:
        conn.close()


async def uploads(port: int, rate: float, bodies: list[bytes], timeout: float, stats: Stats,
                  answers: list[str]) -> None:
    start = time.perf_counter()
    tasks = []
    for i, body in enumerate(bodies):
        delay = start + i / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(post_once(port, body, timeout, stats, answers)))
    await asyncio.gather(*tasks)


async def unauth_client(port: int, body: bytes, until: float, timeout: float,
                        stats: Stats) -> None:
    """Keeps sending ``body`` without a token; times each to its answer's status line."""
    head = (f"POST /v1/results HTTP/1.1\r\nHost: {HOST}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    chunk = 64 * 1024
    while time.perf_counter() < until:
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(HOST, port), timeout)
        except (TimeoutError, OSError) as exc:
            stats.error(type(exc).__name__)
            await asyncio.sleep(0.1)
            continue
        start = time.perf_counter()

        async def send(writer: asyncio.StreamWriter) -> None:
            writer.write(head)
            for i in range(0, len(body), chunk):
                writer.write(body[i:i + chunk])
                await writer.drain()

        sender = asyncio.create_task(send(writer))
        try:
            line = await asyncio.wait_for(reader.readline(), timeout)
            if line:
                stats.latencies.append(time.perf_counter() - start)
                status = line.split(b" ", 2)[1].decode()
                stats.statuses[status] = stats.statuses.get(status, 0) + 1
            else:
                stats.error("closed without an answer")
        except (ConnectionResetError, BrokenPipeError):
            # Closed by the service while the body was still coming: refused unread too.
            stats.latencies.append(time.perf_counter() - start)
            stats.statuses["reset"] = stats.statuses.get("reset", 0) + 1
        except (TimeoutError, OSError) as exc:
            stats.error(type(exc).__name__)
        finally:
            sender.cancel()
            await asyncio.gather(sender, return_exceptions=True)
            writer.close()
        await asyncio.sleep(0.05)


async def run_load(port: int, queries: list[dict[str, Any]], args: argparse.Namespace,
                   upload_bodies: list[bytes]) -> dict[str, Any]:
    targets = [f"/v1/best?{urlencode(q)}" for q in queries]
    total = min(args.max_requests, int(args.rate * args.duration))
    reads, matches = Stats(), {}  # type: ignore[var-annotated]
    out: dict[str, Any] = {}

    # Warm the server's caches (not measured).
    warm = Connection(port)
    for target in targets[:20]:
        await warm.request("GET", target, args.timeout)
    warm.close()

    jobs = [open_loop(port, args.rate, total, lambda i: targets[i % len(targets)],
                      args.connections, args.timeout, reads, matches)]
    probes = Stats()
    if args.random_devices:
        rng = random.Random(0)
        base = {k: v for k, v in queries[0].items() if k != "device"}

        def random_device(_i: int) -> str:
            return f"/v1/best?{urlencode({**base, 'device': f'rand-{rng.getrandbits(48):012x}'})}"

        jobs.append(open_loop(port, args.random_devices,
                              int(args.random_devices * args.duration), random_device,
                              args.connections, args.timeout, probes))
    ups, up_answers = Stats(), []  # type: ignore[var-annotated]
    if upload_bodies:
        jobs.append(uploads(port, args.uploads, upload_bodies, args.timeout * 30, ups,
                            up_answers))
    unauth = Stats()
    start = time.perf_counter()
    if args.unauth_clients:
        body = b'{"format": "attention-tuner/bundle", "version": 1, "items": [' + b",".join(
            [b"1"] * (UNAUTH_BODY_BYTES // 2 - 40)) + b"]}"
        jobs += [unauth_client(port, body, start + args.duration, args.timeout * 10, unauth)
                 for _ in range(args.unauth_clients)]
    reports = Stats()
    if args.demand_clients:
        bodies = demand_bodies(args.demand_problems, args.demand_items, args.demand_count)
        # Together (the default: every client sends at the same moments, as a job's ranks
        # report at about the same time, the worst case) or spread over the period.
        spread = 1.0 / (args.demand_rate * args.demand_clients) if args.demand_spread else 0.0
        jobs += [demand_client(port, f"127.0.0.{2 + i}", args.demand_rate, bodies,
                               start + args.duration, args.timeout, reports,
                               args.demand_path, i * spread)
                 for i in range(args.demand_clients)]
    single, single_answers = Stats(), []  # type: ignore[var-annotated]
    if args.huge_bundle or args.big_upload:
        if args.huge_bundle:
            body = (b'{"format": "attention-tuner/bundle", "version": 1, "items": ['
                    + b",".join([b"1"] * HUGE_BUNDLE_INTEGERS) + b"]}")
        else:
            body = bundle_bytes(items_for(writer_problems(args.big_upload, {
                p.bucket_key() for p in reader_problems(args.configs)}), tflops=450.0))
        out["single_upload_bytes"] = len(body)

        async def later() -> None:
            await asyncio.sleep(min(1.0, args.duration / 4))
            await post_once(port, body, 600.0, single, single_answers)

        jobs.append(later())
    await asyncio.gather(*jobs)
    elapsed = time.perf_counter() - start
    out["reads"] = {**reads.summary(elapsed), "matches": matches}
    if args.random_devices:
        out["random_devices"] = probes.summary(elapsed)
    if upload_bodies:
        out["uploads"] = {**ups.summary(elapsed), "last_answer": up_answers[-1:]}
    if args.unauth_clients:
        out["unauth_8mb"] = unauth.summary(elapsed)
    if args.demand_clients:
        posted = reports.statuses.get("202", 0)
        out["demand"] = {**reports.summary(elapsed),
                         "items_per_s": round(posted * args.demand_items / elapsed),
                         "reports_per_s": round(posted * args.demand_items
                                                * args.demand_count / elapsed)}
    if args.huge_bundle or args.big_upload:
        out["single_upload"] = {**single.summary(elapsed), "answer": single_answers}
    out["elapsed_s"] = round(elapsed, 3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rate", type=float, default=500.0, help="reads per second")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds of load")
    parser.add_argument("--max-requests", type=int, default=20_000)
    parser.add_argument("--configs", type=int, default=48, help="best configs stored (<= 48)")
    parser.add_argument("--timeout", type=float, default=2.0, help="per-request timeout (s)")
    parser.add_argument("--connections", type=int, default=16,
                        help="keep-alive connections per stream (a request waits for one)")
    parser.add_argument("--workers", type=int, default=1, help="tuner serve --workers")
    parser.add_argument("--uploads", type=float, default=0.0,
                        help="authenticated uploads per second beside the reads")
    parser.add_argument("--upload-items", type=int, default=20, help="new items per upload")
    parser.add_argument("--unauth-clients", type=int, default=0,
                        help="clients sending 8 MB bodies without a token, one after another")
    parser.add_argument("--random-devices", type=float, default=0.0,
                        help="lookups per second for made-up device keys")
    parser.add_argument("--huge-bundle", action="store_true",
                        help="one authenticated bundle of 4,000,000 integers as items")
    parser.add_argument("--big-upload", type=int, default=0,
                        help="one authenticated upload of this many valid items")
    parser.add_argument("--demand-clients", type=int, default=0,
                        help="jobs reporting demand, each from its own loopback address")
    parser.add_argument("--demand-rate", type=float, default=5.0,
                        help="demand reports (requests) per second per job")
    parser.add_argument("--demand-items", type=int, default=250,
                        help="problems per demand report (the client sends at most 250)")
    parser.add_argument("--demand-count", type=int, default=1,
                        help="reports per item (a client adds up the repeats of a problem)")
    parser.add_argument("--demand-problems", type=int, default=2000,
                        help="distinct problems the jobs report")
    parser.add_argument("--demand-path", default="/v1/demand",
                        help="where the demand clients post: /healthz sends the same requests "
                             "and bytes to a path that answers 405 without reading them, the "
                             "transport's load without the demand work (a baseline)")
    parser.add_argument("--demand-spread", action="store_true",
                        help="spread the demand clients' reports over each period instead of "
                             "sending them all at the same moments")
    parser.add_argument("--demand-rate-limit", type=float, default=None,
                        help="TUNER_DEMAND_RATE_LIMIT of the service (default: its own, 20)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    if not (0 < args.rate <= 5000 and 0 < args.duration <= 120):
        parser.error("keep --rate in (0, 5000] and --duration in (0, 120]")
    if not 1 <= args.configs <= 48:
        parser.error(f"--configs must be 1..48, but got {args.configs}")
    if not (0 <= args.demand_clients <= 250 and 0 < args.demand_rate <= 1000
            and 1 <= args.demand_items <= 500 and args.demand_problems >= 1
            and 1 <= args.demand_count <= 1_000_000):
        parser.error("keep --demand-clients in 0..250, --demand-rate in (0, 1000], "
                     "--demand-items in 1..500 (the service's limit), --demand-count in "
                     "1..1,000,000 and --demand-problems >= 1")

    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite:///{Path(tmp) / 'load.db'}"
        queries = populate(url, args.configs)
        n_uploads = int(args.uploads * args.duration)
        fresh = writer_problems(n_uploads * args.upload_items,
                                {p.bucket_key() for p in reader_problems(args.configs)})
        upload_bodies = [bundle_bytes(items_for(fresh[i * args.upload_items:
                                                     (i + 1) * args.upload_items]))
                         for i in range(n_uploads)]
        port = free_port()
        server = start_server(url, port, args.workers, args.demand_rate_limit)
        try:
            # CPU used during the load, by the service and by this load generator: on a small
            # machine the generator's share is taken from the service.
            server_cpu, own = cpu_seconds(server.pid), time.process_time()
            result = asyncio.run(run_load(port, queries, args, upload_bodies))
            result["cpu_s"] = {"service": round(cpu_seconds(server.pid) - server_cpu, 2),
                               "load_generator": round(time.process_time() - own, 2)}
        finally:
            server.terminate()
            server.wait(timeout=30)
    result.update({"rate": args.rate, "connections": args.connections,
                   "duration_s": args.duration, "configs": args.configs,
                   "workers": args.workers, "uploads_per_s": args.uploads,
                   "upload_items": args.upload_items, "unauth_clients": args.unauth_clients,
                   "random_devices_per_s": args.random_devices,
                   "demand_clients": args.demand_clients, "demand_rate": args.demand_rate,
                   "demand_items": args.demand_items, "demand_count": args.demand_count,
                   "demand_problems": args.demand_problems,
                   "demand_path": args.demand_path, "demand_spread": args.demand_spread,
                   "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
                   "python": platform.python_version(),
                   "date": time.strftime("%Y-%m-%d", time.gmtime())})
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
