"""Block-mask training calls on Hopper by our kernels both ways (``gluon_train``: the Gluon
forward and the warp-specialized Gluon backward, both walking the mask): run only where a
sweep measured ``gluon_train`` fastest on the mask's named pattern (or when forced), with
the mask's own causality (is_causal False) and 128 x 128 blocks; anything else goes to the
block-mask baseline (flash) or is refused by name.

As in test_dispatch_gluon_masks.py, the CPU stands in for an H100: the Gluon entry points are
recorders that check what the real ones check and answer with the reference (their numerics
are tests/templates/gluon/test_gluon_bwd_mask.py's, on the GPU); flash runs under the
interpreter."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

import templates.gluon.fwd
import tuner
import tuner.dispatch.implementations.gluon_train as gluon_train_impl
from templates.attention_reference import attention_reference
from templates.base import Problem
from templates.flash.bwd import reference_grads
from templates.gluon import bwd as gluon_bwd
from templates.masks.block_mask import BlockMask
from templates.masks.mods import pattern_block_mask
from templates.registry import get_template
from tests.api.serving_data import H100
from tests.tuner.dispatch.test_dispatch import measured as measured_on
from tests.tuner.dispatch.test_dispatch import store
from tests.tuner.dispatch.test_dispatch_gluon_masks import (
    gluon_config_not_the_default,
    on_hopper,  # noqa: F401  (a fixture)
)
from tuner.dispatch.rule import Call, choose

pytestmark = pytest.mark.usefixtures("no_tuned_configs", "on_hopper")

PATTERN = "sliding_causal:100"  # causality inside the mask: the call passes is_causal=False
N = 256
MASKED = Problem(batch=1, heads_q=4, heads_kv=2, seqlen_q=N, seqlen_kv=N, head_dim=64,
                 dtype="bfloat16", causal="none", mask=PATTERN)
OWN = get_template("gluon_train")


@pytest.fixture
def kernels(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[dict[str, Any]]]:
    """Calls of the Gluon forward and backward entry points, answered with the reference
    under the call's dense mask, after checking what the real entries check."""
    calls: dict[str, list[dict[str, Any]]] = {"fwd": [], "bwd": []}

    def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: Any
                ) -> tuple[torch.Tensor, torch.Tensor]:
        problem = templates.gluon.fwd.problem_of(q, k, kw["causal"])
        assert templates.gluon.fwd.TEMPLATE.run_constraint(
            problem, kw["config"], H100, kw["block_mask"].block_size) is None
        calls["fwd"].append(kw)
        o, lse = attention_reference(q, k, v, causal=kw["causal"],
                                     scale=kw["scale"] or q.shape[-1] ** -0.5,
                                     mask=kw["block_mask"].to_dense())
        return o.to(q.dtype), lse.float()

    def backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 o: torch.Tensor, lse: torch.Tensor, *, causal: bool, scale: float | None,
                 block_mask: BlockMask | None = None, config: Any = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        assert block_mask is not None and causal is False
        # The config the real entry runs: the given one, which must take the mask, or its
        # default for the mask's blocks.
        problem = gluon_bwd.problem_of(q, k, "none")
        if config is None:
            assert gluon_bwd.TEMPLATE.run_default(problem, H100,
                                                  block_mask.block_size).warp_specialize
        else:
            assert gluon_bwd.TEMPLATE.run_constraint(problem, config, H100,
                                                     block_mask.block_size) is None
        calls["bwd"].append({"o": o, "lse": lse, "block_mask": block_mask, "config": config})
        grads = masked_closed_form_grads(q, k, v, do, block_mask.to_dense(),
                                         scale or q.shape[-1] ** -0.5)
        return tuple(g.to(q.dtype) for g in grads)  # type: ignore[return-value]

    monkeypatch.setattr(templates.gluon.fwd, "gluon_attention_fwd", forward)
    monkeypatch.setattr(gluon_train_impl, "gluon_attention_bwd", backward)
    return calls


