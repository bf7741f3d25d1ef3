"""benchmarks/decode_grid.py: a GPU measurement only; here, its refusal and its grid."""

from __future__ import annotations

import pytest

from templates.decode.template import FlashDecodeConfig
from tests.benchmarks.benchmark_scripts import load_benchmark_script

decode_grid = load_benchmark_script("decode_grid")


def test_without_a_gpu_it_says_it_needs_one(capsys: pytest.CaptureFixture[str],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(decode_grid.torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exit_info:
        decode_grid.main(["--rows", "b1-32k"])
    assert exit_info.value.code == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_unknown_rows_are_named_with_the_known_ones(capsys: pytest.CaptureFixture[str],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(decode_grid.torch.cuda, "is_available", lambda: True)
    with pytest.raises(SystemExit):
        decode_grid.main(["--rows", "b1-32k,b3-1k"])
    assert "['b3-1k']" in capsys.readouterr().err


@pytest.mark.parametrize("grid", sorted(decode_grid.GRIDS))
def test_grids_are_valid_configs_without_a_fused_single_split(grid: str) -> None:
    configs = decode_grid.grid_configs(decode_grid.GRIDS[grid])
    assert configs and len({tuple(sorted(c.items())) for c in configs}) == len(configs)
    for knobs in configs:
        FlashDecodeConfig(**knobs)  # every value is one the config accepts
        assert not (knobs["num_splits"] == 1 and knobs["combine"] == "fused")
    assert any(c["combine"] == "fused" for c in configs)
