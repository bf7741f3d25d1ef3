"""``tuner compile-check``: a spec's default configs compiled for the H100 on this CPU."""

from __future__ import annotations

import json
from pathlib import Path

from tests.tuner.cli.test_sweep_cli import cli
from tuner.cli.compile_check import _compile_in_child

SPEC = """
name = "compile-check-test"
templates = ["flash_fwd", "flash_decode"]
dtypes = ["bfloat16"]
causal = ["none", "top_left"]
shapes = [{B = 1, H = 2, N = 256, D = 64}]
"""


def test_compile_check_compiles_each_default_config_for_the_target(tmp_path: Path) -> None:
    spec = tmp_path / "spec.toml"
    spec.write_text(SPEC)
    code, out, err = cli("compile-check", str(spec), "--target", "h100", "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["device"] == "NVIDIA H100 80GB HBM3"
    outcomes = report["outcomes"]
    assert [o["problem"]["causal"] for o in outcomes] == ["none", "top_left"]
    for outcome in outcomes:
        assert outcome["error"] == "" and outcome["template"] == "flash_fwd"
        (kernel,) = outcome["kernels"]
        assert kernel["registers"] > 0 and kernel["shared_bytes"] > 0
    # Decode takes at most 16 query tokens: skipped, with the reason.
    assert all("flash_decode" in s["problem"] and "16 query tokens" in s["why"]
               for s in report["skipped"]) and len(report["skipped"]) == 2


def test_compile_check_compiles_the_decode_kernels(tmp_path: Path) -> None:
    spec = tmp_path / "spec.toml"
    spec.write_text(SPEC.replace("causal = [\"none\", \"top_left\"]", "causal = [\"none\"]")
                    .replace("{B = 1, H = 2, N = 256, D = 64}",
                             "{B = 1, H_q = 8, H_kv = 2, N_q = 1, N_kv = 2048, D = 64}"))
    code, out, err = cli("compile-check", str(spec), "--target", "h100", "--json")
    assert code == 0, err
    [outcome] = [o for o in json.loads(out)["outcomes"] if o["template"] == "flash_decode"]
    assert outcome["error"] == ""
    # The default splits a 2k cache in two: the split kernel, then the separate combine.
    assert [k["kernel"] for k in outcome["kernels"]] == ["_decode_split_kernel",
                                                       "_decode_combine_kernel"]
    assert all(k["registers"] > 0 for k in outcome["kernels"])


def test_an_unknown_target_is_a_user_error() -> None:
    code, out, _ = cli("compile-check", "quick", "--target", "v100", "--json")
    assert code == 2
    assert "unknown --target 'v100'" in json.loads(out)["error"]


def test_jobs_of_a_dead_compiling_process_are_reported_failed() -> None:
    # A request the child refuses (exit 2) stands in for a compiler abort killing it.
    jobs = [{"template": "flash_fwd", "problem": {"batch": "x"}, "config": {}}]
    (outcome,) = _compile_in_child({"target": "h100", "jobs": jobs}, timeout_s=300)
    assert "the compiling process died" in outcome["error"]
    assert "bad compile request" in outcome["error"]
