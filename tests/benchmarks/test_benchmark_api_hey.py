"""benchmarks/api_hey.py: cores, hey's setup from a .deb, its csv records merged, the read
mix spread over one-connection hey processes."""

from __future__ import annotations

import asyncio
import io
import json
import os
import sys
import tarfile
from pathlib import Path

import pytest

from tests.benchmarks.benchmark_scripts import load_benchmark_script

hey_bench = load_benchmark_script("api_hey")

CSV_HEAD = "response-time,DNS+dialup,DNS,Request-write,Response-delay,Response-read,status-code,offset\n"


def test_cores_are_parsed_and_planned_apart() -> None:
    assert hey_bench.parse_cores("0-1,4,6-7") == [0, 1, 4, 6, 7]
    with pytest.raises(ValueError, match="must look like"):
        hey_bench.parse_cores("a-b")
    sixteen = list(range(16))
    assert hey_bench.plan_cores(1, None, None, sixteen) == ([0, 1], list(range(2, 16)), True)
    assert hey_bench.plan_cores(4, None, None, sixteen) == ([0, 1, 2, 3], list(range(4, 16)),
                                                            True)
    assert hey_bench.plan_cores(1, "0-1", "4-15", sixteen) == ([0, 1], list(range(4, 16)), True)
    # Two cores: no two to spare, so one each (still apart); one core: shared, and said so.
    assert hey_bench.plan_cores(1, None, None, [0, 1]) == ([0], [1], True)
    assert hey_bench.plan_cores(1, None, None, [3]) == ([3], [3], False)
    with pytest.raises(ValueError, match="not available"):
        hey_bench.plan_cores(1, "0-1", "20", sixteen)


def test_hey_csv_records_and_their_summary() -> None:
    text = CSV_HEAD + "".join(f"{ms / 1000},0,0,0,0,0,{200 if ms < 99 else 503},{ms}\n"
                              for ms in range(1, 101))
    records = hey_bench.hey_records(text)
    assert len(records) == 100 and records[0] == (0.001, 200)
    summary = hey_bench.summarize(records, asked=120, seconds=2.0)
    assert summary["answered"] == 100 and summary["asked"] == 120
    assert summary["delivered"] == 50.0
    assert summary["statuses"] == {"200": 98, "503": 2}
    assert summary["p50_ms"] == 51.0 and summary["p99_ms"] == 100.0
    with pytest.raises(ValueError, match="lacks"):
        hey_bench.hey_records("Summary:\n  Total: 1 secs\n")


def _deb_with(tmp_path: Path, files: dict[str, bytes]) -> Path:
    """A minimal .deb: an ar archive of debian-binary, control.tar.xz and data.tar.xz."""
    def tar_xz(members: dict[str, bytes]) -> bytes:
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w:xz") as tar:
            for name, data in members.items():
                info = tarfile.TarInfo(name)
                info.size, info.mode = len(data), 0o755
                tar.addfile(info, io.BytesIO(data))
        return buffer.getvalue()

    members = {"debian-binary": b"2.0\n", "control.tar.xz": tar_xz({"./control": b"x"}),
               "data.tar.xz": tar_xz(files)}
    out = bytearray(b"!<arch>\n")
    for name, data in members.items():
        out += f"{name + '/':<16}{0:<12}{0:<6}{0:<6}{'100644':<8}{len(data):<10}`\n".encode()
        out += data + (b"\n" if len(data) % 2 else b"")
    deb = tmp_path / "hey_0.1.4-2+b4_amd64.deb"
    deb.write_bytes(bytes(out))
    return deb


def test_hey_is_unpacked_from_its_deb_without_dpkg(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    deb = _deb_with(tmp_path, {"./usr/bin/hey": b"#!/bin/sh\necho hey\n"})
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # neither hey nor dpkg on it
    binary, source = hey_bench.find_hey(None, tmp_path, tmp_path / "unpacked")
    assert binary == tmp_path / "unpacked" / "usr" / "bin" / "hey"
    assert source == deb.name and os.access(binary, os.X_OK)


def test_no_hey_anywhere_says_how_to_get_it(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(SystemExit, match="apt-get download hey"):
        hey_bench.find_hey(None, tmp_path / "no-debs", tmp_path / "unpacked")


def test_the_read_mix_is_spread_over_one_connection_hey_processes(tmp_path: Path) -> None:
    """A stand-in hey records how it was called and answers 3 requests; the rate is split
    into processes of --per-hey each, the URL kinds taken in turn, their records merged."""
    calls = tmp_path / "calls.jsonl"
    fake = tmp_path / "hey"
    fake.write_text(f"#!{sys.executable}\n"
                    "import json, sys, time\n"
                    f"open({str(calls)!r}, 'a').write(json.dumps([time.monotonic(), sys.argv[1:]]) + '\\n')\n"
                    f"print({CSV_HEAD!r} + '0.002,0,0,0,0,0,200,0\\n' * 3, end='')\n")
    fake.chmod(0o755)
    targets = {kind: [f"/v1/best?{kind}={i}" for i in range(2)] for kind in hey_bench.KINDS}
    result = asyncio.run(hey_bench.hey_reads(fake, "http://h", targets, rate=500.0,
                                             seconds=2.0, per_hey=100.0))
    assert result["hey_processes"] == 5 and result["per_hey_rate"] == 100.0
    assert result["answered"] == 15 and result["asked"] == 1000
    assert result["p50_ms"] == 2.0 and result["statuses"] == {"200": 15}
    # Each stand-in answers 3 of its 200 ticks, all at its start: the rest are the run's end.
    assert result["missed"] == {"waiting": 0, "unexplained": 0, "start": 0, "end": 985}
    runs = [json.loads(line) for line in calls.read_text().splitlines()]
    argvs = sorted(argv for _, argv in runs)
    assert all(a[:8] == ["-c", "1", "-cpus", "1", "-q", "100.000", "-z", "2.0s"]
               and a[8:10] == ["-o", "csv"] for a in argvs)
    urls = sorted(a[-1] for a in argvs)
    assert urls == sorted(["http://h/v1/best?exact=0", "http://h/v1/best?bucket=0",
                           "http://h/v1/best?nearest=0", "http://h/v1/best?default=0",
                           "http://h/v1/best?exact=1"])


def test_missing_requests_are_told_apart_by_why_their_ticks_were_dropped() -> None:
    """hey at 100/s for 1 s (period 10 ms): ticks 1-20 answered in 1 ms; request 21 answered
    in 45 ms (the ticks of 220-260 ms dropped while waiting: 4); then two ticks missing after
    a quick answer (a failure or hey late); the last 10 ticks never came (the run's end)."""
    rows = [(0.010 * k, 0.001) for k in range(1, 21)] + [(0.210, 0.045)]
    rows += [(0.010 * k, 0.001) for k in range(26, 60)] + [(0.010 * k, 0.001)
                                                            for k in range(62, 91)]
    text = CSV_HEAD + "".join(f"{took},0,0,0,0,0,200,{offset:.4f}\n" for offset, took in rows)
    missed = hey_bench.missed_ticks(text, period=0.010, seconds=1.0)
    assert missed == {"waiting": 4, "unexplained": 2, "start": 0, "end": 10}
    assert len(rows) + sum(missed.values()) == 100
    late_start = CSV_HEAD + "0.001,0,0,0,0,0,200,0.0500\n"
    assert hey_bench.missed_ticks(late_start, 0.010, 0.1) == {"waiting": 0, "unexplained": 0,
                                                              "start": 4, "end": 5}
    assert hey_bench.missed_ticks(CSV_HEAD, 0.010, 0.1)["end"] == 10
