"""The Gluon backward's two passes over the fp32 dQ accumulator, by launch shape: the
preprocess (delta = rowsum(dO * O), lse2, and the accumulator zeroed: ``ZERO_DQ``) and the
cast of the accumulator into dq, each at several rows per program and warps, beside the
accumulator zeroed by ``torch.zeros`` with the preprocess not zeroing. Every variant's
outputs are checked against torch before it is timed.

Why: at 4 x 16 x 4k, d128 under a block mask these two passes took 0.068 + 0.050 ms of a
1.185 ms training step where Flex's one pass took 0.034 (``step_kernels.py``), and the 4k mask
rows are about 10 us short of 1.2x Flex; neither kernel is in a template's version, so a
better launch shape lands without a re-sweep.

    python benchmarks/bwd_passes_bench.py --json out/bwd_passes.json
    python benchmarks/bwd_passes_bench.py --shapes 4,16,4096,128 --rows 32,64,128 --warps 4,8
    TRITON_INTERPRET=1 python benchmarks/bwd_passes_bench.py --smoke   # CPU: checks only

Shapes are (B, H_q, N_q, D) with N_q padded to 128 (a block-masked backward's rows). Times:
``do_bench`` medians (PROTOCOL) and the bandwidth they imply (bytes read + written).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from templates.device import interpreter_active  # noqa: E402
from templates.gluon.bwd_kernel import (  # noqa: E402
    DQ_CAST_ROWS,
    PREPROCESS_ROWS,
    _dq_cast_kernel,
    _gluon_bwd_preprocess_kernel,
)
from templates.kernel_common import LOG2_E  # noqa: E402

PAD = 128  # a block mask's query block: the rows a masked backward pads to


def preprocess(o: torch.Tensor, do: torch.Tensor, lse: torch.Tensor, rows: int, warps: int,
               zero_dq: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(delta, lse2, dq_accum) by the backward's preprocess kernel at ``rows`` rows a
    program; the accumulator zeroed by it (``zero_dq``) or by ``torch.zeros`` first."""
    batch, heads, seqlen, dim = o.shape
    pad = -(-seqlen // PAD) * PAD
    delta = torch.empty(batch, heads, pad, device=o.device, dtype=torch.float32)
    lse2 = torch.empty_like(delta)
    acc = (torch.empty if zero_dq else torch.zeros)(
        (batch, heads, seqlen, dim), device=o.device, dtype=torch.float32)
    tiles = pad // rows
    _gluon_bwd_preprocess_kernel[(tiles * batch * heads,)](
        o, do, lse, delta, lse2, acc, *o.stride()[:3], *do.stride()[:3], *lse.stride(), seqlen,
        pad, heads, tiles, HEAD_DIM=dim, BLOCK_M=rows, ZERO_DQ=zero_dq, num_warps=warps)
    return delta, lse2, acc


def cast(acc: torch.Tensor, rows: int, warps: int, dtype: torch.dtype) -> torch.Tensor:
    """dq (``dtype``, (B, H, N, D) contiguous) from the row-major accumulator."""
    batch, heads, seqlen, dim = acc.shape
    dq = torch.empty(acc.shape, device=acc.device, dtype=dtype)
    _dq_cast_kernel[(batch * heads, -(-seqlen // rows))](
        acc, dq, seqlen, seqlen, heads, *dq.stride()[:3], HEAD_DIM=dim, ROWS=rows,
        num_warps=warps)
    return dq


def check_preprocess(out: tuple[torch.Tensor, ...], o: torch.Tensor, do: torch.Tensor,
                     lse: torch.Tensor) -> None:
    delta, lse2, acc = out
    seqlen = o.shape[2]
    want = (o.float() * do.float()).sum(-1)
    torch.testing.assert_close(delta[..., :seqlen], want, rtol=1e-4, atol=1e-3)
    assert bool((delta[..., seqlen:] == 0).all())
    torch.testing.assert_close(lse2[..., :seqlen], lse * LOG2_E)
    assert bool(torch.isinf(lse2[..., seqlen:]).all())
    assert bool((acc == 0).all())


def timer(smoke: bool) -> Callable[[Callable[[], Any]], float]:
    if smoke:
        def wall(fn: Callable[[], Any]) -> float:
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e3

        return wall
    import triton.testing

    return lambda fn: float(triton.testing.do_bench(fn, warmup=25, rep=200,
                                                    return_mode="median"))


def run_shape(shape: tuple[int, ...], rows: list[int], warps: list[int], device: str,
              bench: Callable[[Callable[[], Any]], float]) -> list[dict[str, Any]]:
    batch, heads, seqlen, dim = shape
    gen = torch.Generator(device=device).manual_seed(0)
    dtype = torch.float16 if device == "cpu" else torch.bfloat16  # (interpreter: fp16)
    o, do = (torch.randn(shape, generator=gen, device=device, dtype=dtype) for _ in range(2))
    lse = torch.randn(batch, heads, seqlen, generator=gen, device=device)
    acc = torch.randn(shape, generator=gen, device=device)
    elements = batch * heads * seqlen * dim
    out: list[dict[str, Any]] = []
    for r in rows:
        for w in warps:
            for zero in (True, False):
                run = functools.partial(preprocess, o, do, lse, r, w, zero)
                check_preprocess(run(), o, do, lse)
                moved = elements * (2 * o.element_size() + 4)  # o, do read; acc written
                name = "preprocess" + (" (zeroes dQ)" if zero else " + torch.zeros")
                out.append(row(name, shape, r, w, bench(run), moved,
                               r == PREPROCESS_ROWS and w == 4 and zero))
            run_cast = functools.partial(cast, acc, r, w, dtype)
            assert torch.equal(run_cast(), acc.to(dtype))
            out.append(row("dq cast", shape, r, w, bench(run_cast), elements * (4 + 2),
                           r == DQ_CAST_ROWS and w == 4))
    return out


def row(name: str, shape: tuple[int, ...], rows: int, warps: int, ms: float, moved: int,
        current: bool) -> dict[str, Any]:
    return {"pass": name, "shape": list(shape), "rows": rows, "warps": warps, "ms": ms,
            "tb_per_s": moved / ms / 1e9, "current": current}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="4,16,4096,128;1,16,16384,128;1,32,16384,64",
                        help="B,H,N,D shapes separated by ;")
    parser.add_argument("--rows", default="32,64,128", help="rows per program to try")
    parser.add_argument("--warps", default="4,8", help="warps per program to try")
    parser.add_argument("--smoke", action="store_true",
                        help="CPU under TRITON_INTERPRET=1: a tiny shape, checks only")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args(argv)
    if args.smoke:
        if not interpreter_active():
            parser.error("--smoke runs the kernels on the CPU: set TRITON_INTERPRET=1")
        shapes: list[tuple[int, ...]] = [(1, 2, 200, 64)]
        device = "cpu"
    else:
        if not torch.cuda.is_available():
            parser.error("needs a CUDA GPU (or --smoke)")
        shapes = [tuple(int(x) for x in s.split(",")) for s in args.shapes.split(";")]
        device = "cuda"
    rows = [int(x) for x in args.rows.split(",")]
    warps = [int(x) for x in args.warps.split(",")]
    bench = timer(args.smoke)
    results: list[dict[str, Any]] = []
    for shape in shapes:
        for r in run_shape(shape, rows, warps, device, bench):
            results.append(r)
            mark = "  (now)" if r["current"] else ""
            print(f"{'x'.join(map(str, r['shape'])):>16} {r['pass']:<28} rows {r['rows']:>3} "
                  f"warps {r['warps']} {r['ms']:8.4f} ms {r['tb_per_s']:6.2f} TB/s{mark}",
                  flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name()
                                         if device == "cuda" else "cpu (smoke)",
                                         "rows": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
