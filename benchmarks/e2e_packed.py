"""Padding-free training (issue 43's bar): a Llama-shaped transformers model trained on packed
rows, ``attn_implementation="sdpa"`` against ``"tuner"`` (and ``"flex_attention"``), side by
side in one process (PROTOCOL.md's end-to-end protocol), with the loss checked against the
same documents run unpacked.

    pip install -e '.[hf]'
    python benchmarks/e2e_packed.py --json packed.json            # database: TUNER_DATABASE_URL
    python benchmarks/e2e_packed.py --tune --db sqlite:///p.db    # sweep the row's problem first
    python benchmarks/e2e_packed.py --smoke                       # tiny model on the CPU (CI)

The model is built from a config with random weights (no download), one config object per
model: Llama-3-8B attention (hidden 4096, 32 query heads, 8 KV heads, head dim 128), 4 layers,
intermediate 4096, vocab 32000, bf16 (flags change each). The row: documents of seeded random
lengths in [--min-doc, --max-doc] (200-4000) packed into one row of --tokens (16k) tokens, as
``DataCollatorWithFlattening`` packs them: ``position_ids`` restart at 0 for every document
and each document's first label is -100 (no loss across a document edge). transformers reads
the documents off the ``position_ids`` (``find_packed_sequence_indices``): "sdpa" gets a dense
(1, 1, L, L) block-diagonal mask; "tuner" a document ``BlockMask`` built from the mask rule
(``tuner.hf``), the dispatcher running ours, Flex or torch's varlen_attn as measured;
"flex_attention" transformers' own Flex block mask. "tuner + cu_seq_lens" is the "tuner"
model given the collator's flash kwargs too (``cu_seq_lens_q/k``, ``max_length_q/k``, as
``DataCollatorWithFlattening(return_flash_attn_kwargs=True)`` adds them), which ``tuner.hf``
runs through ``tuner.varlen_attention`` on those offsets. "tuner:<implementation>" is the
"tuner" model with that implementation forced (``tuner.use_implementation``): on the GPU by
default "tuner:torch_varlen" (torch's varlen_attn) and "tuner:flex", so one run shows what
each candidate of the dispatcher would give the model whichever the database picks.

The step: forward with labels, loss backward, gradients dropped (no optimizer: the same for
every implementation), a synchronized wall time after a warm-up; ``--rounds`` paired rounds
(benchmarks/paired.py: each implementation and "sdpa again", the A/A noise floor, once per
round in alternating orders); per implementation the median ms and the paired median of
sdpa / it (``speedup``; the bar is >= 2.5 for "tuner" at 16k tokens).

The check, before any timing: every implementation's packed loss and logits against the same
documents run unpacked by a float32 model (the same weights, "sdpa", one document per call:
no mask, no neighbours; PROTOCOL.md's float32 reference). The bf16 noise is what "sdpa"
itself reads packed against it: an implementation passes if its loss and its first attention
layer's output differ from the reference's by at most NOISE_FACTOR (3) times that, or a small
absolute floor (bf16 kernels that tile and accumulate differently read up to ~2x apart; a mask
that lets documents see each other reads orders of magnitude further there). The logits are
reported, not judged: a random model's later layers amplify rounding (bf16 logits read ~70%
from float32's on the H200, a leak's ~2x that). A control shows the check can fail: the
same row with ``position_ids`` that do not restart (one 16k document: every token sees the
documents before its own) must miss it.
Every call passes ``use_cache=False``, as a training loop does: transformers looks for packed
documents only without a KV cache (the default config makes one, and the row is then one
causal sequence).
Exit status 1 if an implementation fails the check.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
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
from templates.device import DeviceInfo, interpreter_active  # noqa: E402
from templates.masks.patterns import documents_pattern  # noqa: E402
from tuner.dispatch.implementations import (  # noqa: E402
    implementations as registered_implementations,
)
from tuner.hf import register_transformers  # noqa: E402

SMOKE = dict(hidden=64, heads=4, kv_heads=2, head_dim=16, layers=2, intermediate=128,
             vocab=64, tokens=96, min_doc=5, max_doc=40)
SDPA, AGAIN = "sdpa", "sdpa again"
COLLATOR = "tuner + cu_seq_lens"  # the tuner model, given the collator's flash kwargs
GPU_IMPLS = "sdpa,tuner,tuner+cu_seq_lens,tuner:torch_varlen,tuner:flex,flex_attention"
SMOKE_IMPLS = "sdpa,tuner,tuner+cu_seq_lens"
NOISE_FACTOR = 3.0  # how many times sdpa's own packed-vs-reference difference passes
# Absolute floors of the check (fp32 on the CPU agrees far closer than bf16).
FLOOR = {torch.bfloat16: {"loss": 1e-3, "attention": 1e-2},
         torch.float32: {"loss": 1e-6, "attention": 1e-5}}


def document_lengths(tokens: int, min_doc: int, max_doc: int, seed: int) -> list[int]:
    """Seeded lengths in [min_doc, max_doc] that fill ``tokens`` exactly (each drawn so that
    what is left can still be one document or more)."""
    if not 0 < min_doc <= max_doc or tokens < min_doc:
        raise ValueError(f"documents of {min_doc}-{max_doc} tokens cannot fill {tokens} tokens "
                         f"(need 0 < --min-doc <= --max-doc and --tokens >= --min-doc)")
    rng = random.Random(seed)
    lengths, left = [], tokens
    while left > max_doc:
        n = rng.randint(min_doc, min(max_doc, left - min_doc))
        lengths.append(n)
        left -= n
    return [*lengths, left]


def packed_row(lengths: list[int], vocab: int, device: str, seed: int = 1) -> dict[str, Any]:
    """One packed row as ``DataCollatorWithFlattening`` makes it: input_ids, position_ids
    restarting per document, labels with -100 at each document's first token; and, apart,
    the collator's flash kwargs (``cu_seq_lens_*``, ``max_length_*``)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    ids = torch.randint(0, vocab, (1, sum(lengths)), generator=gen)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    labels = ids.clone()
    starts = torch.tensor([0, *lengths[:-1]]).cumsum(0)
    labels[0, starts] = -100
    cu = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
    # use_cache=False, as a training loop runs: transformers reads packed documents off
    # position_ids only without a cache (with one, created by default, the row is one
    # causal sequence whose documents see each other).
    return {"batch": {"input_ids": ids.to(device), "position_ids": positions.to(device),
                      "labels": labels.to(device), "use_cache": False},
            "flash_kwargs": {"cu_seq_lens_q": cu.to(device), "cu_seq_lens_k": cu.to(device),
                             "max_length_q": max(lengths), "max_length_k": max(lengths)}}


