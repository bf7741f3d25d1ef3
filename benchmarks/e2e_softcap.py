"""A Gemma-2-style softcapped model through transformers: ``attn_implementation="eager"`` (what
transformers runs for softcapped scores: SDPA cannot cap them) against ``"tuner"``, side by
side in one process (PROTOCOL.md's end-to-end protocol; issue 43's bar: "tuner" >= 3x "eager"
end to end at 8k tokens, logits within bf16 noise of eager).

    python benchmarks/e2e_softcap.py --force flash --json softcap.json   # our kernels
    python benchmarks/e2e_softcap.py --tune --db sqlite:///softcap.db --json softcap.json
    python benchmarks/e2e_softcap.py --smoke                            # tiny, CPU (CI)

The model is built from a config with random weights (no download), each implementation from
its own config object: Gemma-2-9B attention (hidden 3584, 16 query heads, 8 KV heads, head
dim 256, scores capped at 50, final logits at 30, query_pre_attn_scalar 256), sliding window
4096 on every other layer, 4 layers, intermediate 4096, vocab 32000, bf16. Rows: a prefill of
B1 x 8k tokens (no grad) and a training step of B1 x 8k (loss backward), timed in paired
rounds with "eager again" as the A/A noise floor (benchmarks/paired.py). No "sdpa" row:
transformers (5.24) refuses ``attn_implementation="sdpa"`` for Gemma 2 ("does not support an
attention implementation through torch.nn.functional.scaled_dot_product_attention").

Which implementation "tuner" runs is the dispatcher's: eager attention where nothing is
measured (ours must be measured faster), so either ``--tune`` first (a sweep of the model's
softcapped problems for flash_fwd, flash_bwd, torch_eager, torch_eager_train into ``--db``)
or ``--force flash`` (``tuner.use_implementation``). The choice per problem is printed and
stored. Logits: a 1k prefill of each bf16 model against an fp32 eager model; "within bf16
noise" is tuner's error no more than about eager's own.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import tuner  # noqa: E402  (imports templates first: TRITON_INTERPRET is set without CUDA)
from benchmarks import paired  # noqa: E402
from benchmarks.paired import compare, describe, interleave  # noqa: E402
from templates.device import interpreter_active  # noqa: E402
from tuner.attention import plan_for  # noqa: E402
from tuner.hf import register_transformers  # noqa: E402

GEMMA2: dict[str, Any] = dict(
    hidden_size=3584, num_attention_heads=16, num_key_value_heads=8, head_dim=256,
    num_hidden_layers=4, intermediate_size=4096, vocab_size=32000,
    max_position_embeddings=16384, sliding_window=4096, attn_logit_softcapping=50.0,
    final_logit_softcapping=30.0, query_pre_attn_scalar=256)
TINY: dict[str, Any] = dict(
    hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    num_hidden_layers=2, intermediate_size=128, vocab_size=64,
    max_position_embeddings=256, sliding_window=24, attn_logit_softcapping=50.0,
    final_logit_softcapping=30.0, query_pre_attn_scalar=16)
SIZES = dict(prefill=8192, train_len=8192, logits=1024)
TINY_SIZES = dict(prefill=64, train_len=48, logits=32)


def build(attn: str, dims: dict[str, Any], dtype: torch.dtype, device: str) -> Any:
    """A Gemma 2 model of ``dims`` with ``attn``, its own config object (from_config may write
    the implementation into it), the same random weights for every implementation."""
    import transformers

    config = copy.deepcopy(transformers.Gemma2Config(**dims))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn)
    return model.to(device=device, dtype=dtype)


def steps_for(model: Any, sizes: dict[str, int], device: str, sync: Callable[[], None],
              scope: Callable[[], Any]) -> dict[str, Callable[[], float]]:
    """prefill and train step on ``model`` (inside ``scope``: the forced implementation, for
    "tuner"), each a call returning its milliseconds; inputs from a fixed seed."""
    vocab = model.config.vocab_size
    gen = torch.Generator(device=device).manual_seed(1)
    prefill = torch.randint(0, vocab, (1, sizes["prefill"]), device=device, generator=gen)
    ids = torch.randint(0, vocab, (1, sizes["train_len"]), device=device, generator=gen)

    def timed(fn: Callable[[], Any]) -> float:
        def scoped() -> None:
            with scope():
                fn()
        return paired.synced_ms(scoped, sync)

    def run_prefill() -> float:
        model.eval()
        with torch.no_grad():
            return timed(lambda: model(prefill))

    def run_train() -> float:
        model.train()
        try:
            return timed(lambda: model(ids, labels=ids).loss.backward())
        finally:  # several models resident: only the one timed holds gradients
            model.zero_grad(set_to_none=True)

    return {"prefill ms": run_prefill, "train step ms": run_train}


def logits_error(model: Any, reference: Any, ids: torch.Tensor, scope: Callable[[], Any]
                 ) -> float:
    with torch.no_grad(), scope():
        got = model.eval()(ids).logits.double()
    with torch.no_grad():
        ref = reference(ids).logits.double()
    return float((got - ref).norm() / ref.norm())


def tune_spec(dims: dict[str, Any], sizes: dict[str, int]) -> str:
    """The model's softcapped problems as a sweep spec: its global layers' causal attention and
    its sliding layers' block mask (causality in the mask), at the prefill and training
    lengths, capped as the model caps them."""
    heads = (f'H_q = {dims["num_attention_heads"]}, H_kv = {dims["num_key_value_heads"]}, '
             f'D = {dims["head_dim"]}, softcap = {float(dims["attn_logit_softcapping"])!r}')
    shapes = []
    for n in sorted({sizes["prefill"], sizes["train_len"]}):
        shapes.append(f'{{B = 1, {heads}, N = {n}, causal = "top_left"}}')
        if n > dims["sliding_window"]:
            shapes.append(f'{{B = 1, {heads}, N = {n}, causal = "none", '
                          f'mask = "sliding_causal:{dims["sliding_window"]}"}}')
    templates = ["flash_fwd", "flash_bwd", "torch_eager", "torch_eager_train"]
    return (f"templates = {json.dumps(templates)}\n"
            f'dtypes = ["bfloat16"]\ntrials = 8\nshapes = [{", ".join(shapes)}]\n')


def choices(dims: dict[str, Any], sizes: dict[str, int], device: str, dtype: torch.dtype
            ) -> dict[str, str]:
    """What the dispatcher runs for the global layers' calls (forward and training)."""
    q = torch.empty(1, dims["num_attention_heads"], sizes["prefill"], dims["head_dim"],
                    device=device, dtype=dtype)
    k = torch.empty(1, dims["num_key_value_heads"], sizes["prefill"], dims["head_dim"],
                    device=device, dtype=dtype)
    out = {}
    for needs_grad in (False, True):
        c = plan_for(q, k, k, is_causal=True, enable_gqa=True, needs_grad=needs_grad,
                           softcap=dims["attn_logit_softcapping"])
        out["training" if needs_grad else "inference"] = f"{c.implementation.name}: {c.why}"
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--db", help="database of tuned configs (default: TUNER_DATABASE_URL)")
    parser.add_argument("--tune", action="store_true", help="sweep the model's problems first")
    parser.add_argument("--tune-s", type=int, default=600, help="seconds the sweep may take")
    parser.add_argument("--force", choices=["flash", "eager"],
                        help="run tuner's calls by this implementation (use_implementation)")
    parser.add_argument("--smoke", action="store_true", help="tiny model, CPU interpreter")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--rounds", type=int, help="paired rounds per step (default 10; "
                        "--smoke: 3)")
    args = parser.parse_args(argv)
    on_gpu = torch.cuda.is_available() and not interpreter_active()
    if not on_gpu and not args.smoke:
        parser.error("needs a CUDA GPU (or --smoke)")
    if args.db:
        os.environ["TUNER_DATABASE_URL"] = args.db
        from tuner.lookup.resolver import set_resolver  # after the variable: it reads it

        set_resolver(None)
    device, dtype = ("cuda", torch.bfloat16) if on_gpu else ("cpu", torch.float32)
    dims, sizes = (TINY, TINY_SIZES) if args.smoke else (GEMMA2, SIZES)
    if args.tune and args.db:
        spec = Path(os.environ.get("TMPDIR", "/tmp")) / "e2e_softcap.toml"
        spec.write_text(tune_spec(dims, sizes))
        try:
            subprocess.run([sys.executable, "-m", "tuner.cli.app", "sweep", str(spec),
                            "--db", args.db], timeout=args.tune_s, check=False)
        except subprocess.TimeoutExpired:
            print(f"tune: the sweep ran past --tune-s {args.tune_s} s and was stopped; the "
                  "model runs on what it stored", flush=True)
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    name = register_transformers()

    def plain() -> Any:
        return nullcontext()

    def tuner_scope() -> Any:
        return tuner.use_implementation(args.force) if args.force else nullcontext()

    scopes = {"eager": plain, name: tuner_scope}
    chosen = choices(dims, sizes, device, dtype)
    with tuner_scope():
        forced = choices(dims, sizes, device, dtype) if args.force else chosen
    print(f"dispatcher: {json.dumps(chosen)}\ntuner runs: {json.dumps(forced)}", flush=True)
    gen = torch.Generator(device=device).manual_seed(2)
    ids = torch.randint(0, dims["vocab_size"], (1, sizes["logits"]), device=device,
                        generator=gen)
    reference = build("eager", dims, torch.float32, device).eval()
    models = {attn: build(attn, dims, dtype, device) for attn in scopes}
    errors = {attn: logits_error(model, reference, ids, scopes[attn])
              for attn, model in models.items()}
    del reference
    if on_gpu:
        torch.cuda.empty_cache()
    rounds = max(1, args.rounds if args.rounds is not None else 3 if args.smoke else 10)
    steps = {attn: steps_for(model, sizes, device, sync, scopes[attn])
             for attn, model in models.items()}
    times: dict[str, dict[str, list[float]]] = {}
    for step in steps["eager"]:
        for attn in models:  # warm-up: plans, compiles, autotuning
            steps[attn][step]()
        measures = {attn: steps[attn][step] for attn in models}
        measures["eager again"] = steps["eager"][step]
        start = time.perf_counter()
        times[step] = interleave(measures, rounds)
        print(f"{step}: {rounds} rounds in {time.perf_counter() - start:.1f} s", flush=True)
    comparisons = {step: compare(t, "eager", name, "eager again") for step, t in times.items()}
    row: dict[str, Any] = {
        attn: {**{step: statistics.median(t[attn]) for step, t in times.items()},
               "logits error vs fp32": errors[attn]} for attn in models}
    row["speedup over eager"] = {step: 1.0 / c["ratio"]["median"]
                                 for step, c in comparisons.items()}
    row["paired"] = comparisons
    row["rounds_ms"] = times
    # None where eager is the fp32 reference bit for bit (--smoke: fp32 on the CPU).
    row["logits error tuner / eager"] = (errors[name] / errors["eager"] if errors["eager"]
                                         else None)
    print(f"\n{'step':<16} {'eager ms':>9} {'tuner ms':>9} {'speedup':>8}  tuner/eager paired "
          f"median [{100 * paired.LEVEL:.0f}% interval], A/A noise floor, verdict")
    for step, c in comparisons.items():
        print(f"{step:<16} {row['eager'][step]:>9.3f} {row[name][step]:>9.3f} "
              f"{row['speedup over eager'][step]:>7.2f}x  {describe(c)}")
    print(f"logits error vs fp32: eager {errors['eager']:.2e}, tuner {errors[name]:.2e} "
          f"(ratio {row['logits error tuner / eager']})")
    if args.json:
        args.json.write_text(json.dumps({
            "device": torch.cuda.get_device_name() if on_gpu else "cpu (smoke)",
            "torch": torch.__version__, "python": platform.python_version(),
            "transformers": __import__("transformers").__version__,
            "date": datetime.date.today().isoformat(), "db": args.db, "force": args.force,
            "command": " ".join(["python", "benchmarks/e2e_softcap.py",
                                 *(sys.argv[1:] if argv is None else argv)]),
            "dims": dims, "sizes": sizes, "rounds": rounds, "dispatcher": chosen,
            "tuner runs": forced, "results": row}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
