"""``ops.TrainingOp``: a training op's bodies run eagerly under one autograd.Function, and the
``torch.library`` op (its fake and autograd registered) wherever something traces or fakes.

The toy op's forward is o = q * k + v (lse = rowsum of q), its backward the exact gradients, so
both forms can be checked against plain autograd."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from tuner.dispatch.implementations.ops import TrainingOp

CALLS: list[str] = []


def _toy_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
             scale: float | None, enable_gqa: bool) -> tuple[torch.Tensor, torch.Tensor]:
    CALLS.append("forward")
    return q * k + v, q.sum(-1).float()


def _toy_bwd(grad_o: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             o: torch.Tensor, lse: torch.Tensor, is_causal: bool, scale: float | None,
             enable_gqa: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    CALLS.append("backward")
    return grad_o * k, grad_o * q, grad_o.clone()


def _toy_bwd_fake(grad_o: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  o: torch.Tensor, lse: torch.Tensor, is_causal: bool, scale: float | None,
                  enable_gqa: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


TOY = TrainingOp.define("test_toy_training_fwd", _toy_fwd, "test_toy_training_bwd", _toy_bwd,
                        _toy_bwd_fake)


def _leaves() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(2, 3, 5, 4, generator=gen) for _ in range(4))
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), do


def _expected(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor
              ) -> tuple[torch.Tensor, ...]:
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    return torch.autograd.grad(q * k + v, (q, k, v), do)


def test_an_eager_call_runs_the_bodies_under_one_autograd_function() -> None:
    q, k, v, do = _leaves()
    CALLS.clear()
    o, lse = TOY(q, k, v, False, None, False)
    assert type(o.grad_fn).__name__ == "_EagerTrainingBackward"
    assert not lse.requires_grad  # marked non-differentiable, as the library op's is
    grads = torch.autograd.grad(o, (q, k, v), do)
    assert CALLS == ["forward", "backward"]
    for got, want in zip(grads, _expected(q, k, v, do), strict=True):
        torch.testing.assert_close(got, want)


def test_the_library_op_gives_the_same_outputs_and_gradients() -> None:
    q, k, v, do = _leaves()
    o_eager, _ = TOY(q, k, v, False, None, False)
    o_library, _ = TOY.library(q, k, v, False, None, False)
    assert type(o_library.grad_fn).__name__ != "_EagerTrainingBackward"
    torch.testing.assert_close(o_eager, o_library)
    eager = torch.autograd.grad(o_eager, (q, k, v), do)
    library = torch.autograd.grad(o_library, (q, k, v), do)
    for a, b in zip(eager, library, strict=True):
        torch.testing.assert_close(a, b)


def test_an_output_not_reaching_the_loss_gives_no_gradient() -> None:
    q, k, v, _ = _leaves()
    o, lse = TOY(q, k, v, False, None, False)
    (lse.sum() * 0 + q.sum()).backward()  # o unused: the op's backward sees no grad_o
    assert torch.equal(q.grad, torch.ones_like(q))
    assert k.grad is None and v.grad is None


def test_fake_tensors_take_the_library_op_and_its_fake() -> None:
    with FakeTensorMode() as mode:
        q, k, v = (mode.from_tensor(torch.randn(2, 3, 5, 4)) for _ in range(3))
        CALLS.clear()
        o, lse = TOY(q, k, v, False, None, False)
    assert CALLS == []  # the fake ran, not the body
    assert o.shape == (2, 3, 5, 4) and lse.shape == (2, 3, 5) and lse.dtype == torch.float32


def test_a_traced_call_takes_the_library_op() -> None:
    q, k, v, do = _leaves()

    def step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return TOY(q, k, v, False, None, False)[0]

    graphs: list[torch.fx.GraphModule] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: object) -> object:
        graphs.append(gm)
        return gm.forward

    o = torch.compile(step, backend=backend, fullgraph=True)(q, k, v)
    assert "test_toy_training_fwd" in str(graphs[0].graph)  # the op, not the traced bodies
    torch.testing.assert_close(o, q * k + v)
    grads = torch.autograd.grad(o, (q, k, v), do)
    for got, want in zip(grads, _expected(q, k, v, do), strict=True):
        torch.testing.assert_close(got, want)
