"""tuner.attention's flash path against torch SDPA (tiny shapes, under the interpreter without a
GPU). Every test here forces the ``flash`` implementation: unmeasured calls would otherwise run
torch SDPA itself (tests/tuner/dispatch/test_dispatch.py tests that choice)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import tuner
from db.session import dispose_engine, session_scope
from templates.device import current_device
from tests.api.serving_data import FWD, bundle, item, problem, tuned_config
from tuner.attention import _PLANS, MAX_PLANS, clear_plans, plan_for
from tuner.lookup.bundle import store_bundle, validate_bundle
from tuner.lookup.resolver import ConfigResolver, set_resolver
from tuner.settings import load_settings

TOL = {torch.float16: 2e-3, torch.float32: 1e-4}


@pytest.fixture(autouse=True)
def flash_kernels(no_tuned_configs: None) -> Iterator[None]:
    """Our kernels, with nothing tuned (unmeasured calls would run torch SDPA)."""
    with tuner.use_implementation("flash"):
        yield


def rand(*shape: int, dtype: torch.dtype, device: str, grad: bool = False) -> torch.Tensor:
    return torch.randn(*shape, dtype=dtype, device=device).requires_grad_(grad)


def sdpa_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: object
                   ) -> torch.Tensor:
    return F.scaled_dot_product_attention(q.double(), k.double(), v.double(), **kw)  # type: ignore[arg-type]


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).norm() / ref.norm())


@pytest.mark.parametrize(("dtype", "is_causal", "heads_kv", "scale", "lq", "lk"), [
    (torch.float16, False, 4, None, 40, 56),
    (torch.float16, True, 2, None, 48, 48),
    (torch.float32, True, 1, 0.3, 48, 32),  # MQA; causal with more queries than keys
    (torch.float32, False, 2, 0.5, 17, 70),
])
def test_matches_sdpa(device: str, dtype: torch.dtype, is_causal: bool, heads_kv: int,
                      scale: float | None, lq: int, lk: int) -> None:
    torch.manual_seed(0)
    q = rand(2, 4, lq, 16, dtype=dtype, device=device)
    k, v = (rand(2, heads_kv, lk, 16, dtype=dtype, device=device) for _ in range(2))
    gqa = heads_kv != 4
    out = tuner.attention(q, k, v, is_causal=is_causal, scale=scale, enable_gqa=gqa)
    ref = sdpa_reference(q, k, v, is_causal=is_causal, scale=scale, enable_gqa=gqa)
    assert out.shape == ref.shape and out.dtype == dtype
    assert rel_error(out, ref) < TOL[dtype]


@pytest.mark.parametrize("lead", [(), (3,), (2, 3)], ids=["2d", "3d", "5d"])
def test_any_number_of_batch_dims(device: str, lead: tuple[int, ...]) -> None:
    torch.manual_seed(1)
    q, k, v = (rand(*lead, 24, 16, dtype=torch.float32, device=device) for _ in range(3))
    out = tuner.attention(q, k, v, is_causal=True)
    assert out.shape == q.shape
    assert rel_error(out, sdpa_reference(q, k, v, is_causal=True)) < TOL[torch.float32]


def test_gradients_match_sdpa(device: str) -> None:
    torch.manual_seed(2)
    q = rand(1, 4, 20, 16, dtype=torch.float32, device=device, grad=True)
    k, v = (rand(1, 2, 28, 16, dtype=torch.float32, device=device, grad=True) for _ in range(2))
    grad = torch.randn(1, 4, 20, 16, device=device)
    tuner.attention(q, k, v, is_causal=True, enable_gqa=True, scale=0.4).backward(grad)
    ours = [t.grad for t in (q, k, v)]
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    F.scaled_dot_product_attention(q2, k2, v2, is_causal=True, enable_gqa=True,
                                   scale=0.4).backward(grad)
    for mine, theirs in zip(ours, (q2.grad, k2.grad, v2.grad), strict=True):
        assert mine is not None and theirs is not None
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-5)
    # the flash_bwd kernel ran, with a resolved config (kept in the one plan cache)
    [config] = [p.choice.config for key, p in _PLANS.items() if key[0] == "flash_bwd"]  # type: ignore[attr-defined]
    assert type(config).__name__ == "BwdConfig"


@pytest.mark.skipif(torch.cuda.is_available(), reason="about the CPU interpreter only")
def test_the_first_call_may_be_a_training_step_in_a_fresh_process() -> None:
    # The op's first call imports torch._dynamo (and with it triton) before anything else ran;
    # the interpreter must still be the one in use (tuner.attention imports templates first).
    code = ("import torch, tuner\n"
            "q = torch.randn(1, 2, 16, 16, requires_grad=True)\n"
            "tuner.attention(q, q, q, is_causal=True).sum().backward()\n"
            "assert q.grad is not None and torch.isfinite(q.grad).all()\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TUNER_DATABASE_URL"] = "sqlite:///file-that-does-not-exist.db"
    env.pop("TUNER_URL", None)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]


def test_compiles_without_graph_breaks_forward_and_backward(device: str) -> None:
    torch.manual_seed(3)
    q = rand(1, 2, 16, 16, dtype=torch.float32, device=device, grad=True)
    k, v = (rand(1, 2, 16, 16, dtype=torch.float32, device=device, grad=True) for _ in range(2))

    def block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return tuner.attention(q * 2, k, v, is_causal=True).relu().sum()

    # fullgraph=True raises on any graph break; aot_eager traces the fake impl and the backward.
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    loss = compiled(q, k, v)
    loss.backward()
    grads = [t.grad.clone() for t in (q, k, v)]  # type: ignore[union-attr]
    for t in (q, k, v):
        t.grad = None
    eager = block(q, k, v)
    eager.backward()
    torch.testing.assert_close(loss, eager)
    for mine, theirs in zip(grads, (q.grad, k.grad, v.grad), strict=True):
        torch.testing.assert_close(mine, theirs)


@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("lead", [(2,), (2, 3)])
def test_attn_mask_matches_sdpa(device: str, kind: str, lead: tuple[int, ...]) -> None:
    q = rand(*lead, 20, 32, dtype=torch.float16, device=device)
    k, v = (rand(*lead, 30, 32, dtype=torch.float16, device=device) for _ in range(2))
    if kind == "bool":
        mask = torch.rand(20, 30, device=device) < 0.7
        mask[:, 0] = True  # SDPA gives NaN for a row that sees nothing (tuner.attention: 0)
    else:
        mask = torch.randn(*lead[:-1], 1, 20, 30, device=device).to(torch.float16)
    out = tuner.attention(q, k, v, attn_mask=mask, is_causal=False)
    ref_mask = mask if kind == "bool" else mask.double()
    assert rel_error(out, sdpa_reference(q, k, v, attn_mask=ref_mask)) <= TOL[torch.float16]


def _grads_of(fn: object, inputs: list[torch.Tensor], grad_out: torch.Tensor
              ) -> list[torch.Tensor]:
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves)  # type: ignore[operator]
    out.backward(grad_out.to(out.dtype))
    return [t.grad for t in leaves]  # type: ignore[misc]


@pytest.mark.parametrize("mask_kind", ["bool", "float", "block"])
def test_masked_gradients_match_sdpa(device: str, mask_kind: str) -> None:
    """Autograd through a masked call runs the masked backward kernels (GQA, causal)."""
    torch.manual_seed(0)
    q = rand(2, 4, 40, 16, dtype=torch.float32, device=device)
    k, v = (rand(2, 2, 48, 16, dtype=torch.float32, device=device) for _ in range(2))
    grad_out = torch.randn(2, 4, 40, 16, device=device)
    sliding = tuner.BlockMask.from_mask_mod(lambda b, h, qi, ki: (qi - ki).abs() <= 12, None,
                                            None, 40, 48, 16, device=device)
    random_bool = torch.rand(2, 1, 40, 48, device=device) < 0.6
    random_bool[..., 0] = True  # with causal, every row then sees a key (SDPA: NaN rows)
    dense = {"bool": random_bool, "float": torch.randn(40, 48, device=device),
             "block": sliding.to_dense()}[mask_kind]
    causal = torch.ones(40, 48, dtype=torch.bool, device=device).tril()
    ref_mask = (dense & causal) if dense.dtype == torch.bool else dense.double().masked_fill(
        ~causal, float("-inf"))
    # As with SDPA, an attn_mask carries the causal part itself (is_causal=True with it is an
    # error); a block mask combines with is_causal.
    kwargs: dict[str, object] = ({"block_mask": sliding, "is_causal": True}
                                 if mask_kind == "block" else
                                 {"attn_mask": ref_mask.to(dense.dtype)})

    def mine(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return tuner.attention(q, k, v, enable_gqa=True, **kwargs)  # type: ignore[arg-type]

    def theirs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return sdpa_reference(q, k, v, attn_mask=ref_mask, enable_gqa=True)

    for g_mine, g_ref in zip(_grads_of(mine, [q, k, v], grad_out),
                             _grads_of(theirs, [q, k, v], grad_out), strict=True):
        assert rel_error(g_mine, g_ref) <= TOL[torch.float32]


def test_attn_mask_with_is_causal_does_what_this_torchs_sdpa_does(device: str) -> None:
    # torch versions differ (older ones raise, 2.13 on the CPU combines both): a drop-in
    # follows the torch at hand, so outside use_implementation("flash") SDPA itself runs it.
    q = torch.randn(1, 2, 8, 16, device=device)
    mask = torch.rand(8, 8, device=device) < 0.7
    try:
        ref = F.scaled_dot_product_attention(q, q, q, attn_mask=mask, is_causal=True)
    except RuntimeError as exc:
        ref = exc
    with tuner.use_implementation(None):
        if isinstance(ref, RuntimeError):
            with pytest.raises(RuntimeError):
                tuner.attention(q, q, q, attn_mask=mask, is_causal=True)
        else:
            torch.testing.assert_close(tuner.attention(q, q, q, attn_mask=mask, is_causal=True),
                                       ref, rtol=0, atol=0)


def test_a_float_mask_that_requires_grad_raises(device: str) -> None:
    q = torch.randn(1, 2, 8, 16, device=device, requires_grad=True)
    mask = torch.zeros(8, 8, device=device, requires_grad=True)
    with pytest.raises(NotImplementedError, match="attn_mask requires grad"):
        tuner.attention(q, q, q, attn_mask=mask)


def test_block_mask_matches_sdpa_with_its_dense_mask(device: str) -> None:
    q, k, v = (rand(2, 4, 64, 32, dtype=torch.float16, device=device) for _ in range(3))
    mask = tuner.BlockMask.from_mask_mod(lambda b, h, qi, ki: (qi - ki).abs() <= 20, None,
                                         None, 64, 64, 16, device=device)
    out = tuner.attention(q, k, v, block_mask=mask, is_causal=True)
    dense = mask.to_dense() & torch.ones(64, 64, dtype=torch.bool, device=device).tril()
    assert rel_error(out, sdpa_reference(q, k, v, attn_mask=dense)) <= TOL[torch.float16]


@pytest.mark.parametrize(("kwargs", "error", "needle"), [
    ({"block_mask": object()}, TypeError, "BlockMask"),
    ({"attn_mask": torch.ones(3, 8, 8, dtype=torch.bool)}, ValueError, "does not broadcast"),
    ({"dropout_p": 0.1}, NotImplementedError, "dropout"),
])
def test_unsupported_arguments_raise_instead_of_a_slow_path(kwargs: dict[str, object],
                                                            error: type[Exception],
                                                            needle: str) -> None:
    q = torch.randn(1, 2, 8, 16)
    with pytest.raises(error, match=needle):
        tuner.attention(q, q, q, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(("shapes", "gqa", "error", "needle"), [
    (((1, 4, 8, 16), (1, 2, 8, 16), (1, 2, 8, 16)), False, ValueError, "enable_gqa=True"),
    (((1, 6, 8, 16), (1, 4, 8, 16), (1, 4, 8, 16)), True, ValueError, "multiple"),
    (((1, 2, 8, 16), (1, 2, 8, 16), (1, 2, 8, 32)), False, NotImplementedError, "head dim"),
    (((1, 2, 8, 16), (1, 2, 8, 8), (1, 2, 8, 8)), False, ValueError, "embedding dim"),
    (((2, 2, 8, 16), (1, 2, 8, 16), (1, 2, 8, 16)), False, ValueError, "batch dims"),
    (((1, 2, 0, 16), (1, 2, 8, 16), (1, 2, 8, 16)), False, ValueError, "empty"),
])
def test_bad_shapes_say_what_is_wrong(shapes: tuple[tuple[int, ...], ...], gqa: bool,
                                      error: type[Exception], needle: str) -> None:
    q, k, v = (torch.randn(*s) for s in shapes)
    with pytest.raises(error, match=needle):
        tuner.attention(q, k, v, enable_gqa=gqa)


def test_dtype_mismatch_is_a_type_error() -> None:
    q = torch.randn(1, 2, 8, 16)
    with pytest.raises(TypeError, match="one dtype"):
        tuner.attention(q, q.half(), q)


def test_runs_the_config_tuned_in_the_local_database(device: str, tmp_path: Path) -> None:
    dev = current_device()
    p = problem(32, batch=1, heads=2, head_dim=16, dtype="float32", causal="top_left")
    config = tuned_config(p, dev)
    url = f"sqlite:///{tmp_path / 'tuned.db'}"
    with session_scope(url) as s:
        store_bundle(s, validate_bundle(bundle(item(p, device=dev, config=config))))
    dispose_engine(url)
    set_resolver(ConfigResolver(load_settings(database_url=url, url=None)))

    q, k, v = (torch.randn(1, 2, 32, 16, device=device) for _ in range(3))
    chosen = plan_for(q, k, v, is_causal=True)
    assert (chosen.source, chosen.match, chosen.config.to_dict()) == ("database", "exact", config)
    out = tuner.attention(q, k, v, is_causal=True)
    assert rel_error(out, sdpa_reference(q, k, v, is_causal=True)) < TOL[torch.float32]
    o_direct, _ = FWD.run({"q": q, "k": k, "v": v, "causal": "top_left", "scale": 0.25},
                          FWD.config(config))
    torch.testing.assert_close(out, o_direct, rtol=0, atol=0)  # the same kernel and config


def test_plans_are_cached_per_shape_and_bounded(device: str) -> None:
    q = torch.randn(1, 2, 8, 16, device=device)
    tuner.attention(q, q, q)
    tuner.attention(q, q, q)
    assert len(_PLANS) == 1
    tuner.attention(q[:, :, :4], q, q)
    assert len(_PLANS) == 2
    clear_plans()
    assert not _PLANS and MAX_PLANS >= 1024
