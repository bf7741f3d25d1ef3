"""Record issue 42's job: two transformers models run through ``attn_implementation="tuner"``
under ``tuner.record``, so that ``tuner sweep`` / ``time_to_tuned.py`` tune what it ran.

    python benchmarks/record_job.py --out job.toml          # GPU: the job as issue 42 ran it
    python benchmarks/record_job.py --out job.toml --smoke  # tiny models on the CPU (CI)

The models (random weights, bf16, each from its own config object):

* a dense GQA model, e2e_hf.py's Llama shape (32 query / 8 KV heads, d128, 4 layers): a
  prefill of 8k tokens, a greedy decode of ``--new-tokens`` after a 2k prompt (every step a
  shape of its own, recorded by bucket with its count), a training step of 2 x 4k;
* a model of interleaved sliding-window and global layers (Gemma 2's layout without its
  score cap: 16 query / 8 KV heads, d128, window 4096, 4 layers): a prefill of 8k and a
  training step of 8k.

The recording says how many problems it holds; nothing is timed here.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import tuner  # noqa: E402  (imports templates first: TRITON_INTERPRET is set without CUDA)
from benchmarks.e2e_hf import LLAMA, TINY, build  # noqa: E402
from benchmarks.e2e_softcap import build as build_gemma2  # noqa: E402
from templates.device import interpreter_active  # noqa: E402
from tuner.hf import register_transformers  # noqa: E402

INTERLEAVED = dict(hidden_size=2048, num_attention_heads=16, num_key_value_heads=8,
                   head_dim=128, num_hidden_layers=4, intermediate_size=4096, vocab_size=32000,
                   max_position_embeddings=16384, sliding_window=4096,
                   attn_logit_softcapping=None, final_logit_softcapping=None,
                   query_pre_attn_scalar=128)
TINY_INTERLEAVED = dict(INTERLEAVED, hidden_size=64, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, intermediate_size=128,
                        vocab_size=64, max_position_embeddings=256, sliding_window=24,
                        query_pre_attn_scalar=16)
SIZES = dict(prefill=8192, prompt=2048, train_batch=2, train_len=4096, interleaved_train=8192)
TINY_SIZES = dict(prefill=64, prompt=16, train_batch=2, train_len=32, interleaved_train=48)


def run_job(attn: str, *, smoke: bool, new_tokens: int, device: str, dtype: torch.dtype
            ) -> None:
    """Both models' steps, once each, with ``attn``."""
    sizes = TINY_SIZES if smoke else SIZES
    gen = torch.Generator(device=device).manual_seed(0)

    def ids(batch: int, length: int, vocab: int) -> torch.Tensor:
        # Never token 0: generate() takes pad_token_id=0 tokens in the prompt for padding,
        # and a padded prompt is another problem (a dense mask) than the job's.
        return torch.randint(1, vocab, (batch, length), device=device, generator=gen)

    llama_dims = TINY if smoke else LLAMA
    llama = build("llama", attn, llama_dims, 0, dtype, device)
    vocab = llama_dims["vocab_size"]
    with torch.no_grad():
        llama.eval()(ids(1, sizes["prefill"], vocab))
        llama.generate(ids(1, sizes["prompt"], vocab), max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    batch = ids(sizes["train_batch"], sizes["train_len"], vocab)
    llama.train()(batch, labels=batch).loss.backward()
    del llama
    dims = TINY_INTERLEAVED if smoke else INTERLEAVED
    model = build_gemma2(attn, dims, dtype, device)  # Gemma 2's layout, uncapped dims
    with torch.no_grad():
        model.eval()(ids(1, sizes["prefill"], dims["vocab_size"]))
    batch = ids(1, sizes["interleaved_train"], dims["vocab_size"])
    model.train()(batch, labels=batch).loss.backward()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the recording to write")
    parser.add_argument("--new-tokens", type=int, help="greedy decode steps (default 64; "
                        "--smoke: 4)")
    parser.add_argument("--smoke", action="store_true", help="tiny models, CPU interpreter")
    args = parser.parse_args(argv)
    on_gpu = torch.cuda.is_available() and not interpreter_active()
    if not on_gpu and not args.smoke:
        parser.error("needs a CUDA GPU (or --smoke)")
    device, dtype = ("cuda", torch.bfloat16) if on_gpu else ("cpu", torch.float32)
    new_tokens = args.new_tokens or (4 if args.smoke else 64)
    name = register_transformers()
    with tuner.record(args.out) as recorder:
        run_job(name, smoke=args.smoke, new_tokens=new_tokens, device=device, dtype=dtype)
    plans = sum(recorder.counts.values())
    print(f"recorded {len(recorder.problems)} problem(s) by bucket ({plans} plans made) "
          f"to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
