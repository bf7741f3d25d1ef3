"""Compile configs for a GPU target and report what each kernel uses: registers, stack
(where spilled registers go), shared memory, compile seconds.

Run as a module in a process without the interpreter; it reads a JSON request on stdin and
prints one JSON report per line, so a compiler crash takes only this process down::

    echo '{"target": "h100", "jobs": [{"template": "flash_fwd", "problem": {...},
           "config": {...}}]}' | TRITON_INTERPRET=0 python -m templates.compile.report

``tuner compile-check`` is the way people run it (``tuner/cli/compile_check.py``).
"""

from __future__ import annotations

import collections
import functools
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, replace
from shutil import which
from typing import Any

import triton

from templates.base import KernelConfig, Problem, Template
from templates.compile.offline_target import offline_target
from templates.device import interpreter_active
from templates.registry import get_template

__all__ = ["CompileOutcome", "KernelResources", "compile_config", "main", "wgmma_serialization"]


@dataclass(frozen=True)
class KernelResources:
    kernel: str
    registers: int | None  # per thread; None if cuobjdump is missing
    stack_bytes: int | None  # per-thread stack frame: spilled registers live there
    shared_bytes: int  # dynamic shared memory per program
    seconds: float  # compile time (less on a hit in Triton's on-disk cache)
    # ptxas's note when it serialized the kernel's wgmma GEMMs (each waited for at once: no
    # GEMM overlaps anything); "" when they pipeline or there are none; None without ptxas.
    wgmma_serialized: str | None = ""


@dataclass(frozen=True)
class CompileOutcome:
    template: str
    problem: dict[str, Any]
    config: dict[str, Any]
    kernels: list[KernelResources]
    error: str = ""  # the compiler's message when a kernel failed to compile
    constraint: str = ""  # why the template's constraint rejects this config ("" if it does not)
    skipped: str = ""  # why nothing was compiled (no stand-in launch for this problem)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def compile_config(template: Template, problem: Problem, config: KernelConfig,
                   constraint: str = "") -> CompileOutcome:
    """Compile every launch of ``config`` for ``problem`` on the active target (a GPU or an
    ``offline_target`` block). A compile error is reported, not raised."""
    outcome = CompileOutcome(template.name, problem.to_dict(), config.to_dict(), [],
                             constraint=constraint)
    launches = template.kernel_launches(problem, config)
    if launches is None:
        return replace(outcome, skipped=f"{template.name} has no stand-in launch for this "
                                        "problem")
    kernels: list[KernelResources] = []
    for fn, grid, args, options in launches:
        start = time.perf_counter()
        try:
            compiled = fn.warmup(*args, grid=grid, **options)
        except Exception as exc:  # noqa: BLE001  (the compiler raises many kinds)
            message = f"{fn.__name__}: {type(exc).__name__}: {exc}"
            return replace(outcome, kernels=kernels, error=message[:2000])
        registers, stack = _cubin_resources(compiled.asm.get("cubin"))
        seconds = round(time.perf_counter() - start, 3)
        kernels.append(KernelResources(kernel=fn.__name__, registers=registers,
                                       stack_bytes=stack,
                                       shared_bytes=int(compiled.metadata.shared),
                                       seconds=seconds,
                                       wgmma_serialized=wgmma_serialization(
                                           compiled.asm.get("ptx"))))
    return replace(outcome, kernels=kernels)


@functools.cache
def _nvidia_tool(name: str) -> str | None:
    """The CUDA tool ``name`` (cuobjdump, ptxas) that triton bundles, else one on PATH."""
    bundled = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    if os.access(bundled, os.X_OK):
        return bundled

    return which(name)


