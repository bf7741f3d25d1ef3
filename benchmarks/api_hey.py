"""Load test of GET /v1/best with a generator that shares no code with the service: hey (Go).

    python benchmarks/api_hey.py --workers 1,2,4 --json out.json     # on a host with cores to spare

Setup: hey from Debian's packages. ``--hey PATH`` names the binary; else ``hey`` on PATH; else
the first ``hey_*.deb`` in ``--deb-dir`` (default ``.deb/`` at the repository root, where
``apt-get download hey`` puts it; no root needed) is unpacked with ``dpkg -x`` into a
temporary folder.

For each ``--workers`` count, ``tuner serve --workers N`` runs pinned to its own cores
(``--service-cores``, default: cores 0..max(2, N)-1) over a fresh SQLite file holding the 48
best configs of ``benchmarks/api_load.py``; everything that generates load (hey, and this
script's own event loop for the clients hey cannot play) runs pinned to the other cores
(``--generator-cores``, default: all the rest). Where the host has no cores to spare the two
share, and the JSON says so (``dedicated: false``).

Measured, each for ``--duration`` seconds, every latency from hey's own per-request records
(``-o csv``), merged:

- ``curve``: the read mix at each ``--rates`` value: ``rate / --per-hey`` hey processes, each
  one connection (``-c 1``) asking one URL at ``--per-hey`` requests a second, started at
  staggered moments, each on one of the four kinds of lookup (exact, same bucket, nearest,
  untuned default). One hey process with ``-c C -q R/C`` is not used for the curve: its C
  workers tick at the same moments, so requests arrive in bursts of C and wait for each
  other (``one_hey_c50`` measures that, below).
- ``hostile`` (at ``--mix-rate``): the reads beside 1 authenticated upload a second, 16
  clients sending 8 MB bodies without a token and 300 lookups a second for made-up devices
  (``api_load.py``'s clients, run by this script on the generator's cores).
- ``demand`` (at ``--mix-rate``): the reads beside 8 jobs reporting demand (``api_load.py``'s
  clients, its defaults: 10,000 reports a second).
- ``one_hey_c50`` (at ``--mix-rate``): the reads as one ``hey -c 50 -q rate/50`` process asks
  them (bursts of 50), and ``api_load_open_loop``: the same rate from ``api_load.py``'s own
  open-loop generator (Python), on the same server and cores: how the harnesses compare.

hey is closed loop per connection: a connection waits for its answer before its next request
and hey skips the ticks it missed, so a stall delays the requests behind it without their
being sent or timed (coordinated omission); ``delivered`` below ``rate`` shows it, and the
reads' ``missed`` says why each unanswered request is missing (``missed_ticks``: a slow
answer waited for, a failure or hey late, hey's start, the run's end). api_load.py
times each request from its planned moment instead. The service's CPU per read (from /proc)
is recorded for every run: it does not depend on who else uses the host.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import csv
import io
import itertools
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

sys.path.insert(0, str(Path(__file__).resolve().parent))
import api_load  # noqa: E402  (its database seeding and its clients that hey cannot play)

ROOT = Path(__file__).resolve().parent.parent
KINDS = ("exact", "bucket", "nearest", "default")  # api_load.populate's queries, i % 4
HEY_COLUMNS = ("response-time", "status-code")


def parse_cores(text: str) -> list[int]:
    """``"0-1,4"`` -> [0, 1, 4]."""
    cores: list[int] = []
    for part in text.split(","):
        first, _, last = part.strip().partition("-")
        if not first.isdigit() or (last and not last.isdigit()):
            raise ValueError(f"cores must look like '0-1,4', but got {text!r}")
        cores += range(int(first), int(last or first) + 1)
    return sorted(set(cores))


def plan_cores(workers: int, service: str | None, generator: str | None,
               available: list[int]) -> tuple[list[int], list[int], bool]:
    """The service's cores, the generator's and whether they are disjoint."""
    if service is not None:
        svc = parse_cores(service)
    else:
        svc = available[:max(2, workers)]
        if len(available) - len(svc) < 2:  # no cores to spare: half each, and said so
            svc = available[:max(1, len(available) // 2)]
    gen = parse_cores(generator) if generator is not None else [
        c for c in available if c not in svc]
    if not gen:
        gen = list(available)
    missing = sorted(set(svc + gen) - set(available))
    if missing:
        raise ValueError(f"cores {missing} are not available to this process ({available})")
    return svc, gen, not set(svc) & set(gen)


def find_hey(explicit: Path | None, deb_dir: Path, unpack_to: Path) -> tuple[Path, str]:
    """The hey binary and where it came from (the .deb's name, or its path)."""
    if explicit is not None:
        if not os.access(explicit, os.X_OK):
            raise SystemExit(f"error: --hey {explicit} is not an executable file")
        return explicit, str(explicit)
    on_path = shutil.which("hey")
    if on_path:
        return Path(on_path), on_path
    debs = sorted(deb_dir.glob("hey_*.deb"))
    if not debs:
        raise SystemExit(f"error: no hey: not on PATH and no hey_*.deb in {deb_dir}\n"
                         f"fix: mkdir -p {deb_dir} && cd {deb_dir} && apt-get download hey")
    if shutil.which("dpkg"):
        subprocess.run(["dpkg", "-x", str(debs[-1]), str(unpack_to)], check=True)
    else:  # a host without dpkg: a .deb is an ar archive holding data.tar.*
        unpack_deb(debs[-1], unpack_to)
    binary = unpack_to / "usr" / "bin" / "hey"
    if not os.access(binary, os.X_OK):
        raise SystemExit(f"error: {debs[-1].name} holds no usr/bin/hey")
    return binary, debs[-1].name


def unpack_deb(deb: Path, into: Path) -> None:
    """``dpkg -x`` for hosts without dpkg: the members of the ar archive, data.tar.* unpacked."""
    data = deb.read_bytes()
    if not data.startswith(b"!<arch>\n"):
        raise SystemExit(f"error: {deb} is not a .deb (no ar header)")
    at = 8
    while at + 60 <= len(data):
        name = data[at:at + 16].decode().strip().rstrip("/")
        size = int(data[at + 48:at + 58])
        member = data[at + 60:at + 60 + size]
        if name.startswith("data.tar"):
            with tarfile.open(fileobj=io.BytesIO(member)) as tar:
                tar.extractall(into, filter="data")
            return
        at += 60 + size + size % 2
    raise SystemExit(f"error: {deb} holds no data.tar")


def hey_records(text: str) -> list[tuple[float, int]]:
    """(seconds, status) of each answered request in hey's ``-o csv`` output. Requests that
    failed (no answer) are not in it: they show as answered < asked."""
    rows = csv.DictReader(io.StringIO(text))
    if rows.fieldnames is None or not set(HEY_COLUMNS) <= set(rows.fieldnames):
        raise ValueError(f"hey's csv lacks {HEY_COLUMNS}: {text[:200]!r}")
    return [(float(r["response-time"]), int(r["status-code"])) for r in rows]


def missed_ticks(text: str, period: float, seconds: float) -> dict[str, int]:
    """Why one one-connection hey process (``-c 1 -q 1/period -z seconds``) answered fewer
    requests than it was asked, from its csv's ``offset`` (when each request started) and
    ``response-time``. hey waits for a tick of its rate before each request, and Go drops the
    ticks that come while it is busy, so every missing request is a tick that found it:

    - ``waiting``: waiting for a slow answer (the request before the gap took longer than a
      period): a stall of the service, the requests behind it neither sent nor timed;
    - ``unexplained``: a gap after a quick answer: a request that failed (hey's csv leaves
      errors and timeouts out) or hey itself not run on time;
    - ``start``: before its first request (hey starting); ``end``: after its last one (the
      run's end cutting off a tick, or an answer still awaited at the end)."""
    rows = [(float(r["offset"]), float(r["response-time"]))
            for r in csv.DictReader(io.StringIO(text))]
    asked = round(seconds / period)
    out = {"waiting": 0, "unexplained": 0, "start": 0, "end": 0}
    if not rows:
        out["end"] = asked
        return out
    rows.sort()
    out["start"] = max(0, round(rows[0][0] / period) - 1)
    for (offset, took), (following, _) in itertools.pairwise(rows):
        missed = max(0, round((following - offset) / period) - 1)
        out["waiting" if took > period else "unexplained"] += missed
    out["end"] = max(0, asked - len(rows) - out["start"] - out["waiting"] - out["unexplained"])
    return out


def summarize(records: list[tuple[float, int]], asked: int, seconds: float) -> dict[str, Any]:
    ms = sorted(t * 1e3 for t, _ in records)
    statuses: dict[str, int] = {}
    for _, status in records:
        statuses[str(status)] = statuses.get(str(status), 0) + 1

    def pct(p: float) -> float | None:
        return round(ms[min(len(ms) - 1, int(p / 100 * len(ms)))], 3) if ms else None

    return {"asked": asked, "answered": len(ms), "delivered": round(len(ms) / seconds, 1),
            "statuses": statuses, "p50_ms": pct(50), "p90_ms": pct(90), "p99_ms": pct(99),
            "max_ms": round(ms[-1], 3) if ms else None,
            "mean_ms": round(statistics.fmean(ms), 3) if ms else None}


async def run_hey(hey: Path, argv: list[str], url: str, delay: float) -> str:
    await asyncio.sleep(delay)
    proc = await asyncio.create_subprocess_exec(
        str(hey), *argv, "-o", "csv", url, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE)
    out, err = await proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"hey {' '.join(argv)} exited with {proc.returncode}: "
                           f"{err.decode(errors='replace')[-500:]}")
    return out.decode()


