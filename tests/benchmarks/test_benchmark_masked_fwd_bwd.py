"""benchmarks/masked_fwd_bwd_bench.py: its masks, its check (a wrong or failing call is
reported, never timed), and a --smoke run on the CPU interpreter that goes through every
pattern, our forward, forward + backward and backward grid, the table and the JSON."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from templates.attention_reference import attention_reference
from templates.flash.bwd import reference_grads
from tests.benchmarks.benchmark_scripts import BENCHMARKS, load_benchmark_script

SCRIPT = BENCHMARKS / "masked_fwd_bwd_bench.py"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_benchmark_script("masked_fwd_bwd_bench")


def sliding_causal_pairs(seqlen: int, window: int) -> int:
    """Query i sees keys max(0, i - window) .. i."""
    return sum(min(i, window) + 1 for i in range(seqlen))


# ----------------------------------------------------------------------------- masks
@pytest.mark.parametrize("pattern", ["sliding-causal:40", "document-causal:48", "random:0.3"])
def test_our_block_mask_is_the_dense_mask_the_reference_uses(bench: ModuleType,
                                                             pattern: str) -> None:
    mod = bench.pattern_mod(pattern, 256, 32, "cpu")
    dense = bench.dense_mask(mod, 256, "cpu")
    block_mask = bench.BlockMask.from_mask_mod(mod, None, None, 256, 256, 32)
    assert dense.shape == (256, 256) and dense.dtype == torch.bool
    assert torch.equal(block_mask.to_dense()[0, 0], dense)
    assert dense.diagonal().all()  # every query sees a key
    if not pattern.startswith("random"):
        assert not dense.triu(1).any()  # causal


def test_sliding_causal_window(bench: ModuleType) -> None:
    dense = bench.dense_mask(bench.pattern_mod("sliding-causal:40", 128, 32, "cpu"), 128, "cpu")
    assert int(dense.sum()) == sliding_causal_pairs(128, 40)
    assert dense[100, 60] and not dense[100, 59] and not dense[60, 61]


def test_documents_fill_the_sequence_causally(bench: ModuleType) -> None:
    lengths = bench.document_lengths(4096, 1024)
    assert sum(lengths) == 4096 and len(lengths) >= 3
    assert all(256 <= n <= 1792 for n in lengths[:-1]) and 1 <= lengths[-1] <= 1792
    assert lengths == bench.document_lengths(4096, 1024)  # seeded: every run times one mask
    dense = bench.dense_mask(bench.pattern_mod("document-causal:1024", 4096, 128, "cpu"), 4096,
                             "cpu")
    assert int(dense.sum()) == sum(n * (n + 1) // 2 for n in lengths)
    start = lengths[0]  # the second document's first token sees only itself
    assert dense[start, start] and not dense[start, :start].any()


def test_random_blocks_keep_the_diagonal(bench: ModuleType) -> None:
    dense = bench.dense_mask(bench.pattern_mod("random:0.1", 4096, 128, "cpu"), 4096, "cpu")
    blocks = dense.view(32, 128, 32, 128).any(dim=(1, 3))
    assert torch.equal(dense, blocks.repeat_interleave(128, 0).repeat_interleave(128, 1))
    assert blocks.diagonal().all()
    assert 0.1 < blocks.float().mean() < 0.1 + 1 / 32 + 0.05  # 10% kept, plus the diagonal


# ----------------------------------------------------------------------------- the check
@pytest.fixture(scope="module")
def case(bench: ModuleType) -> Any:
    """A tiny row: masks, inputs and the float32 reference (no kernel runs)."""
    return bench.prepare(bench.SMOKE, 16, 64, "sliding-causal:8")


def never_timed(call: Any) -> float:
    raise AssertionError("a call that failed its check was timed")


@pytest.mark.parametrize("spoil", ["scaled", "nan"])
def test_a_wrong_output_is_reported_and_not_timed(bench: ModuleType, case: Any,
                                                  spoil: str) -> None:
    setup = dataclasses.replace(bench.SMOKE, timer=never_timed)
    o, dq, dk, dv = case.ref
    bad_dk = dk * 1.05 if spoil == "scaled" else torch.full_like(dk, float("nan"))
    m = bench.measure(setup, case, "ours", "fwd+bwd", lambda: (o, dq, bad_dk, dv))
    assert m.status == "wrong" and m.ms is None and m.tflops is None
    assert m.errors["o"] == m.errors["dq"] == m.errors["dv"] == 0.0
    assert not m.errors["dk"] <= setup.tolerance and "dk error" in m.note


def test_a_call_that_raises_is_reported_and_not_timed(bench: ModuleType, case: Any) -> None:
    setup = dataclasses.replace(bench.SMOKE, timer=never_timed)

    def refuses() -> tuple[torch.Tensor, ...]:
        raise RuntimeError("No available kernel")

    m = bench.measure(setup, case, "sdpa-cudnn", "fwd", refuses)
    assert (m.status, m.ms, m.errors) == ("error", None, {})
    assert m.note == "RuntimeError: No available kernel"


def test_a_matching_output_is_timed_and_counts_visible_flops(bench: ModuleType,
                                                             case: Any) -> None:
    setup = dataclasses.replace(bench.SMOKE, timer=lambda call: 2.0)
    row = case.row
    assert row.visible_pairs == sliding_causal_pairs(64, 8)
    assert row.fwd_flops == 4 * row.batch * row.heads * 16 * row.visible_pairs
    fwd = bench.measure(setup, case, "ours", "fwd", lambda: case.ref[:1])
    both = bench.measure(setup, case, "ours", "fwd+bwd", lambda: case.ref)
    assert (fwd.status, fwd.ms, list(fwd.errors)) == ("timed", 2.0, ["o"])
    assert list(both.errors) == ["o", "dq", "dk", "dv"]
    assert fwd.tflops == pytest.approx(row.fwd_flops / 2e-3 / 1e12)
    assert both.tflops == pytest.approx(3.5 * fwd.tflops)


# ----------------------------------------------------------------------------- Gluon
def test_gluon_where_it_runs_is_checked_and_timed_both_ways(
        bench: ModuleType, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """On a Hopper GPU with Gluon: its inference forward beside ours, and both Gluon kernels
    (``gluon-train``: the forward, then the Gluon backward under the same mask), and our
    Triton forward with the Gluon backward (``flash-gluon``), checked, timed, in the table
    (the Gluon kernels stood in for by the reference here: they need a Hopper GPU)."""
    assert not bench.gluon_runs(bench.SMOKE)
    forwards: list[tuple[Any, bool]] = []
    backwards: list[Any] = []

    def gluon_attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                            block_mask: Any) -> tuple[torch.Tensor, torch.Tensor]:
        forwards.append((block_mask, torch.is_grad_enabled() and q.requires_grad))
        o, lse = attention_reference(q.detach(), k.detach(), v.detach(), causal="none",
                                     scale=q.shape[-1] ** -0.5, mask=block_mask.to_dense())
        return o.to(q.dtype), lse.float()

    def gluon_attention_bwd(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                            v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor, *,
                            block_mask: Any, config: Any = None) -> tuple[torch.Tensor, ...]:
        backwards.append((block_mask, config))
        grads = reference_grads(q, k, v, do, causal="none", scale=q.shape[-1] ** -0.5,
                                mask=block_mask.to_dense())
        return tuple(g.to(q.dtype) for g in grads)

    monkeypatch.setattr(bench, "gluon_runs", lambda setup: True)
    monkeypatch.setattr(bench, "gluon_attention_fwd", gluon_attention_fwd)
    monkeypatch.setattr(bench, "gluon_attention_bwd", gluon_attention_bwd)
    setup = dataclasses.replace(bench.SMOKE, timer=lambda call: 2.0)
    row = bench.measure_row(setup, 16, 64, "sliding-causal:8")
    assert [(m.impl, m.step, m.status) for m in row.results] == [
        ("ours", "fwd", "timed"), ("ours", "fwd+bwd", "timed"), ("gluon", "fwd", "timed"),
        ("gluon-train", "fwd", "timed"), ("gluon-train", "fwd+bwd", "timed"),
        ("flash-gluon", "fwd", "timed"), ("flash-gluon", "fwd+bwd", "timed"),
        *[(name, step, "timed") for name in bench.BWD_VARIANTS
          for step in ("fwd", "fwd+bwd")]]
    # Checked once each, then timed; every call under the row's mask; no graph in a forward
    # (flash-gluon's forward is the Triton one: not among the Gluon forwards); the split
    # variants' backwards with their configs, the others with the default.
    assert len(forwards) == 3 + 2 * len(bench.BWD_VARIANTS)
    assert all(m.block_size == (32, 32) and not graph for m, graph in forwards)
    assert [config for _, config in backwards] == [None, None,
                                                   *bench.BWD_VARIANTS.values()]
    assert bench.SPLIT_BWD["split_warpgroups"] and bench.BWD_VARIANTS["gluon-split"] is \
        bench.SPLIT_BWD
    assert bench.BWD_VARIANTS["gluon-pers-lf"]["longest_first"]
    assert list(row.results[4].errors) == ["o", "dq", "dk", "dv"]
    assert list(row.results[6].errors) == ["o", "dq", "dk", "dv"]
    bench.print_tables([row])
    table = capsys.readouterr().out
    assert "gluon fwd" in table and "gluon/ours" in table and "glu f+b" in table
    assert "f+g f+b" in table and "f+g/flex" in table
    assert "1.00x" in table  # gluon/ours: both 2 ms (ours/flex and best/flex: no Flex, "-")
    only = bench.measure_row(setup, 16, 64, "sliding-causal:8",
                             only=frozenset({"gluon-train"}))
    assert {m.impl for m in only.results} == {"gluon-train"}


# ----------------------------------------------------------------------------- the smoke run
@pytest.mark.slow
def test_smoke_run_checks_and_times_every_pattern(tmp_path: Path) -> None:
    out = tmp_path / "masked.json"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--json", str(out)],
                          env=env, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads(out.read_text())
    assert results["environment"]["gpu"] == "cpu-interpreter"
    rows = {row["pattern"]: row for row in results["rows"]}
    assert list(rows) == ["sliding-causal:40", "document-causal:48", "random:0.3"]
    assert rows["sliding-causal:40"]["visible_pairs"] == sliding_causal_pairs(128, 40)
    # Block-aligned: the visible pairs are exactly the visited blocks' pairs.
    random = rows["random:0.3"]
    assert random["visible_fraction"] == pytest.approx(random["block_density"])
    for pattern, row in rows.items():
        runs = [(m["impl"], m["step"]) for m in row["results"]]
        # No Flex, no SDPA in a smoke run; the grid's one config after the defaults.
        assert runs == [("ours", "fwd"), ("ours", "fwd+bwd"), ("ours-grid", "fwd+bwd")], pattern
        for m in row["results"]:
            assert m["status"] == "timed" and m["ms"] > 0, (pattern, m)
            assert max(m["errors"].values()) <= results["tolerance"], (pattern, m)
            factor = 1.0 if m["step"] == "fwd" else 3.5
            assert m["tflops"] == pytest.approx(factor * row["fwd_flops"] / m["ms"] / 1e9)
        assert row["results"][2]["config"]["dq_mode"] == "separate"
        assert f"d32 N128 {pattern}" in done.stdout
    assert "TFLOP/s (visible work)" in done.stdout and "not timed" not in done.stdout


def test_rows_are_chosen_by_head_dim_length_and_pattern_prefix(bench: ModuleType) -> None:
    specs = [(d, n, p) for d, n in bench.GPU.shapes for p in bench.GPU.patterns]
    assert bench.selected_rows(specs, "128:16384:document") == [
        (128, 16384, "document-causal:1024")]
    assert [s[2] for s in bench.selected_rows(specs, "64:16384")] == list(bench.GPU.patterns)
    both = bench.selected_rows(specs, "128:4096:random, 64:16384:sliding")
    assert both == [(128, 4096, "random:0.1"), (64, 16384, "sliding-causal:1024")]
    assert bench.selected_rows(specs, "256:16384") == []


def test_the_masks_carry_what_callers_masks_carry(bench: ModuleType) -> None:
    """The sliding rows' masks are the named pattern they claim (the same pairs), and the
    document rows' masks carry the documents their rule packs."""
    from templates.masks.mods import pattern_block_mask
    from templates.masks.row_ranges import causal_window, row_first_keys, takes_offsets

    sliding = bench.prepare(bench.SMOKE, 32, 128, "sliding-causal:40")
    assert causal_window(sliding.block_mask) == 41
    named = pattern_block_mask("sliding_causal:41", 128, 128, block_size=32)
    assert torch.equal(named.to_dense()[0, 0], sliding.dense)
    docs = bench.prepare(bench.SMOKE, 32, 128, "document-causal:48")
    assert takes_offsets(docs.block_mask)
    first = row_first_keys(docs.block_mask, 128).long()
    i, j = torch.arange(128)[:, None], torch.arange(128)[None, :]
    assert torch.equal((j >= first[:, None]) & (j <= i), docs.dense)
    assert bench.callers_view("random:0.1", 128) == {}


