"""``tuner compile-check``: compile a spec's configs for a GPU this host does not have.

Triton compiles on the CPU; only running needs the GPU. For every problem of a spec, the
default config for the target GPU (and with --known-good the template's measured runners-up)
is compiled down to a cubin in a child process (``templates.compile.report`` under
``templates.compile.offline_target``), and the registers, stack bytes (spills) and shared memory of
each kernel are shown. A config that fails to compile makes the command exit 1: a CI gate
for kernel changes, and a look at a config's resources before GPU time is spent on it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Annotated, Any

import typer
from rich.table import Table

from tuner.cli.common import (
    JsonOption,
    config_text,
    console,
    print_json,
    print_table,
    problem_label,
)
from tuner.errors import TunerError

__all__ = ["compile_check"]

EXIT_COMPILE_FAILED = 1


def compile_check(
    spec: Annotated[str, typer.Argument(
        help="a suite (quick, standard, cpu) or a .toml/.yaml spec file")] = "quick",
    target: Annotated[str, typer.Option(
        "--target", help="the GPU to compile for: h100, h200, a100, b200")] = "h100",
    known_good: Annotated[bool, typer.Option(
        "--known-good", help="also the template's measured runners-up, not only the default "
                             "config")] = False,
    timeout: Annotated[float, typer.Option(
        "--timeout", help="seconds for all the compiles together")] = 1800.0,
    json_out: JsonOption = False,
) -> None:
    """Compile each problem's default config for --target without that GPU; show registers,
    stack (spills) and shared memory per kernel. Exit 1 if a config fails to compile."""
    # lazy: optuna, sqlalchemy, torch+triton +3.2 s (2-core CPU); keeps `tuner --help` < 1 s
    from templates.compile.offline_target import TARGETS
    from tuner.tuning.suites import resolve_spec
    from tuner.tuning.sweep import expand_tasks

    if target not in TARGETS:
        raise TunerError(f"unknown --target {target!r}", f"use one of {', '.join(TARGETS)}")
    device = TARGETS[target]
    resolved, _ = resolve_spec(spec, interpreter=False)
    tasks, skipped = expand_tasks(resolved)
    jobs = []
    for task in tasks:
        configs = [task.template.default_config(task.problem, device)]
        if known_good:
            configs += task.template.known_good_configs(task.problem, device)
        jobs += [{"template": task.template.name, "problem": task.problem.to_dict(),
                  "config": cfg.to_dict()} for cfg in configs]
    outcomes = _compile_in_child({"target": target, "jobs": jobs}, timeout)
    failed = [o for o in outcomes if o["error"]]
    if json_out:
        print_json({"target": target, "device": device.name, "outcomes": outcomes,
                    "skipped": [{"problem": label, "why": why} for label, why in skipped]})
    else:
        _print_table(outcomes, device.name)
        for label, why in skipped:
            console.print(f"[dim]skipped {label}: {why}[/]")
        for outcome in failed:
            console.print(f"[bold red]failed[/] {outcome['template']} "
                          f"{problem_label(outcome['problem'])} "
                          f"{config_text(outcome['config'])}:\n{outcome['error']}",
                          highlight=False)
    if failed:
        raise typer.Exit(EXIT_COMPILE_FAILED)


def _compile_in_child(request: dict[str, Any], timeout_s: float) -> list[dict[str, Any]]:
    """Run ``templates.compile.report`` in a child without the interpreter (``@triton.jit``
    decides at import time), so a compiler abort takes down only the child."""
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    try:
        done = subprocess.run([sys.executable, "-m", "templates.compile.report"],
                              input=json.dumps(request), capture_output=True, text=True,
                              env=env, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        raise TunerError(f"compiling {len(request['jobs'])} configs took over {timeout_s:g} s",
                         "raise --timeout, or check fewer problems") from None
    # lazy: torch+triton +1.7 s (2-core CPU); keeps `tuner --help` < 1 s
    from templates.compile.report import CompileOutcome

    outcomes = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or len(outcomes) < len(request["jobs"]):
        compiled = {_job_key(o) for o in outcomes}
        lost = [job for job in request["jobs"] if _job_key(job) not in compiled]
        why = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        # The child died (a compiler abort): the job it was on, and those after, have no
        # outcome; report the first as failed with the child's last words.
        outcomes += [CompileOutcome(
            job["template"], job["problem"], job["config"], [],
            error=f"the compiling process died ({why})" if i == 0 else
                  "not compiled: the compiling process died before it").to_dict()
            for i, job in enumerate(lost)]
    return outcomes


def _job_key(job: dict[str, Any]) -> tuple[str, str, str]:
    """A job (or its outcome) by template, problem and config."""
    return (job["template"], json.dumps(job["problem"], sort_keys=True),
            json.dumps(job["config"], sort_keys=True))


def _print_table(outcomes: list[dict[str, Any]], device_name: str) -> None:
    table = Table(title=f"compiled for {device_name} (no GPU used)")
    for column in ("template", "problem", "kernel", "regs", "stack B", "smem KiB", "s",
                   "note"):
        table.add_column(column, justify="right" if column in (
            "regs", "stack B", "smem KiB", "s") else "left")
    for outcome in outcomes:
        note = ("FAILED" if outcome["error"] else outcome["skipped"] or (
            f"constraint: {outcome['constraint']}" if outcome["constraint"] else ""))
        kernels = outcome["kernels"] or [None]
        for kernel in kernels:
            serialized = kernel and kernel.get("wgmma_serialized")
            # (Serialized GEMMs compute the same, without overlapping anything: slower.)
            row_note = "; ".join(filter(None, [note, serialized and
                                               f"wgmma serialized ({serialized[:5]})"]))
            table.add_row(
                outcome["template"], problem_label(outcome["problem"]),
                kernel["kernel"].lstrip("_") if kernel else "-",
                _num(kernel and kernel["registers"]), _num(kernel and kernel["stack_bytes"]),
                f"{kernel['shared_bytes'] / 1024:.0f}" if kernel else "-",
                f"{kernel['seconds']:.1f}" if kernel else "-", row_note)
    print_table(table)


def _num(value: Any) -> str:
    return "-" if value is None else str(value)
