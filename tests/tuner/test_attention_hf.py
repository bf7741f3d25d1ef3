"""attn_implementation="tuner" in Hugging Face transformers (skipped where it is not installed)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed here (the GPU host has it)")

import tuner  # noqa: E402
from tuner.attention import _PLANS  # noqa: E402
from tuner.hf import register_transformers  # noqa: E402


@pytest.fixture(autouse=True)
def flash_kernels() -> Any:
    """Our kernels, not the SDPA that unmeasured calls fall back to (else nothing is tested)."""
    with tuner.use_implementation("flash"):
        yield


def tiny_llama(attn: str, device: str) -> Any:
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn)
    return model.to(device).eval()


@pytest.mark.slow
def test_llama_logits_match_sdpa(device: str) -> None:
    name = register_transformers()
    ids = torch.randint(0, 64, (2, 16), device=device)
    sdpa = tiny_llama("sdpa", device)
    ours = tiny_llama(name, device)
    ours.load_state_dict(sdpa.state_dict())
    _PLANS.clear()
    with torch.no_grad():
        expected = sdpa(ids).logits
        got = ours(ids).logits
    assert _PLANS, "the model did not call tuner.attention"
    torch.testing.assert_close(got, expected, rtol=1e-3, atol=1e-3)


def test_greedy_decoding_with_a_kv_cache_matches_sdpa(device: str) -> None:
    name = register_transformers()
    sdpa = tiny_llama("sdpa", device)
    ours = tiny_llama(name, device)
    ours.load_state_dict(sdpa.state_dict())
    ids = torch.randint(0, 64, (1, 8), device=device)
    kwargs = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        expected = sdpa.generate(ids, **kwargs)
        got = ours.generate(ids, **kwargs)  # prefill (causal), then one-token steps
    assert torch.equal(got, expected)


def test_padded_batch_matches_sdpa_on_the_real_tokens(device: str) -> None:
    """A left-padded batch gets transformers' boolean mask, run by the masked kernel."""
    name = register_transformers()
    sdpa = tiny_llama("sdpa", device)
    ours = tiny_llama(name, device)
    ours.load_state_dict(sdpa.state_dict())
    ids = torch.randint(0, 64, (2, 12), device=device)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # left padding
    with torch.no_grad():
        expected = sdpa(ids, attention_mask=mask).logits
        got = ours(ids, attention_mask=mask).logits
    real = mask.bool()  # padded positions are garbage in both (SDPA may even give NaN)
    torch.testing.assert_close(got[real], expected[real], rtol=1e-3, atol=1e-3)


def tiny_mistral(attn: str, device: str, window: int) -> Any:
    config = transformers.MistralConfig(vocab_size=64, hidden_size=64, intermediate_size=128,
                                        num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, max_position_embeddings=64,
                                        sliding_window=window)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn)
    return model.to(device).eval()