def masked_closed_form_grads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             do: torch.Tensor, visible: torch.Tensor, scale: float
                             ) -> tuple[torch.Tensor, ...]:
    """Attention's gradients under a dense mask (every row sees a key), in float64 without
    autograd (a custom op's body runs below autograd)."""
    group = q.shape[1] // k.shape[1]
    q, do = q.double(), do.double()
    k, v = (t.double().repeat_interleave(group, dim=1) for t in (k, v))
    s = (scale * q @ k.transpose(-1, -2)).masked_fill(~visible, float("-inf"))
    p = s.softmax(-1)
    dp = do @ v.transpose(-1, -2)
    ds = p * (dp - (dp * p).sum(-1, keepdim=True))
    dq, dk, dv = scale * ds @ k, scale * ds.transpose(-1, -2) @ q, p.transpose(-1, -2) @ do
    return dq, dk.unflatten(1, (-1, group)).sum(2), dv.unflatten(1, (-1, group)).sum(2)


def measured(template: str, tflops: float, config: dict[str, Any] | None = None
             ) -> dict[str, Any]:
    return measured_on(template, MASKED, tflops, config, device=H100)


def mask(pattern: str | None = PATTERN, block: int = 128) -> BlockMask:
    return dataclasses.replace(pattern_block_mask(PATTERN, N, N, block_size=block),
                               pattern=pattern)


def leaves() -> tuple[torch.Tensor, ...]:
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, heads, N, 64, dtype=torch.bfloat16).requires_grad_()
               for heads in (4, 2, 2))
    return q, k, v, torch.randn(1, 4, N, 64, dtype=torch.bfloat16)


def train(block_mask: BlockMask, is_causal: bool = False) -> tuple[torch.Tensor, ...]:
    q, k, v, do = leaves()
    tuner.attention(q, k, v, block_mask=block_mask, is_causal=is_causal,
                    enable_gqa=True).backward(do)
    return q, k, v, do


def assert_reference_grads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           do: torch.Tensor, block_mask: BlockMask) -> None:
    ref = reference_grads(q.detach(), k.detach().repeat_interleave(2, 1),
                          v.detach().repeat_interleave(2, 1), do, causal="none",
                          scale=64 ** -0.5, mask=block_mask.to_dense())
    for t, r, grouped in zip((q, k, v), ref, (False, True, True), strict=True):
        assert t.grad is not None
        r = r.unflatten(1, (2, 2)).sum(2) if grouped else r
        err = float((t.grad.double() - r.double()).norm() / r.double().norm())
        assert err < 2e-2, err  # bf16


def store_ours_fastest(tmp_path: Path, cfg: dict[str, Any]) -> None:
    store(tmp_path, measured("flash_fwd", 100.0), measured("flash_bwd", 100.0),
          measured("torch_flex_train", 100.0), measured("gluon_train", 400.0, cfg))


# ----------------------------------------------------------------------------- the templates
def test_gluon_train_prices_mask_patterns_cudnns_sibling_does_not() -> None:
    assert OWN.unsupported(MASKED) is None
    reason = OWN.unsupported(dataclasses.replace(MASKED, causal="top_left"))
    assert reason is not None and "own causality" in reason
    reason = get_template("gluon_cudnn_train").unsupported(MASKED)
    assert reason is not None and "no block mask" in reason
    cfg = OWN.default_config(MASKED, H100)
    assert OWN.constraint(MASKED, cfg, H100) is None


