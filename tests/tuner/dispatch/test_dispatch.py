"""The dispatcher: which implementation a call of tuner.attention runs, by stored measurement
(tiny shapes, under the interpreter without a GPU; torch SDPA runs on the CPU as it is)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import tuner
from db.session import dispose_engine, session_scope
from templates.base import Problem
from templates.decode.template import decode_reference
from templates.device import DeviceInfo, current_device
from templates.registry import get_template
from tests.api.serving_data import bundle, item
from tuner.attention import _PLANS, clear_plans, plan_for
from tuner.dispatch.rule import Call, choose, implementations, use_implementation
from tuner.lookup.bundle import store_bundle, validate_bundle
from tuner.lookup.resolver import ConfigResolver, set_resolver
from tuner.settings import load_settings

pytestmark = pytest.mark.usefixtures("no_tuned_configs")


def problem_of(q: torch.Tensor, k: torch.Tensor, *, causal: str = "none") -> Problem:
    return Problem(batch=q.shape[0], heads_q=q.shape[1], heads_kv=k.shape[1],
                   seqlen_q=q.shape[2], seqlen_kv=k.shape[2], head_dim=q.shape[3],
                   dtype="float32", causal=causal)


def measured(template: str, p: Problem, tflops: float, config: dict[str, Any] | None = None,
             device: DeviceInfo | None = None) -> dict[str, Any]:
    """A stored best of ``template`` for ``p`` on ``device`` (default: this machine) at
    ``tflops``: ``config`` or the template's default."""
    t = get_template(template)
    device = device or current_device()
    cfg = t.config(config) if config is not None else t.default_config(p, device)
    return item(p, device=device, template=t.name, template_version=t.version(),
                config=cfg.to_dict(), tflops=tflops, median_ms=t.flops(p) / (tflops * 1e9),
                default_tflops=None)


def store(tmp_path: Path, *items: dict[str, Any], db: str = "tuned.db") -> None:
    url = f"sqlite:///{tmp_path / db}"
    with session_scope(url) as s:
        store_bundle(s, validate_bundle(bundle(*items)))
    dispose_engine(url)
    set_resolver(ConfigResolver(load_settings(database_url=url, url=None), shipped_dir=None))
    clear_plans()


