"""A real client: a transformers model with ``attn_implementation="sdpa"`` against ``"tuner"``,
side by side in one process (PROTOCOL.md's end-to-end protocol).

    pip install -e '.[hf]'
    python benchmarks/e2e_hf.py --json e2e.json                 # database: TUNER_DATABASE_URL
    python benchmarks/e2e_hf.py --tune --db sqlite:///e2e.db    # sweep the model's shapes first
    python benchmarks/e2e_hf.py --smoke                         # tiny model on the CPU (CI)

The model is built from a config with random weights (no download): Llama-3-8B attention
(hidden 4096, 32 query heads, 8 KV heads, head dim 128), 4 layers, intermediate 4096, vocab
32000, bf16; the sliding-window rows use the same model as Mistral with a window of 4096 on
every layer (transformers hands SDPA a dense boolean mask there). Rows:

* prefill: B1 x 8k tokens, no grad;
* decode: greedy ``generate`` of 64 tokens after a 2k prompt, ms per new token (generate time
  minus the prompt's forward);
* train: B2 x 4k (sliding: B1 x 8k), loss backward;

each a synchronized wall time after a warm-up. Logits of a 1k prefill are compared with an
fp32 eager model for both implementations (greedy tokens of a random model diverge at
near-ties, so token equality is not the check).

Noise control (benchmarks/paired.py): both models stay resident (same weights), and each
step is timed in ``--rounds`` rounds, each running "sdpa", "tuner" and "sdpa again" (the sdpa
model once more: the A/A noise floor) once, in orders that alternate (ABBA-like). Per step:
the median over rounds of tuner / sdpa *within* a round (``ratio``, <= 1.00: the switch costs
nothing), the interval of that median, the same for sdpa again / sdpa, and a verdict: faster,
same within noise or slower. One implementation timed after the other (the old best-of-3)
read a few percent apart from drift alone.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import tuner  # noqa: E402, F401  (imports templates first: TRITON_INTERPRET is set without CUDA)
from benchmarks import paired  # noqa: E402
from benchmarks.paired import compare, describe, interleave  # noqa: E402
from templates.device import interpreter_active  # noqa: E402
from tuner.hf import register_transformers  # noqa: E402

LLAMA = dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
             num_hidden_layers=4, intermediate_size=4096, vocab_size=32000,
             max_position_embeddings=16384)
TINY = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            num_hidden_layers=2, intermediate_size=128, vocab_size=64,
            max_position_embeddings=256)


def build(kind: str, attn: str, dims: dict[str, Any], window: int, dtype: torch.dtype,
          device: str) -> Any:
    import transformers

    if kind == "llama":
        config = transformers.LlamaConfig(**dims)
    else:
        config = transformers.MistralConfig(**dims, sliding_window=window)
    torch.manual_seed(0)  # same weights for every implementation
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn)
    return model.to(device=device, dtype=dtype)


def steps_for(model: Any, kind: str, sizes: dict[str, int], device: str,
              sync: Callable[[], None]) -> dict[str, Callable[[], float]]:
    """The row's steps on ``model``, each a call that runs the step once and returns its
    milliseconds. Inputs come from a fixed seed: every model gets the same."""
    vocab = model.config.vocab_size
    gen = torch.Generator(device=device).manual_seed(1)

    def timed(fn: Callable[[], Any]) -> float:
        return paired.synced_ms(fn, sync)

    prefill = torch.randint(0, vocab, (1, sizes["prefill"]), device=device, generator=gen)

    def run_prefill() -> float:
        model.eval()
        with torch.no_grad():
            return timed(lambda: model(prefill))

    steps = {"prefill ms": run_prefill}
    if kind == "llama":
        # Never token 0: generate() takes prompt tokens equal to pad_token_id (0 here) for
        # padding, and a "padded" prompt runs a dense mask (another problem than the job's).
        prompt = torch.randint(1, vocab, (1, sizes["prompt"]), device=device, generator=gen)
        new = sizes["new_tokens"]

        def run_decode() -> float:  # generate time minus the prompt's forward, per new token
            model.eval()
            with torch.no_grad():
                prompt_ms = timed(lambda: model(prompt))
                gen_ms = timed(lambda: model.generate(prompt, max_new_tokens=new,
                                                      min_new_tokens=new, do_sample=False,
                                                      pad_token_id=0))
            return (gen_ms - prompt_ms) / new

        steps["decode ms/token"] = run_decode
    ids = torch.randint(0, vocab, (sizes["train_batch"], sizes["train_len"]), device=device,
                        generator=gen)

    def run_train() -> float:
        model.train()
        try:
            return timed(lambda: model(ids, labels=ids).loss.backward())
        finally:  # two models resident: only the one timed holds gradients, and only now
            model.zero_grad(set_to_none=True)

    steps["train step ms"] = run_train
    return steps


def paired_rows(models: dict[str, Any], kind: str, sizes: dict[str, int], device: str,
                sync: Callable[[], None], rounds: int) -> dict[str, dict[str, list[float]]]:
    """step -> implementation -> its milliseconds per round. Per step: one warm-up call of
    each model (plans, compiles, cuDNN graphs), then :func:`interleave` of sdpa, ours and
    "sdpa again" (the sdpa model's step timed as a third implementation: the A/A floor)."""
    steps = {name: steps_for(model, kind, sizes, device, sync) for name, model in models.items()}
    out = {}
    for step in steps["sdpa"]:
        for name in models:
            steps[name][step]()
        measures = {name: steps[name][step] for name in models}
        measures["sdpa again"] = steps["sdpa"][step]
        start = time.perf_counter()
        out[step] = interleave(measures, rounds)
        print(f"{kind} {step}: {rounds} rounds in {time.perf_counter() - start:.1f} s",
              flush=True)
    return out


def logits_error(model: Any, reference: Any, ids: torch.Tensor) -> float:
    with torch.no_grad():
        got = model(ids).logits.double()
        ref = reference(ids).logits.double()
    return float((got - ref).norm() / ref.norm())


def tune_specs(sizes: dict[str, int]) -> dict[str, str]:
    """The model's own attention problems as sweep specs, one per family, each naming only the
    templates that serve its calls (a spec's templates apply to all its shapes: one spec for
    all of them had the backward templates measure the decode steps)."""
    def spec(templates: list[str], shapes: list[str]) -> str:
        # A JSON array of strings is a TOML array too.
        return (f"templates = {json.dumps(templates)}\n"
                + f'dtypes = ["bfloat16"]\ntrials = 8\nshapes = [{", ".join(shapes)}]\n')

    heads = "H_q = 32, H_kv = 8, D = 128"
    # Prefill and training are causal.
    dense = [f'{{B = 1, {heads}, N = {sizes["prefill"]}, causal = "top_left"}}',
             f'{{B = {sizes["train_batch"]}, {heads}, N = {sizes["train_len"]}, '
             f'causal = "top_left"}}']
    # A decode step's one query sees every cached key (tuner.hf passes is_causal=False
    # there), so its problems are dense.
    decode = [f'{{B = 1, {heads}, N_q = 1, N_kv = {n}, causal = "none"}}'
              for n in (sizes["prompt"], 2 * sizes["prompt"])]
    # The sliding model's layers (prefill, and its training step of twice the window): the
    # block mask tuner.hf passes, causality in the mask (benchmarks/specs/dispatch_sliding_hf.toml).
    sliding_train = (sizes.get("sliding_train_batch", 1),
                     sizes.get("sliding_train_len", 2 * sizes["window"]))
    sliding = [f'{{B = {b}, {heads}, N = {n}, causal = "none", '
               f'mask = "sliding_causal:{sizes["window"]}"}}'
               for b, n in sorted({(1, sizes["prefill"]), sliding_train})]
    return {
        # Training: SDPA's step, our forward with cuDNN's backward, and our own backwards
        # (gluon_train; gluon_bwd with flash_fwd prices flash_gluon).
        "dense": spec(["torch_sdpa", "flash_fwd", "gluon_fwd", "torch_sdpa_train", "flash_bwd",
                       "gluon_cudnn_train", "gluon_train", "gluon_bwd"], dense),
        "decode": spec(["torch_sdpa", "flash_decode", "flash_fwd", "gluon_fwd"], decode),
        "sliding": spec(["flash_fwd", "torch_flex", "gluon_fwd", "flash_bwd", "torch_flex_train",
                         "gluon_train", "gluon_bwd"], sliding),
    }


# The families each row's model calls, and their shares of --tune-s (training problems
# cost the most per trial).
FAMILIES = {"llama": ("dense", "decode"), "sliding": ("sliding",)}
FAMILY_WEIGHT = {"dense": 4.0, "decode": 1.0, "sliding": 3.0}


def tune(db: str, sizes: dict[str, int], budget_s: int, rows: list[str]) -> None:
    """Sweep the model's own attention problems (prefill, decode steps, training) of ``rows``
    into db, family after family, each with its share of budget_s (``tuner sweep --budget``:
    it stops with the best found so far, everything measured stored)."""
    deadline = time.monotonic() + budget_s
    specs = tune_specs(sizes)
    families = [f for f in specs if any(f in FAMILIES.get(row, ()) for row in rows)]
    for i, family in enumerate(families):
        spec = Path(os.environ.get("TMPDIR", "/tmp")) / f"e2e_hf_{family}.toml"
        spec.write_text(specs[family])
        left = deadline - time.monotonic()
        share = FAMILY_WEIGHT[family] / sum(FAMILY_WEIGHT[f] for f in families[i:])
        budget = max(10, int(left * share))
        try:
            subprocess.run([sys.executable, "-m", "tuner.cli.app", "sweep", str(spec),
                            "--db", db, "--budget", f"{budget}s"],
                           timeout=max(1.0, left), check=False)
        except subprocess.TimeoutExpired:
            # What the sweep measured is stored; the model runs on it (a later --tune resumes).
            print(f"tune: the {family} sweep ran past --tune-s {budget_s} s and was stopped; "
                  "the families after it were not swept", flush=True)
            return


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--db", help="database of tuned configs (default: TUNER_DATABASE_URL)")
    parser.add_argument("--tune", action="store_true", help="sweep the model's shapes first")
    parser.add_argument("--tune-s", type=int, default=240, help="seconds the sweep may take")
    parser.add_argument("--rows", default="llama,sliding", help="llama and/or sliding")
    parser.add_argument("--train-len", type=int,
                        help="tokens per row of the training step (default: llama 4096 with "
                             "2 rows, sliding twice the window with 1); e.g. 32768 with "
                             "--train-batch 1 for issue 40's long-context row")
    parser.add_argument("--train-batch", type=int, help="rows of the training step")
    parser.add_argument("--smoke", action="store_true", help="tiny model, CPU interpreter")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--rounds", type=int,
                        help="paired rounds per step (default 30; estimated 1.9 s a Llama round "
                             "and 0.5 s a sliding one on an H100; --smoke: 3)")
    args = parser.parse_args(argv)
    on_gpu = torch.cuda.is_available() and not interpreter_active()
    if not on_gpu and not args.smoke:
        parser.error("needs a CUDA GPU (or --smoke)")
    if args.db:
        os.environ["TUNER_DATABASE_URL"] = args.db
        from tuner.lookup.resolver import set_resolver

        set_resolver(None)
    device, dtype = ("cuda", torch.bfloat16) if on_gpu else ("cpu", torch.float32)
    dims = TINY if args.smoke else LLAMA
    if args.train_len and args.train_len > dims["max_position_embeddings"]:
        dims = dict(dims, max_position_embeddings=args.train_len)
    sizes = (dict(prefill=64, prompt=16, new_tokens=4, train_batch=2, train_len=32,
                  window=24, logits=32) if args.smoke else
             dict(prefill=8192, prompt=2048, new_tokens=64, train_batch=2, train_len=4096,
                  window=4096, logits=1024))
    # --train-len / --train-batch set both models' training step; the sweep tunes those
    # shapes (sizes also goes into the JSON, so it says what was timed).
    sizes["sliding_train_batch"], sizes["sliding_train_len"] = 1, 2 * sizes["window"]
    for prefix in ("", "sliding_"):
        if args.train_len:
            sizes[f"{prefix}train_len"] = args.train_len
        if args.train_batch:
            sizes[f"{prefix}train_batch"] = args.train_batch
    if args.tune and args.db:
        tune(args.db, sizes, args.tune_s, args.rows.split(","))
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    name = register_transformers()
    rounds = max(1, args.rounds if args.rounds is not None else 3 if args.smoke else 30)
    results: dict[str, Any] = {}
    for kind in args.rows.split(","):
        window = sizes["window"]
        kind_sizes = dict(sizes)
        if kind == "sliding":  # one batch of the window's twice for training, unless set
            kind_sizes.update(train_batch=sizes["sliding_train_batch"],
                              train_len=sizes["sliding_train_len"])
        gen = torch.Generator(device=device).manual_seed(2)
        ids = torch.randint(0, dims["vocab_size"], (1, sizes["logits"]), device=device,
                            generator=gen)
        reference = build(kind, "eager", dims, window, torch.float32, device).eval()
        models = {attn: build(kind, attn, dims, window, dtype, device) for attn in ("sdpa", name)}
        errors = {attn: logits_error(model.eval(), reference, ids)
                  for attn, model in models.items()}
        del reference
        if on_gpu:
            torch.cuda.empty_cache()
        times = paired_rows(models, kind, kind_sizes, device, sync, rounds)
        del models
        if on_gpu:
            torch.cuda.empty_cache()
        # "sdpa" and ours: each step's median over rounds (the table's times); "ratio": the
        # paired median of ours / sdpa (what the verdict rests on; was best / best before).
        row: dict[str, Any] = {
            attn: {**{step: statistics.median(t[attn]) for step, t in times.items()},
                   "logits error vs fp32": errors[attn]} for attn in ("sdpa", name)}
        comparisons = {step: compare(t, "sdpa", name, "sdpa again") for step, t in times.items()}
        row["ratio"] = {step: c["ratio"]["median"] for step, c in comparisons.items()}
        row["paired"] = comparisons
        row["rounds_ms"] = times
        results[kind] = row
    print(f"\n{'row':<28} {'sdpa ms':>9} {'tuner ms':>9}  tuner/sdpa paired median "
          f"[{100 * paired.LEVEL:.0f}% interval], A/A noise floor, verdict")
    for kind, row in results.items():
        for step, c in row["paired"].items():
            print(f"{kind + ' ' + step:<28} {row['sdpa'][step]:>9.3f} {row[name][step]:>9.3f}  "
                  f"{describe(c)}")
        print(f"{kind + ' logits err vs fp32':<28} {row['sdpa']['logits error vs fp32']:>9.2e} "
              f"{row[name]['logits error vs fp32']:>9.2e}")
    if args.json:
        args.json.write_text(json.dumps({
            "device": torch.cuda.get_device_name() if on_gpu else "cpu (smoke)",
            "torch": torch.__version__, "python": platform.python_version(),
            "transformers": __import__("transformers").__version__,
            "date": datetime.date.today().isoformat(), "db": args.db,
            "command": " ".join(["python", "benchmarks/e2e_hf.py",
                                 *(sys.argv[1:] if argv is None else argv)]),
            "sizes": sizes, "rounds": rounds, "results": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
