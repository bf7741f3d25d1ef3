"""benchmarks/gluon_sass_diff.py and ``templates.compile.report.count_opcodes``: the opcode
count of a listing, the diff of two, and one offline compile of a DIAG experiment."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from templates.compile.report import count_opcodes
from templates.gluon.fwd import GLUON_MISSING
from tests.benchmarks.benchmark_scripts import BENCHMARKS, load_benchmark_script

sass_diff = load_benchmark_script("gluon_sass_diff")

LISTING = """
        code for sm_90a
        /*0000*/                   LDC R1, c[0x0][0x28] ;                 /* 0x00000a00ff017b82 */
        /*0010*/              @!P0 FFMA.FTZ R2, R3, R4, R5 ;              /* 0x000fe20000010000 */
        /*0020*/                   FFMA R6, R7, R8, R9 ;                  /* 0x000fe20000010000 */
        /*0030*/               @P1 BRA 0x80 ;                             /* 0x000fea0003800000 */
        /*17af0*/                  NOP;                                   /* 0x0000000000007918 */
        .L_x_1:
"""


def test_opcodes_are_counted_without_modifiers_or_predicates() -> None:
    assert count_opcodes(LISTING) == {"LDC": 1, "FFMA": 2, "BRA": 1, "NOP": 1}


def test_a_diff_keeps_only_what_changed() -> None:
    a = {"instructions": 4, "stack_bytes": 0, "opcodes": {"FMUL": 2, "FADD": 1, "MUFU": 1}}
    b = {"instructions": 3, "stack_bytes": 8, "opcodes": {"FFMA": 2, "MUFU": 1}}
    b["wgmma_serialized"] = "C7511: wgmma.mma_async instructions are serialized"
    assert sass_diff.diff_row(a, b) == {"instructions": (4, 3), "stack_bytes": (0, 8),
                                        "changed": {"FADD": -1, "FFMA": 2, "FMUL": -2},
                                        "wgmma_serialized": ("", b["wgmma_serialized"])}


@pytest.mark.skipif(bool(GLUON_MISSING), reason=GLUON_MISSING or "gluon present")
def test_a_diag_compiles_offline_and_its_opcode_change_shows(tmp_path: Path) -> None:
    # DIAG 1 (the unmasked step without its exponentials) against DIAG 0, compiled for the
    # H100 on one causal d64 shape (a subprocess: compiling needs the interpreter off before
    # templates is imported).
    out = tmp_path / "diff.json"
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    done = subprocess.run([sys.executable, str(BENCHMARKS / "gluon_sass_diff.py"), "--diag",
                           "1", "--shapes", "1x2x512x64", "--causal", "top_left", "--json",
                           str(out)],
                          capture_output=True, text=True, env=env, timeout=900, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    (row,) = json.loads(out.read_text())["rows"]
    a, b = row["instructions"]
    assert b < a
    # The exponentials are MUFU.EX2s: the unmasked step's go, the masked step's stay.
    assert row["changed"]["MUFU"] < 0
    assert row["wgmma_serialized"] == ["", ""]  # (both pipeline their GEMMs)
