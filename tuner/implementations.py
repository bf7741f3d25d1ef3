"""The implementations ``tuner.attention`` chooses among, and how each runs a call.

Each registers with ``tuner.dispatch`` (what it serves, which templates price it) and brings a
plan builder: given checked inputs of one layout and the chosen configs, a function of
(q, k, v) that returns the output. Plans are kept per layout by ``tuner.attention``, so a
builder may do its checks once.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

import torch

from templates import flash_fwd_kernel
from templates.device import interpreter_active
from templates.flash_decode import FlashDecodeConfig, kept_launch
from templates.flash_decode_kernel import MAX_QUERY_TOKENS, check_decode_inputs
from templates.flash_fwd import FwdConfig, launch_plan
from templates.gluon_fwd import GluonFwdConfig, gluon_attention_fwd
from templates.torch_sdpa import SdpaConfig, default_backend, sdpa
from tuner.dispatch import Call, Choice, Implementation, register_implementation

Run = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def shapes_4d(q: torch.Tensor, k: torch.Tensor
              ) -> tuple[tuple[int, int, int, int], tuple[int, int, int, int]]:
    """The (B, H_q, L, E) and (B, H_kv, S, E) the kernels see of checked inputs with any
    number of leading dims (folded into B; 2-D inputs are one head)."""
    batch = math.prod(q.shape[:-3])
    heads_q, heads_kv = (q.shape[-3], k.shape[-3]) if q.dim() >= 3 else (1, 1)
    return ((batch, heads_q, q.shape[-2], q.shape[-1]),
            (batch, heads_kv, k.shape[-2], k.shape[-1]))


def _runs_triton(call: Call) -> str | None:
    if call.device.is_interpreter and not interpreter_active():
        return "Triton kernels need a CUDA GPU or TRITON_INTERPRET=1"
    return None


# ----------------------------------------------------------------------------- torch SDPA
def sdpa_backend(choice: Choice, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 is_causal: bool, scale: float | None, enable_gqa: bool) -> str:
    """The chosen SDPA backend, as ``default`` where torch picks it anyway (then no
    ``sdpa_kernel`` context manager runs on every call)."""
    config = choice.config
    assert isinstance(config, SdpaConfig)
    if config.backend != "default" and config.backend == default_backend(
            q, k, v, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa):
        return "default"
    return config.backend


def build_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
               scale: float | None, enable_gqa: bool, choice: Choice) -> Run:
    backend = sdpa_backend(choice, q, k, v, is_causal, scale, enable_gqa)

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return sdpa(q, k, v, backend=backend, is_causal=is_causal, scale=scale,
                    enable_gqa=enable_gqa)

    return run


SDPA = register_implementation(Implementation(
    name="sdpa", forward="torch_sdpa", training=("torch_sdpa_train",),
    serves=lambda call: None, build=build_sdpa, layout_free=True,
    description="torch.nn.functional.scaled_dot_product_attention, its best measured backend "
                "(or torch's own choice where nothing is measured)"))


# ----------------------------------------------------------------------------- Triton flash
def build_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
                scale: float | None, enable_gqa: bool, choice: Choice
                ) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor],
                              tuple[torch.Tensor, torch.Tensor]]:
    """The flash_fwd launch plan for inputs laid out like these: (o, lse) in the inputs' shape."""
    config = choice.config
    assert isinstance(config, FwdConfig)
    q4, kv4 = shapes_4d(q, k)
    out_shape, lse_shape = tuple(q.shape), tuple(q.shape[:-1])
    reshape = q.dim() != 4
    # Inputs laid out alike reshape to views laid out alike: one launch plan serves them all.
    if reshape:
        q, k, v = q.reshape(q4), k.reshape(kv4), v.reshape(kv4)
    # A tuned TMA config needs 16-byte aligned strides; other layouts use pointer loads.
    if config.use_tma and flash_fwd_kernel.tma_inputs_problem(q, k, v):
        config = replace(config, use_tma=False)
    launch = launch_plan(q, k, v, causal="top_left" if is_causal else "none", scale=scale,
                         config=config)

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor]:
        if reshape:
            o, lse = launch(q.reshape(q4), k.reshape(kv4), v.reshape(kv4))
            return o.reshape(out_shape), lse.reshape(lse_shape)
        return launch(q, k, v)

    return run


def _output_only(run: Callable[[torch.Tensor, torch.Tensor, torch.Tensor],
                               tuple[torch.Tensor, torch.Tensor]]) -> Run:
    return lambda q, k, v: run(q, k, v)[0]


