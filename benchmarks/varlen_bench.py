"""Packed documents (varlen): ``tuner.varlen_attention`` against compiled FlexAttention with a
document mask, torch's ``varlen_attn`` where this torch has it, and a per-document SDPA loop.
Side by side, one process, forward and forward + backward.

    python benchmarks/varlen_bench.py --json varlen.json                # 16k tokens, 13 docs
    python benchmarks/varlen_bench.py --tokens 65536 --docs 52          # a 64k row
    python benchmarks/varlen_bench.py --lengths 3658,1777,3304,3846,3799 --heads 32,8
    python benchmarks/varlen_bench.py --smoke                           # a tiny CPU row

Row: ``--docs`` causal documents of seeded random lengths in [200, 4000] packed into
``--tokens`` tokens, ``--heads`` (32 query / 16 KV by default), ``--head-dim`` (128), bf16
(issue 43's workload). Candidates,
each checked first against a float32 per-document SDPA reference (output and, for the
training row, dq, dk, dv), then timed in ``--rounds`` alternated rounds (median kept):

* ``tuner.varlen_attention``: the dispatcher's choice for the documents' mask problem
  (``documents_causal:<L>``) with the database ``--db`` (none: ours);
* ``ours``: the same, our block-sparse kernels forced; ``ours again``: the noise floor;
  ``ours (gluon)``: the Gluon forward forced; for the training row instead ``ours (gluon_train)`` (the Gluon forward and backward) and
  ``ours (flash_gluon)`` (the Triton forward, the Gluon backward), forced;
* ``flex (our mask)``: the same mask run by compiled Flex (``use_implementation("flex")``);
* ``flex (document mask_mod)``: compiled ``flex_attention`` with ``create_block_mask`` of a
  document mask_mod, as a FlexAttention user writes it (the mask built once, not timed);
* ``torch varlen_attn``: ``torch.nn.attention.varlen.varlen_attn`` where present;
* ``torch_varlen (dispatcher)``: the same run by the dispatcher's ``torch_varlen``
  implementation (``use_implementation("torch_varlen")``): its cost through
  ``tuner.varlen_attention``, the mask lookup included;
* ``per-document SDPA``: one ``scaled_dot_product_attention`` call per document.

Also printed: the time to build the document mask from cu_seqlens (cache cleared), which
padding-free training pays once per step.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import tuner  # noqa: E402  (imports templates first: TRITON_INTERPRET is set without CUDA)
from benchmarks.dispatch_bench import (  # noqa: E402
    TOLERANCE,
    bench_function,
    check_and_time,
    ms_cell,
)
from templates.device import interpreter_active  # noqa: E402
from templates.pytorch.varlen import varlen_attn_function, varlen_call  # noqa: E402
from tuner.attention import clear_plans  # noqa: E402
from tuner.lookup.resolver import ConfigResolver, set_resolver  # noqa: E402
from tuner.settings import load_settings  # noqa: E402
from tuner.varlen import (  # noqa: E402
    clear_document_masks,
    document_block_mask,
    varlen_attention,
    varlen_attention_reference,
)

MIN_DOC, MAX_DOC = 200, 4000
DRAWS = 100_000  # seeded redraws of the lengths before giving up


def document_lengths(tokens: int, docs: int, seed: int = 0) -> list[int]:
    """``docs`` lengths in [MIN_DOC, MAX_DOC] summing to ``tokens`` (seeded): drawn from the
    whole range, redrawn until the last one fits; where that fails ``DRAWS`` times (their
    mean, 2100, far above ``tokens / docs``: 52 documents in 64k tokens took 9 million draws
    before 2026-11-30), from [MIN_DOC, 2 * tokens / docs - MIN_DOC], whose mean is
    ``tokens / docs``."""
    if not docs * MIN_DOC <= tokens <= docs * MAX_DOC:
        raise ValueError(f"{docs} documents of {MIN_DOC}-{MAX_DOC} tokens cannot hold "
                         f"{tokens} tokens")
    rng = random.Random(seed)
    high = MAX_DOC
    for attempt in range(2 * DRAWS):
        if attempt == DRAWS:
            high = max(MIN_DOC, min(MAX_DOC, 2 * tokens // docs - MIN_DOC))
        lengths = [rng.randint(MIN_DOC, high) for _ in range(docs - 1)]
        last = tokens - sum(lengths)
        if MIN_DOC <= last <= MAX_DOC:
            return [*lengths, last]
    raise ValueError(f"no {docs} documents of {MIN_DOC}-{MAX_DOC} tokens summing to {tokens} "
                     f"found in {2 * DRAWS} draws")


def inputs_for(lengths: list[int], heads: tuple[int, int], head_dim: int, dtype: torch.dtype,
               device: str, training: bool) -> dict[str, Any]:
    tokens = sum(lengths)
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    cu = torch.tensor(offsets, dtype=torch.int32, device=device)
    q = torch.randn(tokens, heads[0], head_dim, device=device, dtype=dtype)
    k, v = (torch.randn(tokens, heads[1], head_dim, device=device, dtype=dtype)
            for _ in range(2))
    kw = {"cu_seqlens_q": cu, "cu_seqlens_k": cu, "max_seqlen_q": max(lengths),
          "max_seqlen_k": max(lengths), "causal": True}
    return {"q": q.requires_grad_(training), "k": k.requires_grad_(training),
            "v": v.requires_grad_(training), "do": torch.randn_like(q), "kw": kw}


def reference(t: dict[str, Any], training: bool) -> tuple[torch.Tensor, ...]:
    """float32 output (and grads) by the per-document SDPA loop on upcast inputs."""
    q, k, v = (t[n].detach().float().requires_grad_(training) for n in ("q", "k", "v"))
    kw = t["kw"]
    with torch.enable_grad():
        o = varlen_attention_reference(q, k, v, kw["cu_seqlens_q"], kw["cu_seqlens_k"],
                                       causal=kw["causal"])
        if not training:
            return (o.detach(),)
        return (o.detach(), *torch.autograd.grad(o, (q, k, v), t["do"].float()))


def _forced(name: str) -> Callable[..., torch.Tensor]:
    def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: Any) -> torch.Tensor:
        with tuner.use_implementation(name):
            return varlen_attention(q, k, v, **kw)

    return call


def per_document_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: Any
                      ) -> torch.Tensor:
    return varlen_attention_reference(q, k, v, kw["cu_seqlens_q"], kw["cu_seqlens_k"],
                                      causal=kw["causal"], upcast=False)


def torch_varlen() -> Callable[..., torch.Tensor] | None:
    """torch's varlen_attn called directly, adapted to this torch's signature as the
    dispatcher's ``torch_varlen`` adapts it (``templates.pytorch.varlen.varlen_call``: 2.10
    and 2.11 take ``is_causal``, later ones ``window_size``; GQA by ``enable_gqa`` where it
    exists, else repeated K/V heads); None where this torch has none."""
    if varlen_attn_function() is None:
        return None

    def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: Any) -> torch.Tensor:
        return varlen_call(q, k, v, kw["cu_seqlens_q"], kw["cu_seqlens_k"], kw["max_seqlen_q"],
                           kw["max_seqlen_k"], causal=kw["causal"])

    return call


def flex_document(offsets: list[int], device: str) -> Callable[..., torch.Tensor]:
    """Compiled flex_attention with a document mask_mod's block mask (FlexAttention's own
    create_block_mask, built once here as a user would per step), on (1, H, T, D) views."""
    from torch.nn.attention.flex_attention import create_block_mask

    from templates.pytorch.flex import compiled_flex_attention

    cu = torch.tensor(offsets, device=device)
    doc = torch.searchsorted(cu, torch.arange(offsets[-1], device=device), right=True) - 1

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor,
                 kv_idx: torch.Tensor) -> torch.Tensor:
        return (doc[q_idx] == doc[kv_idx]) & (kv_idx <= q_idx)

    block_mask = create_block_mask(mask_mod, None, None, offsets[-1], offsets[-1],
                                   device=device)
    flex = compiled_flex_attention()

    def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: Any) -> torch.Tensor:
        o = flex(*(t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)), block_mask=block_mask,
                 enable_gqa=q.shape[1] != k.shape[1])
        # (squeeze, not o[0]: a select's gradient is a zeroed copy, a squeeze's a view)
        return o.squeeze(0).transpose(0, 1)  # type: ignore[no-any-return]

    return call


def candidates(offsets: list[int], device: str, training: bool = False
               ) -> dict[str, Callable[..., torch.Tensor]]:
    """The row's candidates: Flex and torch's varlen only on a GPU (Flex has no CPU
    backward; varlen_attn is a CUDA kernel), and there our Gluon kernels (they do not run on
    the CPU): the Gluon forward, and for the training row our two implementations with the
    Gluon backward."""
    out: dict[str, Callable[..., torch.Tensor]] = {"tuner.varlen_attention": varlen_attention,
                                                   "ours": _forced("flash")}
    if device == "cuda":
        if training:
            out["ours (gluon_train)"] = _forced("gluon_train")
            out["ours (flash_gluon)"] = _forced("flash_gluon")
        else:
            out["ours (gluon)"] = _forced("gluon")
    if device == "cuda":
        out["flex (our mask)"] = _forced("flex")
        out["flex (document mask_mod)"] = flex_document(offsets, device)
        varlen = torch_varlen()
        if varlen is not None:
            out["torch varlen_attn"] = varlen
            out["torch_varlen (dispatcher)"] = _forced("torch_varlen")
    out["per-document SDPA"] = per_document_sdpa
    out["ours again"] = _forced("flash")
    return out


def mask_build_ms(offsets: list[int], device: str, repeats: int = 5) -> float:
    """Median wall-clock ms of building the document mask from scratch (cache cleared)."""
    times = []
    for _ in range(repeats):
        clear_document_masks()
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        document_block_mask(offsets, offsets, causal=True, device=device)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    clear_document_masks()
    return sorted(times)[len(times) // 2]


def run(args: argparse.Namespace, on_gpu: bool) -> dict[str, Any]:
    device = "cuda" if on_gpu else "cpu"
    if args.smoke:
        lengths, heads, head_dim, dtype = [37, 133, 90], (4, 2), 16, torch.float32
    else:
        lengths = args.lengths or document_lengths(args.tokens, args.docs, args.seed)
        heads, head_dim, dtype = args.heads, args.head_dim, torch.bfloat16
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    bench = bench_function(on_gpu, args.rep_ms)
    mask = document_block_mask(offsets, offsets, causal=True, device=device)
    result: dict[str, Any] = {
        "lengths": lengths, "heads": list(heads), "head_dim": head_dim,
        "dtype": str(dtype).removeprefix("torch."), "pattern": mask.pattern,
        "density": mask.density(), "mask_build_ms": mask_build_ms(offsets, device),
        "rows": []}
    print(f"{len(lengths)} documents, {offsets[-1]} tokens, heads {heads}, d{head_dim}, "
          f"{result['dtype']}; mask {mask.pattern}, density {mask.density():.3f}, "
          f"built in {result['mask_build_ms']:.3g} ms", flush=True)
    name = result["dtype"]
    for training in (False, True):
        torch.manual_seed(0)
        t = inputs_for(lengths, heads, head_dim, dtype, device, training)
        ref = reference(t, training)
        ms, errors, spread, _ = check_and_time(candidates(offsets, device, training), t,
                                               training, ref,
                                               TOLERANCE[name], bench, max(1, args.rounds))
        row = {"training": training, "ms": ms, "errors": errors, "spread": spread}
        ours = ms.get("tuner.varlen_attention")
        row["speedup"] = {n: (m / ours if m and ours else None) for n, m in ms.items()}
        result["rows"].append(row)
        cells = "  ".join(f"{n}={ms_cell(m)}" for n, m in ms.items())
        print(f"{'fwd+bwd' if training else 'fwd'}: {cells}"
              + "".join(f"  [{n}: {e}]" for n, e in errors.items()), flush=True)
        del t, ref
        if on_gpu:
            torch.cuda.empty_cache()
    return result


def _heads(text: str) -> tuple[int, int]:
    """'32,16' -> (32, 16): query heads, a multiple of the KV heads."""
    try:
        hq, hkv = (int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--heads {text!r}: give query,KV heads, e.g. 32,16") from None
    if hkv < 1 or hq % hkv:
        raise argparse.ArgumentTypeError(f"--heads {text!r}: the query heads must be a "
                                         "multiple of the KV heads")
    return hq, hkv


def _lengths(text: str) -> list[int]:
    """'3658,1777' -> [3658, 1777]: document lengths, each at least 1."""
    try:
        lengths = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--lengths {text!r}: give document lengths, e.g. 3658,1777,3304") from None
    if not lengths or min(lengths) < 1:
        raise argparse.ArgumentTypeError(f"--lengths {text!r}: every length must be >= 1")
    return lengths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=16384, help="packed tokens per row")
    parser.add_argument("--docs", type=int, default=13, help="documents per row")
    parser.add_argument("--seed", type=int, default=0, help="document lengths' seed")
    parser.add_argument("--lengths", type=_lengths,
                        help="the documents' lengths instead (--tokens, --docs and --seed "
                             "unused), e.g. e2e_packed.py's row: 3658,1777,3304,3846,3799")
    parser.add_argument("--heads", type=_heads, default=(32, 16),
                        help="query,KV heads (default 32,16)")
    parser.add_argument("--head-dim", type=int, default=128, help="head dim (default 128)")
    parser.add_argument("--db", help="database with the sweep's bests (default: none, so "
                                     "tuner.varlen_attention runs what it runs unmeasured: "
                                     "torch's varlen where this torch has it)")
    parser.add_argument("--rep-ms", type=int, default=100, help="do_bench rep (ms)")
    parser.add_argument("--rounds", type=int, default=5,
                        help="alternated timing rounds (median kept)")
    parser.add_argument("--smoke", action="store_true", help="a tiny row on the CPU")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    on_gpu = torch.cuda.is_available() and not interpreter_active()
    if not on_gpu and not args.smoke:
        parser.error("needs a CUDA GPU (or --smoke for a tiny row on the CPU)")
    url = args.db or f"sqlite:///{Path(os.devnull)}"
    set_resolver(ConfigResolver(load_settings(database_url=url, url=None)))
    clear_plans()
    result = run(args, on_gpu)
    if args.json:
        import triton

        args.json.write_text(json.dumps({
            "device": torch.cuda.get_device_name() if on_gpu else "cpu",
            "torch": torch.__version__, "triton": str(triton.__version__),
            "python": platform.python_version(), "date": datetime.date.today().isoformat(),
            "command": " ".join(["python", "benchmarks/varlen_bench.py",
                                 *(sys.argv[1:] if argv is None else argv)]),
            "db": args.db, "timings_are_gpu_timings": on_gpu, **result}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
