"""What the Gluon template tests (test_gluon_fwd.py, test_gluon_bwd.py) both need: the offline
compile report of a child process, the standalone module imported on its own, and whether a
Hopper GPU is here."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import torch


def compile_reports(template_module: str, jobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The compile report of each job, from a child process without the interpreter (the
    template module is imported there so that the registry knows its template)."""
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    code = (f"import sys, {template_module}; from templates.compile.report import main; "
            "sys.exit(main())")
    done = subprocess.run([sys.executable, "-c", code],
                          input=json.dumps({"target": "h100", "jobs": jobs}),
                          capture_output=True, text=True, env=env, timeout=900, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines()]


def import_standalone(source: str, path: Path) -> ModuleType:
    """``source`` written to ``path`` and imported from there (triton reads a jit function's
    source from its file): proves the pasted-in helpers (gluon_common) make it whole."""
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def is_hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def check_bwd_like(template: Any, inputs: dict[str, Any], problem: Any, config: Any,
                   twin: Any) -> None:
    """gluon_bwd's ``config`` on ``inputs``: no NaN (with DEBUG_POISON, unwritten dK/dV read
    NaN), within the tolerance of the reference, and dK and dV bit for bit those of ``twin``,
    a config whose kernel sums each key row in the same order (dq's atomics come in any)."""
    ref = template.reference(inputs)
    twin_out = template.run(inputs, twin)
    out = template.run(inputs, config)
    for grad in out:
        assert not torch.isnan(grad).any()
    assert template.error(out, ref) <= template.tolerance(problem)
    assert torch.equal(out[1], twin_out[1]) and torch.equal(out[2], twin_out[2])
