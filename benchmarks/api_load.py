"""Load test of GET /v1/best: latency at a fixed request rate against uvicorn + SQLite.

    python benchmarks/api_load.py                       # 500 req/s for 10 s
    python benchmarks/api_load.py --rate 1000 --duration 5 --json load.json

Starts the service as its own process (``uvicorn --factory api.main:create_app``, one worker)
on a free loopback port, over a fresh SQLite file holding ``--configs`` tuned best configs of
``flash_fwd``, then sends best-config lookups at ``--rate`` per second, open loop: request i is
sent at start + i / rate whether or not earlier ones have finished, and its latency counts from
that planned moment, so a stalled server shows up in the tail instead of slowing the sender
down (no coordinated omission). The lookups cycle through exact, same-bucket, nearest-shape and
untuned (default) problems. Loopback only; bounded by --duration, --max-requests and a
per-request timeout. Target (issue 7): p99 <= 5 ms at 500 req/s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TOKEN = "load-test-token-5d1e9a"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def populate(url: str, n_configs: int) -> list[dict[str, Any]]:
    """Store ``n_configs`` best configs; return the lookup queries to cycle through."""
    from db.session import dispose_engine, session_scope
    from templates.base import Problem
    from templates.device import DeviceInfo
    from templates.registry import get_template
    from tuner.bundle import BUNDLE_FORMAT, BundleDevice, store_bundle, validate_bundle

    fwd = get_template("flash_fwd")
    h100 = DeviceInfo(name="NVIDIA H100 80GB HBM3", compute_capability="9.0", sm_count=132,
                      total_memory=85_520_809_984, smem_per_block=232_448,
                      driver_version="570.86", triton_version="3.6.0", torch_version="2.11.0",
                      cuda_version="12.8")
    problems = []
    for head_dim in (64, 128):
        for causal in ("none", "top_left"):
            for dtype in ("bfloat16", "float16"):
                for exp in range(9, 15):  # 512 .. 16k, the standard suite's tokens per batch
                    n = 1 << exp
                    problems.append(Problem(batch=max(1, 16384 // n), heads_q=2048 // head_dim,
                                            heads_kv=2048 // head_dim, seqlen_q=n, seqlen_kv=n,
                                            head_dim=head_dim, dtype=dtype, causal=causal))
    problems = problems[:n_configs]
    items = []
    for p in problems:
        config = fwd.default_config(p, h100)
        items.append({"device": BundleDevice.of(h100).model_dump(), "template": fwd.name,
                      "template_version": fwd.version(), "problem": p.to_dict(),
                      "config": config.to_dict(), "tflops": 400.0,
                      "median_ms": fwd.flops(p) / 400e9, "default_tflops": 300.0})
    with session_scope(url) as s:
        store_bundle(s, validate_bundle({"format": BUNDLE_FORMAT, "version": 1, "items": items}))
    dispose_engine(url)

    queries = []
    for i, p in enumerate(problems):
        q = {"device": h100.key, "template": fwd.name, **p.to_dict()}
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


def start_server(url: str, port: int) -> subprocess.Popen[bytes]:
    env = {**os.environ, "TUNER_DATABASE_URL": url, "TUNER_TOKEN": TOKEN,
           "TUNER_LOG_LEVEL": "WARNING", "PYTHONPATH": str(ROOT)}
    env.pop("TUNER_URL", None)
    cmd = [sys.executable, "-m", "uvicorn", "--factory", "api.main:create_app", "--host",
           "127.0.0.1", "--port", str(port), "--log-level", "warning", "--no-access-log"]
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the service exited with {proc.returncode} before answering")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.terminate()
    raise RuntimeError("the service did not answer /healthz within 60 s")


class Connection:
    """One keep-alive HTTP/1.1 connection speaking just enough protocol for GETs.

    httpx's async client spends ~1-2 ms of CPU per request on this class of machine, as much
    as the server it measures; on a 2-core box the load generator then starves the server.
    Raw streams cost tens of microseconds per request.
    """

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def get(self, target: str, timeout: float) -> tuple[int, bytes]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.wait_for(
                asyncio.open_connection(self.host, self.port), timeout)
        assert self.reader is not None and self.writer is not None
        self.writer.write(f"GET {target} HTTP/1.1\r\nHost: {self.host}\r\n\r\n".encode())
        try:
            head = await asyncio.wait_for(self.reader.readuntil(b"\r\n\r\n"), timeout)
            status = int(head.split(b" ", 2)[1])
            length = 0
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            body = await asyncio.wait_for(self.reader.readexactly(length), timeout)
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError):
            self.close()
            raise
        return status, body

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


async def run_load(base: str, queries: list[dict[str, Any]], rate: float, duration: float,
                   max_requests: int, timeout: float, connections: int) -> dict[str, Any]:
    from urllib.parse import urlencode, urlsplit

    parts = urlsplit(base)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    targets = [f"/v1/best?{urlencode(q)}" for q in queries]
    total = min(max_requests, int(rate * duration))
    latencies: list[float] = []
    errors: dict[str, int] = {}
    matches: dict[str, int] = {}
    queue: asyncio.Queue[tuple[int, float] | None] = asyncio.Queue()

    async def worker() -> None:
        conn = Connection(host, port)
        while (job := await queue.get()) is not None:
            i, planned = job
            try:
                status, body = await conn.get(targets[i % len(targets)], timeout)
                latencies.append(time.perf_counter() - planned)
                if status != 200:
                    errors[str(status)] = errors.get(str(status), 0) + 1
                else:
                    m = json.loads(body)["match"]
                    matches[m] = matches.get(m, 0) + 1
            except (TimeoutError, OSError, asyncio.IncompleteReadError) as exc:
                errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1
        conn.close()

    # Warm the server's caches (not measured).
    warm = Connection(host, port)
    for target in targets[:20]:
        await warm.get(target, timeout)
    warm.close()

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
    elapsed = time.perf_counter() - start
    ms = sorted(x * 1e3 for x in latencies)

    def pct(p: float) -> float:
        return round(ms[min(len(ms) - 1, int(p / 100 * len(ms)))], 3) if ms else float("nan")

    return {"requests": total, "completed": len(latencies), "elapsed_s": round(elapsed, 3),
            "achieved_rate": round(len(latencies) / elapsed, 1), "errors": errors,
            "matches": matches, "p50_ms": pct(50), "p90_ms": pct(90), "p99_ms": pct(99),
            "max_ms": round(ms[-1], 3) if ms else None,
            "mean_ms": round(statistics.fmean(ms), 3) if ms else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rate", type=float, default=500.0, help="requests per second")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds of load")
    parser.add_argument("--max-requests", type=int, default=20_000)
    parser.add_argument("--configs", type=int, default=48, help="best configs stored")
    parser.add_argument("--timeout", type=float, default=2.0, help="per-request timeout (s)")
    parser.add_argument("--connections", type=int, default=16,
                        help="keep-alive connections (a request waits for a free one)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    if not (0 < args.rate <= 5000 and 0 < args.duration <= 120):
        parser.error("keep --rate in (0, 5000] and --duration in (0, 120]")

    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite:///{Path(tmp) / 'load.db'}"
        queries = populate(url, args.configs)
        port = free_port()
        server = start_server(url, port)
        try:
            result = asyncio.run(run_load(f"http://127.0.0.1:{port}", queries, args.rate,
                                          args.duration, args.max_requests, args.timeout,
                                          args.connections))
        finally:
            server.terminate()
            server.wait(timeout=30)
    result.update({"rate": args.rate, "connections": args.connections, "duration_s": args.duration, "configs": args.configs,
                   "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
                   "python": platform.python_version(),
                   "date": time.strftime("%Y-%m-%d", time.gmtime())})
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