def build(attn: str, args: argparse.Namespace, dtype: torch.dtype, device: str) -> Any:
    """A fresh model of its own config object (transformers writes the attention
    implementation into the config), the same seeded weights for every implementation."""
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=args.hidden, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
        num_hidden_layers=args.layers, intermediate_size=args.intermediate,
        vocab_size=args.vocab, max_position_embeddings=max(args.max_doc, args.tokens))
    torch.manual_seed(0)
    # Built where it runs: 631M parameters initialized on the CPU took ~30 s a model (four
    # models and the reference per run; the GPU's RNG gives them all the same weights too).
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn)
    return model.to(device=device, dtype=dtype)


# ----------------------------------------------------------------------------- the check
class FirstAttention:
    """The output of the model's first attention layer on the last forward (a hook): the
    mask's effect before any later layer amplifies rounding (a random model's bf16 logits
    read ~70% from float32's, a documents leak's only ~2x further; the first layer's output
    reads rounding alone, a leak O(1))."""

    def __init__(self, model: Any) -> None:
        self.output: torch.Tensor | None = None
        self._layer = model.model.layers[0].self_attn
        self._handle: Any = None

    def __enter__(self) -> FirstAttention:
        self._handle = self._layer.register_forward_hook(self._keep)
        return self

    def __exit__(self, *exc: object) -> None:  # the timed steps run without the hook
        self._handle.remove()

    def _keep(self, module: Any, args: Any, out: Any) -> None:
        self.output = (out[0] if isinstance(out, tuple) else out)[0].detach().double()


