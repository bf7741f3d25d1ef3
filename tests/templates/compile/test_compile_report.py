"""``templates.compile.report.wgmma_serialization``: ptxas's note when it serializes a
kernel's wgmma GEMMs, read from a stand-in ptxas (the real one runs in the Gluon templates'
offline compile tests, which require the shipped kernels to have none)."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from templates.compile import report as compile_report
from templates.compile.report import wgmma_serialization

PTX = """
.version 8.7
.target sm_90a
.address_size 64
.visible .entry k() {
    wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%f1}, %rd1, %rd2, 1, 1, 1, 0, 1;
    ret;
}
"""
# What triton 3.6's ptxas printed for a kernel whose S accumulator stayed in flight across
# a persistent loop's back edge (notes/gluon_notes.md).
NOTE = ("ptxas info    : (C7511) Potential Performance Loss: wgmma.mma_async instructions are "
        "serialized due to insufficient register resources for the wgmma pipeline in the "
        "function 'k'\nptxas info    : Used 168 registers, used 3 barriers\n")


def _stand_in_ptxas(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, prints: str,
                    status: int = 0) -> Path:
    """A ptxas that records its arguments, prints ``prints`` on stderr and exits ``status``."""
    (tmp_path / "out.txt").write_text(prints)
    tool = tmp_path / "ptxas"
    tool.write_text(f'#!/bin/sh\necho "$@" > {tmp_path}/args\ncat {tmp_path}/out.txt >&2\n'
                    f"exit {status}\n")
    tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setattr(compile_report, "_ptxas", lambda target: str(tool))
    return tmp_path / "args"


def test_a_serialized_kernel_is_reported_with_ptxas_note(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    args = _stand_in_ptxas(tmp_path, monkeypatch, NOTE)
    assert wgmma_serialization(PTX) == (
        "C7511: wgmma.mma_async instructions are serialized due to insufficient register "
        "resources for the wgmma pipeline in the function 'k'")
    assert args.read_text().split()[:2] == ["-arch=sm_90a", "-v"]  # the PTX's own target


def test_a_pipelined_kernel_reports_nothing(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    _stand_in_ptxas(tmp_path, monkeypatch, "ptxas info    : Used 168 registers\n")
    assert wgmma_serialization(PTX) == ""


def test_without_wgmma_ptxas_is_not_run(tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    args = _stand_in_ptxas(tmp_path, monkeypatch, NOTE)
    assert wgmma_serialization(PTX.replace("wgmma.mma_async", "mma")) == ""
    assert wgmma_serialization(None) == ""
    assert not args.exists()


def test_without_ptxas_the_answer_is_unknown(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compile_report, "_ptxas", lambda target: None)
    assert wgmma_serialization(PTX) is None


def test_a_failing_ptxas_leaves_the_answer_unknown(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    _stand_in_ptxas(tmp_path, monkeypatch, "ptxas fatal   : Unsupported .version 8.7\n", 255)
    assert wgmma_serialization(PTX) is None


def test_the_ptxas_is_the_one_triton_runs_for_the_target() -> None:
    # (triton 3.9 bundles two; the older one rejects 3.9's PTX, which left the check blind.)
    tool = compile_report._ptxas("sm_90a")
    if tool is None:
        pytest.skip("no ptxas here")
    from triton.backends.nvidia.compiler import get_ptxas

    assert tool == get_ptxas(90).path
