"""benchmarks/varlen_bench.py: its document lengths, and --smoke (a tiny CPU row: every
candidate checked against the per-document reference, then timed; the numbers mean nothing)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.benchmarks.benchmark_scripts import BENCHMARKS, load_benchmark_script


def test_the_document_lengths_are_in_range_and_fill_the_row() -> None:
    bench = load_benchmark_script("varlen_bench")
    lengths = bench.document_lengths(16384, 13)
    assert len(lengths) == 13 and sum(lengths) == 16384
    assert all(bench.MIN_DOC <= n <= bench.MAX_DOC for n in lengths)
    assert lengths == bench.document_lengths(16384, 13)  # seeded: every run times one row
    with pytest.raises(ValueError, match="cannot hold"):
        bench.document_lengths(1000, 13)


@pytest.mark.parametrize(("tokens", "docs"), [(65536, 52), (16384, 60)])
def test_many_short_documents_are_drawn_in_bounded_time(tokens: int, docs: int,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows whose mean length is far below the range's (52 documents in 64k took 9 million
    whole-range draws): after DRAWS of them, drawn from a range of the row's mean."""
    bench = load_benchmark_script("varlen_bench")
    monkeypatch.setattr(bench, "DRAWS", 1000)
    lengths = bench.document_lengths(tokens, docs)
    assert len(lengths) == docs and sum(lengths) == tokens
    assert all(bench.MIN_DOC <= n <= bench.MAX_DOC for n in lengths)


def test_given_document_lengths_are_parsed_or_refused_by_name() -> None:
    bench = load_benchmark_script("varlen_bench")
    assert bench._lengths("3658,1777,3304") == [3658, 1777, 3304]
    for bad in ("3658,x", "100,0", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="--lengths"):
            bench._lengths(bad)

@pytest.mark.slow
def test_smoke_checks_and_times_every_cpu_candidate(tmp_path: Path) -> None:
    out = tmp_path / "varlen.json"
    env = {k: v for k, v in os.environ.items() if k != "TUNER_URL"}
    done = subprocess.run([sys.executable, str(BENCHMARKS / "varlen_bench.py"), "--smoke",
                           "--rounds", "1", "--json", str(out)],
                          env=env, capture_output=True, text=True, timeout=500, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(out.read_text())
    assert results["timings_are_gpu_timings"] is False
    assert results["pattern"] == "documents_causal:128"
    assert [row["training"] for row in results["rows"]] == [False, True]
    for row in results["rows"]:
        assert row["errors"] == {}, row["errors"]
        assert set(row["ms"]) == {"tuner.varlen_attention", "ours", "per-document SDPA",
                                  "ours again"}
        assert all(ms is not None and ms > 0 for ms in row["ms"].values())