# ----------------------------------------------------------------------------- by measurement
def test_measured_fastest_trains_a_mask_with_both_gluon_kernels(
        tmp_path: Path, kernels: dict[str, list[dict[str, Any]]]) -> None:
    cfg = gluon_config_not_the_default(OWN, MASKED)
    store_ours_fastest(tmp_path, cfg)
    choice = choose(Call(MASKED, True, H100))
    assert choice.implementation.name == "gluon_train" and choice.match == "exact", choice.why
    block_mask = mask()
    q, k, v, do = train(block_mask)
    [fwd] = kernels["fwd"]
    assert fwd["block_mask"] is block_mask and fwd["causal"] == "none"
    assert fwd["config"] == OWN.config(cfg)  # the measured config (it walks 128-blocks)
    [bwd] = kernels["bwd"]
    assert bwd["block_mask"] is block_mask
    assert_reference_grads(q, k, v, do, block_mask)


def test_the_backward_takes_gluon_bwds_config_measured_on_the_pattern(
        tmp_path: Path, kernels: dict[str, list[dict[str, Any]]]) -> None:
    """A sweep that tuned gluon_bwd on the mask's named problem: the backward runs its best
    there; one that cannot walk the call's mask (or a mask without a name) runs the
    default."""
    default = gluon_bwd.TEMPLATE.run_default(MASKED, H100, (128, 128))
    tuned = dataclasses.replace(default, dq_buffers=3 - default.dq_buffers, doc_offsets=False)
    assert gluon_bwd.TEMPLATE.run_constraint(MASKED, tuned, H100, (128, 128)) is None
    store(tmp_path, measured("flash_fwd", 100.0), measured("flash_bwd", 100.0),
          measured("torch_flex_train", 100.0), measured("gluon_train", 400.0),
          measured("gluon_bwd", 300.0, tuned.to_dict()))
    block_mask = mask()
    q, k, v, do = train(block_mask)
    assert [c["config"] for c in kernels["bwd"]] == [tuned]
    assert_reference_grads(q, k, v, do, block_mask)
    # A mask without a name has no measurements: the default.
    with tuner.use_implementation("gluon_train"):
        train(mask(pattern=None))
    assert kernels["bwd"][-1]["config"] is None
    # and the forward the dense problem's config with doc_offsets on (the rows decide)
    assert kernels["fwd"][-1]["config"].doc_offsets


