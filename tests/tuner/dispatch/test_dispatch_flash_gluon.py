"""``flash_gluon``: a block-mask training call by our Triton forward and the Gluon backward fed
its o and logsumexp. Priced by flash_fwd + gluon_bwd on the mask's named problem; it runs
where that pair was measured fastest, where nothing of ours is measured for the mask problem
(the block-mask training baseline on Hopper), or forced; dense calls, inference, elementwise
masks and causal calls on top of a mask are not its own.

The CPU stands in for an H100: the Triton forward runs under the interpreter, the Gluon
backward is a recorder answering with the reference (its numerics under masks are
tests/templates/gluon/test_gluon_bwd_mask.py's, on the GPU)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

import tuner
import tuner.dispatch.implementations.flash_gluon as flash_gluon_impl
from templates.attention_reference import attention_reference
from templates.base import Problem
from templates.device import current_device
from templates.flash.bwd import reference_grads
from templates.gluon.bwd import GluonBwdConfig
from templates.masks.mods import pattern_block_mask
from tests.api.serving_data import H100
from tests.tuner.dispatch.test_dispatch import measured as measured_on
from tests.tuner.dispatch.test_dispatch import store
from tests.tuner.dispatch.test_dispatch_gluon_masks import on_hopper  # noqa: F401  (a fixture)
from tests.tuner.dispatch.test_dispatch_gluon_train_masks import (
    N_GPU,
    assert_trains_on_the_gpu,
    masked_closed_form_grads,
)
from tuner.dispatch.rule import Call, choose

pytestmark = pytest.mark.usefixtures("no_tuned_configs", "on_hopper")

PATTERN = "sliding_causal:100"  # causality inside the mask: the call passes is_causal=False
N, D = 256, 64
MASKED = Problem(batch=1, heads_q=4, heads_kv=2, seqlen_q=N, seqlen_kv=N, head_dim=D,
                 dtype="float16", causal="none", mask=PATTERN)
# A backward config other than gluon_bwd's default for a mask (one dQ staging tile).
TUNED_BWD = GluonBwdConfig(warp_specialize=True, dq_buffers=2)


def measured(template: str, tflops: float, config: dict[str, Any] | None = None
             ) -> dict[str, Any]:
    return measured_on(template, MASKED, tflops, config, device=H100)


def store_pair_fastest(tmp_path: Path) -> None:
    # Forward FLOPs F: flash_gluon F/300 + 2.5F/400 (0.0096 F) beats flash F/300 + 2.5F/200
    # (0.016 F), gluon_train 3.5F/300 (0.0117 F) and Flex 3.5F/250 (0.014 F).
    store(tmp_path, measured("flash_fwd", 300.0), measured("flash_bwd", 200.0),
          measured("gluon_bwd", 400.0, TUNED_BWD.to_dict()),
          measured("torch_flex_train", 250.0), measured("gluon_train", 300.0))


@pytest.fixture
def gluon_backward(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """The Gluon backward's calls, answered with the closed-form gradients under the call's
    mask (no autograd: under torch.compile the op's body runs below it)."""
    calls: list[dict[str, Any]] = []

    def backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 o: torch.Tensor, lse: torch.Tensor, **kw: Any) -> tuple[torch.Tensor, ...]:
        calls.append({"o": o, "lse": lse, **kw})
        grads = masked_closed_form_grads(q, k, v, do, kw["block_mask"].to_dense(),
                                         kw["scale"] or q.shape[-1] ** -0.5)
        return tuple(g.to(q.dtype) for g in grads)

    monkeypatch.setattr(flash_gluon_impl, "gluon_attention_bwd", backward)
    return calls


def leaves() -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, heads, N, D, generator=g, dtype=torch.float16).requires_grad_()
               for heads in (4, 2, 2))
    return q, k, v, torch.randn(1, 4, N, D, generator=g, dtype=torch.float16)


