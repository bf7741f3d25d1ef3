"""The implementation contract (``tuner.dispatch.implementations.base.Implementation``): a new
implementation is one class registered from outside ``tuner.attention``, chosen and run by
it, for inference and (through its own training op) for a gradient; masked calls travel as
tensors through the ops and compile in one graph; bad inputs name what was wrong."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import tuner
from templates.masks.block_mask import BlockMask
from tuner.attention import _PLANS, plan_for
from tuner.dispatch.implementations import (
    Choice,
    Implementation,
    Run,
    register_implementation,
    unregister_implementation,
)
from tuner.dispatch.implementations.ops import backward_by, setup_context, training_fake


# ----------------------------------------------------------------------------- a toy one
def _math_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
                    scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, lse) in float64 math, as a kernel would give them."""
    s = (q.double() @ k.double().transpose(-1, -2)) * (scale or q.shape[-1] ** -0.5)
    if is_causal:
        s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), float("-inf"))
    lse = s.logsumexp(-1)
    return ((s - lse[..., None]).exp() @ v.double()).to(q.dtype), lse.float()


@torch.library.custom_op("tuner_test::toy_attention_fwd", mutates_args=())
def _toy_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
             scale: float | None, enable_gqa: bool) -> tuple[torch.Tensor, torch.Tensor]:
    TOY.calls.append("training op")
    o, lse = _math_attention(q, k, v, is_causal, scale)
    return o.contiguous(), lse


@torch.library.custom_op("tuner::toy_attention_bwd", mutates_args=())
def _toy_bwd(grad_o: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             o: torch.Tensor, lse: torch.Tensor, is_causal: bool, scale: float | None,
             enable_gqa: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    TOY.calls.append("backward op")
    # In closed form (an op's body runs below autograd): P = exp(S - lse), dV = P^T dO,
    # dS = P * (dO V^T - rowsum(dO * O)), dQ = scale dS K, dK = scale dS^T Q.
    scale = scale or q.shape[-1] ** -0.5
    qd, kd, vd, do = q.double(), k.double(), v.double(), grad_o.double()
    s = (qd @ kd.transpose(-1, -2)) * scale
    if is_causal:
        s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), float("-inf"))
    p = (s - lse.double()[..., None]).exp()
    ds = p * (do @ vd.transpose(-1, -2) - (do * o.double()).sum(-1, keepdim=True))
    grads = (scale * ds @ kd, scale * ds.transpose(-1, -2) @ qd, p.transpose(-1, -2) @ do)
    return tuple(g.to(t.dtype) for g, t in zip(grads, (q, k, v), strict=True))  # type: ignore[return-value]


_toy_fwd.register_fake(training_fake)
_toy_bwd.register_fake(lambda g, q, k, v, *rest: (torch.empty_like(q), torch.empty_like(k),
                                                  torch.empty_like(v)))
_toy_fwd.register_autograd(backward_by("toy_attention_bwd"), setup_context=setup_context)


class Toy(Implementation):
    """Plain math attention, priced by SDPA's templates (so only forcing it makes it run)."""

    name = "toy"
    forward = "torch_sdpa"
    training = ("torch_sdpa_train",)
    description = "math attention, a test's"
    training_op = torch.ops.tuner_test.toy_attention_fwd

    def __init__(self) -> None:
        self.calls: list[str] = []

    def plan(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
             scale: float | None, enable_gqa: bool, choice: Choice) -> Run:
        self.calls.append("plan")

        def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            self.calls.append("run")
            return _math_attention(q, k, v, is_causal, scale)[0]

        return run


TOY = Toy()


@pytest.fixture
def toy(no_tuned_configs: None) -> Iterator[Toy]:
    register_implementation(TOY)
    TOY.calls.clear()
    try:
        yield TOY
    finally:
        unregister_implementation(TOY.name)


def test_a_registered_implementation_is_chosen_and_its_plan_runs(toy: Toy) -> None:
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 24, 16) for _ in range(3))
    assert plan_for(q, k, v).implementation.name == "sdpa"  # priced as SDPA: not chosen
    with tuner.use_implementation("toy"):
        assert plan_for(q, k, v, is_causal=True).implementation is toy
        out = tuner.attention(q, k, v, is_causal=True)
        again = tuner.attention(q, k, v, is_causal=True)
    assert toy.calls == ["plan", "run", "run"]  # planned once per problem and layout
    [plan] = _PLANS.values()
    assert plan.choice.implementation is toy  # type: ignore[attr-defined]
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(again, out, rtol=0, atol=0)


def test_a_registered_implementation_trains_through_its_own_op(toy: Toy) -> None:
    torch.manual_seed(1)
    leaves = [torch.randn(1, 2, 20, 16, requires_grad=True) for _ in range(3)]
    q, k, v = leaves
    grad = torch.randn(1, 2, 20, 16)
    with tuner.use_implementation("toy"):
        tuner.attention(q, k, v, is_causal=True, scale=0.3).backward(grad)
    assert toy.calls == ["training op", "backward op"]
    ours = [t.grad for t in leaves]
    copies = [t.detach().clone().requires_grad_() for t in leaves]
    cq, ck, cv = copies
    F.scaled_dot_product_attention(cq, ck, cv, is_causal=True, scale=0.3).backward(grad)
    for mine, theirs in zip(ours, (t.grad for t in copies), strict=True):
        assert mine is not None and theirs is not None
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-5)


def test_a_name_cannot_be_registered_twice_or_empty(toy: Toy) -> None:
    with pytest.raises(ValueError, match="already registered"):
        register_implementation(TOY)
    with pytest.raises(ValueError, match="needs a name and a forward template"):
        register_implementation(Implementation())


