"""Decode steps back to back: the time per call that a model's decode loop sees.

``do_bench`` (the sweep's and dispatch_bench's timer) flushes L2 between calls, and the GPU
works on the flush while the host launches the next call, so a launch slower than the kernel
hides partly behind it. A decode loop has no flush: call after call, the slower of host and
GPU sets the pace. This times N calls queued back to back between two CUDA events (after a
warm-up), in alternated rounds, for PROTOCOL.md's decode rows (bf16, 32 query / 8 KV heads,
d128, one new token): torch SDPA as the user calls it (cuDNN on an H100), ``tuner.attention``
(the dispatcher's pick for the call) and ``tuner.decode`` with the configs the database holds
(``--db``; the default heuristic without one). Every output is checked against SDPA's first.
Beside the loop's time per call: the host's alone (the same loop, not waiting for the GPU)
and the GPU's alone (the calls captured in a CUDA graph and replayed): a loop slower than its
graph is paced by the host.

    python benchmarks/decode_loop.py [--db sqlite:///tuner.db] [--calls 200] [--rounds 5]
        [--rows b1-32k,b1-128k,b8-32k,b64-4k] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tuner.tuning.runner.timing import back_to_back_ms  # noqa: E402

ROWS = {"b1-32k": (1, 32768), "b1-128k": (1, 131072), "b8-32k": (8, 32768),
        "b64-4k": (64, 4096)}
HEADS_Q, HEADS_KV, HEAD_DIM = 32, 8, 128
TOLERANCE = 2e-2  # bf16 outputs of two exact implementations


def host_us(fn: Callable[[], Any], calls: int) -> float:
    """Host time per call: the loop's wall time without waiting for the GPU (the launch
    queue holds far more than ``calls`` launches, so no call blocks on a full queue)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed * 1e6 / calls


def graph_us(fn: Callable[[], Any], calls: int) -> float | None:
    """GPU time per call with no host in the way: ``calls`` calls captured in one CUDA graph,
    replayed. None where the call cannot be captured."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
    except RuntimeError:
        return None
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000.0 / calls


def profile_host(calls: dict[str, Callable[[], Any]]) -> None:
    import cProfile
    import pstats

    for what in ("tuner.attention", "tuner.decode"):
        profiler = cProfile.Profile()
        torch.cuda.synchronize()
        profiler.enable()
        for _ in range(200):
            calls[what]()
        profiler.disable()
        torch.cuda.synchronize()
        print(f"--- {what}: 200 calls, by own time")
        pstats.Stats(profiler).sort_stats("tottime").print_stats(12)


def row_calls(batch: int, seqlen: int) -> tuple[dict[str, Callable[[], torch.Tensor]], str]:
    import tuner
    from tuner.attention import plan_for
    from tuner.decode import decode_plan_for

    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=gen)

    q = randn(batch, HEADS_Q, 1, HEAD_DIM)
    k = randn(batch, HEADS_KV, seqlen, HEAD_DIM)
    v = randn(batch, HEADS_KV, seqlen, HEAD_DIM)
    lengths = torch.full((batch,), seqlen, dtype=torch.int32, device="cuda")
    choice = plan_for(q, k, v, enable_gqa=True)
    calls = {
        "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
        "tuner.attention": lambda: tuner.attention(q, k, v, enable_gqa=True),
        "tuner.decode": lambda: tuner.decode(q, k, v, cache_seqlens=lengths),
    }
    resolved = decode_plan_for(q, k, v, cache_seqlens=lengths)
    note = (f"tuner.attention runs {choice.implementation.name} ({choice.match}); tuner.decode "
            f"runs {resolved.config.key()} ({resolved.match})")
    return calls, note


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--db", help="database with tuned configs (sets TUNER_DATABASE_URL)")
    parser.add_argument("--calls", type=int, default=200, help="calls per timed round")
    parser.add_argument("--rounds", type=int, default=5, help="alternated rounds")
    parser.add_argument("--rows", default=",".join(ROWS), help=f"of {', '.join(ROWS)}")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--profile", action="store_true",
                        help="also print where the host time of tuner.attention and "
                             "tuner.decode goes (cProfile, first row)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU: a decode loop's pace is a GPU measurement")
    unknown = [r for r in args.rows.split(",") if r not in ROWS]
    if unknown:
        parser.error(f"unknown rows {unknown}; known: {', '.join(ROWS)}")
    if args.db:
        import os
        os.environ["TUNER_DATABASE_URL"] = args.db
    results: list[dict[str, Any]] = []
    print(f"{'row':9} {'impl':16} {'us/call':>9} {'vs sdpa':>8}  {'spread':>6} {'host us':>8} "
          f"{'graph us':>8}")
    for name in args.rows.split(","):
        calls, note = row_calls(*ROWS[name])
        reference = calls["sdpa"]().float()
        errors = {what: float((fn().float() - reference).abs().max()) for what, fn in calls.items()}
        bad = {what: err for what, err in errors.items() if err > TOLERANCE}
        if bad:
            raise SystemExit(f"{name}: outputs differ from SDPA's beyond {TOLERANCE}: {bad}")
        for fn in calls.values():
            back_to_back_ms(fn, 20)  # warm-up: compile, plans, caches
        rounds: dict[str, list[float]] = {what: [] for what in calls}
        for _ in range(args.rounds):
            for what, fn in calls.items():
                rounds[what].append(1000.0 * back_to_back_ms(fn, args.calls))
        median = {what: statistics.median(times) for what, times in rounds.items()}
        host = {what: statistics.median(host_us(fn, args.calls) for _ in range(3))
                for what, fn in calls.items()}
        graph = {what: graph_us(fn, 20) for what, fn in calls.items()}
        for what, times in rounds.items():
            spread = (max(times) - min(times)) / median[what]
            in_graph = graph[what]
            print(f"{name:9} {what:16} {median[what]:9.1f} {median['sdpa'] / median[what]:7.2f}x"
                  f"  {spread:6.1%} {host[what]:8.1f} "
                  f"{'-' if in_graph is None else f'{in_graph:.1f}':>8}")
        print(f"          {note}")
        if args.profile and name == args.rows.split(",")[0]:
            profile_host(calls)
        results.append({"row": name, "us_per_call": median, "rounds": rounds,
                        "host_us_per_call": host, "graph_us_per_call": graph,
                        "max_abs_error_vs_sdpa": errors, "note": note})
    if args.json:
        args.json.write_text(json.dumps({
            "device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "cudnn": torch.backends.cudnn.version(), "calls": args.calls,
            "rounds": args.rounds, "rows": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
