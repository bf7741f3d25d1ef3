"""Where a transformers prefill spends its time, SDPA against ``tuner``: the e2e_hf model
(benchmarks/e2e_hf.py) under torch.profiler, the top operations by GPU time and by host
time. GPU only.

    python benchmarks/e2e_profile.py --db sqlite:///tuner.db --kind sliding
    python benchmarks/e2e_profile.py --db sqlite:///tuner.db --kind sliding --train  # a step
    python benchmarks/e2e_profile.py --db sqlite:///tuner.db --kind llama --decode 16 --tokens 2048
    python benchmarks/e2e_profile.py --kind gemma2 --force flash   # softcapped, against eager
    python benchmarks/e2e_profile.py --kind packed --train          # e2e_packed.py's step

``--kind gemma2``: e2e_softcap.py's Gemma-2-style model (softcapped scores, head dim 256),
whose baseline is ``"eager"`` (SDPA cannot cap scores); ``--force`` runs one implementation.

``--kind packed``: e2e_packed.py's model on its packed row of documents (its defaults: 16k
tokens, ``position_ids`` restarting per document), whose "sdpa" gets a dense block-diagonal
mask; ``--tokens`` sets the row's length.

Every run also prints the step's wall time (unprofiled) beside its kernels' GPU time summed
and the attention kernels' part of it (by name: ``ATTENTION_KERNEL_NAMES``): the attention's
share of the step, and the time the GPU waits on the host.

``--decode N``: a greedy ``generate`` of N tokens after a prompt of ``--tokens``; it also
counts, for "tuner", the attention calls that came with a mask (transformers' mask function
decides that, per step).
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any, cast

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import e2e_packed  # noqa: E402
from e2e_hf import LLAMA, build  # noqa: E402
from e2e_softcap import GEMMA2  # noqa: E402
from e2e_softcap import build as build_gemma2  # noqa: E402
from paired import synced_ms  # noqa: E402

import tuner  # noqa: E402
from tuner.hf import register_transformers  # noqa: E402


def step(model: torch.nn.Module, batch: dict[str, Any], train: bool, decode: int = 0) -> None:
    """A prefill, a training step (loss backward, gradients dropped), or a greedy generate of
    ``decode`` tokens; ``batch`` the model's keyword inputs (``input_ids``, and a packed row's
    position_ids and labels: a step without labels of its own learns its input ids)."""
    if decode:
        with torch.no_grad():
            # a transformers model's method (nn.Module types unknown attributes as Tensor)
            cast(Any, model).generate(batch["input_ids"], max_new_tokens=decode,
                                      min_new_tokens=decode, do_sample=False)
    elif train:
        model(**{"labels": batch["input_ids"], **batch}).loss.backward()
        model.zero_grad(set_to_none=True)
    else:
        with torch.no_grad():
            model(**batch)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--db", help="database of tuned configs")
    parser.add_argument("--kind", default="sliding",
                        choices=("llama", "sliding", "gemma2", "packed"))
    parser.add_argument("--force", help="run this implementation for every attention call "
                        "(tuner.use_implementation), e.g. flash")
    parser.add_argument("--tokens", type=int,
                        help="the prompt's tokens (8192), or the packed row's (16384)")
    parser.add_argument("--window", type=int, default=4096)
    parser.add_argument("--top", type=int, default=14)
    parser.add_argument("--train", action="store_true",
                        help="profile a training step (loss backward) instead of a prefill")
    parser.add_argument("--sync-debug", action="store_true",
                        help="also list where the step synchronizes the host with the GPU "
                             "(torch.cuda.set_sync_debug_mode), by source line")
    parser.add_argument("--decode", type=int, default=0,
                        help="profile a generate of this many tokens after the prompt")
    args = parser.parse_args()
    if args.tokens is None:
        args.tokens = 16384 if args.kind == "packed" else 8192
    if args.db:
        os.environ["TUNER_DATABASE_URL"] = args.db
        from tuner.lookup.resolver import set_resolver
        set_resolver(None)
    name = register_transformers()
    calls = _count_masked_calls()
    dims = GEMMA2 if args.kind == "gemma2" else LLAMA
    if args.kind == "packed":
        packed = e2e_packed.model_parser().parse_args(["--tokens", str(args.tokens)])
        lengths = e2e_packed.document_lengths(packed.tokens, packed.min_doc, packed.max_doc,
                                              packed.seed)
        batch = e2e_packed.packed_row(lengths, packed.vocab, "cuda")["batch"]
        print(f"packed row: {len(lengths)} documents of {min(lengths)}-{max(lengths)} tokens")
    else:
        # From 1: --decode's generate() may take prompt tokens equal to a pad token.
        batch = {"input_ids": torch.randint(1, dims["vocab_size"], (1, args.tokens),
                                            device="cuda")}
    baseline = "eager" if args.kind == "gemma2" else "sdpa"
    for attn in (baseline, name):
        if args.kind == "gemma2":
            model = build_gemma2(attn, GEMMA2, torch.bfloat16, "cuda")
        elif args.kind == "packed":
            model = e2e_packed.build(attn, packed, torch.bfloat16, "cuda")
        else:
            model = build(args.kind, attn, LLAMA, args.window, torch.bfloat16, "cuda")
        model.train(args.train)
        scope = (tuner.use_implementation(args.force) if args.force and attn == name
                 else nullcontext())
        with scope:
            for _ in range(2):
                step(model, batch, args.train, args.decode)
            torch.cuda.synchronize()
            wall_ms = _wall_ms(functools.partial(step, model, batch, args.train, args.decode))
            calls.clear()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                    torch.profiler.ProfilerActivity.CUDA]
                                        ) as prof:
                step(model, batch, args.train, args.decode)
                torch.cuda.synchronize()
            if args.sync_debug:
                print(f"\n=== {attn}: host-GPU synchronizations by source line")
                for where, count in synchronizations(
                        functools.partial(step, model, batch, args.train, args.decode)):
                    print(f"{count:5d}  {where}")
        if attn == name:
            print(f"\n{attn}: {sum(calls)} of {len(calls)} attention calls came with a mask")
        averages = prof.key_averages()
        kernels = kernel_ms(prof.events())
        gpu_ms = sum(kernels.values())
        attention = sum(ms for kernel, ms in kernels.items() if is_attention_kernel(kernel))
        # What the wall time holds beyond the kernels is, on one stream, the GPU waiting on
        # the host (launches, a read of a device tensor, work done in Python).
        print(f"\n=== {attn}: the step {wall_ms:.1f} ms wall (median of 3, unprofiled), "
              f"{gpu_ms:.1f} ms of GPU time (kernels' own times summed), of which "
              f"attention kernels {attention:.1f} ms")
        print(f"=== {attn}: by GPU time")
        print(averages.table(sort_by="cuda_time_total", row_limit=args.top, max_name_column_width=60))
        print(f"=== {attn}: by host time")
        print(averages.table(sort_by="cpu_time_total", row_limit=args.top, max_name_column_width=60))
        del model
        torch.cuda.empty_cache()
    return 0


# Kernel names of an attention call's kernels, lower case: cuDNN's and FlashAttention's
# ("sdpa", "fmha", "flash"), ours ("_gluon_", our Triton "_flash_"; the backward's "_dq_cast"
# and preprocess), FlexAttention's ("flex_attention"). Eager attention (matmuls and a softmax,
# the gemma2 row's baseline) has none of its own and is not counted.
ATTENTION_KERNEL_NAMES = ("sdpa", "fmha", "flash", "_gluon_", "_dq_cast", "flex_attention",
                          "varlen")


def is_attention_kernel(name: str) -> bool:
    lower = name.lower()
    return any(part in lower for part in ATTENTION_KERNEL_NAMES)


def kernel_ms(events: Any) -> dict[str, float]:
    """ms per kernel name, summed over the profiler's CUDA events (kernels only: an
    operator's self device time repeats its kernels', so summing every row of
    ``key_averages`` counted each kernel twice)."""
    out: dict[str, float] = {}
    for e in events:
        if e.device_type == torch.autograd.DeviceType.CUDA:
            out[e.name] = out.get(e.name, 0.0) + e.self_device_time_total / 1e3
    return out


def _wall_ms(run: Callable[[], None], repeats: int = 3) -> float:
    """Median wall-clock ms of ``run`` from a synchronized start to a synchronized end."""
    times = sorted(synced_ms(run, torch.cuda.synchronize) for _ in range(repeats))
    return times[len(times) // 2]


def synchronizations(run: Callable[[], None]) -> list[tuple[str, int]]:
    """Where ``run`` makes the host wait for the GPU (a copy to the host, ``.item()``, a
    ``bool`` of a CUDA tensor...): torch's sync debug warnings counted by the Python line
    that caused them, most frequent first."""
    import collections
    import warnings

    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    lines = collections.Counter(f"{w.filename}:{w.lineno}" for w in caught
                                if "synchroniz" in str(w.message))
    return lines.most_common()


def _count_masked_calls() -> list[bool]:
    """Per call of tuner.hf's attention: whether it came with a mask (appended as it runs)."""
    import tuner.hf

    seen: list[bool] = []
    inner = tuner.hf.attention

    def counted(*args: object, **kwargs: object) -> torch.Tensor:
        seen.append(kwargs.get("attn_mask") is not None or kwargs.get("block_mask") is not None)
        return inner(*args, **kwargs)  # type: ignore[arg-type]

    tuner.hf.attention = counted  # type: ignore[assignment]
    return seen


if __name__ == "__main__":
    sys.exit(main())
