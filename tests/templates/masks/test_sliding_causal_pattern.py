"""The ``sliding_causal:<w>`` pattern: transformers' causal sliding window (query i sees key j
iff i - w < j <= i), named so that a sweep can measure it and the dispatcher price it."""

from __future__ import annotations

import pytest
import torch

from api.schemas import ProblemQuery
from templates.base import Problem
from templates.device import current_device
from templates.masks.mods import (
    PATTERNS,
    pattern_block_mask,
    pattern_mask_mod,
    pattern_problem,
    sliding_window_mask,
)
from templates.registry import get_template
from tuner.tuning.suites import spec_from_mapping


def hf_rule(n: int, window: int) -> torch.Tensor:
    rows, cols = torch.arange(n)[:, None], torch.arange(n)[None, :]
    return (cols <= rows) & (cols > rows - window)


def dense(mod: object, n: int) -> torch.Tensor:
    q, k = torch.arange(n)[:, None], torch.arange(n)[None, :]
    return mod(None, None, q, k)  # type: ignore[operator]


def test_it_is_the_transformers_rule_and_sliding_is_not() -> None:
    n, w = 50, 7
    assert "sliding_causal:<window>" in PATTERNS
    assert torch.equal(dense(pattern_mask_mod(f"sliding_causal:{w}", n, n), n), hf_rule(n, w))
    # sliding:<w> is two-sided (|i - j| <= w); made causal it sees one key more than w.
    assert not torch.equal(dense(pattern_mask_mod(f"sliding:{w}", n, n), n), hf_rule(n, w))
    assert torch.equal(dense(sliding_window_mask(w - 1, causal=True), n), hf_rule(n, w))
    assert torch.equal(dense(pattern_mask_mod("sliding_causal:1", n, n), n),
                       torch.eye(n, dtype=torch.bool))


@pytest.mark.parametrize("pattern", ["sliding_causal:0", "sliding_causal:-3", "sliding_causal:x",
                                     "sliding_causal", "sliding_causal:"])
def test_malformed_windows_are_refused(pattern: str) -> None:
    assert "malformed mask pattern" in (pattern_problem(pattern, 64, 64) or "")
    with pytest.raises(ValueError, match="malformed"):
        pattern_block_mask(pattern, 64, 64)


def test_its_block_mask_carries_the_name_only_with_the_sweeps_blocks() -> None:
    mask = pattern_block_mask("sliding_causal:100", 300, 300)
    assert mask.pattern == "sliding_causal:100" and mask.to("cpu").pattern == mask.pattern
    assert torch.equal(mask.to_dense()[0, 0], hf_rule(300, 100))
    assert pattern_block_mask("sliding_causal:100", 300, 300, block_size=64).pattern is None


def test_problems_specs_and_queries_take_it() -> None:
    p = Problem(1, 32, 8, 8192, 8192, 128, "bfloat16", "none", mask="sliding_causal:4096")
    assert p.key().endswith("-sparse-sliding_causal:4096")
    assert Problem.from_dict(p.to_dict()) == p
    for name in ("flash_fwd", "flash_bwd", "torch_flex", "torch_flex_train"):
        assert get_template(name).unsupported(p) is None, name
    assert "dense problems" in (get_template("torch_sdpa").unsupported(p) or "")
    spec = spec_from_mapping({"templates": ["flash_fwd"], "shapes": [
        {"B": 1, "H_q": 32, "H_kv": 8, "N": 8192, "D": 128, "dtype": "bfloat16",
         "causal": "none", "mask": "sliding_causal:4096"}]}, source="test")
    assert spec.problems == (p,)
    query = ProblemQuery(batch=1, heads_q=32, heads_kv=8, seqlen_q=8192, seqlen_kv=8192,
                         head_dim=128, mask="sliding_causal:4096")
    assert query.problem() == p


def test_our_forward_template_runs_it(device: str) -> None:
    """A sweep of the pattern: the template builds the named mask, and its output matches the
    reference under that mask (the interpreter on the CPU)."""
    template = get_template("flash_fwd")
    problem = Problem(batch=1, heads_q=2, heads_kv=1, seqlen_q=200, seqlen_kv=200,
                      head_dim=32, dtype="float16", causal="none", mask="sliding_causal:60")
    inputs = template.make_inputs(problem, device)
    assert inputs["block_mask"].pattern == "sliding_causal:60"
    config = template.default_config(problem, current_device())
    error = template.error(template.run(inputs, config), template.reference(inputs))
    assert error <= template.tolerance(problem)
