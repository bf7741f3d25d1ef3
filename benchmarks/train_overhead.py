"""The training rows of ``benchmarks/attention_overhead.py``: forward + backward calls, dense
causal and under a block mask, through the kernels' entry points and through
``tuner.attention``, so that host time per training step can be set beside the kernels' time.

Per case (``dense causal``; ``block mask``: a named pattern, ``sliding_causal:W`` by default,
with ``is_causal=False``: the mask carries its causality, as gluon_train needs), each path is
one training step of one attention call:

* ``flash entry points``: ``flash_attention_fwd`` then ``flash_attention_bwd`` on its o and
  lse, the templates' default configs (fitted to the mask's blocks) given as config objects;
* ``flash entry points, unplanned backward``: the same, the backward as
  ``flash_attention_bwd`` ran before its plans (checks, config, ``bwd_kernel.launch``
  through the JIT on every call), for the plans' gain in one process;
* ``flash_attention``: the templates' autograd function, the same configs,
  ``torch.autograd.grad(o, (q, k, v), do)``;
* ``tuner.attention``: the same step through the dispatcher, ``flash`` forced;
* ``torch SDPA`` (dense case only): ``F.scaled_dot_product_attention`` and
  ``torch.autograd.grad``, what a training step costs the host without us (its kernels are
  torch's: they launch for real in every timing, so read it beside the others' enqueue and
  synced columns, not their launch-free host column);
* (CUDA, Hopper, Gluon present) ``gluon entry points``: ``gluon_attention_fwd`` then
  ``gluon_attention_bwd`` (their default configs), and ``tuner.attention (gluon_train)``:
  the dispatcher's step with ``gluon_train`` forced, and ``gluon entry points, unplanned
  backward`` (the backward's launch plan made and launched through the JIT on each call).

Every path's gradients are checked against the first path's (one real call each, before any
timing) within fp16/bf16 tolerance: the configs may differ between the Gluon and the Triton
kernels, so bits are not compared.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import torch

import tuner
from templates.device import current_device
from templates.flash import bwd as flash_bwd
from templates.flash import fwd as flash_fwd
from templates.flash.autograd import flash_attention
from templates.kernel_common import normalize_causal

Call = Callable[[], object]
FLASH_PATHS = ("flash entry points", "flash_attention", "tuner.attention",
               "flash entry points, unplanned backward")
GLUON_PATHS = ("gluon entry points", "tuner.attention (gluon_train)",
               "gluon entry points, unplanned backward")
SDPA_PATH = "torch SDPA"
CASES = ("dense causal", "block mask")
# Gradients of two paths agree within this (fp16/bf16 inputs, fp32 accumulation; dQ by
# atomics in some configs).
GRAD_ATOL = 5e-2


@dataclass
class TrainCase:
    """The calls of one case, by implementation forced while they are timed."""

    name: str
    mask: str | None
    calls: dict[str | None, dict[str, Call]] = field(default_factory=dict)
    configs: dict[str, str] = field(default_factory=dict)


def default_mask(seqlen: int) -> str:
    """A sliding causal window of a quarter of the sequence, at most 1024 keys."""
    return f"sliding_causal:{min(1024, max(1, seqlen // 4))}"


def train_cases(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor,
                mask: str, with_gluon: bool) -> list[TrainCase]:
    """The dense causal case and the block-mask case, each path checked once."""
    block_mask = flash_fwd.pattern_mask(mask, q.shape[2], k.shape[2], str(q.device))
    out = []
    for name, is_causal, bm in ((CASES[0], True, None), (CASES[1], False, block_mask)):
        case = TrainCase(name, None if bm is None else mask)
        case.calls["flash"] = flash_calls(q, k, v, do, is_causal, bm, case.configs)
        if bm is None:
            case.calls["sdpa"] = {SDPA_PATH: sdpa_step(q, k, v, do, is_causal)}
        if with_gluon:
            case.calls["gluon_train"] = gluon_calls(q, k, v, do, is_causal, bm)
        check_grads(case)
        out.append(case)
    return out


def flash_calls(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor,
                is_causal: bool, block_mask: Any, configs: dict[str, str]) -> dict[str, Call]:
    causal = normalize_causal(is_causal)
    problem = flash_fwd.problem_of(q, k, causal)
    device = current_device(q.device.index) if q.is_cuda else current_device()
    fwd_config = flash_fwd.TEMPLATE.default_config(problem, device)
    bwd_config = flash_bwd.TEMPLATE.default_config(problem, device)
    assert isinstance(bwd_config, flash_bwd.BwdConfig)
    if block_mask is not None:
        fwd_config = flash_fwd.fit_to_block_mask(fwd_config, block_mask.block_size)
        bwd_config = flash_bwd.fit_to_block_mask(bwd_config, block_mask.block_size)
    configs.update(flash_fwd=fwd_config.key(), flash_bwd=bwd_config.key())
    leaves = tuple(t.detach().requires_grad_() for t in (q, k, v))

    def entry_points() -> object:
        o, lse = flash_fwd.flash_attention_fwd(q, k, v, causal=causal, config=fwd_config,
                                               block_mask=block_mask)
        return flash_bwd.flash_attention_bwd(do, q, k, v, o, lse, causal=causal,
                                             config=bwd_config, block_mask=block_mask)

    def autograd_function() -> object:
        o = flash_attention(*leaves, causal=causal, fwd_config=fwd_config,
                            bwd_config=bwd_config, block_mask=block_mask)
        return torch.autograd.grad(o, leaves, do)

    def unplanned() -> object:
        o, lse = flash_fwd.flash_attention_fwd(q, k, v, causal=causal, config=fwd_config,
                                               block_mask=block_mask)
        return unplanned_flash_backward(do, q, k, v, o, lse, causal, bwd_config, block_mask)

    return {FLASH_PATHS[0]: entry_points, FLASH_PATHS[1]: autograd_function,
            FLASH_PATHS[2]: dispatched(leaves, do, is_causal, block_mask),
            FLASH_PATHS[3]: unplanned}


def unplanned_flash_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                             v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor, causal: str,
                             config: flash_bwd.BwdConfig, block_mask: Any) -> object:
    """``flash_attention_bwd`` as it was before its plans (the same checks, the config
    checked, ``bwd_kernel.launch`` working out the three launches and launching them through
    the JIT), timed beside the planned entry: the plans' gain in one process."""
    from templates.flash import bwd_kernel

    mode, scale = bwd_kernel.validate_inputs(do, q, k, v, o, lse, causal, None)
    if block_mask is not None:
        flash_fwd.check_block_mask(block_mask, q, k)
    problem = flash_bwd.problem_of(q, k, mode)
    device = current_device(q.device.index) if q.is_cuda else current_device()
    cfg = flash_bwd.resolve_config(config, problem, device,
                                   None if block_mask is None else block_mask.block_size)
    return bwd_kernel.launch(do, q, k, v, o, lse, causal_mode=mode, scale=scale,
                             config=cfg.to_dict(), block_mask=block_mask)


