"""Training calls on Hopper: where ``gluon_cudnn_train`` (the Gluon forward with cuDNN's
backward, timed together) is measured faster than ``torch_sdpa_train``, ``tuner.attention``
runs the Gluon forward through the custom op ``tuner::gluon_attention_fwd``, and its backward
is cuDNN's (``tuner::cudnn_attention_bwd``) fed with that forward's o and lse; elsewhere SDPA.

The CPU stands in for an H100 (the measurements are stored for tests/api/serving_data's H100):
``gluon_attention_fwd`` and ``cudnn_attention_bwd`` are recorders that answer with the
reference (neither runs on the CPU; their numerics are the GPU tests' and
benchmarks/gluon_cudnn_train_bench.py's)."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import pytest
import torch

import templates.pytorch.cudnn_bwd
import tuner
import tuner.dispatch.implementations.gluon
from templates.attention_reference import attention_reference
from templates.base import Problem
from templates.flash.bwd import reference_grads
from templates.kernel_common import normalize_causal
from templates.registry import get_template
from tests.api.serving_data import H100
from tests.tuner.dispatch.test_dispatch import measured as measured_on
from tests.tuner.dispatch.test_dispatch import store
from tests.tuner.dispatch.test_dispatch_gluon_masks import gluon_config_not_the_default
from tuner.dispatch.rule import Call, choose

pytestmark = pytest.mark.usefixtures("no_tuned_configs", "on_hopper")

B, HQ, HKV, N, D = 1, 4, 2, 80, 64
PROBLEM = Problem(batch=B, heads_q=HQ, heads_kv=HKV, seqlen_q=N, seqlen_kv=N, head_dim=D,
                  dtype="float16", causal="top_left")
TRAIN = get_template("gluon_cudnn_train")
call_module = importlib.import_module("tuner.dispatch.implementations.call")


@pytest.fixture
def on_hopper(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(call_module, "cpu_device", lambda: H100)


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[dict[str, Any]]]:
    """The forward's and the backward's calls, each answered with the reference."""
    seen: dict[str, list[dict[str, Any]]] = {"fwd": [], "bwd": []}

    def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: Any
                ) -> tuple[torch.Tensor, torch.Tensor]:
        assert q.dim() == 4 and k.shape[1] == HKV  # GQA: the kernel groups the heads itself
        o, lse = attention_reference(q, k, v, causal=kw["causal"],
                                     scale=kw["scale"] or q.shape[-1] ** -0.5)
        seen["fwd"].append({**kw, "o": o.to(q.dtype), "lse": lse.float()})
        return seen["fwd"][-1]["o"], seen["fwd"][-1]["lse"]

    def backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 o: torch.Tensor, lse: torch.Tensor, *, causal: bool, scale: float | None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        seen["bwd"].append({"o": o, "lse": lse, "causal": causal, "scale": scale})
        grads = closed_form_grads(q, k, v, do, causal, scale or q.shape[-1] ** -0.5)
        return tuple(g.to(q.dtype) for g in grads)  # type: ignore[return-value]

    monkeypatch.setattr(tuner.dispatch.implementations.gluon, "gluon_attention_fwd", forward)
    monkeypatch.setattr(templates.pytorch.cudnn_bwd, "cudnn_attention_bwd", backward)
    return seen


def closed_form_grads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor,
                      causal: bool, scale: float) -> tuple[torch.Tensor, ...]:
    """Attention's gradients in float64 without autograd (a custom op's body runs below
    autograd, so the autograd reference cannot run inside the recorder)."""
    group = q.shape[1] // k.shape[1]
    q, do = q.double(), do.double()
    k, v = (t.double().repeat_interleave(group, dim=1) for t in (k, v))
    s = scale * q @ k.transpose(-1, -2)
    if causal:  # top-left
        s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), float("-inf"))
    p = s.softmax(-1)
    dp = do @ v.transpose(-1, -2)
    ds = p * (dp - (dp * p).sum(-1, keepdim=True))
    dq, dk, dv = scale * ds @ k, scale * ds.transpose(-1, -2) @ q, p.transpose(-1, -2) @ do

    def per_kv_head(t: torch.Tensor) -> torch.Tensor:
        return t.unflatten(1, (-1, group)).sum(2)

    return dq, per_kv_head(dk), per_kv_head(dv)


def measured(template: str, tflops: float, config: dict[str, Any] | None = None
             ) -> dict[str, Any]:
    """A stored best of ``template`` for the training problem on the H100."""
    return measured_on(template, PROBLEM, tflops, config, device=H100)


def leaves(layout: str = "bhnd") -> tuple[torch.Tensor, ...]:
    torch.manual_seed(0)
    shapes = [(B, HQ, N, D), (B, HKV, N, D), (B, HKV, N, D), (B, HQ, N, D)]
    if layout == "bnhd":  # what transformers passes: (B, N, H, D) viewed as (B, H, N, D)
        return tuple(torch.randn(b, n, h, d, dtype=torch.float16).transpose(1, 2)
                     .requires_grad_(i < 3) for i, (b, h, n, d) in enumerate(shapes))
    return tuple(torch.randn(s, dtype=torch.float16).requires_grad_(i < 3)
                 for i, s in enumerate(shapes))


def assert_reference_grads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           do: torch.Tensor) -> None:
    ref = reference_grads(q.detach(), k.detach(), v.detach(), do, causal="top_left",
                          scale=D ** -0.5)
    for got, want in zip((q.grad, k.grad, v.grad), ref, strict=True):
        assert got is not None and got.shape == want.shape and got.dtype == torch.float16
        assert float((got.double() - want).norm() / want.norm()) < 2e-3


@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
def test_gluon_measured_faster_trains_with_its_forward_and_cudnns_backward(
        tmp_path: Path, calls: dict[str, list[dict[str, Any]]], layout: str) -> None:
    cfg = gluon_config_not_the_default(TRAIN, PROBLEM)
    store(tmp_path, measured("torch_sdpa_train", 100.0), measured("flash_fwd", 10.0),
          measured("flash_bwd", 10.0), measured("gluon_cudnn_train", 110.0, config=cfg))
    choice = choose(Call(PROBLEM, True, H100))
    assert choice.implementation.name == "gluon" and choice.match == "exact", choice.why
    q, k, v, do = leaves(layout)
    out = tuner.attention(q, k, v, is_causal=True, enable_gqa=True)
    assert out.requires_grad and out.shape == q.shape
    [fwd] = calls["fwd"]
    assert fwd["config"] == TRAIN.config(cfg) and fwd["causal"] == "top_left"
    assert not calls["bwd"]
    out.backward(do)
    [bwd] = calls["bwd"]
    # The backward is fed the forward's own o and lse (4-D: the op reshapes).
    assert torch.equal(bwd["o"], fwd["o"]) and torch.equal(bwd["lse"], fwd["lse"])
    assert bwd["causal"] is True and bwd["scale"] is None
    assert_reference_grads(q, k, v, do)
    for t in (q, k, v):  # laid out as the inputs (torch.empty_like), as the fake says
        assert t.grad is not None and t.grad.stride() == torch.empty_like(t).stride()


def test_training_runs_sdpa_where_gluon_is_slower_or_unmeasured(
        tmp_path: Path, calls: dict[str, list[dict[str, Any]]]) -> None:
    q, k, v, do = leaves()
    # Only the forward measured fast: no training price, so SDPA's training step runs.
    store(tmp_path, measured("torch_sdpa_train", 100.0),
          measured("gluon_fwd", 500.0))
    assert choose(Call(PROBLEM, True, H100)).implementation.name == "sdpa"
    tuner.attention(q, k, v, is_causal=True, enable_gqa=True).backward(do)
    store(tmp_path, measured("torch_sdpa_train", 100.0), measured("gluon_cudnn_train", 90.0),
          db="slower.db")
    assert choose(Call(PROBLEM, True, H100)).implementation.name == "sdpa"
    tuner.attention(q, k, v, is_causal=True, enable_gqa=True).backward(do)
    assert not calls["fwd"] and not calls["bwd"]


def test_the_ops_fakes_match_the_real_strides(calls: dict[str, list[dict[str, Any]]]) -> None:
    """torch.compile plans with the fakes: the real ops' outputs must be laid out as they
    say, whatever layout the inputs (and the backward's gradient) come in."""
    for layout in ("bhnd", "bnhd"):
        q, k, v, do = (t.detach() for t in leaves(layout))
        with tuner.use_implementation("gluon"):
            torch.library.opcheck(torch.ops.tuner.gluon_attention_fwd.default, (q, k, v, True, None, True),
                                  test_utils=("test_faketensor",))
            o, lse = torch.ops.tuner.gluon_attention_fwd(q, k, v, True, None, True)
        torch.library.opcheck(torch.ops.tuner.cudnn_attention_bwd.default,
                              (do.contiguous(), q, k, v, o, lse, True, None, True),
                              test_utils=("test_faketensor",))


def test_under_torch_compile_gluon_training_is_its_op_with_cudnns_backward(
        tmp_path: Path, calls: dict[str, list[dict[str, Any]]]) -> None:
    store(tmp_path, measured("torch_sdpa_train", 100.0), measured("gluon_cudnn_train", 110.0))
    q, k, v, do = leaves()

    def step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return tuner.attention(q, k, v, is_causal=True, enable_gqa=True) * 2

    graphs: list[torch.fx.GraphModule] = []

    def aot_eager_kept(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        graphs.append(gm)
        from functorch.compile import make_boxed_func
        from torch._dynamo.backends.common import aot_autograd

        def eager(g: torch.fx.GraphModule, _: Any) -> Any:
            return make_boxed_func(g)

        return aot_autograd(fw_compiler=eager, bw_compiler=eager)(gm, example_inputs)

    # fullgraph=True raises on any graph break; aot_autograd traces the fakes and the backward.
    out = torch.compile(step, fullgraph=True, backend=aot_eager_kept)(q, k, v)
    [graph] = graphs
    targets = {str(node.target) for node in graph.graph.nodes if node.op == "call_function"}
    assert "tuner.gluon_attention_fwd" in targets, targets
    out.backward(do)
    assert len(calls["fwd"]) == 1 and len(calls["bwd"]) == 1
    assert_reference_grads(q, k, v, 2 * do)  # the step doubles the attention's output


# ----------------------------------------------------------------------------- GPU
GPU_CASES = [  # (B, H_q, H_kv, N_q, N_kv, D, dtype, causal)
    (1, 4, 4, 333, 333, 128, torch.bfloat16, True),
    (1, 8, 2, 300, 300, 64, torch.float16, True),
    (1, 4, 1, 128, 515, 128, torch.bfloat16, True),
    (2, 4, 4, 200, 200, 256, torch.bfloat16, False),
]


def gpu_inputs(case: tuple[Any, ...], layout: str) -> tuple[torch.Tensor, ...]:
    b, hq, hkv, nq, nkv, d, dtype, _ = case
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(h: int, n: int) -> torch.Tensor:
        if layout == "bnhd":  # what transformers passes
            return torch.randn(b, n, h, d, generator=gen, device="cuda",
                               dtype=dtype).transpose(1, 2)
        return torch.randn(b, h, n, d, generator=gen, device="cuda", dtype=dtype)

    return randn(hq, nq), randn(hkv, nkv), randn(hkv, nkv), randn(hq, nq)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["bhnd", "bnhd", "3d"])
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: "-".join(map(str, c)))
def test_training_through_gluon_and_cudnn_matches_the_reference_on_the_gpu(
        case: tuple[Any, ...], layout: str) -> None:
    """The real kernels (no recorders), forced: dq, dk, dv against the autograd reference."""
    from tuner.attention import plan_for

    q, k, v, do = gpu_inputs(case, "bhnd" if layout == "3d" else layout)
    causal = case[-1]
    gqa = q.shape[1] != k.shape[1]
    if layout == "3d":
        if gqa:
            pytest.skip("3-D inputs are one batch of heads: no GQA")
        q, k, v, do = (t[0] for t in (q, k, v, do))
    grads_of = [t.detach().requires_grad_() for t in (q, k, v)]
    with tuner.use_implementation("gluon"):
        assert plan_for(*grads_of, is_causal=causal, enable_gqa=gqa,
                        needs_grad=True).implementation.name == "gluon"
        o = tuner.attention(*grads_of, is_causal=causal, enable_gqa=gqa)
    o.backward(do)
    four = [t if t.dim() == 4 else t.unsqueeze(0) for t in (q, k, v, do)]
    ref = reference_grads(*four, causal=normalize_causal(causal),
                          scale=q.shape[-1] ** -0.5)
    tol = 2e-3 if q.dtype == torch.float16 else 1e-2
    for t, r in zip(grads_of, ref, strict=True):
        assert t.grad is not None and t.grad.shape == t.shape
        assert float(t.grad.abs().max()) > 0
        err = float((t.grad.reshape(r.shape).double() - r).norm() / r.norm())
        assert err < tol, (layout, err)
