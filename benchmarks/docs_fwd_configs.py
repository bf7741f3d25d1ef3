"""Do a documents pattern's stand-in rows rank the forwards as a real packed row does? Our
Triton forward and the Gluon forward (its configs given) on one packed row of documents of
seeded random lengths (``varlen_bench.py``'s row) and on the pattern that row is priced by
(``documents_causal:<L>``, whose documents ``templates.masks.mods.standin_document_lengths``
lays out), side by side in one process, every output checked against the Triton forward's.

    python benchmarks/docs_fwd_configs.py --json docs_fwd.json             # H100 / H200
    python benchmarks/docs_fwd_configs.py --config '{"persistent": false}' # another Gluon config
    python benchmarks/docs_fwd_configs.py --config '{"doc_offsets": true}' \
        --flash-config '{"doc_offsets": true}' --window 1024                # knob on / off

A sweep measures the pattern and the dispatcher runs its winner on real rows: if the two
orders differ, packed rows run the kernel that loses on them (what this measured on the H200,
templates/masks/mods.py's comment on ``STANDIN_DOCUMENTS``). Hopper only (the Gluon forward).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.varlen_bench import document_lengths  # noqa: E402
from templates.device import current_device  # noqa: E402
from templates.flash import fwd as flash_fwd  # noqa: E402
from templates.flash.fwd import flash_attention_fwd  # noqa: E402
from templates.gluon.fwd import TEMPLATE as GLUON_FWD  # noqa: E402
from templates.gluon.fwd import gluon_attention_fwd  # noqa: E402
from templates.masks.documents import document_block_mask  # noqa: E402
from templates.masks.patterns import documents_pattern  # noqa: E402

# The Gluon config a sweep of the 16k documents problem chose on the H200 (2026-11-29).
SWEPT = {"BLOCK_M": 128, "BLOCK_N": 128, "kv_stages": 2, "consumers": 2,
         "warp_specialize": True, "pingpong": True, "longest_first": False,
         "p_from_smem": False, "persistent": True, "tree_max": False, "split_tail": False,
         "pack_gqa": False, "ctas_per_sm": 1}
TOLERANCE = 2e-2  # bf16 outputs of two kernels


def row_masks(tokens: int, docs: int, seed: int, device: str,
              window: int = 0) -> dict[str, Any]:
    """The real row's block mask and its pattern's (and a causal window's, given one)."""
    lengths = document_lengths(tokens, docs, seed)
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    pattern = documents_pattern(lengths, causal=True)
    assert pattern is not None
    masks = {"real": document_block_mask(offsets, offsets, causal=True, device=device),
             pattern: flash_fwd.pattern_mask(pattern, tokens, tokens, device)}
    if window:
        name = f"sliding_causal:{window}"
        masks[name] = flash_fwd.pattern_mask(name, tokens, tokens, device)
    return masks


def flash_default(q: torch.Tensor, k: torch.Tensor, mask: Any) -> dict[str, Any]:
    """The config the Triton forward runs ``mask`` with when given none, with its tiles
    (``doc_offsets`` off; ``--flash-config '{"doc_offsets": true}'`` turns it on)."""
    problem = flash_fwd.problem_of(q, k, "none", 0.0)
    config = flash_fwd.TEMPLATE.default_config(problem, current_device(q.device.index))
    return {**flash_fwd.fit_to_block_mask(config, mask.block_size).to_dict(),
            "doc_offsets": False}


def time_row(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any,
             configs: dict[str, dict[str, Any]],
             flash_configs: tuple[dict[str, Any], ...] = ()) -> dict[str, Any]:
    import triton.testing

    def bench(fn: Any) -> float:
        return float(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median"))

    want, _ = flash_attention_fwd(q, k, v, block_mask=mask)

    def checked(run: Any) -> float | str:
        """``run``'s median ms where its output is the default forward's, else why not."""
        got, _ = run()
        error = (got.float() - want.float()).abs().max().item()
        return bench(run) if error <= TOLERANCE else f"wrong: max error {error:.3g}"

    row: dict[str, Any] = {"flash (default)": bench(
        lambda: flash_attention_fwd(q, k, v, block_mask=mask))}
    for fields in flash_configs:
        flash_config = {**flash_default(q, k, mask), **fields}
        row[f"flash {json.dumps(fields)}"] = checked(
            lambda c=flash_config: flash_attention_fwd(q, k, v, block_mask=mask, config=c))
    for name, fields in configs.items():
        config = GLUON_FWD.config(fields)
        row[name] = checked(
            lambda c=config: gluon_attention_fwd(q, k, v, config=c, block_mask=mask))
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--docs", type=int, default=13)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--config", action="append", default=[],
                        help="JSON fields over the swept Gluon config (repeatable)")
    parser.add_argument("--flash-config", action="append", default=[],
                        help="JSON fields over the Triton forward's default (repeatable)")
    parser.add_argument("--window", type=int, default=0,
                        help="also a causal sliding window of this many keys")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9):
        parser.error("needs a Hopper GPU (the Gluon forward)")
    configs = {"gluon (swept)": SWEPT}
    for text in args.config:
        configs[f"gluon {text}"] = {**SWEPT, **json.loads(text)}
    torch.manual_seed(0)
    shape_q, shape_kv = (1, 32, args.tokens, 128), (1, 16, args.tokens, 128)
    q = torch.randn(shape_q, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(shape_kv, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    result = {}
    flash_configs = tuple(json.loads(text) for text in args.flash_config)
    masks = row_masks(args.tokens, args.docs, args.seed, "cuda", args.window)
    for name, mask in masks.items():
        result[name] = {"density": mask.density(),
                        **time_row(q, k, v, mask, configs, flash_configs)}
        print(name, json.dumps(result[name]), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(),
                                         "rows": result}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
