"""``import triton`` before ``import tuner`` on a machine without CUDA (issue 20, item 3):
the first kernel call says what to set, instead of the interpreter's "Cannot call
@triton.jit'd outside of the scope of a kernel"; with TRITON_INTERPRET=1 set first it runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = """
import triton  # before tuner: triton's own jit functions are built for a GPU compiler
import torch
import tuner

q = torch.randn(1, 2, 16, 16, dtype=torch.float16)
print("sdpa shape", tuple(tuner.attention(q, q, q).shape))  # unmeasured: torch SDPA, no kernel
with tuner.use_implementation("flash"):  # a kernel of ours: the interpreter must be in use
    print("shape", tuple(tuner.attention(q, q, q).shape))
"""

pytestmark = pytest.mark.skipif(torch.cuda.is_available(),
                                reason="a CUDA host does not use the interpreter")


def run(interpret: str | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    env["TUNER_DATABASE_URL"] = "sqlite:///:memory:"
    if interpret is not None:
        env["TRITON_INTERPRET"] = interpret
    return subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True,
                          text=True, timeout=300, cwd=ROOT)


@pytest.mark.slow
def test_triton_imported_first_gets_a_message_that_says_what_to_set() -> None:
    done = run(None)
    assert done.returncode != 0
    assert "sdpa shape (1, 2, 16, 16)" in done.stdout  # SDPA needs no Triton
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("RuntimeError: triton was imported before TRITON_INTERPRET=1")
    assert "TRITON_INTERPRET=1 python train.py" in last and "import tuner" in last
    assert "Cannot call @triton.jit'd" not in done.stderr


@pytest.mark.slow
def test_with_the_interpreter_set_first_any_import_order_works() -> None:
    done = run("1")
    assert done.returncode == 0, done.stderr
    assert "shape (1, 2, 16, 16)" in done.stdout
