"""benchmarks/gluon_bwd_profile.py on a machine without a GPU: it says what it needs and
exits 2 instead of failing inside torch; bad arguments are refused by name."""

from __future__ import annotations

import pytest
import torch

from tests.benchmarks.benchmark_scripts import load_benchmark_script


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU path")
def test_without_a_gpu_it_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    profile = load_benchmark_script("gluon_bwd_profile")
    assert profile.main(["--causal", "top_left", "--head-dim", "64"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_a_head_dim_it_does_not_profile_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    profile = load_benchmark_script("gluon_bwd_profile")
    with pytest.raises(SystemExit) as exit_info:
        profile.main(["--head-dim", "96"])
    assert exit_info.value.code == 2
    assert "--head-dim" in capsys.readouterr().err
