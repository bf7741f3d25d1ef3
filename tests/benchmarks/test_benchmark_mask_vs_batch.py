"""benchmarks/mask_vs_batch.py: the packed row is the batch's rows one after another (what
the documents mask and the batch's causal rows both see), and unpacking gives the batch back;
the timing itself needs a Hopper GPU."""

from __future__ import annotations

import pytest
import torch

from tests.benchmarks.benchmark_scripts import load_benchmark_script

SCRIPT = load_benchmark_script("mask_vs_batch")


def test_packing_puts_each_batch_row_at_its_document_offset() -> None:
    batch = torch.randn(3, 2, 5, 4)
    packed = SCRIPT.rows(batch)
    assert packed.shape == (1, 2, 15, 4) and packed.is_contiguous()
    for b in range(3):
        assert torch.equal(packed[0, :, 5 * b:5 * (b + 1)], batch[b])
    assert torch.equal(SCRIPT.unpack(packed, 3), batch)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's refusal")
def test_without_a_gpu_it_says_what_it_needs(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        SCRIPT.main(["--lengths", "1024"])
    assert "needs a CUDA GPU" in capsys.readouterr().err