def unpacked_reference(model: Any, row: dict[str, Any], lengths: list[int]
                       ) -> tuple[float, list[torch.Tensor], torch.Tensor]:
    """The loss over the row's documents run one per call (each document's own tokens,
    positions from 0, no mask: plain causal), as the packed loss averages it (over every
    label but each document's first), each document's logits (float32) and the first
    attention layer's output over the row (``FirstAttention``)."""
    ids = row["batch"]["input_ids"][0]
    total, count, logits, first = 0.0, 0, [], []
    start = 0
    model.eval()
    with torch.no_grad(), FirstAttention(model) as attention:
        for n in lengths:
            doc = ids[start:start + n][None]
            out = model(input_ids=doc, labels=doc, use_cache=False)
            total += float(out.loss) * (n - 1)
            count += n - 1
            logits.append(out.logits[0].float())
            assert attention.output is not None
            first.append(attention.output)
            start += n
    return total / count, logits, torch.cat(first)


def packed_check(model: Any, batch: dict[str, Any],
                 reference: tuple[float, list[torch.Tensor], torch.Tensor],
                 kwargs: dict[str, Any], forced: str | None = None) -> dict[str, float]:
    """The packed row's loss, logits and first attention layer's output against the unpacked
    run's: relative differences."""
    ref_loss, ref_logits, ref_first = reference
    model.eval()
    # A forced implementation is checked as the timed step runs it, with a gradient (some
    # serve only training calls: flash_gluon, whose inference is flash's).
    grad = torch.enable_grad() if forced else torch.no_grad()
    with grad, tuner.use_implementation(forced), FirstAttention(model) as attention:
        out = model(**batch, **kwargs)
    want = torch.cat(ref_logits).double()
    got = out.logits[0].detach().double()
    assert attention.output is not None
    return {"loss": float(out.loss), "loss_rel_diff": abs(float(out.loss) - ref_loss) / ref_loss,
            "logits_rel_err": float((got - want).norm() / want.norm()),
            "attention_rel_err": float((attention.output - ref_first).norm()
                                       / ref_first.norm())}


def verdicts(checks: dict[str, dict[str, float]], dtype: torch.dtype) -> dict[str, bool]:
    """Pass: the loss and the first attention layer's output within NOISE_FACTOR times what
    "sdpa" reads packed against the float32 unpacked reference (its bf16 noise), or the
    dtype's floor. The logits are reported, not judged: a random model's later layers amplify
    rounding until a leak's logits read only ~2x further than bf16's (H200, 2026-11-29). The
    control (documents leaking) is judged the same way: it must fail, or the check cannot
    tell a wrong mask."""
    floor = FLOOR[dtype]
    noise = checks[SDPA]
    loss_tol = max(NOISE_FACTOR * noise["loss_rel_diff"], floor["loss"])
    attention_tol = max(NOISE_FACTOR * noise["attention_rel_err"], floor["attention"])
    return {name: c["loss_rel_diff"] <= loss_tol and c["attention_rel_err"] <= attention_tol
            for name, c in checks.items()}


# ----------------------------------------------------------------------------- timing
def train_step(model: Any, batch: dict[str, Any], kwargs: dict[str, Any],
               sync: Callable[[], None], forced: str | None = None) -> Callable[[], float]:
    """One training step's milliseconds: forward with labels, backward, gradients dropped
    (two or more models resident: only the one timed holds gradients, and only now)."""
    def step() -> float:
        model.train()
        sync()
        start = time.perf_counter()
        try:
            with tuner.use_implementation(forced):
                model(**batch, **kwargs).loss.backward()
            sync()
            return (time.perf_counter() - start) * 1e3
        finally:
            model.zero_grad(set_to_none=True)

    return step


