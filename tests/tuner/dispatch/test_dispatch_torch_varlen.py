"""torch's varlen_attn as a dispatcher implementation (``torch_varlen``) for packed documents:
what it refuses and why, how its call adapts to each torch release's signature, how a call's
rows are packed, and when the dispatcher offers it (a document mask that carries its offsets)
or hands the call to ours.

torch's varlen_attn is a CUDA kernel, so on the CPU it is stood in for by fakes with each
release's signature, computing the per-document reference; the GPU tests at the end run the
real one (marked ``gpu``)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import pytest
import torch

import tuner
from templates.base import Problem
from templates.masks.document_offsets import DocumentOffsets
from templates.masks.mods import pattern_block_mask
from templates.pytorch import varlen as varlen_templates
from templates.registry import get_template
from tests.api.serving_data import H100
from tests.tuner.dispatch.test_dispatch import measured, store
from tests.tuner.dispatch.test_dispatch_flex import priced
from tuner.dispatch.implementations import get_implementation
from tuner.dispatch.implementations.call import Call
from tuner.dispatch.rule import choose_masked, decide
from tuner.varlen import clear_document_masks, document_block_mask, varlen_attention
from tuner.varlen import varlen_attention_reference as reference

pytestmark = pytest.mark.usefixtures("no_tuned_configs")

IMPL = get_implementation("torch_varlen")
# A device where our untuned kernels were not measured against torch's varlen (Ampere): it is
# the unmeasured documents' baseline there (on Hopper ours runs unmeasured: rule.py).
A100 = dataclasses.replace(H100, name="NVIDIA A100-SXM4-80GB", compute_capability="8.0",
                           sm_count=108)
DOCS = "documents_causal:2048"
OFFSETS = [0, 37, 170, 170, 213, 300]  # odd lengths, an empty document


def docs_problem(**changes: Any) -> Problem:
    p = Problem(batch=1, heads_q=32, heads_kv=16, seqlen_q=16384, seqlen_kv=16384,
                head_dim=128, dtype="bfloat16", causal="none", mask=DOCS)
    return dataclasses.replace(p, **changes)


class Recorder:
    """Stands in for varlen_attn with one release's signature: records each call's
    arguments and computes the per-document reference (differentiable)."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def record(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor,
               cu_k: torch.Tensor, max_q: int, max_k: int, causal: bool,
               scale: float | None, /, **kwargs: Any) -> torch.Tensor:
        self.calls.append({"q": q, "k": k, "cu_q": cu_q.tolist(), "cu_k": cu_k.tolist(),
                           "max_q": max_q, "max_k": max_k, **kwargs})
        return reference(q, k, v, cu_q, cu_k, causal=causal, scale=scale)


class Release211(Recorder):
    """torch 2.10/2.11: is_causal, no scale, no enable_gqa (K/V heads must match)."""

    def __call__(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 cu_seq_q: torch.Tensor, cu_seq_k: torch.Tensor, max_q: int, max_k: int,
                 is_causal: bool = False, return_aux: Any = None) -> torch.Tensor:
        assert query.shape[1] == key.shape[1], "this release takes no GQA"
        return self.record(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal,
                           None, is_causal=is_causal)


class Release213(Recorder):
    """torch 2.13: window_size ((-1, 0) causal), scale, enable_gqa."""

    def __call__(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 cu_seq_q: torch.Tensor, cu_seq_k: torch.Tensor | None, max_q: int,
                 max_k: int, *, return_aux: Any = None, scale: float | None = None,
                 window_size: tuple[int, int] = (-1, -1), enable_gqa: bool = False,
                 seqused_k: Any = None, block_table: Any = None,
                 num_splits: int | None = None) -> torch.Tensor:
        assert enable_gqa or query.shape[1] == key.shape[1]
        # What the caller passed (the defaults left out).
        given = {"scale": (scale, None), "window_size": (window_size, (-1, -1)),
                 "enable_gqa": (enable_gqa, False)}
        kwargs = {name: value for name, (value, default) in given.items() if value != default}
        return self.record(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k,
                           window_size == (-1, 0), scale, **kwargs)


@pytest.fixture
def release(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Recorder:
    fake: Recorder = request.param()
    monkeypatch.setattr(varlen_templates, "varlen_attn_function", lambda: fake)
    return fake


def packed(heads: tuple[int, int] = (4, 2), dim: int = 16, offsets: list[int] = OFFSETS,
           dtype: torch.dtype = torch.float16
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return tuple(torch.randn(offsets[-1], h, dim, dtype=dtype).requires_grad_()  # type: ignore[return-value]
                 for h in (heads[0], heads[1], heads[1]))


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.detach().double() - want.detach().double()).norm()
                 / want.detach().double().norm())


