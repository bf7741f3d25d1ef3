"""A worker that follows demand (issue 18, item 2): it tunes what jobs ran untuned, most
reported first, for its own device, with the sweep machinery (``tuner.tuning.sweep.run_sweep``).

The loop: claim the most reported open row of the demand queue for this worker's device key
and the template versions its own code runs, tune its problem as a one-problem sweep into the
worker's database, make the results reach the service, mark the row done (or failed, saying
why), and claim the next; with nothing to claim, wait ``poll_s`` and look again. The queue is
the database the worker shares with the service, or the service's API for hosts that reach only
the service (``tuner.demand.queue``, ``tuner.demand.service_queue``): then the worker tunes into a
database of its own and uploads the job's results before it marks it done; if the upload cannot
get through, it gives the job back.

A claim is a lease: the worker renews it every third of ``lease_s`` while it tunes. A worker
that dies (SIGKILL included) stops renewing, and once the lease has passed the next worker
takes the row over; what the dead one measured is stored and is not measured again (the
sweep resumes, as ``tuner sweep`` does after a kill: its Optuna trial goes stale after three
heartbeats and is run again), where the two share a database. A worker stopped on request
(SIGINT, ``stop``) gives its claim back at once.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from db.models import DemandStatus
from db.session import init_db
from templates.base import Problem
from templates.device import cpu_device, interpreter_active
from templates.registry import all_templates, get_template
from tuner.demand.queue import DatabaseQueue, DemandQueue, Job, QueueUnavailable, ResultsRefused
from tuner.errors import TunerError
from tuner.tuning.runner.isolated import IsolatedRunner
from tuner.tuning.suites import SweepSpec
from tuner.tuning.sweep import SweepOptions, SweepReport, run_sweep

__all__ = ["Job", "JobClaimed", "JobFinished", "WorkerOptions", "WorkerStarted",
           "WorkerWaits", "run_worker", "worker_versions"]

log = logging.getLogger(__name__)
T = TypeVar("T")

DEFAULT_POLL_S = 30.0
DEFAULT_LEASE_S = 300.0
DEFAULT_MAX_ATTEMPTS = 3
# What the service takes in a claim (api.schemas.DemandClaimIn); the database worker keeps to
# the same bounds.
MAX_LEASE_S = 24 * 3600.0
MAX_ATTEMPTS = 100


@dataclass(frozen=True)
class WorkerOptions:
    sweep: SweepOptions = field(default_factory=SweepOptions)
    poll_s: float = DEFAULT_POLL_S  # wait between looks at an empty queue
    lease_s: float = DEFAULT_LEASE_S  # a claim not renewed for this long is taken over
    max_jobs: int = 0  # stop after this many (0: never)
    until_idle: bool = False  # stop when there is nothing to claim, instead of waiting
    max_attempts: int = DEFAULT_MAX_ATTEMPTS  # claims of one row before it is given up
    templates: tuple[str, ...] = ()  # tune only these (empty: every registered template)

    def __post_init__(self) -> None:
        if self.poll_s <= 0:
            raise TunerError(f"--poll must be > 0 seconds, but got {self.poll_s:g}",
                             f"e.g. --poll {DEFAULT_POLL_S:g}")
        if not 3 <= self.lease_s <= MAX_LEASE_S:
            raise TunerError(f"--lease must be >= 3 seconds (it is renewed every third of "
                             f"it) and at most {MAX_LEASE_S:g}, but got {self.lease_s:g}",
                             f"e.g. --lease {DEFAULT_LEASE_S:g}")
        if self.max_jobs < 0:
            raise TunerError(f"--max-jobs must be >= 0, but got {self.max_jobs}",
                             "e.g. --max-jobs 1, or 0 for no limit")
        if not 1 <= self.max_attempts <= MAX_ATTEMPTS:
            raise TunerError(f"--max-attempts must be 1 to {MAX_ATTEMPTS}, but got "
                             f"{self.max_attempts}", f"e.g. --max-attempts {DEFAULT_MAX_ATTEMPTS}")


# ----------------------------------------------------------------------------- events
@dataclass(frozen=True)
class WorkerStarted:
    worker: str  # host:pid, as the claims name it
    device: dict[str, Any]
    versions: dict[str, str]  # the template versions it tunes
    where: str = ""  # the queue: "database ...", "service ..."


@dataclass(frozen=True)
class JobClaimed:
    job: Job


@dataclass(frozen=True)
class JobFinished:
    job: Job
    status: Literal["done", "failed", "released"]
    note: str
    report: SweepReport | None


@dataclass(frozen=True)
class WorkerWaits:
    seconds: float
    why: str = ""  # "" nothing to tune; else why the queue could not be asked


Event = WorkerStarted | JobClaimed | JobFinished | WorkerWaits


# ----------------------------------------------------------------------------- the loop
def worker_versions(names: tuple[str, ...] = ()) -> dict[str, str]:
    """Template name -> the version this process runs, of ``names`` (default: every
    registered template): the demand rows this worker can tune."""
    if names:
        try:
            templates = [get_template(name) for name in names]
        except ValueError as exc:
            raise TunerError(str(exc), "name registered templates (`tuner list templates`)"
                             ) from None
    else:
        templates = all_templates()
    return {t.name: t.version() for t in templates}


def probe_device() -> dict[str, Any]:
    """This worker's device as its trial workers will see it (DeviceInfo fields plus "key"):
    asked of a trial-worker process, as a sweep does, so this process makes no CUDA context.
    Under the interpreter the device is the CPU, known without asking (a process costs
    seconds to start)."""
    if interpreter_active():
        info = cpu_device()
        return {**info.to_dict(), "key": info.key}
    runner = IsolatedRunner(name="device-probe")
    try:
        return runner.device()
    finally:
        runner.close()


def run_worker(options: WorkerOptions, *, db_url: str, queue: DemandQueue | None = None,
               template_modules: tuple[str, ...] = (),
               on_event: Callable[[Event], None] | None = None,
               stop: threading.Event | None = None) -> list[JobFinished]:
    """Claim, tune and finish demand rows until told to stop (module docstring). ``db_url``
    is where the worker tunes; ``queue`` where it claims (default: ``db_url``'s demand
    table)."""
    emit = on_event or (lambda event: None)
    stop = stop or threading.Event()
    queue = queue if queue is not None else DatabaseQueue(db_url)
    # The templates from outside the package (TUNER_TEMPLATE_MODULES), imported as a sweep
    # spec's are: the demand for them is claimed only if their versions are known here.
    SweepSpec(name="tuner worker", templates=(), problems=(),
              template_modules=template_modules).import_template_modules()
    init_db(db_url)
    versions = _asked(queue, options, stop, emit,
                      lambda: queue.accepted_versions(worker_versions(options.templates)))
    if versions is None:  # stopped while the service could not be reached
        return []
    device = probe_device()
    worker = f"{socket.gethostname()}:{os.getpid()}"
    emit(WorkerStarted(worker, device, versions, queue.where))
    finished: list[JobFinished] = []
    while not stop.is_set():
        # In a list: the claim's None is "nothing to claim", _asked's None "stopped".
        claimed = _asked(queue, options, stop, emit, lambda: [queue.claim(
            device_key=device["key"], versions=versions, worker=worker,
            lease_s=options.lease_s, max_attempts=options.max_attempts)])
        job = claimed[0] if claimed else None
        if job is None:
            if options.until_idle or stop.is_set():
                break
            emit(WorkerWaits(options.poll_s))
            stop.wait(options.poll_s)
            continue
        emit(JobClaimed(job))
        result = _tune(job, options, queue=queue, db_url=db_url, device_key=device["key"],
                       worker=worker, template_modules=template_modules, stop=stop)
        finished.append(result)
        emit(result)
        if options.max_jobs and len(finished) >= options.max_jobs:
            break
        if result.status == "released" and not stop.is_set():
            # Given back as its results could not be uploaded: claiming again at once would
            # take the same problem back, and fail the same way until the service is back.
            if options.until_idle:
                break
            emit(WorkerWaits(options.poll_s, result.note))
            stop.wait(options.poll_s)
    return finished


def _asked(queue: DemandQueue, options: WorkerOptions, stop: threading.Event,
           emit: Callable[[Event], None], ask: Callable[[], T]) -> T | None:
    """``ask()`` of the queue, asked again every ``poll_s`` while the queue cannot be reached
    (None: stopped meanwhile). A worker told to stop when idle cannot tell that nothing is
    left: it stops with an error instead."""
    while not stop.is_set():
        try:
            return ask()
        except QueueUnavailable as exc:
            if options.until_idle:
                raise TunerError(f"{queue.where} cannot be reached: {exc}",
                                 "check that it runs and that this host reaches it") from None
            log.warning("%s cannot be reached (%s); asking again in %g s", queue.where, exc,
                        options.poll_s)
            emit(WorkerWaits(options.poll_s, f"{queue.where} cannot be reached: {exc}"))
            stop.wait(options.poll_s)
    return None


def _tune(job: Job, options: WorkerOptions, *, queue: DemandQueue, db_url: str,
          device_key: str, worker: str, template_modules: tuple[str, ...],
          stop: threading.Event) -> JobFinished:
    """One claimed row, tuned as a one-problem sweep; its results published, the row
    finished (or given back)."""

    def finish(status: DemandStatus, note: str, report: SweepReport | None) -> JobFinished:
        try:
            if not queue.finish(job.demand_id, worker=worker, status=status, note=note):
                log.warning("demand row %d was taken over by another worker (this one's lease "
                            "passed); its results are stored all the same", job.demand_id)
        except QueueUnavailable as exc:  # the lease passes, and the row is tuned again
            log.warning("could not mark demand row %d %s on %s (%s); another worker takes it "
                        "over once its lease passes", job.demand_id, status.value, queue.where,
                        exc)
        return JobFinished(job, status.value, note, report)  # type: ignore[arg-type]

    def give_back(note: str, report: SweepReport | None) -> JobFinished:
        _release(queue, job, worker, note)
        return JobFinished(job, "released", note, report)

    try:
        problem = Problem.from_dict(job.problem)
    except (TypeError, ValueError) as exc:
        return finish(DemandStatus.FAILED, f"the stored problem is not valid: {exc}", None)
    if stop.is_set():  # told to stop as it claimed: give the claim back, start nothing
        return give_back("stopped before it started; given back", None)
    spec = SweepSpec(name=f"demand-{job.demand_id}", templates=(job.template,),
                     problems=(problem,), template_modules=template_modules)
    keeper = LeaseKeeper(queue, job.demand_id, worker, options.lease_s)
    try:  # the lease is held while it tunes and while it uploads (a busy service takes a while)
        status, note, report = _outcome(job, spec, options, queue=queue, db_url=db_url,
                                        device_key=device_key, worker=worker, stop=stop)
    except KeyboardInterrupt:
        keeper.close()
        _release(queue, job, worker, "given back by a stopped worker")
        raise
    finally:
        keeper.close()
    if status == "released":
        return give_back(note, report)
    return finish(DemandStatus(status), note, report)


Outcome = tuple[Literal["done", "failed", "released"], str, SweepReport | None]


def _outcome(job: Job, spec: SweepSpec, options: WorkerOptions, *, queue: DemandQueue,
             db_url: str, device_key: str, worker: str, stop: threading.Event) -> Outcome:
    """How the job's sweep and the publishing of its results went, and a note saying so."""
    try:
        report = run_sweep(spec, options.sweep, db_url=db_url, stop=_JobStop(stop))
    except TunerError as exc:  # the template cannot run it here, or its code failed
        return "failed", f"{exc.message} ({exc.fix})" if exc.fix else exc.message, None
    if report.status == "interrupted":
        return "released", "stopped before the end; given back", report
    result = report.problems[0]
    if result.skipped:
        return "failed", result.skipped, report
    if result.best_tflops is None:
        failed = ", ".join(f"{n} {kind}" for kind, n in sorted(result.failed.items()))
        return "failed", f"no config ran correctly ({failed or 'none ran'})", report
    note = f"best {result.best_tflops:.4g} TFLOP/s"
    if result.speedup:
        note += f", {result.speedup:.2f}x the default config"
    note += f" (sweep {report.sweep_id})"
    try:
        published = queue.publish(job, device_key=device_key, results_db_url=db_url)
    except ResultsRefused as exc:
        return "failed", f"{note}; {exc}", report
    except QueueUnavailable as exc:
        return "released", (f"{note}; the results could not be uploaded ({exc}): given back, "
                            f"{worker} keeps them in its database"), report
    return "done", f"{note}; {published}" if published else note, report


