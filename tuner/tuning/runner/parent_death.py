"""A child process that dies with its parent (Linux: ``prctl(PR_SET_PDEATHSIG, SIGKILL)``).

The sweep's children (the trial worker, the compile-ahead pool) wait on pipes whose other
ends their own processes also hold, so they never see the sweep go: killed (SIGKILL, a
timeout's kill), it would leave them running, each holding a Python with torch and Triton
loaded, and the sweep's stdout open (a ``sweep | tail`` then never ends: seen with
``benchmarks/e2e_hf.py --tune`` on the H100). Asking Linux to kill them with their parent
covers every way the parent can end.
"""

from __future__ import annotations

import ctypes
import signal
import sys

__all__ = ["die_with_parent"]

PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent ends (elsewhere: nothing)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass
