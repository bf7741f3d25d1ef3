"""tuner.hf's sliding-window block mask (no transformers needed): it holds causality, carries
the pattern ``sliding_causal:<w>``, and the dispatcher runs the measured winner for it (ours
where nothing is measured)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from templates.attention_reference import attention_reference
from templates.base import Problem
from templates.device import current_device
from tests.api.serving_data import H100
from tests.tuner.dispatch.test_dispatch import measured, store
from tests.tuner.dispatch.test_dispatch_flex import priced
from tuner.dispatch.rule import Call, choose, decide
from tuner.hf import sliding_block_mask, tuner_attention_forward

pytestmark = pytest.mark.usefixtures("no_tuned_configs")

N, WINDOW = 160, 40  # two query blocks of the sweeps' 128: a diagonal and a window edge


def hf_mask(n: int, window: int, device: str | torch.device = "cpu") -> torch.Tensor:
    """What transformers hands every sliding layer: (B, 1, L, L), i - window < j <= i."""
    rows = torch.arange(n, device=device)[:, None]
    cols = torch.arange(n, device=device)[None, :]
    return ((cols <= rows) & (cols > rows - window))[None, None]


def test_the_sliding_block_mask_holds_causality_so_its_inner_blocks_run_unmasked() -> None:
    """With causality left to the kernel, every listed block ran the elementwise causal mask;
    in the mask itself, the blocks between the diagonal and the window's edge are full."""
    n, window = 1024, 512
    mask = sliding_block_mask(n, window, torch.device("cpu"))
    assert mask.block_size == (128, 128)
    dense = hf_mask(n, window)[0, 0]
    qb, kb = mask.block_size
    blocks = dense.reshape(n // qb, qb, n // kb, kb).permute(0, 2, 1, 3).reshape(
        n // qb, n // kb, -1)
    full_expected = int(blocks.all(-1).sum())
    partial_expected = int((blocks.any(-1) & ~blocks.all(-1)).sum())
    assert full_expected > 0
    assert int(mask.full_counts.sum()) == full_expected
    assert int(mask.partial_counts.sum()) == partial_expected


def test_the_sliding_block_mask_is_the_named_pattern() -> None:
    mask = sliding_block_mask(N, WINDOW, torch.device("cpu"))
    assert mask.pattern == f"sliding_causal:{WINDOW}"
    assert torch.equal(mask.to_dense(), hf_mask(N, WINDOW))


# ----------------------------------------------------------------------------- dispatch
def hf_problem(**changes: Any) -> Problem:
    """The problem of hf_call's layer: causality in the mask, so causal "none"."""
    fields: dict[str, Any] = dict(batch=1, heads_q=4, heads_kv=2, seqlen_q=N, seqlen_kv=N,
                                  head_dim=16, dtype="float32", causal="none",
                                  mask=f"sliding_causal:{WINDOW}")
    return Problem(**{**fields, **changes})


def hf_call(device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A sliding layer through the hook, and the reference under transformers' mask."""
    torch.manual_seed(0)
    q = torch.randn(1, 4, N, 16, device=device)
    k, v = torch.randn(1, 2, N, 16, device=device), torch.randn(1, 2, N, 16, device=device)
    mask = hf_mask(N, WINDOW, device)
    out, _ = tuner_attention_forward(torch.nn.Module(), q, k, v, mask, sliding_window=WINDOW)
    ref = attention_reference(q, k, v, causal="none", scale=0.25, mask=mask)[0]
    return out.transpose(1, 2), ref


def assert_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    err = float((out.double() - ref.double()).norm() / ref.double().norm())
    assert err < 1e-3, err


def test_unmeasured_it_runs_ours(device: str, flex_calls: list[dict[str, Any]]) -> None:
    choice = choose(Call(hf_problem(), False, current_device()))
    assert choice.implementation.name == "flash" and "not measured" in choice.why
    assert_close(*hf_call(device))
    assert not flex_calls


def test_flex_measured_faster_runs_flex(tmp_path: Path, device: str,
                                        flex_calls: list[dict[str, Any]]) -> None:
    p = hf_problem()
    store(tmp_path, measured("flash_fwd", p, 100.0), measured("torch_flex", p, 150.0))
    assert choose(Call(p, False, current_device())).implementation.name == "flex"
    assert_close(*hf_call(device))  # the recorder answers with the reference
    [call] = flex_calls
    assert call["causal"] == "none" and call["block_mask"].pattern == p.mask


def test_ours_measured_faster_runs_ours(tmp_path: Path, device: str,
                                       flex_calls: list[dict[str, Any]]) -> None:
    p = hf_problem()
    store(tmp_path, measured("flash_fwd", p, 150.0), measured("torch_flex", p, 100.0))
    assert choose(Call(p, False, current_device())).implementation.name == "flash"
    assert_close(*hf_call(device))
    assert not flex_calls


def test_a_measurement_of_the_two_sided_window_prices_nothing(
        tmp_path: Path, device: str, flex_calls: list[dict[str, Any]]) -> None:
    """``sliding:<w>`` (|i - j| <= w) is another mask: its measurements are not this one's."""
    p = hf_problem(mask=f"sliding:{WINDOW}")
    store(tmp_path, measured("flash_fwd", p, 100.0), measured("torch_flex", p, 150.0))
    assert_close(*hf_call(device))
    assert not flex_calls


@pytest.mark.parametrize(("tflops", "winner"), [
    ({"flash_fwd": 300.0, "flash_bwd": 150.0, "torch_flex": 250.0, "torch_flex_train": 250.0,
      "gluon_train": 200.0}, {False: "flash", True: "flex"}),
    ({"flash_fwd": 300.0, "flash_bwd": 300.0, "torch_flex": 250.0, "torch_flex_train": 100.0,
      "gluon_train": 50.0}, {False: "flash", True: "flash"}),
    # flash and Flex priced for a gradient, neither pair with the Gluon backward (a sweep
    # killed early, or narrowed): the untuned Gluon pair, which beat both untuned
    ({"flash_fwd": 300.0, "flash_bwd": 300.0, "torch_flex": 250.0, "torch_flex_train": 400.0},
     {False: "flash", True: "gluon_train"}),
    # ours unpriced: ours (on Hopper at d128 under a causal window, the Gluon forward, and
    # for a gradient the Gluon forward and backward)
    ({"torch_flex": 400.0, "torch_flex_train": 400.0}, {False: "gluon", True: "gluon_train"}),
])
def test_the_mistral_layer_is_decided_by_its_measurements(tflops: dict[str, float],
                                                          winner: dict[bool, str]) -> None:
    """e2e_hf's sliding layer on the H100 (B1 x 8k, 32/8 heads, d128, bf16, window 4096):
    prefill and training step, each by its own templates' prices; ours where unpriced."""
    p = hf_problem(heads_q=32, heads_kv=8, seqlen_q=8192, seqlen_kv=8192, head_dim=128,
                   dtype="bfloat16", mask="sliding_causal:4096")
    for needs_grad in (False, True):
        choice = decide(Call(p, needs_grad, H100), resolve=priced(tflops), margin=0.03)
        assert choice.implementation.name == winner[needs_grad], choice.why


def test_another_mask_at_the_same_address_is_checked_again() -> None:
    """The next forward's mask may be allocated where the last one was, with its shape and
    version: it is another tensor object, and is checked anew."""
    from tuner.hf import is_sliding_causal

    n, window = 12, 4
    memory = bytearray(hf_mask(n, window).numpy().tobytes())
    first = torch.frombuffer(memory, dtype=torch.bool).view(1, 1, n, n)
    assert is_sliding_causal(first, window)
    memory[5] = 1  # row 0 sees key 5: not the window; written around torch (no version bump)
    second = torch.frombuffer(memory, dtype=torch.bool).view(1, 1, n, n)
    assert second.data_ptr() == first.data_ptr() and second._version == first._version
    assert not is_sliding_causal(second, window)


def test_a_dense_documents_mask_runs_as_its_block_mask(device: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A dense (B, 1, L, L) mask of packed causal documents (what transformers' fallback
    hands a layer for a rule it cannot skip) runs as the documents' named block mask; a
    right-padded one (rows differ between batches) runs as given."""
    import tuner.hf

    seen: list[dict[str, Any]] = []
    real = tuner.hf.attention

    def spy(*args: Any, **kwargs: Any) -> torch.Tensor:
        seen.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(tuner.hf, "attention", spy)
    torch.manual_seed(0)
    q = torch.randn(2, 4, N, 16, device=device)
    k, v = torch.randn(2, 2, N, 16, device=device), torch.randn(2, 2, N, 16, device=device)
    doc = torch.repeat_interleave(torch.arange(2), torch.tensor([70, N - 70])).to(device)
    rows, cols = torch.arange(N, device=device)[:, None], torch.arange(N, device=device)[None]
    docs = ((doc[:, None] == doc[None, :]) & (cols <= rows))[None, None].expand(2, 1, N, N)
    padded = docs.clone()
    padded[1, :, :, 150:] = False  # the second row's last keys are padding
    for mask, named in ((docs, True), (padded, False)):
        out, _ = tuner_attention_forward(torch.nn.Module(), q, k, v, mask)
        ref = attention_reference(q, k, v, causal="none", scale=0.25, mask=mask)[0]
        assert_close(out.transpose(1, 2), ref)
        call = seen.pop()
        if named:
            assert call["block_mask"].pattern == "documents_causal:64"  # (70² + 90²) / 160 ~ 81
            assert call.get("attn_mask") is None
        else:
            assert call.get("block_mask") is None and call["attn_mask"] is mask
