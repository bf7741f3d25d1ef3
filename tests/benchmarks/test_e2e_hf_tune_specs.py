"""benchmarks/e2e_hf.py --tune: the specs it sweeps (no transformers needed to build them)."""

from __future__ import annotations

from pathlib import Path

from tests.benchmarks.benchmark_scripts import load_benchmark_script
from tuner.tuning.suites import load_spec_file


def test_tune_specs_load_one_family_each(tmp_path: Path) -> None:
    """--tune sweeps one spec per family: the backward templates never see a decode step, the
    decode kernel never a prefill, and every spec loads as the sweep loads it."""
    tune_specs = load_benchmark_script("e2e_hf").tune_specs
    sizes = dict(prefill=8192, prompt=2048, train_batch=2, train_len=4096, window=4096)
    specs = {}
    for family, text in tune_specs(sizes).items():
        path = tmp_path / f"{family}.toml"
        path.write_text(text)
        specs[family] = load_spec_file(path)
    assert set(specs) == {"dense", "decode", "sliding"}
    decode = specs["decode"]
    assert {p.seqlen_q for p in decode.problems} == {1}
    assert sorted(p.seqlen_kv for p in decode.problems) == [2048, 4096]
    assert "flash_decode" in decode.templates
    assert not {"flash_bwd", "torch_sdpa_train", "torch_flex_train",
                "gluon_cudnn_train"} & set(decode.templates)
    assert {"torch_sdpa_train", "gluon_cudnn_train"} <= set(specs["dense"].templates)
    assert "flash_decode" not in specs["dense"].templates + specs["sliding"].templates
    assert sorted((p.batch, p.seqlen_q) for p in specs["dense"].problems) == [(1, 8192), (2, 4096)]
    assert {p.causal for p in specs["dense"].problems} == {"top_left"}
    assert {p.mask for p in specs["sliding"].problems} == {"sliding_causal:4096"}


def test_tune_specs_tune_the_training_step_that_is_timed(tmp_path: Path) -> None:
    """--train-len 32768 --train-batch 1 (issue 40's long-context row): the sweep tunes the
    32k training problem the rows then time (it tuned the default 2 x 4k before), for both
    models, and prices our own backwards beside cuDNN's."""
    tune_specs = load_benchmark_script("e2e_hf").tune_specs
    sizes = dict(prefill=8192, prompt=2048, train_batch=1, train_len=32768, window=4096,
                 sliding_train_batch=1, sliding_train_len=32768)
    specs = {}
    for family, text in tune_specs(sizes).items():
        path = tmp_path / f"{family}.toml"
        path.write_text(text)
        specs[family] = load_spec_file(path)
    assert sorted((p.batch, p.seqlen_q) for p in specs["dense"].problems) == [(1, 8192),
                                                                             (1, 32768)]
    assert sorted((p.batch, p.seqlen_q) for p in specs["sliding"].problems) == [(1, 8192),
                                                                               (1, 32768)]
    assert {"gluon_train", "gluon_bwd"} <= set(specs["dense"].templates)
    assert {"gluon_train", "gluon_bwd"} <= set(specs["sliding"].templates)
