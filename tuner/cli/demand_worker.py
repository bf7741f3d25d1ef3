"""``tuner worker``: tune what jobs ran untuned, most reported first, for ever (or until told).

The docker-compose ``demand-worker`` service runs it: each replica claims a GPU, then the
demand of that GPU's device key (tuner/demand/worker.py), in the database it shares with the
service. With ``--service URL`` a GPU host that reaches only the service does the same through its
API (TUNER_TOKEN), tuning into a database of its own (``--db``) and uploading the results.
"""

from __future__ import annotations

import json
import sys
import threading
from typing import Annotated, Any

import typer

from tuner.cli.common import (
    INTERPRETER_WARNING,
    DbOption,
    GpuLockDirOption,
    JsonOption,
    console,
    err_console,
    gpu_lock_dir,
    problem_label,
    settings_with,
)

__all__ = ["worker"]


def worker(
    trials: Annotated[int, typer.Option(
        "--trials", "-n", help="configs to measure per problem")] = 20,
    timeout: Annotated[float, typer.Option(
        "--timeout", help="seconds per trial, compile included")] = 300.0,
    sampler: Annotated[str, typer.Option(
        "--sampler", help="tpe, gp, random, or grid (exhaustive)")] = "tpe",
    seed: Annotated[int | None, typer.Option("--seed", help="sampler and input seed")] = None,
    finalists: Annotated[int, typer.Option(
        "--finalists", help="per problem, configs measured again at the end (0: off)")] = 3,
    final_repeats: Annotated[int, typer.Option(
        "--final-repeats", help="re-measurements of each finalist")] = 2,
    heartbeat: Annotated[int, typer.Option(
        "--heartbeat", help="seconds between trial heartbeats; a trial silent 3x as long is "
                            "a dead worker's and is retried")] = 10,
    compile_ahead: Annotated[int | None, typer.Option(
        "--compile-ahead", help="processes compiling upcoming configs (default: a few on a "
                                "GPU, none under the interpreter)", show_default=False)] = None,
    poll: Annotated[float, typer.Option(
        "--poll", help="seconds to wait before looking again when nothing is to be tuned")
    ] = 30.0,
    lease: Annotated[float, typer.Option(
        "--lease", help="seconds a claim holds unless renewed (it is renewed every third of "
                        "it); a killed worker's claim is taken over once it passes")] = 300.0,
    max_jobs: Annotated[int, typer.Option(
        "--max-jobs", help="stop after tuning this many problems (0: never)")] = 0,
    until_idle: Annotated[bool, typer.Option(
        "--until-idle", help="stop when nothing is left to claim, instead of waiting")] = False,
    max_attempts: Annotated[int, typer.Option(
        "--max-attempts", help="claims of one problem whose workers all died before it is "
                               "given up (failed)")] = 3,
    template: Annotated[list[str] | None, typer.Option(
        "--template", help="tune only the demand for this template (repeatable; default: "
                           "every registered template)", show_default=False)] = None,
    service: Annotated[str | None, typer.Option(
        "--service", help="claim through the config service at this URL (needs TUNER_TOKEN) "
                          "instead of the database, tune into --db, and upload the results",
        show_default=False)] = None,
    lock_dir: GpuLockDirOption = None,
    db: DbOption = None,
    json_out: JsonOption = False,
) -> None:
    """Tune the problems jobs ran without a tuned config (GET /v1/demand), most reported
    first, for this worker's GPU; wait and look again when there are none.

    Claims are leases: a worker killed mid-job loses nothing (its trials are stored, the next
    worker takes the problem over once the lease passes). Ctrl-C gives the claim back. With
    --service, --db is this worker's own database (default: TUNER_DATABASE_URL, else
    sqlite:///tuner.db) and each job's results are uploaded before it is marked done.
    """
    # lazy: httpx, optuna, sqlalchemy, torch+triton +3.4 s (2-core CPU); keeps `tuner --help` < 1 s
    import optuna

    from tuner.demand.service_queue import ServiceQueue
    from tuner.demand.worker import WorkerOptions, run_worker
    from tuner.tuning.gpus import gpus_for_sweep
    from tuner.tuning.sweep import SweepOptions

    settings = settings_with(db)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    options = WorkerOptions(
        sweep=SweepOptions(trials=trials, timeout_s=timeout, sampler=sampler, seed=seed,
                           compile_ahead=compile_ahead, heartbeat_s=heartbeat,
                           finalists=finalists, final_repeats=final_repeats),
        poll_s=poll, lease_s=lease, max_jobs=max_jobs, until_idle=until_idle,
        max_attempts=max_attempts, templates=tuple(template or ()))
    stop = threading.Event()
    show = _JsonLines() if json_out else _Lines()
    queue = ServiceQueue(service, settings.token) if service is not None else None
    try:
        with gpus_for_sweep(gpu_lock_dir(lock_dir), 1) as claimed:
            if claimed and not json_out:
                console.print(f"claimed GPU {', '.join(claimed)}")
            run_worker(options, db_url=settings.database_url, queue=queue,
                       template_modules=tuple(settings.template_modules), on_event=show,
                       stop=stop)
    except KeyboardInterrupt:
        err_console.print("[yellow]interrupted: the claim is given back, everything measured "
                          "is stored[/]")
        raise typer.Exit(130) from None
    finally:
        if queue is not None:
            queue.close()


