"""What the block-mask walk costs our kernels: n causal documents of one length L packed in one
row of n x L tokens under their document ``BlockMask``, against the same tokens as a batch of
n dense causal rows. The work is the same, tile for tile (the documents start on block
boundaries); only the walk differs: the mask's lists, its partial blocks, its grid and tile
order, against the dense kernels' causal loop. Side by side in one process, forward and
forward + backward:

* ``ours, packed``: ``tuner.attention(..., block_mask=documents)``, the Gluon forward
  (``gluon``) or the Gluon pair (``gluon_train``) forced, as the dispatcher runs packed
  documents untuned at d128 on Hopper;
* ``ours, batch``: the same implementation on the (n, H, L, D) batch, ``is_causal=True``;
* ``cuDNN, batch``: torch SDPA's cuDNN backend on the batch (``enable_gqa``).

    python benchmarks/mask_vs_batch.py --lengths 1024,4096 --heads 32,8 --json out/mvb.json

Every timed output is checked first: the packed row's against the batch's (ours) and both
against cuDNN's. Times: ``do_bench`` medians (PROTOCOL), ratios over ``ours, packed``.
GPU only (Hopper: the Gluon kernels).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tuner  # noqa: E402
from benchmarks.fwd_bwd_bench import bench_ms  # noqa: E402
from templates.base import relative_error  # noqa: E402
from templates.masks.documents import document_block_mask  # noqa: E402

Step = Callable[[], Any]


def rows(batch: torch.Tensor) -> torch.Tensor:
    """(n, H, L, D) -> (1, H, n L, D): the batch's rows packed one after another."""
    n, heads, length, dim = batch.shape
    return batch.transpose(0, 1).reshape(1, heads, n * length, dim).contiguous()


def unpack(packed: torch.Tensor, n: int) -> torch.Tensor:
    _, heads, total, dim = packed.shape
    return packed.reshape(heads, n, total // n, dim).transpose(0, 1)


def steps(length: int, total: int, heads: int, heads_kv: int, dim: int,
          gluon_configs: list[dict[str, Any]]
          ) -> tuple[dict[str, dict[str, Step]], dict[str, str]]:
    """Per implementation its forward and forward + backward steps, each checked first
    (``errors``: the worst relative error of each against cuDNN's batch); the packed
    forward also with each of ``gluon_configs`` (fields over the config it runs)."""
    n = total // length
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(h: int) -> torch.Tensor:
        return torch.randn(n, h, length, dim, generator=gen, device="cuda",
                           dtype=torch.bfloat16)

    batch = {"q": randn(heads), "k": randn(heads_kv), "v": randn(heads_kv), "do": randn(heads)}
    packed = {name: rows(t) for name, t in batch.items()}
    offsets = list(range(0, total + 1, length))
    mask = document_block_mask(offsets, offsets, causal=True, device="cuda")

    def run(t: dict[str, torch.Tensor], impl: str | None, grad: bool, **kw: Any
            ) -> tuple[torch.Tensor, ...]:
        q, k, v = (t[name].detach().requires_grad_(grad) for name in ("q", "k", "v"))
        if impl is None:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                o = torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, is_causal=True, enable_gqa=True)
        else:
            with tuner.use_implementation(impl):
                o = tuner.attention(q, k, v, enable_gqa=True, **kw)
        if not grad:
            return (o,)
        return (o, *torch.autograd.grad(o, (q, k, v), t["do"]))

    kinds = {"forward": ("gluon", False), "forward + backward": ("gluon_train", True)}
    out: dict[str, dict[str, Step]] = {}
    errors: dict[str, str] = {}
    for kind, (impl, grad) in kinds.items():
        candidates: dict[str, Step] = {
            "ours, packed": functools.partial(run, packed, impl, grad, block_mask=mask),
            "ours, batch": functools.partial(run, batch, impl, grad, is_causal=True),
            "cuDNN, batch": functools.partial(run, batch, None, grad),
        }
        if not grad:
            candidates.update(configured(packed, batch, mask, gluon_configs))
        with torch.no_grad() if not grad else torch.enable_grad():
            want = candidates["cuDNN, batch"]()
            for name, step in candidates.items():
                got = step()
                if name.startswith("ours, packed"):
                    got = tuple(unpack(g, n) for g in got)
                err = max(relative_error(g.float(), w.float()) for g, w in zip(got, want,
                                                                                strict=True))
                errors[f"{kind}: {name}"] = f"{err:.2e}"
                if err > 2e-2:
                    raise AssertionError(f"{kind}, {name}: relative error {err:.2e} against "
                                         f"cuDNN's batch")
        out[kind] = {name: _no_grad(step) if not grad else step
                     for name, step in candidates.items()}
    return out, errors