async def hey_reads(hey: Path, base: str, targets: dict[str, list[str]], rate: float,
                    seconds: float, per_hey: float) -> dict[str, Any]:
    """``rate`` reads a second from ceil(rate / per_hey) staggered one-connection hey
    processes, the URL kinds taken in turn."""
    n = max(1, -(-int(rate) // int(per_hey)))
    each = rate / n
    period = 1.0 / each
    runs = []
    for i in range(n):
        kind = KINDS[i % len(KINDS)]
        url = base + targets[kind][(i // len(KINDS)) % len(targets[kind])]
        argv = ["-c", "1", "-cpus", "1", "-q", f"{each:.3f}", "-z", f"{seconds}s"]
        runs.append(run_hey(hey, argv, url, i * period / n))  # phases spread over a period
    outputs = await asyncio.gather(*runs)
    records = [r for text in outputs for r in hey_records(text)]
    missed = {"waiting": 0, "unexplained": 0, "start": 0, "end": 0}
    for text in outputs:
        for why, count in missed_ticks(text, period, seconds).items():
            missed[why] += count
    return {**summarize(records, int(rate * seconds), seconds), "hey_processes": n,
            "per_hey_rate": round(each, 3), "missed": missed}


async def one_hey_reads(hey: Path, url: str, rate: float, seconds: float,
                        connections: int) -> dict[str, Any]:
    """The same rate from one hey process of ``connections`` workers (their ticks coincide)."""
    argv = ["-c", str(connections), "-q", f"{rate / connections:.3f}", "-z", f"{seconds}s"]
    records = hey_records(await run_hey(hey, argv, url, 0.0))
    return {**summarize(records, int(rate * seconds), seconds), "hey_processes": 1,
            "connections": connections}


async def beside_reads(reads: Any, clients: list[Any]) -> Any:
    results = await asyncio.gather(reads, *clients)
    return results[0]


def hostile_clients(port: int, seconds: float, queries: list[dict[str, Any]],
                    stats: dict[str, api_load.Stats], answers: list[str]) -> list[Any]:
    """api_load.py's hostile mix: 1 upload/s of 20 new configs of the readers' device, 16
    clients sending 8 MB bodies without a token, 300 lookups/s for made-up devices."""
    fresh = api_load.writer_problems(int(seconds) * 20, {
        p.bucket_key() for p in api_load.reader_problems(len(queries))})
    bodies = [api_load.bundle_bytes(api_load.items_for(fresh[i * 20:(i + 1) * 20]))
              for i in range(int(seconds))]
    rng = random.Random(0)
    base = {k: v for k, v in queries[0].items() if k != "device"}

    def random_device(_i: int) -> str:
        return f"/v1/best?{urlencode({**base, 'device': f'rand-{rng.getrandbits(48):012x}'})}"

    unauth = (b'{"format": "attention-tuner/bundle", "version": 1, "items": ['
              + b",".join([b"1"] * (api_load.UNAUTH_BODY_BYTES // 2 - 40)) + b"]}")
    until = time.perf_counter() + seconds
    return ([api_load.uploads(port, 1.0, bodies, 60.0, stats["uploads"], answers),
             api_load.open_loop(port, 300.0, int(300 * seconds), random_device, 16, 2.0,
                                stats["random_devices"])]
            + [api_load.unauth_client(port, unauth, until, 20.0, stats["unauth_8mb"])
               for _ in range(16)])


def demand_clients(port: int, seconds: float, stats: api_load.Stats) -> list[Any]:
    """api_load.py's --demand-clients 8 with its defaults (10,000 reports a second)."""
    bodies = api_load.demand_bodies(2000, 250, 1)
    until = time.perf_counter() + seconds
    return [api_load.demand_client(port, f"127.0.0.{2 + i}", 5.0, bodies, until, 2.0, stats)
            for i in range(8)]


def measured(server: subprocess.Popen[bytes], run: Any, reads_key: str = "") -> dict[str, Any]:
    """``run`` (a coroutine) with the service's CPU time over it, per answered read."""
    before = api_load.cpu_seconds_by_process(server.pid)
    started = time.perf_counter()
    result = asyncio.run(run)
    elapsed = time.perf_counter() - started
    after = api_load.cpu_seconds_by_process(server.pid)
    by_process = {p: after[p] - before.get(p, 0.0) for p in after}
    cpu = sum(by_process.values())
    reads = result[reads_key] if reads_key else result
    result["service_cpu_s"] = round(cpu, 2)
    # Per process, busiest first: with --workers N, whether the kernel spread the connections
    # (each keep-alive connection stays with the worker that accepted it).
    result["service_cpu_s_by_process"] = sorted((round(c, 2) for c in by_process.values()),
                                                 reverse=True)
    result["wall_s"] = round(elapsed, 2)
    if reads.get("answered"):
        result["service_cpu_us_per_read"] = round(cpu / reads["answered"] * 1e6)
    return result


def serve_and_measure(workers: int, args: argparse.Namespace, hey: Path, svc: list[int],
                      tmp: Path) -> dict[str, Any]:
    url = f"sqlite:///{tmp / f'hey-{workers}.db'}"
    queries = api_load.populate(url, 48)
    targets: dict[str, list[str]] = {k: [] for k in KINDS}
    for i, q in enumerate(queries):
        targets[KINDS[i % 4]].append(f"/v1/best?{urlencode(q)}")
    port = api_load.free_port()
    base = f"http://{api_load.HOST}:{port}"
    server = api_load.start_server(url, port, workers, cores=svc)
    out: dict[str, Any] = {"workers": workers, "service_cores": svc, "curve": []}
    try:
        for kind in KINDS:  # warm: each URL once (connections, the answers kept)
            for target in targets[kind]:
                subprocess.run([str(hey), "-n", "1", "-c", "1", base + target],
                               check=True, capture_output=True)
        for rate in args.rates:
            point = measured(server, hey_reads(hey, base, targets, rate, args.duration,
                                               args.per_hey))
            out["curve"].append({"rate": rate, **point})
            print(json.dumps({"workers": workers, "rate": rate, "p50_ms": point["p50_ms"],
                              "p99_ms": point["p99_ms"], "delivered": point["delivered"]}),
                  file=sys.stderr)
        rate = args.mix_rate
        if "one_hey_c50" in args.mixes:
            out["one_hey_c50"] = measured(server, one_hey_reads(
                hey, base + targets["exact"][0], rate, args.duration, 50))
        if "api_load_open_loop" in args.mixes:
            out["api_load_open_loop"] = measured(
                server, api_load_reads(port, targets, rate, args.duration))
        if "demand" in args.mixes:
            stats = api_load.Stats()

            async def demand() -> dict[str, Any]:
                reads = await beside_reads(
                    hey_reads(hey, base, targets, rate, args.duration, args.per_hey),
                    demand_clients(port, args.duration, stats))
                return {"reads": reads, "demand": stats.summary(args.duration)}

            out["demand"] = measured(server, demand(), "reads")
        if "hostile" in args.mixes:
            hostile = {k: api_load.Stats() for k in ("uploads", "random_devices",
                                                     "unauth_8mb")}
            answers: list[str] = []

            async def hostile_mix() -> dict[str, Any]:
                reads = await beside_reads(
                    hey_reads(hey, base, targets, rate, args.duration, args.per_hey),
                    hostile_clients(port, args.duration, queries, hostile, answers))
                return {"reads": reads, **{k: s.summary(args.duration)
                                           for k, s in hostile.items()},
                        "last_upload_answer": answers[-1:]}

            out["hostile"] = measured(server, hostile_mix(), "reads")
    finally:
        server.terminate()
        server.wait(timeout=30)
    return out


async def api_load_reads(port: int, targets: dict[str, list[str]], rate: float,
                         seconds: float) -> dict[str, Any]:
    """api_load.py's open-loop reads (16 connections, each request timed from its planned
    moment) at ``rate``, the kinds in turn as api_load.py cycles them."""
    cycle = [targets[KINDS[i % 4]][i // 4] for i in range(4 * min(map(len, targets.values())))]
    stats = api_load.Stats()
    await api_load.open_loop(port, rate, int(rate * seconds), lambda i: cycle[i % len(cycle)],
                             16, 2.0, stats)
    summary = stats.summary(seconds)
    return {**summary, "answered": summary["completed"], "delivered": summary["rate"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", default="1,2,4", help="tuner serve --workers, each in turn")
    parser.add_argument("--rates", default="500,1000,2000,3000,5000",
                        help="read rates (req/s) of the curve")
    parser.add_argument("--mix-rate", type=float, default=500.0,
                        help="read rate beside the hostile and demand mixes")
    parser.add_argument("--mixes", default="one_hey_c50,api_load_open_loop,demand,hostile",
                        help="which of one_hey_c50, api_load_open_loop, demand, hostile to run "
                             "(comma-separated; '' for the curve alone)")
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per run")
    parser.add_argument("--per-hey", type=float, default=100.0,
                        help="requests a second per hey process (one connection each)")
    parser.add_argument("--service-cores", help="e.g. 0-1 (default: 0..max(2, workers)-1)")
    parser.add_argument("--generator-cores", help="e.g. 4-15 (default: the other cores)")
    parser.add_argument("--hey", type=Path, help="the hey binary (default: PATH, then --deb-dir)")
    parser.add_argument("--deb-dir", type=Path, default=ROOT / ".deb",
                        help="where apt-get download hey put hey_*.deb")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    try:
        worker_counts = [int(w) for w in args.workers.split(",")]
        args.rates = [float(r) for r in args.rates.split(",")]
    except ValueError:
        parser.error("--workers and --rates are comma-separated numbers, e.g. 1,2,4")
    args.mixes = [m for m in args.mixes.split(",") if m]
    known = {"one_hey_c50", "api_load_open_loop", "demand", "hostile"}
    if set(args.mixes) - known:
        parser.error(f"unknown --mixes {sorted(set(args.mixes) - known)}; known: {sorted(known)}")
    if not (all(1 <= w <= 64 for w in worker_counts) and all(0 < r <= 50_000 for r in args.rates)
            and 0 < args.duration <= 60 and 1 <= args.per_hey <= 1000):
        parser.error("keep --workers in 1..64, --rates in (0, 50000], --duration in (0, 60] "
                     "and --per-hey in 1..1000")
    available = sorted(os.sched_getaffinity(0))
    result: dict[str, Any] = {
        "host": {"cpus": os.cpu_count(), "cores_available": len(available),
                 "machine": platform.machine(), "python": platform.python_version(),
                 "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
        "duration_s": args.duration, "per_hey": args.per_hey, "mix_rate": args.mix_rate,
        "by_workers": {}}
    with tempfile.TemporaryDirectory() as tmp:
        hey, source = find_hey(args.hey, args.deb_dir, Path(tmp) / "hey")
        result["hey"] = source
        for workers in worker_counts:
            svc, gen, dedicated = plan_cores(workers, args.service_cores, args.generator_cores,
                                             available)
            # This process and every hey it starts run on the generator's cores.
            os.sched_setaffinity(0, gen)
            try:
                one = serve_and_measure(workers, args, hey, svc, Path(tmp))
            finally:
                os.sched_setaffinity(0, available)
            one.update({"generator_cores": gen, "dedicated": dedicated})
            result["by_workers"][str(workers)] = one
            if args.json:  # after each worker count: a run cut short keeps what it measured
                args.json.parent.mkdir(parents=True, exist_ok=True)
                args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    with contextlib.suppress(Exception):
        print(curve_table(result), file=sys.stderr)


def curve_table(result: dict[str, Any]) -> str:
    """The curve as a markdown table: rate -> p50 / p99 (ms) per worker count."""
    counts = list(result["by_workers"])
    lines = ["| reads/s asked | " + " | ".join(f"{w} worker(s): p50 / p99 ms (delivered)"
                                               for w in counts) + " |",
             "|---" * (len(counts) + 1) + "|"]
    rates = [p["rate"] for p in result["by_workers"][counts[0]]["curve"]]
    for i, rate in enumerate(rates):
        cells = []
        for w in counts:
            p = result["by_workers"][w]["curve"][i]
            cells.append(f"{p['p50_ms']} / {p['p99_ms']} ({p['delivered']:.0f})")
        lines.append(f"| {rate:.0f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