# ----------------------------------------------------------------------------- refusals
@pytest.mark.parametrize(("changes", "says"), [
    ({"mask": "sliding:1024"}, "packed documents only"),
    ({"mask": "none"}, "packed documents only"),
    ({"causal": "top_left"}, "causality from the documents"),
    ({"dtype": "float32"}, "float32"),
    ({"head_dim": 320}, "up to 256"),
    ({"head_dim": 100}, "multiples of 8"),
    ({"softcap": 50.0}, "softcap"),
])
def test_its_templates_refuse_by_name(changes: dict[str, Any], says: str) -> None:
    for name in ("torch_varlen", "torch_varlen_train"):
        reason = get_template(name).unsupported(docs_problem(**changes))
        assert reason is not None and says in reason, reason
        assert IMPL.why_not(Call(docs_problem(**changes), name.endswith("train"), H100))


@pytest.mark.parametrize("mask", [DOCS, "documents:512", "document:4"])
def test_it_serves_documents_on_a_gpu_with_varlen_attn(mask: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(varlen_templates, "varlen_attn_function", lambda: Release213())
    for needs_grad in (False, True):
        assert IMPL.why_not(Call(docs_problem(mask=mask), needs_grad, H100)) is None


def test_it_refuses_the_cpu_old_gpus_and_a_torch_without_varlen_attn(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from templates.device import cpu_device

    monkeypatch.setattr(varlen_templates, "varlen_attn_function", lambda: Release213())
    assert "CUDA kernel" in IMPL.why_not(Call(docs_problem(), False, cpu_device()))
    turing = dataclasses.replace(H100, compute_capability="7.5")
    assert "8.0" in IMPL.why_not(Call(docs_problem(), False, turing))
    monkeypatch.setattr(varlen_templates, "varlen_attn_function", lambda: None)
    reason = IMPL.why_not(Call(docs_problem(), False, H100))
    assert reason is not None and "has no torch.nn.attention.varlen.varlen_attn" in reason
    template = get_template("torch_varlen")
    assert "has no" in template.constraint(docs_problem(), template.config(), H100)
    assert "CUDA kernel" in template.constraint(docs_problem(), template.config(),
                                                cpu_device())


def test_deterministic_mode_refuses_its_backward(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(varlen_templates, "varlen_attn_function", lambda: Release213())
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert "deterministic" in IMPL.why_not(Call(docs_problem(), True, H100))
        assert IMPL.why_not(Call(docs_problem(), False, H100)) is None
    finally:
        torch.use_deterministic_algorithms(before)


def test_forcing_it_on_the_cpu_names_why() -> None:
    q, k, v = packed()
    cu = torch.tensor(OFFSETS, dtype=torch.int32)
    with tuner.use_implementation("torch_varlen"), pytest.raises(ValueError, match="CUDA"):
        varlen_attention(q, k, v, cu, cu, 133, 133, causal=True)


# ----------------------------------------------------------------------------- signatures
@pytest.mark.parametrize("release", [Release211], indirect=True)
def test_release_211_gets_is_causal_repeated_heads_and_a_folded_scale(
        release: Recorder) -> None:
    q, k, v = packed()
    cu = torch.tensor(OFFSETS, dtype=torch.int32)
    for causal in (True, False):
        out = varlen_templates.varlen_call(q, k, v, cu, cu, 133, 133, causal=causal)
        call = release.calls[-1]
        assert call["is_causal"] is causal and call["k"].shape[1] == 4  # K/V heads repeated
        assert call["q"] is q and call["max_q"] == 133
        assert relative_error(out, reference(q, k, v, cu, cu, causal=causal)) < 5e-3
    # A scale other than 1/sqrt(D): q pre-scaled so the default scale gives it.
    out = varlen_templates.varlen_call(q, k, v, cu, cu, 133, 133, causal=True, scale=0.5)
    assert torch.allclose(release.calls[-1]["q"], q * 0.5 * math.sqrt(16))
    assert relative_error(out, reference(q, k, v, cu, cu, causal=True, scale=0.5)) < 5e-3
    # 1/sqrt(D) (transformers' scaling) is the default: q untouched.
    varlen_templates.varlen_call(q, k, v, cu, cu, 133, 133, causal=True, scale=16 ** -0.5)
    assert release.calls[-1]["q"] is q


@pytest.mark.parametrize("release", [Release213], indirect=True)
def test_release_213_gets_window_size_enable_gqa_and_scale(release: Recorder) -> None:
    q, k, v = packed()
    cu = torch.tensor(OFFSETS, dtype=torch.int32)
    varlen_templates.varlen_call(q, k, v, cu, cu, 133, 133, causal=True, scale=0.5)
    call = release.calls[-1]
    assert call["window_size"] == (-1, 0) and call["enable_gqa"] is True
    assert call["scale"] == 0.5 and call["k"] is k and call["q"] is q
    varlen_templates.varlen_call(q, k[:, :4 // 2], v, cu, cu, 133, 133, causal=False)
    assert "window_size" not in release.calls[-1]  # (-1, -1): full attention, its default


def test_a_torch_without_varlen_attn_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(varlen_templates, "varlen_attn_function", lambda: None)
    q, k, v = packed()
    cu = torch.tensor(OFFSETS, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="has no torch.nn.attention.varlen.varlen_attn"):
        varlen_templates.varlen_call(q, k, v, cu, cu, 133, 133, causal=True)


@pytest.mark.parametrize("release", [Release213], indirect=True)
def test_rows_are_packed_one_after_another(release: Recorder) -> None:
    """A (B, H, L, D) call of documents packed alike in each row: one varlen call over
    B x L tokens, the offsets repeated per row, output (B, H, L, D) as per row."""
    torch.manual_seed(0)
    batch, length = 3, OFFSETS[-1]
    q = torch.randn(batch, length, 4, 16).transpose(1, 2)  # packed layout, viewed
    k, v = (torch.randn(batch, length, 2, 16).transpose(1, 2) for _ in range(2))
    docs = DocumentOffsets(tuple(OFFSETS), tuple(OFFSETS), causal=True)
    out = varlen_templates.run_documents(q, k, v, docs)
    call = release.calls[-1]
    assert call["cu_q"] == [o + r * length for r in range(batch) for o in OFFSETS[:-1]] + [
        batch * length]
    assert call["q"].data_ptr() == q.data_ptr()  # a view, no copy
    cu = torch.tensor(OFFSETS, dtype=torch.int32)
    for row in range(batch):
        want = reference(*(t[row].transpose(0, 1) for t in (q, k, v)), cu, cu, causal=True)
        assert relative_error(out[row].transpose(0, 1), want) < 1e-5


@pytest.mark.parametrize("release", [Release211, Release213], indirect=True)
def test_its_templates_run_the_sweep_inputs_against_their_references(release: Recorder
                                                                    ) -> None:
    """What a sweep times (on the CPU, a fake varlen_attn): the pattern's mask carries its
    documents, the inputs are packed views, and forward and gradients match the
    references the sweep checks them against."""
    p = docs_problem(heads_q=4, heads_kv=2, seqlen_q=300, seqlen_kv=300, head_dim=16,
                     dtype="float16", mask="documents_causal:128", batch=2)
    for name in ("torch_varlen", "torch_varlen_train"):
        template = get_template(name)
        inputs = template.make_inputs(p, "cpu")
        out = template.run(inputs, template.config())
        assert template.error(out, template.reference(inputs)) < template.tolerance(p), name
    # Each row: the pattern's mixed documents (29, 187, 73 and the 11 tokens left).
    assert release.calls[-1]["cu_q"] == [0, 29, 216, 289, 300, 329, 516, 589, 600]


# ----------------------------------------------------------------------------- the dispatcher
@pytest.mark.parametrize(("tflops", "winner"), [
    ({"flash_fwd": 300.0, "flash_bwd": 300.0, "torch_flex": 250.0, "torch_flex_train": 250.0,
      "torch_varlen": 400.0, "torch_varlen_train": 200.0}, {False: "torch_varlen",
                                                             True: "flash"}),
    ({"flash_fwd": 300.0, "flash_bwd": 150.0, "torch_flex": 250.0, "torch_flex_train": 200.0,
      "torch_varlen": 250.0, "torch_varlen_train": 300.0}, {False: "flash",
                                                             True: "torch_varlen"}),
    # Not measured on Ampere: it runs (the baseline of packed documents there: what they ran
    # without us), however fast ours was measured; ours must be measured faster than it.
    ({"flash_fwd": 300.0, "flash_bwd": 300.0}, {False: "torch_varlen", True: "torch_varlen"}),
])
def test_it_is_priced_like_ours_and_flex(tflops: dict[str, float], winner: dict[bool, str],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(varlen_templates, "varlen_attn_function", lambda: Release213())
    for needs_grad in (False, True):
        choice = decide(Call(docs_problem(), needs_grad, A100), resolve=priced(tflops),
                        margin=0.03)
        assert choice.implementation.name == winner[needs_grad], choice.why
        assert "torch_varlen" in {e.implementation for e in choice.estimates}


def test_on_hopper_unmeasured_documents_run_ours(monkeypatch: pytest.MonkeyPatch) -> None:
    """On Hopper our untuned kernels were measured faster than torch's varlen: unmeasured
    documents run ours (by head dim: the Gluon forward at d128, the Triton one at d64; for a
    gradient the pair with the Gluon backward measured faster at the head dim), torch's
    varlen where it is measured fastest."""
    monkeypatch.setattr(varlen_templates, "varlen_attn_function", lambda: Release213())
    nothing = priced({})
    expected = {(False, 128): "gluon", (True, 128): "gluon_train", (False, 64): "flash",
                (True, 64): "flash_gluon"}
    for (needs_grad, head_dim), name in expected.items():
        choice = decide(Call(docs_problem(head_dim=head_dim), needs_grad, H100),
                        resolve=nothing, margin=0.03)
        assert choice.implementation.name == name, choice.why
        assert "not measured" in choice.why and name in choice.why
    # A head dim ours was not measured against it at: it stays the baseline on Hopper too.
    d256 = decide(Call(docs_problem(head_dim=256), True, H100), resolve=nothing, margin=0.03)
    assert d256.implementation.name == "torch_varlen", d256.why
    # Ours priced and torch's varlen priced faster: it runs, on Hopper too.
    varlen_faster = priced({"flash_fwd": 200.0, "torch_varlen": 400.0})
    choice = decide(Call(docs_problem(), False, H100), resolve=varlen_faster, margin=0.03)
    assert choice.implementation.name == "torch_varlen", choice.why


def test_a_mask_without_its_documents_runs_ours(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """torch_varlen measured fastest: it runs a mask that carries its documents; one that
    only names the pattern (a user's own mask) goes to ours, as a mask Flex cannot walk."""
    monkeypatch.setattr(varlen_templates, "varlen_attn_function", lambda: Release213())
    p = docs_problem()
    store(tmp_path, measured("flash_fwd", p, 100.0, device=H100),
          measured("torch_varlen", p, 300.0, device=H100))
    call = Call(dataclasses.replace(p, mask="none"), False, H100)
    with_docs = choose_masked(call, DOCS, (128, 128), documents=True)
    assert with_docs.implementation.name == "torch_varlen", with_docs.why
    without = choose_masked(call, DOCS, (128, 128), documents=False)
    assert without.implementation.name == "flash"


def test_document_masks_carry_their_documents() -> None:
    """Every documents mask the project builds carries its offsets: the varlen path's, the
    sweep's pattern masks, and tuner.hf's packed rows; other masks carry none."""
    clear_document_masks()
    mask = document_block_mask(OFFSETS, OFFSETS, causal=True, device="cpu")
    assert mask.documents == DocumentOffsets(tuple(OFFSETS), tuple(OFFSETS), True)
    sweep = pattern_block_mask("documents_causal:128", 300, 300)
    # Mixed documents around 128 tokens (29, 187, 73), the last one the 11 tokens left.
    assert sweep.documents == DocumentOffsets((0, 29, 216, 289, 300), (0, 29, 216, 289, 300),
                                              True)
    assert pattern_block_mask("document:3", 300, 300).documents == DocumentOffsets(
        (0, 100, 200, 300), (0, 100, 200, 300), False)
    assert pattern_block_mask("sliding:16", 300, 300).documents is None
    assert sweep.to("cpu").documents == sweep.documents


def test_hf_packed_rows_carry_their_documents() -> None:
    from tuner.dispatch.hf_mask import rule_block_mask

    # transformers' packed rule: documents of 100, 150 and 50 tokens, causal within each.
    doc = torch.repeat_interleave(torch.arange(3), torch.tensor([100, 150, 50]))

    def rule(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, k: torch.Tensor
             ) -> torch.Tensor:
        return (doc[q] == doc[k]) & (k <= q)

    mask = rule_block_mask(rule, 1, 300, None, "cpu")
    assert not isinstance(mask, str) and mask is not None
    assert mask.documents == DocumentOffsets((0, 100, 250, 300), (0, 100, 250, 300), True)
    windowed = rule_block_mask(lambda b, h, q, k: rule(b, h, q, k) & (q - k < 64), 1, 300, 64,
                               "cpu")
    assert not isinstance(windowed, str) and windowed is not None
    assert windowed.documents is None


def test_bad_documents_are_named() -> None:
    with pytest.raises(ValueError, match="start at 0"):
        DocumentOffsets((1, 5), (0, 5), True)
    with pytest.raises(ValueError, match="must not decrease"):
        DocumentOffsets((0, 5, 3), (0, 5, 6), True)
    with pytest.raises(ValueError, match="same documents"):
        DocumentOffsets((0, 5), (0, 2, 5), True)
    mask = pattern_block_mask("documents_causal:128", 300, 300)
    with pytest.raises(ValueError, match="must cover"):
        dataclasses.replace(mask, documents=DocumentOffsets((0, 10), (0, 10), True))


@pytest.mark.parametrize("release", [Release211, Release213], indirect=True)
@pytest.mark.parametrize("causal", [True, False])
def test_varlen_attention_through_it_end_to_end(release: Recorder, causal: bool,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """tuner.varlen_attention with torch_varlen forced (on the CPU: serves stood in for):
    the mask's documents reach varlen_attn as cu_seqlens; output and gradients are the
    per-document reference's."""
    monkeypatch.setattr(IMPL, "serves", lambda call: None)
    q, k, v = packed()
    cu = torch.tensor(OFFSETS, dtype=torch.int32)
    with tuner.use_implementation("torch_varlen"):
        out = varlen_attention(q, k, v, cu, cu, 133, 133, causal=causal)
    call = release.calls[-1]
    assert call["cu_q"] == OFFSETS and call["max_q"] == 133 and call["max_k"] == 133
    want = reference(q, k, v, cu, cu, causal=causal)
    assert out.shape == want.shape and relative_error(out, want) < 5e-3
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    expected = torch.autograd.grad(want, (q, k, v), grad)
    for name, g, w in zip("qkv", got, expected, strict=True):
        assert relative_error(g, w) < 2e-2, name


@pytest.mark.parametrize("release", [Release213], indirect=True)
def test_forced_on_documents_no_pattern_names(release: Recorder,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Queries and keys packed differently (no pattern prices them): forced, it runs them
    with its one config, bottom-right causal per document; what it cannot take is named."""
    monkeypatch.setattr(IMPL, "serves", lambda call: None)
    offsets_q, offsets_k = [0, 20, 150, 150, 190], [0, 60, 90, 130, 260]
    torch.manual_seed(0)
    q = torch.randn(190, 4, 16, dtype=torch.float16)
    k, v = (torch.randn(260, 2, 16, dtype=torch.float16) for _ in range(2))
    cu_q, cu_k = (torch.tensor(o, dtype=torch.int32) for o in (offsets_q, offsets_k))
    with tuner.use_implementation("torch_varlen"):
        out = varlen_attention(q, k, v, cu_q, cu_k, 130, 130, causal=True)
    assert release.calls[-1]["cu_q"] == offsets_q and release.calls[-1]["cu_k"] == offsets_k
    assert relative_error(out, reference(q, k, v, cu_q, cu_k, causal=True)) < 5e-3
    with tuner.use_implementation("torch_varlen"), pytest.raises(ValueError, match="float32"):
        varlen_attention(q.float(), k.float(), v.float(), cu_q, cu_k, 130, 130, causal=True)


# ----------------------------------------------------------------------------- on the GPU
@pytest.mark.gpu
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(("offsets_q", "offsets_k"), [
    (OFFSETS, OFFSETS), ([0, 20, 150, 150, 190], [0, 60, 90, 130, 260])], ids=["self", "cross"])
@pytest.mark.parametrize("heads", [(4, 2), (4, 4)], ids=["gqa", "mha"])
def test_torch_varlen_matches_the_per_document_reference_on_the_gpu(
        causal: bool, offsets_q: list[int], offsets_k: list[int],
        heads: tuple[int, int]) -> None:
    """The real varlen_attn forced, bf16, forward and gradients against the float32
    per-document SDPA loop (bottom-right causal, empty documents, queries that see no key)."""
    if varlen_templates.varlen_attn_function() is None:
        pytest.skip(f"torch {torch.__version__} has no varlen_attn")
    torch.manual_seed(0)
    q = torch.randn(offsets_q[-1], heads[0], 64, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(offsets_k[-1], heads[1], 64, device="cuda", dtype=torch.bfloat16)
            for _ in range(2))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    cu_q, cu_k = (torch.tensor(o, dtype=torch.int32, device="cuda")
                  for o in (offsets_q, offsets_k))
    max_q = max(b - a for a, b in zip(offsets_q[:-1], offsets_q[1:], strict=True))
    max_k = max(b - a for a, b in zip(offsets_k[:-1], offsets_k[1:], strict=True))
    with tuner.use_implementation("torch_varlen"):
        out = varlen_attention(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal, scale=0.1)
    want = reference(q, k, v, cu_q, cu_k, causal=causal, scale=0.1)
    assert relative_error(out, want) < 2e-2
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    expected = torch.autograd.grad(want, (q, k, v), grad)
    for name, g, w in zip("qkv", got, expected, strict=True):
        assert relative_error(g, w) < 5e-2, name


@pytest.mark.gpu
def test_the_sweep_times_it_on_the_gpu() -> None:
    """Its templates run the sweep's inputs and agree with their references (what a sweep of
    benchmarks/specs/dispatch_varlen.toml checks before timing)."""
    if varlen_templates.varlen_attn_function() is None:
        pytest.skip(f"torch {torch.__version__} has no varlen_attn")
    p = docs_problem(seqlen_q=4096, seqlen_kv=4096, mask="documents_causal:1024",
                     heads_q=8, heads_kv=4)
    for name in ("torch_varlen", "torch_varlen_train"):
        template = get_template(name)
        inputs = template.make_inputs(p, "cuda")
        out = template.run(inputs, template.config())
        assert template.error(out, template.reference(inputs)) < template.tolerance(p), name


@pytest.mark.parametrize("release", [Release211], indirect=True)
@pytest.mark.parametrize("collator_kwargs", [False, True], ids=["position_ids", "cu_seq_lens"])
def test_a_packed_transformers_row_reaches_it(release: Recorder, collator_kwargs: bool,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A tiny Llama trained padding-free through attn_implementation="tuner" with torch_varlen
    forced (serves stood in for on the CPU): every layer's attention reaches varlen_attn with
    the row's documents (from position_ids' mask rule, or the collator's cu_seq_lens), and
    the loss is the "sdpa" model's on the same packed row."""
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    from tuner.hf import register_transformers

    monkeypatch.setattr(IMPL, "serves", lambda call: None)
    lengths = [40, 7, 81]
    offsets = [0, 40, 47, 128]
    ids = torch.randint(0, 64, (1, 128), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids, "use_cache": False,
             "position_ids": torch.cat([torch.arange(n) for n in lengths])[None]}
    if collator_kwargs:
        cu = torch.tensor(offsets, dtype=torch.int32)
        batch.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=81, max_length_k=81)
    losses = {}
    for attn in ("sdpa", register_transformers()):
        config = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4,
                                          num_key_value_heads=2, head_dim=16,
                                          num_hidden_layers=2, intermediate_size=128,
                                          vocab_size=64, max_position_embeddings=256)
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn)
        model = model.to(torch.float16)
        with tuner.use_implementation("torch_varlen"):
            loss = model(**batch).loss
        loss.backward()
        losses[attn] = loss.detach()
    assert len(release.calls) == 2  # one per layer
    assert all(call["cu_q"] == offsets and call["is_causal"] for call in release.calls)
    assert abs(float(losses["tuner"]) - float(losses["sdpa"])) < 1e-2 * float(losses["sdpa"])


def test_where_it_cannot_serve_unmeasured_documents_run_ours(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The documents baseline only where torch's varlen can run the call: capped scores (or
    the CPU, or a torch without varlen_attn) keep ours as the baseline."""
    monkeypatch.setattr(varlen_templates, "varlen_attn_function", lambda: Release213())
    nothing = priced({})
    served = decide(Call(docs_problem(), False, A100), resolve=nothing, margin=0.03)
    assert served.implementation.name == "torch_varlen" and "not measured" in served.why
    capped = decide(Call(docs_problem(softcap=50.0), False, A100), resolve=nothing,
                    margin=0.03)
    assert capped.implementation.name == "flash", capped.why
    monkeypatch.setattr(varlen_templates, "varlen_attn_function", lambda: None)
    missing = decide(Call(docs_problem(), True, A100), resolve=nothing, margin=0.03)
    assert missing.implementation.name == "flash", missing.why