def configured(packed: dict[str, torch.Tensor], batch: dict[str, torch.Tensor], mask: Any,
               gluon_configs: list[dict[str, Any]]) -> dict[str, Step]:
    """The packed and the batch forwards by the Gluon forward with each of ``gluon_configs``
    over the config each runs untuned (printed), and the packed one with the batch's config
    fitted to the mask's blocks; a config the forward's constraint refuses is said and left
    out."""
    from templates.device import current_device
    from templates.gluon.fwd import TEMPLATE, GluonFwdConfig, fit_to_block_mask
    from tuner.dispatch.implementations.call import call_of
    from tuner.dispatch.rule import choose

    device = current_device(packed["q"].device.index)
    packed_problem = call_of(packed["q"], packed["k"], False, False).problem
    masked = TEMPLATE.run_default(packed_problem, device, mask.block_size)
    batch_call = call_of(batch["q"], batch["k"], True, False)
    with tuner.use_implementation("gluon"):
        [dense] = choose(batch_call).resolved
    print(f"  packed forward's config: {masked.key()}\n  batch forward's: {dense.config.key()}",
          flush=True)
    like_batch = dataclasses.replace(
        fit_to_block_mask(cast(GluonFwdConfig, TEMPLATE.config(dense.config)), mask.block_size),
        doc_offsets=masked.doc_offsets, split_tail=False)
    # (name, inputs, config, the forward's keywords, the mask's blocks, the problem)
    candidates: list[tuple[str, dict[str, torch.Tensor], Any, dict[str, Any], Any, Any]] = [
        ("ours, packed (the batch's config)", packed, like_batch,
         {"block_mask": mask}, mask.block_size, packed_problem)]
    for fields in gluon_configs:
        candidates += [
            (f"ours, packed {json.dumps(fields)}", packed,
             TEMPLATE.config({**masked.to_dict(), **fields}), {"block_mask": mask},
             mask.block_size, packed_problem),
            (f"ours, batch {json.dumps(fields)}", batch,
             TEMPLATE.config({**dense.config.to_dict(), **fields}), {"causal": True}, None,
             batch_call.problem)]
    out: dict[str, Step] = {}
    for name, inputs, config, kw, blocks, problem in candidates:
        refused = TEMPLATE.run_constraint(problem, config, device, blocks)
        if refused:
            print(f"  {name}: refused ({refused})", flush=True)
            continue
        out[name] = functools.partial(gluon_output, inputs, config, kw)
    return out


def gluon_output(inputs: dict[str, torch.Tensor], config: Any, kw: dict[str, Any]
                 ) -> tuple[torch.Tensor]:
    """The Gluon forward's output alone (as the steps return them), with ``config``."""
    from templates.gluon.fwd import gluon_attention_fwd

    return (gluon_attention_fwd(inputs["q"], inputs["k"], inputs["v"], config=config, **kw)[0],)


def _no_grad(step: Step) -> Step:
    def run() -> Any:
        with torch.no_grad():
            return step()

    return run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="1024,4096", help="document lengths (tokens)")
    parser.add_argument("--tokens", type=int, default=16384, help="tokens in the packed row")
    parser.add_argument("--heads", default="32,8", help="query heads, K/V heads")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3, help="alternated rounds (median)")
    parser.add_argument("--gluon-config", action="append", default=[], type=json.loads,
                        help="JSON fields over the Gluon forward's config: the packed and "
                             "the batch forward also run with them (repeatable)")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (Hopper: the Gluon kernels)")
    heads, heads_kv = (int(x) for x in args.heads.split(","))
    results: list[dict[str, Any]] = []
    for length in (int(x) for x in args.lengths.split(",")):
        if args.tokens % length:
            parser.error(f"--lengths: {length} does not divide --tokens {args.tokens}")
        timed, errors = steps(length, args.tokens, heads, heads_kv, args.head_dim,
                              args.gluon_config)
        for kind, candidates in timed.items():
            readings: dict[str, list[float]] = {name: [] for name in candidates}
            for _ in range(args.rounds):
                for name, step in candidates.items():
                    readings[name].append(bench_ms(step))
            ms = {name: sorted(r)[len(r) // 2] for name, r in readings.items()}
            base = ms["ours, packed"]
            cells = ", ".join(f"{name} {t:.3f} ms ({base / t:.2f}x)" for name, t in ms.items())
            print(f"{args.tokens // length} x {length}, {heads}/{heads_kv} heads, "
                  f"d{args.head_dim}, {kind}: {cells}", flush=True)
            results.append({"length": length, "documents": args.tokens // length,
                            "heads": heads, "heads_kv": heads_kv, "head_dim": args.head_dim,
                            "kind": kind, "ms": ms, "readings": readings,
                            "errors": {k: v for k, v in errors.items()
                                       if k.startswith(kind + ":")}})
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(),
                                         "torch": torch.__version__, "rows": results},
                                        indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