def test_other_shapes_and_grouped_heads(bench: ModuleType, tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    """--shapes and --heads (issue 40's rows: 32 query / 16 K/V heads at 8k and 32k): the
    rows' inputs have the K/V heads asked for, the reference repeats them, and our GQA
    kernels are checked against it and timed; bad values are refused by name."""
    out = tmp_path / "gqa.json"
    assert bench.main(["--smoke", "--heads", "1,4,2", "--shapes", "32:96", "--no-grid",
                       "--rows", "32:96:random", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert (row["seqlen"], row["head_dim"], row["heads"], row["heads_kv"]) == (96, 32, 4, 2)
    assert [(m["impl"], m["step"], m["status"]) for m in row["results"]] == [
        ("ours", "fwd", "timed"), ("ours", "fwd+bwd", "timed")]
    case = bench.prepare(bench.with_shapes(bench.SMOKE, None, "1,4,2"), 32, 96, "random:0.3")
    assert case.tensors["k"].shape[1] == 2 and case.tensors["q"].shape[1] == 4
    assert case.ref[2].shape == case.tensors["k"].shape  # dk summed over each group
    for args, says in ((["--heads", "1,4,3"], "HQ a multiple of HKV"),
                       (["--heads", "1,4"], "three positive integers"),
                       (["--shapes", "128x8192"], "comma-separated D:N")):
        with pytest.raises(SystemExit):
            bench.main(["--smoke", *args])
        assert says in capsys.readouterr().err
