"""A killed sweep leaves no process behind: its compile-ahead pool dies with it.

Seen before the fix: ``sweep`` killed by a timeout (SIGKILL) left its two spawned pool
processes and multiprocessing's resource tracker running for good, and the tracker kept the
sweep's stdout open, so a pipeline reading it never ended."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="PR_SET_PDEATHSIG is Linux's")

ROOT = Path(__file__).resolve().parents[3]

# A parent that starts a compile-ahead pool as CompileAhead does, prints its processes' pids,
# and is killed.
PARENT = textwrap.dedent("""
    import multiprocessing as mp, os, signal, sys
    from concurrent.futures import ProcessPoolExecutor
    from tuner.tuning.runner.compile_ahead import _init_pool

    pool = ProcessPoolExecutor(max_workers=2, mp_context=mp.get_context("spawn"),
                               initializer=_init_pool, initargs=({},))
    pids = {pool.submit(os.getpid).result() for _ in range(8)}
    print(" ".join(map(str, sorted(pids))), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
""")


def alive(pid: int) -> bool:
    """Running (a zombie waiting for whoever adopted it to reap it counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def test_the_compile_ahead_pool_dies_with_a_killed_parent(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out, err = tmp_path / "out", tmp_path / "err"
    # Files, not pipes: a survivor holding a pipe would keep run() waiting for its end.
    with out.open("w") as stdout, err.open("w") as stderr:
        done = subprocess.run([sys.executable, "-c", PARENT], stdout=stdout, stderr=stderr,
                              env=env, timeout=120, check=False)
    assert done.returncode == -9, err.read_text()[-2000:]
    pids = [int(p) for p in out.read_text().split()]
    assert pids, err.read_text()[-2000:]
    deadline = time.monotonic() + 15
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    survivors = [p for p in pids if alive(p)]
    for p in survivors:  # do not leave them behind in CI either
        os.kill(p, 9)
    assert not survivors, f"pool processes {survivors} outlived their parent"