@functools.cache
def _ptxas(target: str) -> str | None:
    """The ptxas that Triton itself runs for ``target`` (``sm_90a``): triton 3.9 bundles a
    second, newer one for Hopper and later, and the first rejects 3.9's PTX."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas  # NVIDIA builds of triton only

        path = get_ptxas(int(re.sub(r"\D", "", target))).path
        return path if path and os.access(path, os.X_OK) else None
    except Exception:  # noqa: BLE001  (another triton's layout: the bundled or PATH one)
        return _nvidia_tool("ptxas")


_PTX_TARGET = re.compile(r"^\s*\.target\s+(sm_\w+)", re.MULTILINE)
_SERIALIZED = re.compile(
    r"\((C75\d\d)\) Potential Performance Loss: (wgmma[^\n]*serialized[^\n]*)")


def wgmma_serialization(ptx: str | None) -> str | None:
    """Whether ptxas serializes the kernel's wgmma GEMMs (then each is waited for as soon as
    it is issued, so no softmax or load runs under one): its note (``C7511: ...``), "" when it
    does not or the PTX has no wgmma, None without ptxas or when it fails. Triton's own
    compile hides these notes; a kernel change that trips one loses its overlap with no error
    (an accumulator in flight across a loop's back edge or meeting zeros at a join of two
    paths, say). ptxas runs a second time here (Triton keeps no output of its own run)."""
    if not ptx or "wgmma.mma_async" not in ptx:
        return ""
    target = _PTX_TARGET.search(ptx)
    if target is None:
        return None
    tool = _ptxas(target.group(1))
    if tool is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        source = os.path.join(tmp, "kernel.ptx")
        with open(source, "w") as f:
            f.write(ptx)
        done = subprocess.run([tool, f"-arch={target.group(1)}", "-v", source, "-o",
                               os.path.join(tmp, "kernel.cubin")],
                              capture_output=True, text=True, check=False)
    if done.returncode != 0:
        return None  # (ptxas refused this PTX, e.g. an older one: nothing is known)
    notes = _SERIALIZED.findall(done.stdout + done.stderr)
    return "; ".join(f"{code}: {text}" for code, text in notes)


def _cuobjdump_output(cubin: bytes | None, option: str) -> str | None:
    """What ``cuobjdump <option>`` prints for the cubin; None without the tool or a cubin."""
    tool = _nvidia_tool("cuobjdump")
    if tool is None or not cubin:
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, option, f.name], capture_output=True, text=True,
                              check=False).stdout


def _cubin_resources(cubin: bytes | None) -> tuple[int | None, int | None]:
    """(registers, stack bytes) per thread, read from the cubin by cuobjdump."""
    out = _cuobjdump_output(cubin, "--dump-resource-usage")
    if out is None:
        return None, None
    found = re.search(r"REG:(\d+)\s+STACK:(\d+)", out)
    if not found:
        return None, None
    return int(found.group(1)), int(found.group(2))


# An instruction line of ``cuobjdump -sass``: "/*01a0*/  [@P0 ]OPCODE.MODS operands ;".
_SASS_LINE = re.compile(r"^\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)")


def sass_opcodes(cubin: bytes | None) -> collections.Counter[str] | None:
    """How many instructions of each opcode (modifiers dropped: ``FFMA.FTZ`` counts as FFMA)
    the cubin's SASS holds, read by cuobjdump; None without it. A static count (each
    instruction once, however often it runs): what a kernel change adds or removes."""
    listing = _cuobjdump_output(cubin, "-sass")
    return None if listing is None else count_opcodes(listing)


def count_opcodes(listing: str) -> collections.Counter[str]:
    """``sass_opcodes`` of a ``cuobjdump -sass`` listing."""
    return collections.Counter(m.group(1) for line in listing.splitlines()
                               if (m := _SASS_LINE.match(line)))


def main() -> int:
    """Read {"target", "jobs": [{"template", "problem", "config"}]} on stdin; print one JSON
    ``CompileOutcome`` per job and line. Exit 2 on a bad request."""
    if interpreter_active():
        print("templates.compile.report needs TRITON_INTERPRET=0 in its environment",
              file=sys.stderr)
        return 2
    try:
        request = json.load(sys.stdin)
        jobs = [(get_template(job["template"]), Problem.from_dict(job["problem"]), job["config"])
                for job in request["jobs"]]
        target = str(request["target"])
    except (KeyError, TypeError, ValueError) as exc:
        print(f"bad compile request: {exc}", file=sys.stderr)
        return 2
    with offline_target(target) as device:
        for template, problem, config_data in jobs:
            try:
                config = template.config(config_data)
            except ValueError as exc:
                bad = CompileOutcome(template.name, problem.to_dict(), dict(config_data), [],
                                     error=f"bad config: {exc}")
                print(json.dumps(bad.to_dict()), flush=True)
                continue
            reason = template.constraint(problem, config, device) or ""
            try:
                outcome = compile_config(template, problem, config, reason)
            except Exception:  # noqa: BLE001  (report the job, go on with the others)
                outcome = CompileOutcome(template.name, problem.to_dict(), config.to_dict(),
                                         [], error=traceback.format_exc(limit=3)[-2000:],
                                         constraint=reason)
            print(json.dumps(outcome.to_dict()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
