"""The sweep that prices e2e_hf's sliding-window layer: benchmarks/specs/dispatch_sliding_hf.toml
(and e2e_hf.py --tune's own spec) hold the problem tuner.hf's block mask is priced by."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from templates.base import Problem
from tests.benchmarks.benchmark_scripts import BENCHMARKS, load_benchmark_script
from tuner.hf import sliding_block_mask
from tuner.tuning.suites import load_spec_file

# e2e_hf's Mistral-shaped layer: B1 x 8k (prefill, and the training step of twice the window),
# 32 query / 8 KV heads, d128, bf16, window 4096; causality in the mask.
MISTRAL = Problem(1, 32, 8, 8192, 8192, 128, "bfloat16", "none", "sliding_causal:4096")
SPEC = BENCHMARKS / "specs" / "dispatch_sliding_hf.toml"


def test_the_spec_holds_the_mistral_layer_for_ours_flex_and_gluon() -> None:
    spec = load_spec_file(SPEC)
    assert spec.problems == (MISTRAL,)
    assert set(spec.templates) == {"flash_fwd", "flash_bwd", "torch_flex", "torch_flex_train",
                                   "gluon_fwd", "gluon_train", "gluon_bwd"}
    assert sliding_block_mask(8192, 4096, torch.device("cpu")).pattern == MISTRAL.mask


def test_masked_dispatch_bench_times_its_rows_forward_and_training() -> None:
    bench = load_benchmark_script("masked_dispatch_bench")
    assert bench.rows_of(False, SPEC) == [(MISTRAL, False), (MISTRAL, True)]
    assert len(bench.rows_of(False)) == 2 * len(load_spec_file(bench.SPEC).problems)


def test_e2e_hf_tune_sweeps_the_sliding_layer(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    e2e = load_benchmark_script("e2e_hf")
    ran: list[list[str]] = []
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(e2e.subprocess, "run", lambda cmd, **kw: ran.append(cmd))
    sizes: dict[str, Any] = dict(prefill=8192, prompt=2048, train_batch=2, train_len=4096,
                                 window=4096)
    e2e.tune("sqlite:///x.db", sizes, 60, ["llama", "sliding"])
    specs = [load_spec_file(Path(cmd[cmd.index("sweep") + 1])) for cmd in ran]
    assert len(specs) == 3  # one sweep per family: dense, decode, sliding
    [sliding] = [spec for spec in specs if MISTRAL in spec.problems]
    assert {"torch_flex", "torch_flex_train", "gluon_train"} <= set(sliding.templates)
    # Each family's sweep gets a --budget, its share of the time left (the sweeps here take
    # none, so each share is of the whole 60 s): dense 4 of 8 parts, decode 1 of the 4 left,
    # sliding all that is left.
    budgets = [int(cmd[cmd.index("--budget") + 1].rstrip("s")) for cmd in ran]
    assert budgets[0] in (29, 30) and budgets[1] in (14, 15) and budgets[2] in (59, 60)
    # Only the families of the rows asked for: the sliding model alone sweeps one.
    ran.clear()
    e2e.tune("sqlite:///x.db", sizes, 60, ["sliding"])
    assert len(ran) == 1 and MISTRAL in load_spec_file(
        Path(ran[0][ran[0].index("sweep") + 1])).problems