FLASH = register_implementation(Implementation(
    name="flash", forward="flash_fwd", training=("flash_fwd", "flash_bwd"),
    serves=_runs_triton, build=lambda *args: _output_only(build_flash(*args)),
    description="the project's Triton FlashAttention forward (and backward)"))


# ----------------------------------------------------------------------------- decode
def _serves_decode(call: Call) -> str | None:
    p = call.problem
    if p.seqlen_q != 1 or p.causal != "none":
        return (f"decode takes one query token without causal masking (SDPA's top-left "
                f"is_causal hides every key but the first from it), but got seqlen_q="
                f"{p.seqlen_q}, causal={p.causal!r}")
    return _runs_triton(call)


def build_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
                 scale: float | None, enable_gqa: bool, choice: Choice) -> Run:
    """flash_decode over a contiguous cache that every sequence fills: (B, H, 1, D) queries.
    Built once per layout, so its kept launch serves every call of the layout."""
    config = choice.config
    assert isinstance(config, FlashDecodeConfig)
    q4, kv4 = shapes_4d(q, k)
    out_shape = q.shape
    lengths = torch.full((q4[0],), kv4[2], dtype=torch.int32, device=q.device)
    as_4d = q.dim() == 4 and k.dim() == 4  # then no reshape: each costs host time per call
    q, k, v = (q, k, v) if as_4d else (q.reshape(q4), k.reshape(kv4), v.reshape(kv4))
    shape = check_decode_inputs(q, k, v, lengths, check_contents=False)  # all full: ours
    launch = kept_launch(q, k, v, lengths, None, shape, config)
    if as_4d:
        return lambda q, k, v: launch(q, k, v, lengths, None, scale)
    return lambda q, k, v: launch(q.reshape(q4), k.reshape(kv4), v.reshape(kv4), lengths, None,
                                  scale).reshape(out_shape)


DECODE = register_implementation(Implementation(
    name="decode", forward="flash_decode", training=(),
    serves=_serves_decode, build=build_decode,
    description=f"the split-KV flash-decoding kernel, for one query token (of at most "
                f"{MAX_QUERY_TOKENS}) against a long KV"))


# ----------------------------------------------------------------------------- Gluon (Hopper)
def _serves_gluon(call: Call) -> str | None:
    if not call.device.compute_capability.startswith("9."):
        return (f"the Gluon kernels are written for Hopper (compute capability 9.x), but the "
                f"device is {call.device.name} ({call.device.compute_capability or 'no GPU'})")
    return None


def build_gluon_pair(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
                     scale: float | None, enable_gqa: bool, choice: Choice
                     ) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor],
                                   tuple[torch.Tensor, torch.Tensor]]:
    """The Gluon forward with the choice's config: (o, lse) in the inputs' shape."""
    config = choice.config
    assert isinstance(config, GluonFwdConfig)
    q4, kv4 = shapes_4d(q, k)
    out_shape, lse_shape = tuple(q.shape), tuple(q.shape[:-1])
    causal = "top_left" if is_causal else "none"

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor]:
        o, lse = gluon_attention_fwd(q.reshape(q4), k.reshape(kv4), v.reshape(kv4),
                                     causal=causal, scale=scale, config=config)
        return o.reshape(out_shape), lse.reshape(lse_shape)

    return run


GLUON = register_implementation(Implementation(
    name="gluon", forward="gluon_fwd", training=("gluon_cudnn_train",),
    serves=_serves_gluon, build=lambda *args: _output_only(build_gluon_pair(*args)),
    description="the project's warp-specialized Gluon forward for Hopper (FA3-style ping-pong "
                "consumer warpgroups, TMA producer warp); for a gradient, with torch's cuDNN "
                "backward fed its o and logsumexp (gluon_cudnn_train)"))


# ----------------------------------------------------------------------------- FlexAttention
def _serves_flex(call: Call) -> str | None:
    # Its templates take block-mask problems only (dense ones are torch SDPA's).
    if call.needs_grad and not call.device.compute_capability:
        return "FlexAttention has no backward on the CPU"
    return None


def build_flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
               scale: float | None, enable_gqa: bool, choice: Choice) -> Run:
    """Never built: flex serves block-mask calls, which ``tuner.attention`` runs per call
    (``templates.torch_flex.flex`` with the mask), not through a per-shape plan."""
    raise ValueError("flex runs calls with a block_mask only (tuner.attention(..., "
                     "block_mask=...)); dense calls are torch SDPA's")


FLEX = register_implementation(Implementation(
    name="flex", forward="torch_flex", training=("torch_flex_train",),
    serves=_serves_flex, build=build_flex,
    description="compiled FlexAttention (torch.compile(flex_attention)) under the call's block "
                "mask, converted exactly; a candidate for block-mask calls beside ours"))