# ----------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("position", ["query", "key", "value"])
def test_a_non_tensor_input_is_a_type_error_naming_it(position: str) -> None:
    q = torch.randn(1, 1, 4, 8)
    args: dict[str, Any] = {"query": q, "key": q, "value": q, position: [[1.0]]}
    with pytest.raises(TypeError, match=f"{position} must be a torch.Tensor, but got list"):
        tuner.attention(args["query"], args["key"], args["value"])
    with torch.no_grad(), pytest.raises(TypeError, match=f"{position} must be a torch.Tensor"):
        tuner.attention(args["query"], args["key"], args["value"], is_causal=True)


# ----------------------------------------------------------------------------- masks compiled
def test_a_block_masked_call_compiles_in_one_graph_forward_and_backward(
        device: str, no_tuned_configs: None) -> None:
    torch.manual_seed(2)
    leaves = [torch.randn(1, 2, 32, 16, device=device, requires_grad=True) for _ in range(3)]
    q, k, v = leaves
    window = torch.ones(32, 32, dtype=torch.bool, device=device).tril() & torch.ones(
        32, 32, dtype=torch.bool, device=device).triu(-8)
    mask = BlockMask.from_dense(window, 16)

    def block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, m: BlockMask) -> torch.Tensor:
        return tuner.attention(q * 2, k, v, block_mask=m).relu().sum()

    # fullgraph=True raises on any graph break; aot_eager traces the fakes and the backward.
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    loss = compiled(q, k, v, mask)
    loss.backward()
    grads = [t.grad.clone() for t in leaves]  # type: ignore[union-attr]
    copies = [t.detach().clone().requires_grad_() for t in leaves]
    cq, ck, cv = copies
    ref = F.scaled_dot_product_attention(cq * 2, ck, cv,
                                         attn_mask=window).relu().sum()
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-4, atol=1e-4)
    for mine, theirs in zip(grads, (t.grad for t in copies), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)
    with torch.no_grad():  # without a gradient: the inference op, the mask as its tensors
        infer = torch.compile(lambda q, k, v, m: tuner.attention(q, k, v, block_mask=m),
                              fullgraph=True, backend="aot_eager")
        torch.testing.assert_close(infer(q, k, v, mask), F.scaled_dot_product_attention(
            q, k, v, attn_mask=window), rtol=1e-4, atol=1e-4)
        # Another mask of the same geometry: the op rebuilds it from its tensors.
        causal = torch.ones(32, 32, dtype=torch.bool, device=device).tril()
        torch.testing.assert_close(infer(q, k, v, BlockMask.from_dense(causal, 16)),
                                   F.scaled_dot_product_attention(q, k, v, attn_mask=causal),
                                   rtol=1e-4, atol=1e-4)


def test_a_forced_attn_mask_call_compiles_in_one_graph_forward_and_backward(
        device: str, no_tuned_configs: None) -> None:
    torch.manual_seed(4)
    leaves = [torch.randn(1, 2, 24, 16, device=device, requires_grad=True) for _ in range(3)]
    q, k, v = leaves
    allowed = torch.rand(24, 24, device=device) > 0.3
    allowed.fill_diagonal_(True)

    def block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, m: torch.Tensor
              ) -> torch.Tensor:
        return tuner.attention(q, k, v, attn_mask=m).sum()

    with tuner.use_implementation("flash"):  # (an elementwise mask runs SDPA unless forced)
        loss = torch.compile(block, fullgraph=True, backend="aot_eager")(q, k, v, allowed)
        loss.backward()
    copies = [t.detach().clone().requires_grad_() for t in leaves]
    cq, ck, cv = copies
    ref = F.scaled_dot_product_attention(cq, ck, cv, attn_mask=allowed).sum()
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-4, atol=1e-4)
    for mine, theirs in zip(leaves, copies, strict=True):
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------- imports
ROOT = Path(__file__).resolve().parents[3]
OWN = ("tuner.attention", "tuner.dispatch.rule", "tuner.dispatch.plans", "tuner.record",
       "tuner.decode")


def _imports(module: str) -> set[str]:
    """The tuner modules ``module`` imports (at the top or inside a function)."""
    path = ROOT / (module.replace(".", "/") + ".py")
    if not path.exists():
        path = ROOT / module.replace(".", "/") / "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
                 if isinstance(node, ast.ImportFrom) else [])
        for name in names:
            as_path = ROOT / name.replace(".", "/")
            if name.startswith("tuner") and (as_path.with_suffix(".py").exists()
                                             or (as_path / "__init__.py").exists()):
                found.add(name)
    return found


def test_the_entry_the_dispatcher_and_the_implementations_import_no_cycle() -> None:
    """No cycle among these modules' imports, function-local ones included (record.py once
    imported tuner.attention inside ``record``: attention -> dispatch -> record -> attention)."""
    modules = {*OWN, "tuner.dispatch.implementations",
               *(f"tuner.dispatch.implementations.{p.stem}"
                 for p in (ROOT / "tuner/dispatch/implementations").glob("*.py")
                 if p.stem != "__init__")}
    edges = {m: (_imports(m) & modules) - {m} for m in modules}  # (a package naming its own)

    def visit(module: str, path: tuple[str, ...]) -> None:
        if module in path:
            pytest.fail(" -> ".join((*path[path.index(module):], module)))
        for name in sorted(edges[module]):
            visit(name, (*path, module))

    for module in sorted(modules):
        visit(module, ())
