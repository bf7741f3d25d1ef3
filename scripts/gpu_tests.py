"""The GPU-marked tests, by group, spread over processes and held to a time budget; a summary.

    python3 scripts/gpu_tests.py [--group all|fwd|bwd|decode|tuner] [--workers N]
                                 [--budget-s S] [--timeout-s S] [--out DIR] [--device-tests]

``scripts/gpu_check.sh --tests-only`` runs it on a CUDA host. Why it is shaped so:

- A device call lasts at most 10 minutes, and compiling is most of the suite's time (Triton
  compiles every kernel variant a test launches, on the CPU; one to three seconds each). So the
  tests run in ``--workers`` processes (pytest-xdist; the compiles are independent and Triton's
  on-disk cache is shared between the processes), each group can be run on its own, and pytest
  is interrupted at ``--budget-s`` so that what did finish is reported instead of nothing.
- Never ``-x``: one failure must not hide the rest of a GPU run.
- No stdlib-only tool reads what pytest reports better than its JUnit XML, so the summary
  (counts per group, the slowest tests, wall time) is read from there.

Standard library only: the GPU image has pytest but not this project's dependencies until the
wheels are installed.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Group -> the test paths it runs (files or folders, relative to the repository root). Every
# GPU-marked test belongs to one (tests/test_gpu_tests.py checks it); "all" runs tests/ whole,
# so a GPU test in a file named nowhere here still runs, and counts as "other".
GROUPS: dict[str, tuple[str, ...]] = {
    "fwd": ("tests/templates/flash/test_flash_fwd.py", "tests/templates/flash/test_block_sparse.py",
            "tests/templates/gluon/test_gluon_fwd.py",
            "tests/templates/gluon/test_gluon_fwd_doc_offsets.py",
            "tests/templates/gluon/test_gluon_pack_gqa.py",
            "tests/templates/flash/test_direct_launch_fwd.py"),
    "bwd": ("tests/templates/flash/test_flash_bwd.py",
            "tests/templates/flash/test_block_sparse_bwd.py",
            "tests/templates/gluon/test_gluon_bwd.py",
            "tests/templates/gluon/test_gluon_bwd_mask.py",
            "tests/templates/gluon/test_gluon_bwd_docs.py",
            "tests/templates/gluon/test_gluon_bwd_split.py",
            "tests/templates/gluon/test_gluon_bwd_tile_order.py",
            "tests/templates/gluon/test_gluon_bwd_d256.py",
            "tests/templates/pytorch/test_torch_flex.py",
            "tests/templates/gluon/test_gluon_cudnn_train.py",
            "tests/templates/gluon/test_gluon_train.py"),
    "decode": ("tests/templates/decode/test_flash_decode.py",
               "tests/templates/decode/test_direct_launch.py"),
    "tuner": ("tests/tuner",),
}
OUTCOMES = ("passed", "failed", "error", "skipped")
# Left after the budget for pytest to stop its workers and write the JUnit XML.
STOP_GRACE_S = 60


@dataclass(frozen=True)
class TestResult:
    group: str
    test: str  # module.path::name as the JUnit XML names it, or "module.path (whole module)"
    outcome: str  # one of OUTCOMES
    seconds: float


def group_of(classname: str) -> str:
    """The group of a test from its JUnit classname (``tests.templates.flash.test_flash_fwd`` or
    ``tests.tuner.test_x.TestClass``)."""
    for group, paths in GROUPS.items():
        for path in paths:
            dotted = path.removesuffix(".py").replace("/", ".")
            if classname == dotted or classname.startswith(dotted + "."):
                return group
    return "other"


def read_junit(path: Path) -> list[TestResult]:
    """One result per test case of pytest's JUnit XML."""
    results = []
    for case in ET.parse(path).getroot().iter("testcase"):
        classname, name = case.get("classname", ""), case.get("name", "")
        if not name:
            continue  # pytest-xdist stopped by the budget leaves unnamed, empty cases
        # A module skipped whole (pytest.importorskip) is one case that names the module.
        test = f"{classname}::{name}" if classname else f"{name} (whole module)"
        children = {child.tag for child in case}
        if "failure" in children:
            outcome = "failed"
        elif "error" in children:
            outcome = "error"
        elif "skipped" in children:
            outcome = "skipped"
        else:
            outcome = "passed"
        results.append(TestResult(group_of(classname or name), test, outcome,
                                  float(case.get("time", 0.0))))
    return results


