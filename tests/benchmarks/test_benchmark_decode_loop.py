"""benchmarks/decode_loop.py: a GPU measurement only; here, its refusal and its helpers."""

from __future__ import annotations

import pytest

from tests.benchmarks.benchmark_scripts import load_benchmark_script

decode_loop = load_benchmark_script("decode_loop")


def test_without_a_gpu_it_says_it_needs_one(capsys: pytest.CaptureFixture[str],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(decode_loop.torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exit_info:
        decode_loop.main(["--rows", "b1-32k"])
    assert exit_info.value.code == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_unknown_rows_are_named_with_the_known_ones(capsys: pytest.CaptureFixture[str],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(decode_loop.torch.cuda, "is_available", lambda: True)
    with pytest.raises(SystemExit):
        decode_loop.main(["--rows", "b1-32k,b2-7k"])
    err = capsys.readouterr().err
    assert "['b2-7k']" in err and "b1-128k" in err


def test_rows_are_protocol_decode_rows() -> None:
    assert decode_loop.ROWS == {"b1-32k": (1, 32768), "b1-128k": (1, 131072),
                                "b8-32k": (8, 32768), "b64-4k": (64, 4096)}
