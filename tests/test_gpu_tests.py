"""scripts/gpu_tests.py, the GPU run's test runner, exercised on the CPU: the GPU-marked tests
are skipped here, but collection, the groups, the worker processes, the budget and the summary
are the ones a GPU host gets."""

from __future__ import annotations

import importlib.util
import itertools
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from tests.templates.gpu_matrix import bf16_product_fp16_diagonal

ROOT = Path(__file__).resolve().parents[1]
# Test dependencies that the GPU image lacks (schemathesis) or that are optional everywhere
# (transformers, matplotlib, psycopg): none of them may stop the collection.
OPTIONAL_MODULES = ("schemathesis", "transformers", "matplotlib", "psycopg")


def load_runner() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_tests", ROOT / "scripts" / "gpu_tests.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


RUNNER = load_runner()


BLOCKER = """
import sys

class Absent:
    # Finds the optional modules first and says they are not installed.
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, Absent())
"""


def run_runner(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """The runner in a fresh process in which the optional test dependencies cannot be
    imported, as on a host without them: a sitecustomize that every process the runner starts
    (pytest and its xdist workers) finds through PYTHONPATH, schemathesis's pytest plugin not
    loaded, and no assertion rewriting (its import hook comes first and would import the
    modules of installed pytest plugins, schemathesis among them, past the blocker)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(f"BLOCKED = {OPTIONAL_MODULES!r}\n{BLOCKER}")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)]),
           "PYTEST_ADDOPTS": "-p no:schemathesis --assert=plain"}
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_tests.py"), *args,
                           "--out", str(tmp_path / "out")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_every_gpu_test_runs_in_a_group_without_the_optional_dependencies(
        tmp_path: Path) -> None:
    done = run_runner(tmp_path, "--group", "all", "--workers", "2")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "-x" not in done.stdout.split("\n")[0].split()  # one failure must not end the run
    results = RUNNER.read_junit(tmp_path / "out" / "gpu-tests.xml")
    assert "tests.api.test_schemathesis (whole module)" in {r.test for r in results}
    tests = [r for r in results if "::" in r.test]
    assert {r.group for r in tests} == set(RUNNER.GROUPS), (
        f"GPU tests outside every group of scripts/gpu_tests.py: "
        f"{[r.test for r in tests if r.group == 'other']}")
    if not torch.cuda.is_available():
        assert {r.outcome for r in results} == {"skipped"}
    summary = (tmp_path / "out" / "gpu-tests-summary.txt").read_text()
    assert summary in done.stdout
    total = next(line for line in summary.splitlines() if line.startswith("total"))
    assert total.split()[1:5] == [str(sum(r.outcome == o for r in results))
                                  for o in RUNNER.OUTCOMES]


@pytest.mark.slow
def test_the_budget_interrupts_pytest_and_still_reports(tmp_path: Path) -> None:
    # Starting pytest alone (its imports, torch's through the conftest) takes longer than
    # 0.3 s: pytest is interrupted and the run says so. (A 2 s budget was met by a fast CI
    # machine, which collected and skipped the whole group in 0.2 s.)
    done = run_runner(tmp_path, "--group", "decode", "--workers", "1", "--budget-s", "0.3")
    assert done.returncode == 124, done.stdout + done.stderr
    assert "STOPPED at the budget of 0 s" in done.stdout
    assert (tmp_path / "out" / "gpu-tests-decode-summary.txt").exists()


def test_bad_arguments_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for args, message in ((["--workers", "0"], "--workers must be at least 1, but got 0"),
                          (["--budget-s", "-1"], "--budget-s must be positive, but got -1"),
                          (["--group", "kernels"], "invalid choice: 'kernels'")):
        with pytest.raises(SystemExit) as exc:
            RUNNER.main([*args, "--out", str(tmp_path)])
        assert exc.value.code == 2 and message in capsys.readouterr().err
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--tests", "x"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "unknown argument '--tests'" in done.stderr
    assert "fix:" in done.stderr


JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" errors="1" failures="1" skipped="2" tests="7">
<testcase classname="tests.templates.flash.test_flash_fwd" name="test_gpu_matrix[a]" time="12.4"/>
<testcase classname="tests.templates.flash.test_block_sparse" name="test_gpu_block_masks[b]" time="3.0">
  <failure message="assert 0.1 &lt;= 0.01">trace</failure></testcase>
<testcase classname="tests.templates.flash.test_flash_bwd" name="test_gpu_matrix[c]" time="20.0">
  <error message="setup">trace</error></testcase>
<testcase classname="tests.tuner.cli.test_sweep_cli.TestGpu" name="test_on_the_gpu" time="0.0">
  <skipped message="no GPU"/></testcase>
<testcase classname="tests.api.test_api" name="test_gpu_elsewhere" time="1.0"/>
<testcase classname="" name="tests.tuner.test_attention_hf" time="0.000">
  <skipped message="collection skipped"/></testcase>
<testcase time="0.005"/>
</testsuite></testsuites>
"""


def test_the_summary_counts_each_group_from_the_junit_report(tmp_path: Path) -> None:
    path = tmp_path / "report.xml"
    path.write_text(JUNIT)
    results = RUNNER.read_junit(path)
    assert [(r.group, r.outcome) for r in results] == [
        ("fwd", "passed"), ("fwd", "failed"), ("bwd", "error"), ("tuner", "skipped"),
        ("other", "passed"), ("tuner", "skipped")]  # the unnamed case: no result
    assert results[-1].test == "tests.tuner.test_attention_hf (whole module)"
    text = RUNNER.summary(results, group="all", workers=8, wall_s=301.4, stopped_at_budget=None,
                          exit_code=1, slowest=2)
    rows = {line.split()[0]: line.split()[1:] for line in text.splitlines()[2:8]}
    assert rows == {"fwd": ["1", "1", "0", "0", "15"], "bwd": ["0", "0", "1", "0", "20"],
                    "tuner": ["0", "0", "0", "2", "0"], "other": ["1", "0", "0", "0", "1"],
                    "total": ["2", "1", "1", "2", "36"],
                    "slowest": ["2", "(seconds,", "outcome,", "test):"]}
    assert "wall 301 s" in text and "STOPPED" not in text
    assert text.splitlines()[-2:] == [
        "  failed  tests.templates.flash.test_block_sparse::test_gpu_block_masks[b]",
        "  error   tests.templates.flash.test_flash_bwd::test_gpu_matrix[c]"]
    stopped = RUNNER.summary([], group="bwd", workers=8, wall_s=460, stopped_at_budget=450,
                             exit_code=2)
    assert "STOPPED at the budget of 450 s" in stopped and "no test results" in stopped


def test_the_gpu_matrix_keeps_every_pair_of_values() -> None:
    axes = ((64, 128, 256), ("none", "top_left", "bottom_right"), ("default", "pointer", "tma"))
    cases = [p.values for p in bf16_product_fp16_diagonal(*axes)]
    assert len(cases) == 27 + 3
    assert len({p.id for p in bf16_product_fp16_diagonal(*axes)}) == len(cases)
    all_axes = ((torch.bfloat16, torch.float16), *axes)
    for i, j in itertools.combinations(range(len(all_axes)), 2):
        wanted = set(itertools.product(all_axes[i], all_axes[j]))
        assert {(case[i], case[j]) for case in cases} == wanted, (i, j)


def test_device_tests_are_marked_and_selected_only_when_asked(tmp_path: Path) -> None:
    # Kernel tests written with the device fixture run on CUDA on a GPU host, but only the
    # gpu marker selected them: softcap's and varlen's GPU runs depended on someone naming them.
    base = RUNNER.pytest_command(["tests"], workers=1, junit=tmp_path / "j.xml", timeout_s=60,
                                 dist=None)
    more = RUNNER.pytest_command(["tests"], workers=1, junit=tmp_path / "j.xml", timeout_s=60,
                                 dist=None, device_tests=True)
    def marker(command: list[str]) -> str:
        return command[command.index("-m", command.index("pytest")) + 1]

    assert (marker(base), marker(more)) == ("gpu", "gpu or on_device")
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                           "-p", "no:cacheprovider", "-m", "on_device",
                           "tests/tuner/test_varlen.py"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    collected = [line for line in done.stdout.splitlines() if "::" in line]
    assert collected and all("test_varlen.py::" in line for line in collected), done.stdout
    assert not any("test_bad_arguments_are_named" in line for line in collected)  # no device