def tune_spec(args: argparse.Namespace, pattern: str, dtype: torch.dtype,
              device: DeviceInfo) -> str:
    """The row's attention problem as a sweep spec: the templates of every implementation
    serving its training call here (what ``tuner.record`` notes for it: ours, Flex, torch's
    varlen_attn), in one spec (the head-to-head times a problem's implementations together).
    A list written by hand left out gluon_train, the untuned choice, so the tuned row ran the
    fastest of the others."""
    from tuner.dispatch.implementations.call import call_of_shapes
    from tuner.dispatch.rule import serving_templates

    call = call_of_shapes((1, args.heads, args.tokens, args.head_dim),
                          (1, args.kv_heads, args.tokens, args.head_dim), dtype, False, True,
                          device, mask=pattern)
    templates = sorted(set(serving_templates(call)))
    dtype_name = str(dtype).removeprefix("torch.")
    return (f"templates = {json.dumps(templates)}\ndtypes = [\"{dtype_name}\"]\ntrials = 8\n"
            f"shapes = [{{B = 1, H_q = {args.heads}, H_kv = {args.kv_heads}, N = {args.tokens},"
            f" D = {args.head_dim}, causal = \"none\", mask = \"{pattern}\"}}]\n")


def tune(db: str, spec_text: str, budget_s: int) -> None:
    spec = Path(os.environ.get("TMPDIR", "/tmp")) / "e2e_packed.toml"
    spec.write_text(spec_text)
    try:
        subprocess.run([sys.executable, "-m", "tuner.cli.app", "sweep", str(spec), "--db", db],
                       timeout=budget_s, check=False)
    except subprocess.TimeoutExpired:
        print(f"tune: the sweep ran past --tune-s {budget_s} s and was stopped; the row runs "
              f"on what it stored", flush=True)


def dispatcher_choice(args: argparse.Namespace, lengths: list[int], dtype: torch.dtype,
                      device: str) -> str:
    """What the dispatcher runs for the row's attention with a gradient, and why."""
    from templates.masks.documents import document_block_mask
    from tuner.dispatch.implementations.call import call_of_shapes, device_info
    from tuner.dispatch.rule import choose_masked

    offsets = torch.tensor([0, *lengths]).cumsum(0).tolist()
    mask = document_block_mask(offsets, offsets, causal=True, device=device)
    call = call_of_shapes((1, args.heads, args.tokens, args.head_dim),
                          (1, args.kv_heads, args.tokens, args.head_dim), dtype, False, True,
                          device_info(torch.device(device)))
    try:
        choice = choose_masked(call, mask.pattern, mask.block_size, True)
    except ValueError as exc:
        return f"(no choice: {exc})"
    return f"{choice.implementation.name}: {choice.why}"


