"""Host time per call of ``tuner.attention`` on a cache hit, against launching the kernel.

    python benchmarks/attention_overhead.py                  # CUDA if present, else CPU
    python benchmarks/attention_overhead.py --reps 20000 --json out.json
    python benchmarks/attention_overhead.py --smoke          # seconds, also on the CPU interpreter
    python benchmarks/attention_overhead.py --decode-shape 8,32,8,4096,128
    python benchmarks/attention_overhead.py --train-only --mask random:0.1   # training rows

Three ways to run one kernel with one config on the same inputs, timed side by side in one
process, all in the steady state of a training or inference loop (the shape was seen before):

(a) ``plan(q, k, v)`` with a kept ``templates.flash.fwd_kernel.LaunchPlan``: two output
    allocations, the argument list and Triton's launch. The floor.
(b) ``flash_attention_fwd(q, k, v, causal=..., config=FwdConfig)`` with its plan cache warm:
    (a) plus the cache key and lookup.
(c) ``tuner.attention(q, k, v, is_causal=True)`` on a config-cache hit, its ``flash``
    implementation forced (``use_implementation``): (b) plus its own per-shape plan lookup.

And, timed apart, what the dispatcher adds where it runs torch SDPA (an unmeasured problem):
``torch SDPA`` called directly against ``tuner.attention -> SDPA`` on the same inputs
(``sdpa_overhead_us``: the second minus the first, real calls on every machine).

Decode (``--decode-shape B,H_q,H_kv,N,D``: one query token against a full KV cache of N, GQA),
the same way, under the JSON's ``decode`` key:

(a) ``run_decode_plan`` with a kept ``DecodeLaunchPlan`` (an output allocation, kept scratch
    and the launches): the floor.
(b) ``tuner.decode(q, k, v, cache_seqlens=...)`` on a plan-cache hit.
(c) ``tuner.attention(q, k, v, enable_gqa=True)`` with its ``decode`` implementation forced.

Training (``--train-only`` for these alone, ``--no-train`` without them; ``--train-shape``,
default 4,16,4096,128 on CUDA and ``--shape`` on the CPU; ``--mask``), under the JSON's
``train`` key, per case (dense causal; a block mask, ``sliding_causal`` by default): one
forward + backward step through the flash entry points, ``flash_attention``,
``tuner.attention`` with ``flash`` forced, and the entry points with the backward as it ran
before its launch plans (``..., unplanned backward``); on Hopper the same for the Gluon
kernels and ``gluon_train``; and, dense only, torch's own SDPA step (its kernels launch for
real, so on CUDA it has no host column) (``benchmarks/train_overhead.py``).

On CUDA the plans are also timed with ``DirectLaunch`` off (``..., JIT``: every launch through
Triton's JIT, as before the plans launched the compiled kernels directly).

Each is timed as microseconds per call, in up to three ways:

* host: Triton's launch swapped for a no-op, so only the Python work of each layer is left.
  Meaningful on any machine, and the only meaningful number under the CPU interpreter,
  where a real launch interprets the kernel (milliseconds).
* enqueue (CUDA): real launches, the clock stopped before the synchronize: host time per call
  while the GPU runs behind. On a small shape each kernel is done before the next is queued.
* synced (CUDA): real launches, one synchronize per round of ``--reps`` calls. Well above
  enqueue means the GPU, not the host, is the bottleneck: use a smaller ``--shape``.

Rounds alternate the paths (a, b, c, a, b, c, ...) and each path's best round is kept:
interference only adds time, and the first loop of a run reads slow (on the H100: 226 us
first vs 152 us second for the same kernel launches).

Target (issues 7 and 16): (c) - (a) at most 10 us per call, forward and decode alike.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from importlib.metadata import version
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import tuner  # noqa: E402  (imports templates first: TRITON_INTERPRET is set without CUDA)
from benchmarks import train_overhead  # noqa: E402
from templates.compile import direct_launch  # noqa: E402
from templates.compile.direct_launch import DirectLaunch  # noqa: E402
from templates.decode.kernel import (  # noqa: E402
    check_decode_inputs,
    decode_launch_plan,
    run_decode_plan,
)
from templates.decode.template import FlashDecodeConfig  # noqa: E402
from templates.device import interpreter_active  # noqa: E402
from templates.flash import bwd_kernel as flash_bwd_kernel  # noqa: E402
from templates.flash import fwd_kernel as flash_fwd_kernel  # noqa: E402
from templates.flash.fwd import FwdConfig, flash_attention_fwd  # noqa: E402
from templates.gluon.fwd import GLUON_MISSING  # noqa: E402
from tuner.attention import plan_for  # noqa: E402
from tuner.decode import decode_plan_for  # noqa: E402
from tuner.dispatch.rule import use_implementation  # noqa: E402

TARGET_US = 10.0
PATHS = ("launch plan", "flash_attention_fwd", "tuner.attention")
SDPA_PATHS = ("torch SDPA", "tuner.attention -> SDPA")
NO_TMA = "launch plan, no TMA"  # timed beside them when the config uses TMA
JIT = ", JIT"  # suffix of a path timed with DirectLaunch off (CUDA only)
DECODE_PATHS = ("decode plan", "tuner.decode", "tuner.attention")
Call = Callable[[], object]


def per_call_us(fn: Call, reps: int, sync: Callable[[], None] | None) -> float:
    """Mean microseconds per call over ``reps`` calls. With ``sync``: the clock stops after
    it (synced); without: before it (host or enqueue time)."""
    start = time.perf_counter_ns()
    for _ in range(reps):
        fn()
    if sync is not None:
        sync()
    return (time.perf_counter_ns() - start) / reps / 1e3


def alternated_rounds(calls: dict[str, Call], reps: int, rounds: int,
                      sync: Callable[[], None] | None, before: Callable[[], None]
                      ) -> dict[str, list[float]]:
    """Per path, the per-call time of each round; the paths take turns within each round."""
    for fn in calls.values():  # warm-up: plans built, caches filled, code paths hot
        for _ in range(max(3, reps // 10)):
            fn()
    out: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, fn in calls.items():
            before()
            out[name].append(per_call_us(fn, reps, sync))
    return out


class _NoLaunch:
    """Stands in for ``_flash_fwd_kernel``: ``kernel[grid](*args, **options)`` does nothing."""

    def __getitem__(self, grid: object) -> Callable[..., None]:
        return _ignore


def _ignore(*args: object, **kwargs: object) -> None:
    return None


@contextlib.contextmanager
def launches_skipped() -> Iterator[None]:
    """Launches do nothing: a ``DirectLaunch``'s (dense plans, decode, the backward's plans),
    after its checks, and the JIT's (kernels read as module globals at each masked or first
    call: the forwards', the backwards' where they launch through the JIT)."""
    saved = (DirectLaunch._launch_direct, DirectLaunch._launch_through_jit)
    DirectLaunch._launch_direct = _ignore  # type: ignore[method-assign]
    DirectLaunch._launch_through_jit = _ignore  # type: ignore[method-assign]
    globals_saved = [(module, name, getattr(module, name)) for module, name in _jit_kernels()]
    for module, name, _ in globals_saved:
        setattr(module, name, _NoLaunch())
    try:
        yield
    finally:
        DirectLaunch._launch_direct, DirectLaunch._launch_through_jit = saved  # type: ignore[method-assign]
        for module, name, kernel in globals_saved:
            setattr(module, name, kernel)


def _jit_kernels() -> list[tuple[Any, str]]:
    """(module, name) of every kernel a path launches through ``kernel[grid](...)``."""
    out: list[tuple[Any, str]] = [(flash_fwd_kernel, "_flash_fwd_kernel")]
    out += [(flash_bwd_kernel, name) for name in (
        "_flash_bwd_preprocess_kernel", "_flash_bwd_dkdv_kernel", "_flash_bwd_dq_kernel")]
    from templates.gluon import bwd as gluon_bwd
    from templates.gluon import fwd as gluon_fwd
    if gluon_fwd.kernel is not None:
        out.append((gluon_fwd.kernel, "_gluon_fwd_kernel"))
    if gluon_bwd.kernel is not None:
        out += [(gluon_bwd.kernel, "_gluon_bwd_preprocess_kernel"),
                (gluon_bwd.kernel, "_gluon_bwd_kernel")]
    if gluon_bwd.ws_kernel is not None:
        out.append((gluon_bwd.ws_kernel, "_gluon_bwd_ws_kernel"))
    return out


def build_calls(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                ) -> tuple[dict[str, Call], FwdConfig, str]:
    """The three calls on the same kernel and config, checked to give the same outputs."""
    tuner.attention(q, k, v, is_causal=True)  # resolves and keeps the config
    resolved = plan_for(q, k, v, is_causal=True)  # (called inside use_implementation("flash"))
    config = resolved.config
    assert isinstance(config, FwdConfig)
    if config.use_tma and flash_fwd_kernel.tma_inputs_problem(q, k, v):
        config = replace(config, use_tma=False)  # as tuner.attention does for this layout
    causal_mode, scale = flash_fwd_kernel.validate_inputs(q, k, v, True, None)
    plan = flash_fwd_kernel.LaunchPlan(q, k, v, causal_mode=causal_mode, scale=scale,
                                       config=config.to_dict())
    calls: dict[str, Call] = {
        "launch plan": lambda: plan(q, k, v),
        "flash_attention_fwd": lambda: flash_attention_fwd(q, k, v, causal=causal_mode,
                                                           config=config),
        "tuner.attention": lambda: tuner.attention(q, k, v, is_causal=True),
    }
    o_ref, *others = (_output(fn()) for fn in calls.values())
    for name, o in zip(PATHS[1:], others, strict=True):
        if not torch.equal(o, o_ref):
            raise AssertionError(f"{name} gave other outputs than the launch plan")
    if config.use_tma:
        # Not one of the compared paths: what the same launch costs with pointer loads, i.e.
        # what building the TMA descriptors' tensor maps at each launch adds.
        pointer = flash_fwd_kernel.LaunchPlan(q, k, v, causal_mode=causal_mode, scale=scale,
                                              config=replace(config, use_tma=False).to_dict())
        if not torch.allclose(_output(pointer(q, k, v)), o_ref, atol=1e-2, rtol=0):
            raise AssertionError(f"{NO_TMA} gave other outputs than the launch plan")
        calls[NO_TMA] = lambda: pointer(q, k, v)
    if q.is_cuda:  # the plans' launches as they were before DirectLaunch: through the JIT
        for name in [n for n in (PATHS[0], NO_TMA) if n in calls]:
            calls[name + JIT] = through_jit(calls[name])
    return calls, config, resolved.source


def through_jit(fn: Call) -> Call:
    """``fn`` with every ``DirectLaunch`` off (its launches through Triton's JIT)."""
    def call() -> object:
        direct_launch.ENABLED = False
        try:
            return fn()
        finally:
            direct_launch.ENABLED = True
    return call


def build_decode_calls(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                       ) -> tuple[dict[str, Call], FlashDecodeConfig, str]:
    """The decode paths on one kernel config and a full cache, checked to give the same o."""
    lengths = torch.full((q.shape[0],), k.shape[2], dtype=torch.int32, device=q.device)
    resolved = decode_plan_for(q, k, v, cache_seqlens=lengths)
    config = resolved.config
    assert isinstance(config, FlashDecodeConfig)
    shape = check_decode_inputs(q, k, v, lengths)
    plan = decode_launch_plan(q, k, v, lengths, None, shape, num_splits=config.num_splits,
                              block_n=config.block_n, num_warps=config.num_warps,
                              num_stages=config.num_stages, combine=config.combine,
                              kv_load=config.kv_load, whole_waves=config.whole_waves)
    calls: dict[str, Call] = {
        "decode plan": lambda: run_decode_plan(plan, q, k, v, lengths, None, None,
                                               want_lse=False),
        "tuner.decode": lambda: tuner.decode(q, k, v, cache_seqlens=lengths),
        "tuner.attention": lambda: tuner.attention(q, k, v, enable_gqa=True),
    }
    with use_implementation("decode"):
        o_ref, *others = (_output(fn()) for fn in calls.values())
    for name, o in zip(DECODE_PATHS[1:], others, strict=True):
        if not torch.equal(o, o_ref):
            raise AssertionError(f"{name} gave other outputs than the decode plan")
    if q.is_cuda:
        calls["decode plan" + JIT] = through_jit(calls["decode plan"])
    return calls, config, resolved.source


def build_sdpa_calls(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> dict[str, Call]:
    """torch SDPA direct and through tuner.attention (unmeasured: it runs SDPA), checked equal."""
    calls: dict[str, Call] = {
        "torch SDPA": lambda: torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True),
        "tuner.attention -> SDPA": lambda: tuner.attention(q, k, v, is_causal=True),
    }
    if plan_for(q, k, v, is_causal=True).implementation.name != "sdpa":
        raise AssertionError("tuner.attention does not run SDPA here: a measurement is stored "
                             "or shipped for this shape (use an empty TUNER_DATABASE_URL and "
                             "TUNER_SHIPPED=off)")
    direct, dispatched = (fn() for fn in calls.values())
    if not torch.equal(direct, dispatched):
        raise AssertionError("tuner.attention -> SDPA gave other outputs than torch SDPA")
    return calls


def _output(result: object) -> torch.Tensor:
    o = result[0] if isinstance(result, tuple) else result  # (o, lse), or o alone
    assert isinstance(o, torch.Tensor)
    return o


def summarize(rounds: dict[str, dict[str, list[float]]], paths: tuple[str, ...] = PATHS,
              targeted: tuple[str, ...] = PATHS[2:]) -> dict[str, Any]:
    """Best round per path and timing, the overheads over the first path (the plan), and
    whether those of ``targeted`` meet the target."""
    per_call = {timing: {name: round(min(runs), 3) for name, runs in by_path.items()}
                for timing, by_path in rounds.items()}
    overhead = {timing: {name: round(row[name] - row[paths[0]], 3) for name in paths[1:]}
                for timing, row in per_call.items()}
    out = {"us_per_call": per_call, "overhead_us": overhead,
           "meets_target": {timing: all(row[name] <= TARGET_US for name in targeted)
                            for timing, row in overhead.items()}}
    if all(SDPA_PATHS[0] in row for row in per_call.values()):
        out["sdpa_overhead_us"] = {timing: round(row[SDPA_PATHS[1]] - row[SDPA_PATHS[0]], 3)
                                   for timing, row in per_call.items()}
    return out


def print_table(summary: dict[str, Any], paths: tuple[str, ...] = PATHS,
                target: str = "(c) - (a)") -> None:
    timings = list(summary["us_per_call"])
    rows = [(f"({'abc'[i]}) {name}", [summary["us_per_call"][t][name] for t in timings])
            for i, name in enumerate(paths)]
    rows += [(f"(a) {name}", [summary["us_per_call"][t][name] for t in timings])
             for name in summary["us_per_call"][timings[0]]
             if name not in paths and name not in SDPA_PATHS]
    rows += [(f"({'bc'[i]}) - (a)", [summary["overhead_us"][t][name] for t in timings])
             for i, name in enumerate(paths[1:])]
    print(f"{'us per call':<30}" + "".join(f"{t:>10}" for t in timings))
    for label, values in rows:
        print(f"{label:<30}" + "".join(f"{x:>10.2f}" for x in values))
    if "sdpa_overhead_us" in summary:
        for name in SDPA_PATHS:
            print(f"{name:<30}" + "".join(f"{summary['us_per_call'][t][name]:>10.2f}"
                                          for t in timings))
        print(f"{'dispatch over SDPA':<30}" + "".join(
            f"{summary['sdpa_overhead_us'][t]:>10.2f}" for t in timings))
    verdicts = ", ".join(f"{t} {'met' if ok else 'MISSED'}"
                         for t, ok in summary["meets_target"].items())
    print(f"target {target} <= {TARGET_US:g} us: {verdicts}")


def timed_rounds(calls: dict[str, Call], implementation: str | None, reps: int, rounds: int,
                 on_gpu: bool, skip_launches: bool = True) -> dict[str, dict[str, list[float]]]:
    """Per timing (host; enqueue and synced on CUDA), per path, each round's time per call;
    host with the launches skipped (``skip_launches``), the others real."""
    out: dict[str, dict[str, list[float]]] = {}
    skipped = launches_skipped() if skip_launches else contextlib.nullcontext()
    with use_implementation(implementation), skipped:
        out["host"] = alternated_rounds(calls, reps, rounds, None, lambda: None)
    if on_gpu:
        sync = torch.cuda.synchronize
        for timing, wait in (("enqueue", None), ("synced", sync)):
            # Enqueue: start each round on an idle GPU, stop the clock before waiting for it.
            with use_implementation(implementation):
                out[timing] = alternated_rounds(calls, reps, rounds, wait, sync)
    return out


def decode_results(shape: str, device: str, dtype: torch.dtype, reps: int, rounds: int,
                   on_gpu: bool) -> dict[str, Any]:
    """The decode paths timed, summarized and printed; the JSON's ``decode``."""
    batch, heads_q, heads_kv, seqlen, head_dim = (int(x) for x in shape.split(","))
    q = torch.randn(batch, heads_q, 1, head_dim, device=device, dtype=dtype)
    k, v = (torch.randn(batch, heads_kv, seqlen, head_dim, device=device, dtype=dtype)
            for _ in range(2))
    calls, config, source = build_decode_calls(q, k, v)
    timed = timed_rounds(calls, "decode", reps, rounds, on_gpu)
    summary = summarize(timed, DECODE_PATHS, DECODE_PATHS[1:])
    print()
    print_table(summary, DECODE_PATHS, "(b), (c) - (a)")
    print(f"decode shape {shape} (B,H_q,H_kv,N,D; one query token, the cache full) {dtype}, "
          f"config {config.key()} (from {source})")
    return {"shape": shape, "config": config.key(), "config_source": source, **summary,
            "rounds_us": {t: {name: [round(x, 3) for x in runs] for name, runs in by.items()}
                          for t, by in timed.items()}}


def train_results(shape: str, mask: str | None, device: str, dtype: torch.dtype, reps: int,
                  rounds: int, on_gpu: bool) -> dict[str, Any]:
    """The training rows (``benchmarks/train_overhead.py``) timed, printed; the JSON's
    ``train``: per case, per timing, per path, microseconds per forward + backward step, and
    what the dispatcher adds over the entry points (``dispatch_over_entry_us``)."""
    batch, heads, seqlen, head_dim = (int(x) for x in shape.split(","))
    q, k, v, do = (torch.randn(batch, heads, seqlen, head_dim, device=device, dtype=dtype)
                   for _ in range(4))
    mask = mask or train_overhead.default_mask(seqlen)
    with_gluon = on_gpu and torch.cuda.get_device_capability()[0] == 9 and not GLUON_MISSING
    out: dict[str, Any] = {"shape": shape, "mask": mask, "reps": reps, "gluon": with_gluon,
                           "cases": {}}
    for case in train_overhead.train_cases(q, k, v, do, mask, with_gluon):
        timed: dict[str, dict[str, list[float]]] = {}
        for implementation, calls in case.calls.items():
            by_timing = timed_rounds(calls, implementation, reps, rounds, on_gpu)
            if implementation == "sdpa" and on_gpu:
                # torch's kernels cannot be skipped: launched for real with no synchronize
                # they fill the launch queue, and the loop would time the GPU.
                del by_timing["host"]
            for timing, by_path in by_timing.items():
                timed.setdefault(timing, {}).update(by_path)
        per_call = {t: {name: round(min(runs), 3) for name, runs in by.items()}
                    for t, by in timed.items()}
        over = {t: {"flash": round(row["tuner.attention"] - row["flash entry points"], 3)}
                for t, row in per_call.items()}
        for t, row in per_call.items():
            if "gluon entry points" in row:
                over[t]["gluon_train"] = round(
                    row["tuner.attention (gluon_train)"] - row["gluon entry points"], 3)
        out["cases"][case.name] = {
            "mask": case.mask, "configs": case.configs, "us_per_call": per_call,
            "dispatch_over_entry_us": over,
            "rounds_us": {t: {name: [round(x, 3) for x in runs] for name, runs in by.items()}
                          for t, by in timed.items()}}
        print()
        timings = list(per_call)
        print(f"{'train: ' + case.name + ' (us/step)':<36}" + "".join(f"{t:>10}" for t in timings))
        names = list(dict.fromkeys(name for t in timings for name in per_call[t]))
        for name in names:
            print(f"{name:<36}" + "".join(f"{per_call[t][name]:>10.2f}" if name in per_call[t]
                                          else f"{'-':>10}" for t in timings))
    print(f"train shape {shape} {dtype}, block mask {mask}, forward + backward per step")
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=5000, help="calls per timing round")
    parser.add_argument("--rounds", type=int, default=7, help="alternated rounds per timing")
    parser.add_argument("--shape", default="1,8,128,64", help="B,H,N,D of q, k and v")
    parser.add_argument("--decode-shape", default="1,32,8,4096,128",
                        help="B,H_q,H_kv,N,D of the decode call (one query token)")
    parser.add_argument("--train-shape", default=None,
                        help="B,H,N,D of the training rows (default: 4,16,4096,128 on CUDA, "
                             "--shape on the CPU, where the checks run the interpreter)")
    parser.add_argument("--train-reps", type=int, default=None,
                        help="training steps per timing round (default: --reps / 10)")
    parser.add_argument("--mask", default=None,
                        help="block mask pattern of the training rows (default: "
                             "sliding_causal:min(1024, N/4))")
    parser.add_argument("--no-train", action="store_true", help="skip the training rows")
    parser.add_argument("--train-only", action="store_true",
                        help="only the training rows (no forward, SDPA or decode rows)")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shape and few calls: checks the script runs (CI)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    if args.smoke:
        args.shape, args.reps, args.rounds = "1,2,32,16", 200, 2
        args.decode_shape = "1,4,2,64,16"
        args.train_shape, args.train_reps = "1,2,32,16", 20
    if args.reps < 1 or args.rounds < 1:
        parser.error(f"--reps and --rounds must be >= 1, but got {args.reps}, {args.rounds}")
    try:
        batch, heads, seqlen, head_dim = (int(x) for x in args.shape.split(","))
    except ValueError:
        parser.error(f"--shape must be four integers B,H,N,D, but got {args.shape!r}")
    if len(args.decode_shape.split(",")) != 5 or not all(
            x.strip().isdigit() for x in args.decode_shape.split(",")):
        parser.error(f"--decode-shape must be five integers B,H_q,H_kv,N,D, but got "
                     f"{args.decode_shape!r}")
    on_gpu = torch.cuda.is_available() and not interpreter_active()
    device = "cuda" if on_gpu else "cpu"
    dtype = torch.bfloat16 if on_gpu else torch.float16
    q, k, v = (torch.randn(batch, heads, seqlen, head_dim, device=device, dtype=dtype)
               for _ in range(3))

    results: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if on_gpu else "cpu (TRITON_INTERPRET=1): "
        + (platform.processor() or platform.machine()),
        "torch": torch.__version__, "triton": version("triton"),
        "python": platform.python_version(),
        "command": " ".join(["python", "benchmarks/attention_overhead.py",
                             *(sys.argv[1:] if argv is None else argv)]),
    }
    if not args.train_only:
        with use_implementation("flash"):
            calls, config, source = build_calls(q, k, v)
        sdpa_calls = build_sdpa_calls(q, k, v)
        rounds = timed_rounds(calls, "flash", args.reps, args.rounds, on_gpu)
        # SDPA has no launch to skip: its "host" rounds are real calls (on a GPU, enqueue time).
        for timing, by_path in timed_rounds(sdpa_calls, None, args.reps, args.rounds, on_gpu,
                                            skip_launches=False).items():
            rounds[timing].update(by_path)
        summary = summarize(rounds)
        results.update({
            "shape": args.shape, "dtype": str(dtype), "causal": True, "reps": args.reps,
            "rounds": args.rounds, "config": config.key(), "config_source": source,
            "target_us": TARGET_US, **summary,
            "rounds_us": {t: {name: [round(x, 3) for x in runs] for name, runs in by_path.items()}
                          for t, by_path in rounds.items()},
        })
        print_table(summary)
        print(f"shape {args.shape} {dtype}, config {config.key()} (from {source}), "
              f"on {results['device']}")
        results["decode"] = decode_results(args.decode_shape, device, dtype, args.reps,
                                           args.rounds, on_gpu)
    if not args.no_train:
        train_shape = args.train_shape or ("4,16,4096,128" if on_gpu else args.shape)
        results["train"] = train_results(train_shape, args.mask, device, dtype,
                                         args.train_reps or max(1, args.reps // 10),
                                         args.rounds, on_gpu)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