def qkv(device: str, lq: int = 24, lk: int = 40, heads: int = 4, heads_kv: int = 2
        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return (torch.randn(1, heads, lq, 16, device=device),
            torch.randn(1, heads_kv, lk, 16, device=device),
            torch.randn(1, heads_kv, lk, 16, device=device))


def assert_close_to(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Our kernels against SDPA in float32 (tf32 dots on a GPU: 1e-3 relative)."""
    err = float((out.double() - ref.double()).norm() / ref.double().norm())
    assert err < 1e-3, err


def test_an_unmeasured_problem_runs_torch_sdpa_exactly_as_the_user_had_it(device: str) -> None:
    q, k, v = qkv(device)
    choice = plan_for(q, k, v, enable_gqa=True)
    assert choice.implementation.name == "sdpa" and choice.match == "default"
    assert choice.config.to_dict() == {"backend": "default"}
    out = tuner.attention(q, k, v, enable_gqa=True)
    ref = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)  # bit for bit: the same call


def test_ours_runs_only_where_measured_faster_than_sdpa(tmp_path: Path, device: str) -> None:
    q, k, v = qkv(device)
    p = problem_of(q, k)
    store(tmp_path, measured("torch_sdpa", p, 100.0), measured("flash_fwd", p, 150.0))
    choice = plan_for(q, k, v, enable_gqa=True)
    assert choice.implementation.name == "flash", choice.why
    out = tuner.attention(q, k, v, enable_gqa=True)
    assert_close_to(out, F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
    [plan] = _PLANS.values()
    assert plan.choice.implementation.name == "flash"  # type: ignore[union-attr]

    # Another database where SDPA measured faster: SDPA runs.
    store(tmp_path, measured("torch_sdpa", p, 200.0), measured("flash_fwd", p, 150.0),
          db="other.db")
    assert plan_for(q, k, v, enable_gqa=True).implementation.name == "sdpa"


def test_ours_measured_but_sdpa_not_still_runs_sdpa(tmp_path: Path, device: str) -> None:
    q, k, v = qkv(device)
    store(tmp_path, measured("flash_fwd", problem_of(q, k), 1000.0))
    choice = plan_for(q, k, v, enable_gqa=True)
    assert choice.implementation.name == "sdpa" and "not measured" in choice.why


def test_a_gradient_is_priced_by_the_training_templates(tmp_path: Path, device: str) -> None:
    q, k, v = qkv(device)
    p = problem_of(q, k)
    # flash forward is faster, but forward + backward is slower than SDPA's training step:
    # fwd 1/150 + bwd 2.5/50 = 0.057 units against SDPA 3.5/100 = 0.035.
    store(tmp_path, measured("torch_sdpa", p, 100.0), measured("flash_fwd", p, 150.0),
          measured("flash_bwd", p, 50.0), measured("torch_sdpa_train", p, 100.0))
    assert plan_for(q, k, v, enable_gqa=True).implementation.name == "flash"
    assert plan_for(q, k, v, enable_gqa=True, needs_grad=True).implementation.name == "sdpa"
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    tuner.attention(*leaves, enable_gqa=True).sum().backward()
    refs = [t.clone().requires_grad_() for t in (q, k, v)]
    F.scaled_dot_product_attention(*refs, enable_gqa=True).sum().backward()
    for mine, theirs in zip(leaves, refs, strict=True):
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=0, atol=0)


def test_one_query_token_runs_the_decode_kernel_where_it_is_measured_fastest(
        tmp_path: Path, device: str) -> None:
    q, k, v = qkv(device, lq=1, lk=300, heads=8, heads_kv=2)
    p = problem_of(q, k)
    store(tmp_path, measured("torch_sdpa", p, 10.0), measured("flash_fwd", p, 5.0),
          measured("flash_decode", p, 20.0))
    choice = plan_for(q, k, v, enable_gqa=True)
    assert choice.implementation.name == "decode", choice.why
    assert "flash" in choice.why and "sdpa" in choice.why  # the others' prices, for people
    out = tuner.attention(q, k, v, enable_gqa=True)
    assert_close_to(out, F.scaled_dot_product_attention(q, k, v, enable_gqa=True))


def test_decode_does_not_serve_causal_or_longer_queries_or_gradients(device: str) -> None:
    q, k, v = qkv(device, lq=2, lk=64)
    dev = current_device()
    [decode] = [i for i in implementations() if i.name == "decode"]
    assert "query tokens" in (decode.why_not(Call(problem_of(q, k), False, dev)) or "")
    assert "no backward" in (decode.why_not(Call(problem_of(q[:, :, :1], k), True, dev)) or "")
    with use_implementation("decode"), pytest.raises(ValueError, match="cannot run"):
        tuner.attention(q, k, v, enable_gqa=True)


def test_gluon_serves_hopper_only_and_gradients_only_where_cudnn_takes_them(
        device: str) -> None:
    """For a gradient, gluon is priced by gluon_cudnn_train (its forward, cuDNN's backward):
    dense and causal problems, but no block masks and no bottom-right causal with N_q != N_kv
    (cuDNN's causal is top-left)."""
    [gluon] = [i for i in implementations() if i.name == "gluon"]
    p = Problem(batch=1, heads_q=4, heads_kv=2, seqlen_q=64, seqlen_kv=64, head_dim=64,
                dtype="bfloat16")
    hopper = dataclasses.replace(current_device(), name="NVIDIA H100 80GB HBM3",
                                 compute_capability="9.0")
    ampere = dataclasses.replace(hopper, name="NVIDIA A100", compute_capability="8.0")
    assert gluon.templates_for(Call(p, True, hopper)) == ("gluon_cudnn_train",)
    assert gluon.why_not(Call(p, True, hopper)) is None
    assert gluon.why_not(Call(dataclasses.replace(p, causal="top_left"), True, hopper)) is None
    masked = dataclasses.replace(p, causal="top_left", mask="sliding:64")
    assert gluon.why_not(Call(masked, False, hopper)) is None
    assert "no block mask" in (gluon.why_not(Call(masked, True, hopper)) or "")
    cache = dataclasses.replace(p, seqlen_q=16, causal="bottom_right")
    assert "top-left" in (gluon.why_not(Call(cache, True, hopper)) or "")
    assert "Hopper" in (gluon.why_not(Call(p, False, ampere)) or "")
    assert "Hopper" in (gluon.why_not(Call(p, True, ampere)) or "")
    if not current_device().compute_capability.startswith("9."):
        assert gluon.why_not(Call(p, False, current_device())) is not None


def test_a_forced_implementation_runs_whatever_was_measured(tmp_path: Path, device: str) -> None:
    q, k, v = qkv(device)
    store(tmp_path, measured("torch_sdpa", problem_of(q, k), 500.0))
    with use_implementation("flash"):
        assert plan_for(q, k, v, enable_gqa=True).implementation.name == "flash"
        out = tuner.attention(q, k, v, enable_gqa=True)
    assert plan_for(q, k, v, enable_gqa=True).implementation.name == "sdpa"
    assert_close_to(out, F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
    with pytest.raises(ValueError, match="unknown implementation 'cudnn'"), \
            use_implementation("cudnn"):
        pass


def test_calls_no_kernel_of_ours_takes_run_sdpa(device: str) -> None:
    q, k, v = qkv(device)
    v_wide = torch.randn(1, 2, 40, 24, device=device)
    out = tuner.attention(q, k, v_wide, enable_gqa=True)  # value head dim 24, query's 16
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v_wide,
                                                                   enable_gqa=True))
    q64, k64, v64 = (t.double() for t in (q, k, v))
    torch.testing.assert_close(tuner.attention(q64, k64, v64, enable_gqa=True),
                               F.scaled_dot_product_attention(q64, k64, v64, enable_gqa=True))
    torch.manual_seed(5)
    dropped = tuner.attention(q, k, v, dropout_p=0.5, enable_gqa=True)
    torch.manual_seed(5)
    torch.testing.assert_close(dropped, F.scaled_dot_product_attention(
        q, k, v, dropout_p=0.5, enable_gqa=True), rtol=0, atol=0)


def test_sdpa_backends_need_cuda_and_half_precision() -> None:
    sdpa = get_template("torch_sdpa")
    p = Problem(batch=1, heads_q=2, heads_kv=2, seqlen_q=8, seqlen_kv=8, head_dim=16,
                dtype="float32")
    dev = current_device()
    assert sdpa.constraint(p, sdpa.config({"backend": "default"}), dev) is None
    if dev.is_interpreter:
        assert "CUDA" in (sdpa.constraint(p, sdpa.config({"backend": "cudnn"}), dev) or "")
    assert "bottom-right" in (sdpa.unsupported(Problem(
        batch=1, heads_q=2, heads_kv=2, seqlen_q=4, seqlen_kv=8, head_dim=16,
        causal="bottom_right")) or "")


@pytest.mark.parametrize("template", ["torch_sdpa", "torch_sdpa_train"])
def test_the_sdpa_templates_pass_their_own_reference_check(template: str, device: str) -> None:
    t = get_template(template)
    p = Problem(batch=1, heads_q=4, heads_kv=2, seqlen_q=24, seqlen_kv=40, head_dim=16,
                dtype="float32", causal="top_left")
    inputs = t.make_inputs(p, device, seed=3)
    out = t.run(inputs, t.default_config(p, current_device()))
    assert t.error(out, t.reference(inputs)) < t.tolerance(p)
    assert t.flops(p) > 0 and t.bytes_moved(p) > 0


@pytest.mark.parametrize("paged", [False, True])
def test_tuner_decode_matches_the_reference(paged: bool, device: str) -> None:
    t = get_template("flash_decode")
    p = Problem(batch=3, heads_q=8, heads_kv=2, seqlen_q=1, seqlen_kv=200, head_dim=16,
                dtype="float32", mask="paged:32+mixed" if paged else "mixed")
    inputs = t.make_inputs(p, device, seed=1)
    kwargs = {name: inputs[name] for name in ("cache_seqlens", "block_table")}
    out = tuner.decode(inputs["q"], inputs["k_cache"], inputs["v_cache"], **kwargs)
    ref, _ = decode_reference(inputs["q"], inputs["k_cache"], inputs["v_cache"], **kwargs)
    assert_close_to(out, ref)
    again = tuner.decode(inputs["q"], inputs["k_cache"], inputs["v_cache"], **kwargs)
    torch.testing.assert_close(again, out, rtol=0, atol=0)


@pytest.mark.parametrize("paged", [False, True])
def test_tuner_decode_under_torch_compile_is_one_custom_op(paged: bool, device: str) -> None:
    t = get_template("flash_decode")
    p = Problem(batch=2, heads_q=4, heads_kv=2, seqlen_q=2, seqlen_kv=100, head_dim=16,
                dtype="float32", causal="bottom_right",
                mask="paged:32+mixed" if paged else "mixed")
    inputs = t.make_inputs(p, device, seed=3)
    kwargs = {name: inputs[name] for name in ("cache_seqlens", "block_table")}

    def step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return tuner.decode(q, k, v, **kwargs, scale=0.3) + 1

    graphs: list[torch.fx.GraphModule] = []

    def keep_graph(gm: torch.fx.GraphModule, example_inputs: object) -> object:
        graphs.append(gm)
        return gm.forward

    args = (inputs["q"], inputs["k_cache"], inputs["v_cache"])
    out = torch.compile(step, fullgraph=True, backend=keep_graph)(*args)
    [graph] = graphs
    targets = [str(n.target) for n in graph.graph.nodes if n.op == "call_function"]
    assert targets.count("tuner.decode") == 1, targets
    torch.testing.assert_close(out, step(*args), rtol=0, atol=0)
    ref, _ = decode_reference(*args, **kwargs, scale=0.3)
    assert_close_to(out - 1, ref)


def test_tuner_decode_runs_the_tuned_decode_config(tmp_path: Path, device: str) -> None:
    t = get_template("flash_decode")
    p = Problem(batch=2, heads_q=4, heads_kv=2, seqlen_q=1, seqlen_kv=512, head_dim=16,
                dtype="float32")
    default = t.default_config(p, current_device())
    tuned = next(c for c in t.config_cls.grid() if c != default
                 and t.constraint(p, c, current_device()) is None)
    store(tmp_path, measured("flash_decode", p, 50.0, tuned.to_dict()))
    inputs = t.make_inputs(p, device, seed=2)
    from tuner.decode import decode_plan_for

    resolved = decode_plan_for(inputs["q"], inputs["k_cache"], inputs["v_cache"],
                               cache_seqlens=inputs["cache_seqlens"])
    assert (resolved.match, resolved.config) == ("exact", tuned)
    out = tuner.decode(inputs["q"], inputs["k_cache"], inputs["v_cache"],
                       cache_seqlens=inputs["cache_seqlens"])
    ref, _ = decode_reference(inputs["q"], inputs["k_cache"], inputs["v_cache"],
                              cache_seqlens=inputs["cache_seqlens"])
    assert_close_to(out, ref)


def test_choose_names_the_problem_when_sdpa_itself_cannot_run_it() -> None:
    p = Problem(batch=1, heads_q=2, heads_kv=2, seqlen_q=4, seqlen_kv=8, head_dim=16,
                causal="bottom_right")
    with pytest.raises(ValueError, match="torch SDPA cannot run"):
        choose(Call(p, False, current_device()))


def test_under_torch_compile_a_decode_choice_runs_as_the_inference_op(
        tmp_path: Path, device: str) -> None:
    q, k, v = qkv(device, lq=1, lk=300, heads=8, heads_kv=2)
    p = problem_of(q, k)
    store(tmp_path, measured("torch_sdpa", p, 10.0), measured("flash_decode", p, 20.0))
    assert plan_for(q, k, v, enable_gqa=True).implementation.name == "decode"

    def step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return tuner.attention(q, k, v, enable_gqa=True) * 2

    graphs: list[torch.fx.GraphModule] = []

    def keep_graph(gm: torch.fx.GraphModule, example_inputs: object) -> object:
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(step, fullgraph=True, backend=keep_graph)
    out = compiled(q, k, v)
    [graph] = graphs
    targets = {str(node.target) for node in graph.graph.nodes if node.op == "call_function"}
    assert "tuner.attention_inference" in targets, targets
    assert not any("scaled_dot_product" in t for t in targets)
    # The decode kernel's own output (not SDPA's, which differs in the last bits).
    torch.testing.assert_close(out, tuner.attention(q, k, v, enable_gqa=True) * 2,
                               rtol=0, atol=0)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, enable_gqa=True) * 2,
                               rtol=2e-3, atol=2e-3)


def test_each_choice_is_logged_at_debug(device: str, caplog: pytest.LogCaptureFixture) -> None:
    q, k, v = qkv(device)
    with caplog.at_level("DEBUG", logger="tuner.dispatch.rule"):
        tuner.attention(q, k, v, enable_gqa=True)
        tuner.attention(q, k, v, enable_gqa=True)  # the kept plan: no second line
    [line] = [r.getMessage() for r in caplog.records if r.name == "tuner.dispatch.rule"]
    assert line.startswith(problem_of(q, k).key()) and "sdpa backend=default" in line
    assert "not measured" in line


def test_cpu_tensors_without_the_interpreter_never_reach_a_triton_kernel(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """As in a process with a GPU: CPU tensors run torch SDPA, whatever ours measured."""
    q, k, v = qkv("cpu")
    p = problem_of(q, k)
    store(tmp_path, measured("torch_sdpa", p, 1.0), measured("flash_fwd", p, 1000.0))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    choice = plan_for(q, k, v, enable_gqa=True)
    assert choice.implementation.name == "sdpa"
    torch.testing.assert_close(tuner.attention(q, k, v, enable_gqa=True),
                               F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
                               rtol=0, atol=0)
    with use_implementation("flash"), pytest.raises(ValueError, match="TRITON_INTERPRET"):
        tuner.attention(q, k, v, enable_gqa=True)
