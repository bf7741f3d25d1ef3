"""What the dense L x L mask costs a sliding-window prefill through ``attn_implementation="tuner"``:
tuner.hf's own mask function (the BlockMask built from transformers' mask rule, no L x L mask)
against the same attention fed transformers' "sdpa" mask (a boolean (1, 1, L, L) mask per
forward, recognized as the window by ``tuner.dispatch.dense_mask``: what "tuner" did before),
side by side in one process (PROTOCOL.md's end-to-end protocol).

    python benchmarks/hf_mask_cost.py --tokens 32768 --json hf_mask_cost.json
    python benchmarks/hf_mask_cost.py --smoke       # tiny, CPU interpreter (CI)

The model is e2e_hf.py's sliding-window model (Mistral with Llama-3-8B attention, window
4096, 4 layers, random weights, bf16), one config object per implementation. Both rows run
the same attention kernel (the dispatcher's choice for the window's block mask); what differs
is the mask work, and the memory it takes: the peak memory of one prefill is recorded too.
Rounds are paired (benchmarks/paired.py) with the dense row timed twice ("tuner_dense_mask
again") as the A/A noise floor, the base's twin as ``paired.compare`` takes it (the other
row's twin would make the floor the effect itself); the logits of the two are compared (the
same kernels: equal within bf16 noise).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import tuner  # noqa: E402, F401  (imports templates first: TRITON_INTERPRET is set without CUDA)
from benchmarks.e2e_hf import LLAMA, TINY, build  # noqa: E402
from benchmarks.paired import compare, describe, interleave, synced_ms  # noqa: E402
from templates.device import interpreter_active  # noqa: E402
from tuner.hf import register_transformers, tuner_attention_forward  # noqa: E402

DENSE_MASK_NAME = "tuner_dense_mask"


def register_dense_mask_variant() -> str:
    """``tuner.attention`` with transformers' own "sdpa" mask function: the dense mask path."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(DENSE_MASK_NAME, tuner_attention_forward)
    AttentionMaskInterface.register(DENSE_MASK_NAME, sdpa_mask)
    return DENSE_MASK_NAME


def prefill_call(model: Any, ids: torch.Tensor, on_gpu: bool) -> Any:
    """One no-grad prefill of ``ids``, returning its milliseconds."""
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)

    def prefill() -> None:
        with torch.no_grad():
            model(ids)
    return lambda: synced_ms(prefill, sync)


def peak_mib(model: Any, ids: torch.Tensor) -> float:
    """Peak memory of one prefill above what was allocated before it (MiB)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with torch.no_grad():
        model(ids)
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=32768, help="prefill length")
    parser.add_argument("--window", type=int, default=4096, help="sliding window")
    parser.add_argument("--rounds", type=int, help="paired rounds (default 10; --smoke 3)")
    parser.add_argument("--smoke", action="store_true", help="tiny model, CPU interpreter")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    on_gpu = torch.cuda.is_available() and not interpreter_active()
    if not on_gpu and not args.smoke:
        parser.error("needs a CUDA GPU (or --smoke)")
    device, dtype = ("cuda", torch.bfloat16) if on_gpu else ("cpu", torch.float32)
    dims, tokens, window = (TINY, 48, 16) if args.smoke else (
        dict(LLAMA, max_position_embeddings=max(args.tokens, LLAMA["max_position_embeddings"])),
        args.tokens, args.window)
    own, dense = register_transformers(), register_dense_mask_variant()
    models = {name: build("sliding", name, dims, window, dtype, device).eval()
              for name in (own, dense)}
    ids = torch.randint(0, dims["vocab_size"], (1, tokens), device=device,
                        generator=torch.Generator(device=device).manual_seed(1))
    with torch.no_grad():
        logits = {name: model(ids).logits.float() for name, model in models.items()}
    gap = float((logits[own] - logits[dense]).norm() / logits[dense].norm())
    del logits
    measures = {name: prefill_call(model, ids, on_gpu) for name, model in models.items()}
    measures[dense + " again"] = measures[dense]
    rounds = max(1, args.rounds if args.rounds is not None else 3 if args.smoke else 10)
    times = interleave(measures, rounds)
    comparison = compare(times, dense, own, dense + " again")
    peaks = {name: peak_mib(model, ids) for name, model in models.items()} if on_gpu else {}
    medians = {name: statistics.median(t) for name, t in times.items()}
    print(f"sliding-window prefill, {tokens} tokens, window {window}: "
          f"dense mask {medians[dense]:.2f} ms, own mask {medians[own]:.2f} ms; "
          f"own / dense {describe(comparison)}; logits gap {gap:.2e}")
    if peaks:
        print(f"peak memory above the weights: dense mask {peaks[dense]:.0f} MiB, "
              f"own mask {peaks[own]:.0f} MiB")
    if args.json:
        args.json.write_text(json.dumps({
            "device": torch.cuda.get_device_name() if on_gpu else "cpu (smoke)",
            "torch": torch.__version__, "python": platform.python_version(),
            "transformers": __import__("transformers").__version__,
            "date": datetime.date.today().isoformat(),
            "command": " ".join(["python", "benchmarks/hf_mask_cost.py",
                                 *(sys.argv[1:] if argv is None else argv)]),
            "tokens": tokens, "window": window, "rounds": rounds, "median_ms": medians,
            "paired": comparison, "peak_mib": peaks, "logits_gap": gap,
            "rounds_ms": times}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