@pytest.mark.parametrize("seqlen", [40, 6])
def test_a_sliding_window_runs_as_a_block_mask_and_matches_sdpa(
        device: str, seqlen: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers hands a dense (B, 1, L, L) mask; the hook sees that it is the sliding
    window itself and runs a block mask (or, when the window covers the sequence, plain
    causal attention)."""
    import tuner.hf

    name = register_transformers()
    sdpa = tiny_mistral("sdpa", device, window=8)
    ours = tiny_mistral(name, device, window=8)
    ours.load_state_dict(sdpa.state_dict())
    seen: list[object] = []
    real = tuner.hf.attention

    def spy(*args: Any, **kwargs: Any) -> torch.Tensor:
        seen.append(kwargs.get("block_mask"))
        return real(*args, **kwargs)

    monkeypatch.setattr(tuner.hf, "attention", spy)
    ids = torch.randint(0, 64, (2, seqlen), device=device)
    with torch.no_grad():
        expected = sdpa(ids).logits
        got = ours(ids).logits
    assert len(seen) == 2  # one call per layer
    if seqlen > 8:
        assert all(isinstance(m, tuner.BlockMask) for m in seen)
    else:
        assert seen == [None, None]  # the window covers it: causal, no mask
    torch.testing.assert_close(got, expected, rtol=1e-3, atol=1e-3)


def test_a_padded_sliding_window_mask_is_not_mistaken_for_the_window(device: str) -> None:
    from tuner.hf import is_sliding_causal

    n, window = 12, 4
    rows, cols = torch.arange(n)[:, None], torch.arange(n)[None, :]
    exact = ((cols <= rows) & (cols > rows - window)).to(device)[None, None].expand(2, 1, n, n)
    assert is_sliding_causal(exact.clone(), window)
    assert not is_sliding_causal(exact.clone(), window + 1)
    padded = exact.clone()
    padded[0, :, :, :3] = False  # left padding of the first sequence
    assert not is_sliding_causal(padded, window)
    assert not is_sliding_causal(exact[..., :-1].contiguous(), window)  # a cached prefix



# ----------------------------------------------------------------------------- tuner_mask
DOCS = (90, 130, 80)  # three packed documents, 300 tokens: none a multiple of a tile


def packed_position_ids(device: str) -> torch.Tensor:
    return torch.cat([torch.arange(n, device=device) for n in DOCS])[None]


class SquareTensors(torch.utils._python_dispatch.TorchDispatchMode):
    """Records every tensor an op makes whose last two dims are (L, L): a dense mask."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n, self.seen = n, []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-2:] == (self.n,) * 2:
                self.seen.append((str(func), tuple(t.shape)))
        return out


@pytest.mark.parametrize(("model", "packed"), [("llama", False), ("llama", True),
                                               ("mistral", False), ("mistral", True)])
def test_no_dense_mask_is_made_and_the_logits_match_sdpa(
        device: str, model: str, packed: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Causal, sliding-window and packed layers: transformers' mask rule becomes a BlockMask
    (or no mask, for plain causal) without any (L, L) tensor, and the logits are SDPA's
    with transformers' own dense masks."""
    import tuner.hf

    name = register_transformers()
    make = (lambda attn: tiny_llama(attn, device)) if model == "llama" else (
        lambda attn: tiny_mistral(attn, device, window=50))
    sdpa, ours = make("sdpa"), make(name)
    for m in (sdpa, ours):
        m.config.max_position_embeddings = 512
    ours.load_state_dict(sdpa.state_dict())
    masks: list[object] = []
    real = tuner.hf.attention

    def spy(*args: Any, **kwargs: Any) -> torch.Tensor:
        masks.append(kwargs.get("block_mask"))
        return real(*args, **kwargs)

    monkeypatch.setattr(tuner.hf, "attention", spy)
    ids = torch.randint(0, 64, (1, sum(DOCS)), device=device)
    kwargs: dict[str, Any] = {"use_cache": False}  # a training-style forward: packing is seen
    if packed:
        kwargs["position_ids"] = packed_position_ids(device)
    with torch.no_grad():
        expected = sdpa(ids, **kwargs).logits
        recorder = SquareTensors(sum(DOCS))
        with recorder:
            got = ours(ids, **kwargs).logits
    assert recorder.seen == []
    want_pattern = {("llama", True): "documents_causal:128", ("mistral", False):
                    "sliding_causal:50", ("mistral", True): None}
    if (model, packed) == ("llama", False):
        assert masks == [None]  # plain causal: the dispatcher's causal path
    else:
        assert all(isinstance(m, tuner.BlockMask) for m in masks) and masks
        assert {m.pattern for m in masks} == {want_pattern[(model, packed)]}  # type: ignore[union-attr]
        assert len({id(m) for m in masks}) == 1  # one mask per forward, shared by the layers
    torch.testing.assert_close(got, expected, rtol=1e-3, atol=1e-3)


def test_the_collators_offsets_run_varlen_attention(device: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """DataCollatorWithFlattening's cu_seq_lens_q/k kwargs reach the attention function:
    the layer runs tuner.varlen_attention on them."""
    import tuner.hf

    name = register_transformers()
    sdpa, ours = tiny_llama("sdpa", device), tiny_llama(name, device)
    for m in (sdpa, ours):
        m.config.max_position_embeddings = 512
    ours.load_state_dict(sdpa.state_dict())
    calls: list[object] = []
    real = tuner.hf.varlen_attention

    def spy(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(args[3])
        return real(*args, **kwargs)

    monkeypatch.setattr(tuner.hf, "varlen_attention", spy)
    offsets = torch.tensor([0, 90, 220, 300], dtype=torch.int32, device=device)
    ids = torch.randint(0, 64, (1, 300), device=device)
    position_ids = packed_position_ids(device)
    with torch.no_grad():
        expected = sdpa(ids, position_ids=position_ids, use_cache=False).logits
        got = ours(ids, position_ids=position_ids, use_cache=False, cu_seq_lens_q=offsets,
                   cu_seq_lens_k=offsets, max_length_q=130, max_length_k=130).logits
    assert len(calls) == 1 and calls[0] is offsets
    torch.testing.assert_close(got, expected, rtol=1e-3, atol=1e-3)


def tiny_gemma2(attn: str, device: str, *, window: int = 48, seed: int = 0) -> Any:
    """Gemma 2's attention: scores softcapped at 50 (attn_logit_softcapping), sliding and
    global layers alternating; its own config object per model."""
    config = transformers.Gemma2Config(vocab_size=64, hidden_size=64, intermediate_size=128,
                                       num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, head_dim=16,
                                       max_position_embeddings=256, sliding_window=window,
                                       attn_logit_softcapping=50.0,
                                       query_pre_attn_scalar=16)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn)
    return model.to(device).eval()


def test_gemma2_softcapped_logits_and_grads_match_eager(device: str) -> None:
    """transformers hands the layers ``softcap``: "tuner" caps as "eager" does (what
    transformers runs for Gemma 2), in the forward and in the gradients."""
    name = register_transformers()
    eager, ours = tiny_gemma2("eager", device), tiny_gemma2(name, device)
    ours.load_state_dict(eager.state_dict())
    # Scores large enough for the cap to bend them (x400 query projections: the logits then
    # move by 0.1 without the cap, 2e-6 between eager and ours with it).
    with torch.no_grad():
        for m in (eager, ours):
            for layer in m.model.layers:
                layer.self_attn.q_proj.weight.mul_(400.0)
    ids = torch.randint(0, 64, (1, 100), device=device)
    with torch.no_grad():
        expected = eager(ids).logits
        got = ours(ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-3, atol=1e-3)
    eager(ids, labels=ids).loss.backward()
    ours(ids, labels=ids).loss.backward()
    for (pname, p_eager), p_ours in zip(eager.named_parameters(), ours.parameters(),
                                        strict=True):
        if p_eager.grad is not None:
            torch.testing.assert_close(p_ours.grad, p_eager.grad, rtol=2e-3, atol=2e-4,
                                       msg=pname)