def gluon_calls(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor,
                is_causal: bool, block_mask: Any) -> dict[str, Call]:
    from templates.gluon.bwd import gluon_attention_bwd
    from templates.gluon.fwd import gluon_attention_fwd

    causal = normalize_causal(is_causal)
    leaves = tuple(t.detach().requires_grad_() for t in (q, k, v))

    def entry_points() -> object:
        o, lse = gluon_attention_fwd(q, k, v, causal=causal, block_mask=block_mask)
        return gluon_attention_bwd(do, q, k, v, o, lse, causal=causal, block_mask=block_mask)

    def unplanned() -> object:
        from templates.gluon import bwd as gluon_bwd

        o, lse = gluon_attention_fwd(q, k, v, causal=causal, block_mask=block_mask)
        # gluon_attention_bwd as it was before its plans: a launch plan and its descriptors
        # made, and both kernels launched through the JIT, on every call.
        assert gluon_bwd.kernel is not None
        mode, scale = gluon_bwd.kernel.validate_inputs(do, q, k, v, o, lse, causal, None)
        cfg = gluon_bwd.TEMPLATE.config_to_run(
            q, k, mode, None, None if block_mask is None else block_mask.block_size)
        assert isinstance(cfg, gluon_bwd.GluonBwdConfig)
        module = gluon_bwd.ws_kernel if cfg.warp_specialize else gluon_bwd.kernel
        assert module is not None
        extra = {} if block_mask is None else {"block_mask": block_mask}
        return module.launch(do, q, k, v, o, lse, causal_mode=mode, scale=scale,
                             config=cfg.to_dict(), **extra)

    return {GLUON_PATHS[0]: entry_points,
            GLUON_PATHS[1]: dispatched(leaves, do, is_causal, block_mask),
            GLUON_PATHS[2]: unplanned}


def sdpa_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor,
              is_causal: bool) -> Call:
    """One training step of torch's own SDPA (no dispatcher): the host time it sets the
    others beside."""
    leaves = tuple(t.detach().requires_grad_() for t in (q, k, v))

    def step() -> object:
        o = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=is_causal)
        return torch.autograd.grad(o, leaves, do)
    return step


def dispatched(leaves: tuple[torch.Tensor, ...], do: torch.Tensor, is_causal: bool,
               block_mask: Any) -> Call:
    """One training step through ``tuner.attention`` (the implementation forced around it)."""
    q, k, v = leaves

    def step() -> object:
        o = tuner.attention(q, k, v, is_causal=is_causal, block_mask=block_mask)
        return torch.autograd.grad(o, leaves, do)
    return step


def check_grads(case: TrainCase) -> None:
    """Each path's (dq, dk, dv) against the case's first path's."""
    from tuner.dispatch.rule import use_implementation

    reference: tuple[torch.Tensor, ...] | None = None
    for implementation, calls in case.calls.items():
        with use_implementation(implementation):
            for name, fn in calls.items():
                grads = tuple(cast(tuple[torch.Tensor, ...], fn()))
                if reference is None:
                    reference = grads
                    continue
                for what, got, want in zip("qkv", grads, reference, strict=True):
                    if not torch.allclose(got.float(), want.float(), atol=GRAD_ATOL, rtol=0):
                        raise AssertionError(f"{case.name}: {name} gave other d{what} than "
                                             f"{next(iter(case.calls[next(iter(case.calls))]))}")