def test_the_masked_forward_config_is_worked_out_once_per_shape(
        tmp_path: Path, kernels: dict[str, list[dict[str, Any]]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A training loop's later steps reuse the config (pricing it took host time on every
    step, as long as a 4k step's kernels); a new sweep (``clear_plans``) prices it again."""
    from tuner.dispatch.plans import clear_plans

    cfg = gluon_config_not_the_default(OWN, MASKED)
    store_ours_fastest(tmp_path, cfg)
    resolved: list[object] = []
    real = gluon_train_impl.resolve_config

    def counting(*args: Any) -> Any:
        resolved.append(args)
        return real(*args)

    monkeypatch.setattr(gluon_train_impl, "resolve_config", counting)
    block_mask = mask()
    for _ in range(3):
        train(block_mask)
    # Once for the forward's config, once for the backward's (``tuned_backward``).
    assert len(resolved) == 2 and len(kernels["fwd"]) == 3
    assert all(call["config"] == OWN.config(cfg) for call in kernels["fwd"])
    clear_plans()
    train(block_mask)
    assert len(resolved) == 4


def test_unmeasured_or_slower_gluon_train_does_not_run(
        tmp_path: Path, kernels: dict[str, list[dict[str, Any]]]) -> None:
    # nothing measured: the block-mask training baseline (flash_gluon: Triton forward)
    assert choose(Call(MASKED, True, H100)).implementation.name == "flash_gluon"
    store(tmp_path, measured("flash_fwd", 400.0), measured("flash_bwd", 400.0),
          measured("gluon_train", 100.0))
    assert choose(Call(MASKED, True, H100)).implementation.name != "gluon_train"
    q, k, v, do = train(mask())
    assert not kernels["fwd"] and not kernels["bwd"]
    assert_reference_grads(q, k, v, do, mask())


def test_blocks_the_backward_cannot_walk_go_to_the_baseline(
        tmp_path: Path, kernels: dict[str, list[dict[str, Any]]]) -> None:
    store_ours_fastest(tmp_path, gluon_config_not_the_default(OWN, MASKED))
    q, k, v, do = train(mask(block=64))
    assert not kernels["fwd"] and not kernels["bwd"]
    assert_reference_grads(q, k, v, do, mask(block=64))
    reason = gluon_train_impl.masked_training_refusal((64, 64), OWN.default_config(MASKED, H100))
    assert reason is not None and "Gluon backward" in reason and "128 x 128" in reason


def test_forced_gluon_train_runs_a_mask_or_says_why_not(
        kernels: dict[str, list[dict[str, Any]]]) -> None:
    with tuner.use_implementation("gluon_train"):
        # Unnamed: the dense problem's config, fitted to the mask's blocks.
        q, k, v, do = train(mask(pattern=None))
        assert_reference_grads(q, k, v, do, mask())
        train(mask())  # named, unmeasured: the mask problem's default config
        assert len(kernels["fwd"]) == len(kernels["bwd"]) == 2
        with pytest.raises(ValueError, match="own causality"):
            train(mask(), is_causal=True)
        q, k, v, do = train(mask(block=64))  # blocks it cannot walk: the baseline
    assert len(kernels["fwd"]) == len(kernels["bwd"]) == 2
    assert_reference_grads(q, k, v, do, mask(block=64))


def test_the_masked_ops_fakes_match_the_real_strides(
        kernels: dict[str, list[dict[str, Any]]]) -> None:
    from tuner.dispatch.implementations.mask_args import Masked

    q, k, v, do = (t.detach() for t in leaves())
    block_mask = mask()
    args = Masked.of(q, k, None, block_mask).op_args()
    with tuner.use_implementation("gluon_train"):
        torch.library.opcheck(torch.ops.tuner.gluon_train_fwd.default,
                              (q, k, v, False, None, True, *args),
                              test_utils=("test_faketensor",))
        o, lse = torch.ops.tuner.gluon_train_fwd(q, k, v, False, None, True, *args)
    torch.library.opcheck(torch.ops.tuner.gluon_attention_bwd.default,
                          (do, q, k, v, o, lse, False, None, True, *args),
                          test_utils=("test_faketensor",))


# ----------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("pattern", ["sliding_causal:300", "documents_causal:512"])
def test_forced_gluon_train_matches_the_reference_on_the_gpu(pattern: str) -> None:
    """The real kernels (no recorders), forced, through the ops: dq, dk, dv under the mask
    against the autograd reference."""
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9):
        pytest.skip("the Gluon kernels need a Hopper GPU")
    with tuner.use_implementation("gluon_train"):
        assert_trains_on_the_gpu(pattern)


N_GPU = 1100  # rows of the GPU tests: not a multiple of any tile


def assert_trains_on_the_gpu(pattern: str, head_dim: int = 128) -> None:
    """One GQA (8 query / 2 KV heads) bf16 training call under ``pattern``'s named mask
    through ``tuner.attention`` on the GPU: dq, dk, dv against the autograd reference."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(2, heads, N_GPU, head_dim, generator=gen, device="cuda",
                               dtype=torch.bfloat16) for heads in (8, 2, 2, 8))
    block_mask = pattern_block_mask(pattern, N_GPU, N_GPU, device="cuda")
    leaves_ = [t.detach().requires_grad_() for t in (q, k, v)]
    tuner.attention(*leaves_, block_mask=block_mask, enable_gqa=True).backward(do)
    ref = reference_grads(q, k, v, do, causal="none", scale=head_dim ** -0.5,
                          mask=block_mask.to_dense())
    for t, r in zip(leaves_, ref, strict=True):
        assert t.grad is not None and float(t.grad.abs().max()) > 0
        err = float((t.grad.double() - r.double()).norm() / r.double().norm())
        assert err < 1e-2, (pattern, err)