def model_parser() -> argparse.ArgumentParser:
    """The flags of the model and its packed row (e2e_profile.py's ``--kind packed`` takes
    their defaults)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=32, help="query heads")
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--intermediate", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--tokens", type=int, default=16384, help="tokens in the packed row")
    parser.add_argument("--min-doc", type=int, default=200, help="shortest document")
    parser.add_argument("--max-doc", type=int, default=4000, help="longest document")
    parser.add_argument("--seed", type=int, default=0, help="document lengths' seed")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = model_parser()
    parser.add_argument("--impls", help="comma-separated: sdpa (always), tuner, "
                                        "tuner+cu_seq_lens, tuner:<implementation> (forced), "
                                        f"flex_attention (GPU only); default: {GPU_IMPLS} "
                                        f"(--smoke: {SMOKE_IMPLS})")
    parser.add_argument("--db", help="database of tuned configs (default: TUNER_DATABASE_URL)")
    parser.add_argument("--tune", action="store_true", help="sweep the row's problem first")
    parser.add_argument("--tune-s", type=int, default=240, help="seconds the sweep may take")
    parser.add_argument("--rounds", type=int, help="paired rounds (default 15; --smoke: 3)")
    parser.add_argument("--smoke", action="store_true", help="tiny model, CPU interpreter")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    on_gpu = torch.cuda.is_available() and not interpreter_active()
    if not on_gpu and not args.smoke:
        parser.error("needs a CUDA GPU (or --smoke)")
    if args.smoke:
        for name, value in SMOKE.items():
            setattr(args, name, value)
    impls = args.impls or (SMOKE_IMPLS if args.smoke else GPU_IMPLS)
    wanted = [n.strip() for n in impls.split(",") if n.strip()]
    known = ("sdpa", "tuner", "tuner+cu_seq_lens", "flex_attention")
    forced_names = {n.partition(":")[2] for n in wanted if n.startswith("tuner:")}
    implementations = {impl.name for impl in registered_implementations()}
    if unknown := [n for n in wanted if n not in known and n.partition(":")[2] not in
                   implementations]:
        parser.error(f"--impls: unknown {unknown}; known: {list(known)} and tuner:<one of "
                     f"{sorted(implementations)}>")
    if args.db:
        os.environ["TUNER_DATABASE_URL"] = args.db
        from tuner.lookup.resolver import set_resolver

        set_resolver(None)
    device, dtype = ("cuda", torch.bfloat16) if on_gpu else ("cpu", torch.float32)
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    lengths = document_lengths(args.tokens, args.min_doc, args.max_doc, args.seed)
    pattern = documents_pattern(lengths, causal=True)
    if args.tune and args.db and on_gpu:
        from tuner.dispatch.implementations.call import device_info

        tune(args.db, tune_spec(args, str(pattern), dtype, device_info(torch.device(device))),
             args.tune_s)
    name = register_transformers()
    print(f"{len(lengths)} documents ({min(lengths)}-{max(lengths)} tokens) in one row of "
          f"{args.tokens}; mask problem {pattern}; dispatcher (with a gradient): "
          f"{dispatcher_choice(args, lengths, dtype, device)}", flush=True)

    row = packed_row(lengths, args.vocab, device)
    batch, flash_kwargs = row["batch"], row["flash_kwargs"]
    uses_tuner = bool({"tuner", "tuner+cu_seq_lens"} & set(wanted) or forced_names)
    attns = [SDPA, *(["tuner"] if uses_tuner else []),
             *(["flex_attention"] if "flex_attention" in wanted and on_gpu else [])]
    models = {attn: build(name if attn == "tuner" else attn, args, dtype, device)
              for attn in attns}
    # The implementations, each a model, the kwargs its step passes and the implementation
    # forced in it (None: the dispatcher's choice).
    runs: dict[str, tuple[Any, dict[str, Any], str | None]] = {SDPA: (models[SDPA], {}, None)}
    if "tuner" in wanted:
        runs["tuner"] = (models["tuner"], {}, None)
    if "tuner+cu_seq_lens" in wanted:
        runs[COLLATOR] = (models["tuner"], flash_kwargs, None)
    for forced in sorted(forced_names):
        runs[f"tuner:{forced}"] = (models["tuner"], {}, forced)
    if "flex_attention" in models:
        runs["flex_attention"] = (models["flex_attention"], {}, None)

    reference_model = build(SDPA, args, torch.float32, device)
    reference = unpacked_reference(reference_model, row, lengths)
    del reference_model
    # An implementation that raises (e.g. transformers' flex_attention on this torch) is
    # reported and left out of the timing, not the end of the run; only sdpa's is fatal.
    errors: dict[str, str] = {}
    checks = {}
    for impl, (model, kwargs, forced) in list(runs.items()):
        try:
            checks[impl] = packed_check(model, batch, reference, kwargs, forced)
            if impl != SDPA:
                train_step(model, batch, kwargs, sync, forced)()  # the backward too
        except Exception as exc:  # noqa: BLE001  (any failure is the row's finding)
            if impl == SDPA:
                raise
            errors[impl] = f"{type(exc).__name__}: {exc}"[:500]
            print(f"{impl}: failed, left out of the timing: {errors[impl]}", flush=True)
            checks.pop(impl, None)
            del runs[impl]
    leaking = {**batch, "position_ids": torch.arange(args.tokens, device=device)[None]}
    checks["control: documents leaking (sdpa, no position resets)"] = packed_check(
        models[SDPA], leaking, reference, {})
    passed = verdicts(checks, dtype)
    del reference
    if on_gpu:
        torch.cuda.empty_cache()

    steps = {impl: train_step(model, batch, kwargs, sync, forced)
             for impl, (model, kwargs, forced) in runs.items()}
    for step in steps.values():  # warm-up: plans, compiles, cuDNN graphs, masks
        step()
    rounds = max(1, args.rounds if args.rounds is not None else 3 if args.smoke else 15)
    start = time.perf_counter()
    times = interleave({**steps, AGAIN: steps[SDPA]}, rounds)
    print(f"train step: {rounds} rounds in {time.perf_counter() - start:.1f} s", flush=True)
    comparisons = {impl: compare(times, SDPA, impl, AGAIN) for impl in runs if impl != SDPA}
    medians = {impl: statistics.median(t) for impl, t in times.items()}
    speedup = {impl: 1.0 / c["ratio"]["median"] for impl, c in comparisons.items()}

    print(f"\n{'implementation':<24} {'train ms':>9} {'speedup':>8}  it / sdpa paired median "
          f"[{100 * paired.LEVEL:.0f}% interval], A/A noise floor, verdict")
    for impl in runs:
        cells = (f"{speedup[impl]:>7.2f}x  {describe(comparisons[impl])}" if impl in speedup
                 else f"{'1.00x':>8}")
        print(f"{impl:<24} {medians[impl]:>9.2f} {cells}")
    print(f"\n{'loss check vs unpacked':<52} {'loss':>9} {'loss diff':>10} {'attn0 err':>10} "
          f"{'logits err':>11}")
    for impl, c in checks.items():
        if impl.startswith("control"):
            mark = ("missed, as a leaking mask must" if not passed[impl]
                    else "FAIL: within tolerance, so the check cannot tell a leaking mask")
        else:
            mark = "ok" if passed[impl] else "FAIL"
        print(f"{impl:<52} {c['loss']:>9.5f} {c['loss_rel_diff']:>10.2e} "
              f"{c['attention_rel_err']:>10.2e} {c['logits_rel_err']:>11.2e}  {mark}")
    for impl, error in errors.items():
        print(f"{impl:<52} not run: {error}")
    # flex_attention and forced implementations are reference points: their failure to run
    # is reported, not the row's failure (a wrong result is).
    failed = [impl for impl in checks if passed[impl] == impl.startswith("control")] + [
        impl for impl in errors if impl != "flex_attention" and not impl.startswith("tuner:")]

    if args.json:
        import transformers

        args.json.write_text(json.dumps({
            "device": torch.cuda.get_device_name() if on_gpu else "cpu (smoke)",
            "torch": torch.__version__, "python": platform.python_version(),
            "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
            "triton": __import__("triton").__version__,
            "transformers": transformers.__version__,
            "date": datetime.date.today().isoformat(), "db": args.db,
            "command": " ".join(["python", "benchmarks/e2e_packed.py",
                                 *(sys.argv[1:] if argv is None else argv)]),
            "model": {k: getattr(args, k) for k in ("layers", "hidden", "heads", "kv_heads",
                                                    "head_dim", "intermediate", "vocab")},
            "dtype": str(dtype).removeprefix("torch."), "lengths": lengths, "pattern": pattern,
            "rounds": rounds, "train_step_ms": medians, "speedup_vs_sdpa": speedup,
            "paired": comparisons, "rounds_ms": times,
            "loss_check": {impl: {**c, "passed": passed[impl]} for impl, c in checks.items()},
            "errors": errors,
            "failed": failed}, indent=2) + "\n")
    if failed:
        print(f"\nfailed (the loss check, or an error): {failed}", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
