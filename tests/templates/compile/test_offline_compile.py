"""Compiling for a GPU this machine does not have (templates.compile.offline_target,
templates.compile.report): real sm_90 cubins from the CPU, in a child process without the
interpreter. The tests themselves run under the interpreter, which is why every compile
happens in a child."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest
import torch

from templates import Problem, get_template
from templates.compile.offline_target import TARGETS, offline_target
from templates.compile.standin_tensor import StandinTensor
from templates.flash.fwd import FwdConfig, shared_memory_estimate

SMALL = Problem(1, 2, 2, 256, 256, 64, "bfloat16", "none")


def compile_report(request: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    return subprocess.run([sys.executable, "-m", "templates.compile.report"],
                          input=json.dumps(request), capture_output=True, text=True, env=env,
                          timeout=600, check=False)


def test_standin_strides_are_those_of_a_contiguous_tensor() -> None:
    for shape in ((2, 3, 5, 7), (4, 1, 9), (16,)):
        assert StandinTensor(torch.float16, shape).stride() == torch.empty(shape).stride()


def test_offline_target_refuses_the_interpreter_and_unknown_targets() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"  # how the test session runs
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=0"), offline_target("h100"):
        pass
    with pytest.raises(ValueError, match="unknown offline target 'h900'.*h100"), \
            offline_target("h900"):
        pass


def test_forward_and_backward_compile_for_the_h100_without_a_gpu() -> None:
    device = TARGETS["h100"]
    jobs = []
    for name in ("flash_fwd", "flash_bwd"):
        template = get_template(name)
        config = template.default_config(SMALL, device)
        jobs.append({"template": name, "problem": SMALL.to_dict(), "config": config.to_dict()})
    jobs.append({"template": "flash_fwd", "problem": SMALL.to_dict(), "config": {"BLOCK_M": 7}})
    done = compile_report({"target": "h100", "jobs": jobs})
    assert done.returncode == 0, done.stderr
    fwd, bwd, bad = (json.loads(line) for line in done.stdout.splitlines())

    assert fwd["error"] == "" and fwd["constraint"] == ""
    assert fwd["config"]["use_tma"], "the Hopper default reads through TMA descriptors"
    (kernel,) = fwd["kernels"]
    assert kernel["kernel"] == "_flash_fwd_kernel"
    assert 32 < kernel["registers"] <= 255 and kernel["stack_bytes"] >= 0
    # The constraint's shared-memory estimate is the compiler's number (within 1 KiB).
    estimate = shared_memory_estimate(SMALL, FwdConfig.from_dict(fwd["config"]))
    assert abs(kernel["shared_bytes"] - estimate) <= 1024, (kernel["shared_bytes"], estimate)

    assert bwd["error"] == ""
    assert [k["kernel"] for k in bwd["kernels"]] == [
        "_flash_bwd_preprocess_kernel", "_flash_bwd_dkdv_kernel", "_flash_bwd_dq_kernel"]
    assert all(k["registers"] > 0 for k in bwd["kernels"])

    assert "bad config" in bad["error"] and "BLOCK_M" in bad["error"]


def test_a_block_mask_problem_is_skipped_not_failed() -> None:
    sparse = Problem(1, 2, 2, 256, 256, 64, "bfloat16", "none", mask="sliding:128")
    config = get_template("flash_fwd").default_config(sparse, TARGETS["h100"])
    done = compile_report({"target": "h100", "jobs": [
        {"template": "flash_fwd", "problem": sparse.to_dict(), "config": config.to_dict()}]})
    (outcome,) = (json.loads(line) for line in done.stdout.splitlines())
    assert outcome["error"] == "" and outcome["kernels"] == []
    assert "no stand-in launch" in outcome["skipped"]


def test_a_bad_request_exits_2_naming_what_is_wrong() -> None:
    done = compile_report({"target": "h100", "jobs": [{"template": "nope"}]})
    assert done.returncode == 2 and "bad compile request" in done.stderr
