"""tuner.attention and tuner.decode inside a captured CUDA graph: a prefill and a decode step
replay to the eager result (GPU only: the interpreter has no graphs)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch

import tuner
from templates.registry import get_template
from tuner.attention import clear_plans

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def fresh_plans() -> Iterator[None]:
    clear_plans()
    yield
    clear_plans()


def replayed(fn: Callable[[], torch.Tensor], refill: Callable[[], None]) -> torch.Tensor:
    """Capture ``fn`` (after a warm-up that builds plans and compiles), refill the inputs
    in place, replay, and return the graph's output."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    refill()
    graph.replay()
    torch.cuda.synchronize()
    return out


@pytest.mark.parametrize("implementation", ["sdpa", "flash"])
def test_a_prefill_replays_to_the_eager_result(implementation: str) -> None:
    q, k, v = (torch.randn(2, 8, 300, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    with tuner.use_implementation(implementation):
        out = replayed(lambda: tuner.attention(q, k, v, is_causal=True),
                       lambda: [t.normal_() for t in (q, k, v)])
        eager = tuner.attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out, eager, rtol=0, atol=0)


@pytest.mark.parametrize("paged", [False, True])
def test_a_decode_step_replays_to_the_eager_result(paged: bool) -> None:
    t = get_template("flash_decode")
    from templates.base import Problem

    p = Problem(batch=4, heads_q=32, heads_kv=8, seqlen_q=1, seqlen_kv=4096, head_dim=128,
                dtype="bfloat16", mask="paged:256+mixed" if paged else "mixed")
    inputs = t.make_inputs(p, "cuda", seed=0)
    kw = {"cache_seqlens": inputs["cache_seqlens"], "block_table": inputs["block_table"]}
    q, kc, vc = inputs["q"], inputs["k_cache"], inputs["v_cache"]
    out = replayed(lambda: tuner.decode(q, kc, vc, **kw), lambda: q.normal_())
    torch.testing.assert_close(out, tuner.decode(q, kc, vc, **kw), rtol=0, atol=0)


def test_a_one_token_call_replays_through_the_decode_kernel() -> None:
    q = torch.randn(1, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, 8, 8192, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    with tuner.use_implementation("decode"):
        out = replayed(lambda: tuner.attention(q, k, v, enable_gqa=True), lambda: q.normal_())
    ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(),
                                                           enable_gqa=True)
    assert float((out.float() - ref).norm() / ref.norm()) < 1e-2