def test_the_pair_measured_fastest_on_the_mask_runs_a_training_call(
        tmp_path: Path, gluon_backward: list[dict[str, Any]]) -> None:
    store_pair_fastest(tmp_path)
    choice = choose(Call(MASKED, True, H100))
    assert choice.implementation.name == "flash_gluon", choice.why
    block_mask = pattern_block_mask(PATTERN, N, N)
    q, k, v, do = leaves()
    o = tuner.attention(q, k, v, block_mask=block_mask, enable_gqa=True)
    o.backward(do)
    [call] = gluon_backward
    assert call["causal"] == "none" and call["block_mask"] is block_mask
    assert call["config"] == TUNED_BWD  # the measured backward config, not the default
    dense = block_mask.to_dense()
    ref_o, ref_lse = attention_reference(q.detach(), k.detach().repeat_interleave(2, 1),
                                         v.detach().repeat_interleave(2, 1), causal="none",
                                         scale=D ** -0.5, mask=dense)
    # The backward was fed the Triton forward's own o and natural-log lse.
    torch.testing.assert_close(call["o"].float(), ref_o.float(), atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(call["lse"].float(), ref_lse.float(), atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(o.detach().float(), ref_o.float(), atol=2e-3, rtol=2e-3)
    ref = reference_grads(q.detach(), k.detach().repeat_interleave(2, 1),
                          v.detach().repeat_interleave(2, 1), do, causal="none",
                          scale=D ** -0.5, mask=dense)
    for t, r, grouped in zip((q, k, v), ref, (False, True, True), strict=True):
        assert t.grad is not None
        r = r.unflatten(1, (2, 2)).sum(2) if grouped else r
        torch.testing.assert_close(t.grad.float(), r.float(), atol=2e-3, rtol=2e-3)


def test_unmeasured_it_trains_masks_on_hopper_with_the_backwards_default(
        gluon_backward: list[dict[str, Any]]) -> None:
    """Nothing measured for the mask problem: a training call runs it (the block-mask
    training baseline on Hopper), inference runs flash; forced, it runs named and unnamed
    masks with gluon_bwd's default for a mask."""
    unmeasured = choose(Call(MASKED, True, H100))
    assert unmeasured.implementation.name == "flash_gluon" and "not measured" in unmeasured.why
    assert choose(Call(MASKED, False, H100)).implementation.name == "flash"
    causal = dataclasses.replace(MASKED, causal="top_left")  # not the mask's own causality
    assert choose(Call(causal, True, H100)).implementation.name == "flash"
    q, k, v, do = leaves()
    with tuner.use_implementation("flash_gluon"):
        tuner.attention(q, k, v, block_mask=pattern_block_mask(PATTERN, N, N),
                        enable_gqa=True).backward(do)
    assert [c["config"] for c in gluon_backward] == [None]  # gluon_bwd's default for a mask
    unnamed = dataclasses.replace(pattern_block_mask(PATTERN, N, N), pattern=None)
    q, k, v, do = leaves()
    with tuner.use_implementation("flash_gluon"):
        tuner.attention(q, k, v, block_mask=unnamed, enable_gqa=True).backward(do)
    assert gluon_backward[-1]["block_mask"] is unnamed and gluon_backward[-1]["config"] is None


def test_what_is_not_its_own_is_refused_by_name() -> None:
    impl = flash_gluon_impl.FLASH_GLUON
    dense = dataclasses.replace(MASKED, mask="none")
    assert "block-mask" in (impl.why_not(Call(dense, True, H100)) or "")
    assert "gradient" in (impl.why_not(Call(MASKED, False, H100)) or "")
    assert impl.why_not(Call(MASKED, True, H100)) is None
    q, k, v, _ = leaves()
    with tuner.use_implementation("flash_gluon"), pytest.raises(ValueError, match="causality"):
        tuner.attention(q, k, v, block_mask=pattern_block_mask(PATTERN, N, N), is_causal=True,
                        enable_gqa=True)


def test_each_of_the_pair_takes_its_own_measured_config(
        tmp_path: Path, gluon_backward: list[dict[str, Any]]) -> None:
    """A sweep that measured the backward alone on the mask's problem still tunes it."""
    store(tmp_path, measured("gluon_bwd", 400.0, TUNED_BWD.to_dict()))
    q, k, v, do = leaves()
    with tuner.use_implementation("flash_gluon"):
        tuner.attention(q, k, v, block_mask=pattern_block_mask(PATTERN, N, N),
                        enable_gqa=True).backward(do)
    assert [c["config"] for c in gluon_backward] == [TUNED_BWD]


def test_unmeasured_masked_training_compiles_in_one_graph(
        gluon_backward: list[dict[str, Any]]) -> None:
    """What an untuned masked training step on Hopper runs now (flash_gluon) traces into one
    graph under torch.compile(fullgraph=True): its ops' fakes, the mask as their tensors;
    the gradients the reference's, and the fakes' strides the real ones' (opcheck)."""
    from tuner.dispatch.implementations.mask_args import Masked

    q, k, v, do = leaves()
    block_mask = pattern_block_mask(PATTERN, N, N)

    def step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return tuner.attention(q, k, v, block_mask=block_mask, enable_gqa=True)

    torch.compile(step, fullgraph=True, backend="aot_eager")(q, k, v).backward(do)
    assert [c["block_mask"].pattern for c in gluon_backward] == [PATTERN]
    dense = block_mask.to_dense()
    ref = reference_grads(q.detach(), k.detach(), v.detach(), do, causal="none",
                          scale=D ** -0.5, mask=dense)
    for t, r in zip((q, k, v), ref, strict=True):
        assert t.grad is not None
        torch.testing.assert_close(t.grad.float(), r.float(), atol=2e-3, rtol=2e-3)
    inputs = [t.detach() for t in (q, k, v)]
    args = Masked.of(inputs[0], inputs[1], None, block_mask).op_args()
    torch.library.opcheck(torch.ops.tuner.flash_gluon_fwd.default,
                          (*inputs, False, None, True, *args), test_utils=("test_faketensor",))
    o, lse = torch.ops.tuner.flash_gluon_fwd(*inputs, False, None, True, *args)
    torch.library.opcheck(torch.ops.tuner.flash_gluon_bwd.default,
                          (do, *inputs, o, lse, False, None, True, *args),
                          test_utils=("test_faketensor",))


@pytest.mark.parametrize(("pattern", "head_dim", "runs"), [
    # d128: the Gluon forward's pair trains; the Gluon forward infers where each row sees one
    # range of keys, the Triton forward elsewhere (the two not compared there)
    ("sliding_causal:4096", 128, {True: "gluon_train", False: "gluon"}),
    ("documents_causal:2048", 128, {True: "gluon_train", False: "gluon"}),
    ("random:0.1", 128, {True: "gluon_train", False: "flash"}),
    # d64: the Triton forward both ways, with the Gluon backward for a gradient
    ("sliding_causal:4096", 64, {True: "flash_gluon", False: "flash"}),
    ("random:0.1", 64, {True: "flash_gluon", False: "flash"}),
])
def test_unmeasured_block_masks_run_the_baseline_of_their_head_dim(
        pattern: str, head_dim: int, runs: dict[bool, str]) -> None:
    problem = Problem(batch=1, heads_q=32, heads_kv=8, seqlen_q=8192, seqlen_kv=8192,
                      head_dim=head_dim, dtype="bfloat16", causal="none", mask=pattern)
    for needs_grad, name in runs.items():
        choice = choose(Call(problem, needs_grad, H100))
        assert choice.implementation.name == name, choice.why
        assert "not measured" in choice.why
    # is_causal on top of the mask: neither Gluon pair's backward takes it, and the Gluon
    # forward was not measured under it: flash both ways.
    causal = dataclasses.replace(problem, causal="top_left")
    for needs_grad in (False, True):
        assert choose(Call(causal, needs_grad, H100)).implementation.name == "flash"


# ----------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("pattern", ["sliding_causal:300", "documents_causal:512",
                                     "random:0.3"])
@pytest.mark.parametrize(("head_dim", "runs"), [(128, "gluon_train"), (64, "flash_gluon")])
def test_unmeasured_it_trains_masks_on_the_gpu(pattern: str, head_dim: int, runs: str) -> None:
    """Nothing measured: the real kernels (no recorders, nothing forced) train a named mask
    through the head dim's baseline pair (packed documents too, though this torch has
    varlen_attn: on Hopper ours was measured faster), the forward by its rows' first keys
    where the mask allows it; dq, dk, dv against the autograd reference."""
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9):
        pytest.skip("the Gluon backward needs a Hopper GPU")
    problem = Problem(batch=2, heads_q=8, heads_kv=2, seqlen_q=N_GPU, seqlen_kv=N_GPU,
                      head_dim=head_dim, dtype="bfloat16", causal="none", mask=pattern)
    assert choose(Call(problem, True, current_device(0))).implementation.name == runs
    assert_trains_on_the_gpu(pattern, head_dim)