class _Lines:
    """What the worker does, one line per step, for people."""

    def __call__(self, event: Any) -> None:
        # lazy: optuna, sqlalchemy, torch+triton +3.3 s (2-core CPU); keeps `tuner --help` < 1 s
        from tuner.demand.worker import JobClaimed, JobFinished, WorkerStarted, WorkerWaits

        if isinstance(event, WorkerStarted):
            device = event.device
            console.print(f"[bold]worker {event.worker}[/] on {device.get('name')} (triton "
                          f"{device.get('triton_version')}, torch "
                          f"{device.get('torch_version')}): tunes the demand of {event.where} "
                          f"for {', '.join(sorted(event.versions))}", highlight=False)
            if device.get("name") == "cpu-interpreter":
                console.print(f"[yellow]{INTERPRETER_WARNING}[/]")
        elif isinstance(event, JobClaimed):
            job = event.job
            console.print(f"claimed #{job.demand_id}: {job.template} "
                          f"{problem_label(job.problem)} ({job.reports} report(s), attempt "
                          f"{job.attempt})")
        elif isinstance(event, JobFinished):
            color = {"done": "green", "failed": "red"}.get(event.status, "yellow")
            console.print(f"  [{color}]{event.status}[/] #{event.job.demand_id}: {event.note}")
        elif isinstance(event, WorkerWaits):
            why = event.why or "nothing to tune"
            console.print(f"[dim]{why}; looking again in {event.seconds:g} s[/]",
                          highlight=False)


class _JsonLines:
    """One JSON object per finished job, for machines (and compose logs)."""

    def __call__(self, event: Any) -> None:
        # lazy: optuna, sqlalchemy, torch+triton +3.2 s (2-core CPU); keeps `tuner --help` < 1 s
        from tuner.demand.worker import JobFinished, WorkerStarted, WorkerWaits

        if isinstance(event, WorkerStarted):
            print_json_line({"event": "started", "worker": event.worker,
                             "device": event.device.get("key"),
                             "templates": event.versions, "queue": event.where})
        elif isinstance(event, WorkerWaits) and event.why:  # the queue cannot be reached
            print_json_line({"event": "unreachable", "reason": event.why,
                             "retry_s": event.seconds})
        elif isinstance(event, JobFinished):
            job, report = event.job, event.report
            best = report.problems[0] if report is not None and report.problems else None
            print_json_line({
                "event": "finished", "demand_id": job.demand_id, "template": job.template,
                "template_version": job.template_version, "problem": job.problem,
                "problem_key": job.problem_key, "reports": job.reports,
                "attempt": job.attempt, "status": event.status, "note": event.note,
                "sweep_id": report.sweep_id if report is not None else None,
                "best_tflops": best.best_tflops if best else None,
                "speedup": best.speedup if best else None,
                "measured": best.measured if best else 0,
                "interpreter": report.interpreter if report is not None else None})


def print_json_line(data: dict[str, Any]) -> None:
    """One line per object (JSON lines), flushed: a long-running worker's log is read live."""
    sys.stdout.write(json.dumps(data, default=str) + "\n")
    sys.stdout.flush()