def summary(results: list[TestResult], *, group: str, workers: int, wall_s: float,
            stopped_at_budget: float | None, exit_code: int, slowest: int = 10) -> str:
    """The table printed at the end: counts per group, totals, the slowest tests, wall time."""
    lines = [f"gpu tests: group {group}, {workers} worker process(es), wall {wall_s:.0f} s, "
             f"pytest exit status {exit_code}"]
    if stopped_at_budget is not None:
        lines.append(f"STOPPED at the budget of {stopped_at_budget:.0f} s: the tests below are "
                     "the ones that finished; run the groups one by one (--group)")
    header = f"{'group':<8}" + "".join(f"{o:>9}" for o in OUTCOMES) + f"{'test s':>10}"
    lines.append(header)
    groups = [g for g in (*GROUPS, "other") if any(r.group == g for r in results)]
    for name in [*groups, "total"]:
        rows = [r for r in results if name in ("total", r.group)]
        counts = Counter(r.outcome for r in rows)
        seconds = sum(r.seconds for r in rows)
        lines.append(f"{name:<8}" + "".join(f"{counts[o]:>9}" for o in OUTCOMES)
                     + f"{seconds:>10.0f}")
    if not results:
        lines.append("(no test results: see the pytest log)")
    timed = sorted((r for r in results if r.outcome != "skipped"), key=lambda r: -r.seconds)
    if timed:
        lines.append(f"slowest {min(slowest, len(timed))} (seconds, outcome, test):")
        lines += [f"  {r.seconds:7.1f}  {r.outcome:<7} {r.test}" for r in timed[:slowest]]
    bad = [r for r in results if r.outcome in ("failed", "error")]
    if bad:
        lines.append("failed:")
        lines += [f"  {r.outcome:<7} {r.test}" for r in bad]
    return "\n".join(lines)


def xdist_dist_mode() -> str | None:
    """``--dist`` for pytest-xdist, or None when it is not installed. worksteal (xdist >= 3.2)
    moves queued tests from busy workers to idle ones: the tests' lengths differ by 100x."""
    if importlib.util.find_spec("xdist") is None:
        return None
    import xdist

    version = tuple(int(p) for p in xdist.__version__.split(".")[:2] if p.isdigit())
    return "worksteal" if version >= (3, 2) else "load"


def pytest_command(paths: list[str], *, workers: int, junit: Path, timeout_s: int,
                   dist: str | None, device_tests: bool = False) -> list[str]:
    """The pytest run: the GPU-marked tests of ``paths``; with ``device_tests`` also those
    that take the ``device`` fixture (``on_device``: kernel tests that run under the
    interpreter in CI and on CUDA here, 250-odd, not selected by default: they double the
    run)."""
    marker = "gpu or on_device" if device_tests else "gpu"
    command = [sys.executable, "-m", "pytest", "-q", "-m", marker, *paths,
               "-p", "no:cacheprovider", "--timeout", str(timeout_s), "--durations", "15",
               f"--junitxml={junit}"]
    if workers > 1 and dist is not None:
        command += ["-n", str(workers), "--dist", dist]
    return command


def run_pytest(command: list[str], log: Path, budget_s: float) -> tuple[int, bool]:
    """Run pytest with its output in ``log``; at ``budget_s`` interrupt it as Ctrl-C would (its
    whole process group, workers included), so that it still writes its report.
    Returns (exit status, whether the budget stopped it)."""
    with log.open("w") as out:
        proc = subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            return proc.wait(timeout=budget_s), False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        return proc.returncode, True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--group", default="all", choices=["all", *GROUPS],
                        help="which tests: all (tests/ whole) or one group")
    parser.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1),
                        help="pytest-xdist processes (default: 8, or fewer CPUs)")
    parser.add_argument("--budget-s", type=float, default=450,
                        help="interrupt pytest after this many seconds and report what "
                             "finished (default 450: with the install and the stop, a run "
                             "stays under 8 minutes)")
    parser.add_argument("--timeout-s", type=int, default=300, help="limit of one test")
    parser.add_argument("--device-tests", action="store_true",
                        help="also the tests that take the device fixture (on CUDA here)")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ROOT / "out")),
                        help="folder for the log, the JUnit XML and the summary")
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error(f"--workers must be at least 1, but got {args.workers}")
    if args.budget_s <= 0:
        parser.error(f"--budget-s must be positive, but got {args.budget_s}")

    args.out.mkdir(parents=True, exist_ok=True)
    name = "gpu-tests" if args.group == "all" else f"gpu-tests-{args.group}"
    junit, log = args.out / f"{name}.xml", args.out / f"{name}.log"
    junit.unlink(missing_ok=True)  # a report left by an earlier run must not be read as this one
    dist = xdist_dist_mode()
    workers = args.workers if dist is not None else 1
    if dist is None and args.workers > 1:
        print("gpu_tests: pytest-xdist is not installed: running in one process")
    paths = ["tests"] if args.group == "all" else list(GROUPS[args.group])
    command = pytest_command(paths, workers=workers, junit=junit, timeout_s=args.timeout_s,
                             dist=dist, device_tests=args.device_tests)
    print("gpu_tests:", " ".join(command[1:]), flush=True)
    start = time.monotonic()
    code, stopped = run_pytest(command, log, args.budget_s)
    wall = time.monotonic() - start
    results = read_junit(junit) if junit.exists() else []
    tail = log.read_text(errors="replace").splitlines()[-40:]
    text = summary(results, group=args.group, workers=workers, wall_s=wall,
                   stopped_at_budget=args.budget_s if stopped else None, exit_code=code)
    (args.out / f"{name}-summary.txt").write_text(text + "\n")
    print("\n".join(tail))
    print(text)
    if stopped:
        return 124
    return code


if __name__ == "__main__":
    sys.exit(main())