class _JobStop(threading.Event):
    """The stop event of one job's sweep: set when the worker is asked to stop. The sweep sets
    its event itself when it ends (``run_sweep``), which must not stop the worker: so the
    worker's event is read here, never written."""

    def __init__(self, worker_stop: threading.Event) -> None:
        super().__init__()
        self._worker_stop = worker_stop

    def is_set(self) -> bool:
        return super().is_set() or self._worker_stop.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        # In slices, so that a wait notices the worker's stop within a tenth of a second.
        end = None if timeout is None else time.monotonic() + timeout
        while not self.is_set():
            left = 0.1 if end is None else min(0.1, end - time.monotonic())
            if left <= 0:
                return False
            super().wait(left)
        return True


def _release(queue: DemandQueue, job: Job, worker: str, note: str) -> None:
    try:
        queue.release(job.demand_id, worker=worker, note=note)
    except Exception as exc:  # the lease will pass anyway: nothing is lost
        log.warning("could not give demand row %d back (%s); it is taken over once its "
                    "lease passes", job.demand_id, exc)


class LeaseKeeper:
    """Renews a claim's lease every third of ``lease_s`` on a thread of its own, until
    closed; says so once if the claim was taken over (this worker was thought dead)."""

    def __init__(self, queue: DemandQueue, demand_id: int, worker: str, lease_s: float) -> None:
        self.queue, self.demand_id, self.worker, self.lease_s = queue, demand_id, worker, lease_s
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"lease-{demand_id}",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._closed.wait(self.lease_s / 3):
            try:
                held = self.queue.renew(self.demand_id, worker=self.worker,
                                        lease_s=self.lease_s)
            except Exception as exc:  # the queue is away: try again at the next beat
                log.warning("could not renew the lease on demand row %d: %s", self.demand_id,
                            exc)
                continue
            if not held:
                log.warning("demand row %d was taken over by another worker; tuning it on "
                            "(the two share its trials where they share a database)",
                            self.demand_id)
                return

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self._thread.join(timeout=30)
