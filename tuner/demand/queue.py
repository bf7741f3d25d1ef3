"""Where ``tuner worker`` takes its work from and hands it back: the demand queue.

Two places hold it. ``DatabaseQueue``: the database the worker shares with the service, for
workers that reach it (the docker-compose ``demand-worker``); results are stored there as they
are measured. ``tuner.demand.service_queue.ServiceQueue``: the service's API, for GPU hosts that
reach only the service with a token; the worker tunes into a database of its own and uploads the
results before it marks the problem done. The worker's loop (``tuner.demand.worker``) is the same
for both.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from sqlalchemy.engine import make_url

from db import demand
from db.models import DemandStatus
from db.session import run_in_transaction

__all__ = ["DatabaseQueue", "DemandQueue", "Job", "QueueUnavailable", "ResultsRefused"]


@dataclass(frozen=True)
class Job:
    """A claimed demand row."""

    demand_id: int
    template: str
    template_version: str
    problem_key: str
    problem: dict[str, Any]
    reports: int
    attempt: int


class QueueUnavailable(Exception):
    """The queue cannot be reached now (the service down, overloaded, or cut off): the worker
    waits and asks again. A claim it could not give back lapses with its lease."""


class ResultsRefused(Exception):
    """The results of a job were refused for good (not for a passing reason): the job is
    failed with this message."""


class DemandQueue(Protocol):
    """The demand queue as a worker uses it. ``renew``, ``finish`` and ``release`` answer
    False when the claim is no longer the worker's (its lease passed and another worker took
    the row over); any of them may raise ``QueueUnavailable``."""

    where: str  # for people: "database ...", "service ..."

    def accepted_versions(self, versions: Mapping[str, str]) -> dict[str, str]:
        """Of ``versions`` (template -> the version this worker runs), those whose demand and
        results this queue takes."""
        ...

    def claim(self, *, device_key: str, versions: Mapping[str, str], worker: str,
              lease_s: float, max_attempts: int) -> Job | None: ...

    def renew(self, demand_id: int, *, worker: str, lease_s: float) -> bool: ...

    def finish(self, demand_id: int, *, worker: str, status: DemandStatus, note: str
               ) -> bool: ...

    def release(self, demand_id: int, *, worker: str, note: str) -> bool: ...

    def publish(self, job: Job, *, device_key: str, results_db_url: str) -> str:
        """Make ``job``'s results (stored in ``results_db_url``) reach the place its demand
        came from; a few words saying so, for the job's note ("" when they are there
        already). ``ResultsRefused`` for good, ``QueueUnavailable`` for now."""
        ...


class DatabaseQueue:
    """The demand table of the database at ``database_url`` (``db.demand``), which holds the
    results too: a worker tunes straight into it."""

    def __init__(self, database_url: str) -> None:
        self.database_url = database_url
        self.where = f"database {make_url(database_url).render_as_string(hide_password=True)}"

    def accepted_versions(self, versions: Mapping[str, str]) -> dict[str, str]:
        return dict(versions)

    def claim(self, *, device_key: str, versions: Mapping[str, str], worker: str,
              lease_s: float, max_attempts: int) -> Job | None:
        def take(s: Any) -> Job | None:
            row = demand.claim_demand(s, device_key=device_key, versions=versions,
                                      worker=worker, lease_s=lease_s,
                                      max_attempts=max_attempts)
            if row is None:
                return None
            return Job(row.id, row.template, row.template_version, row.problem_key,
                       dict(row.problem), row.reports, row.attempts)

        return run_in_transaction(self.database_url, take)

    def renew(self, demand_id: int, *, worker: str, lease_s: float) -> bool:
        return run_in_transaction(self.database_url, lambda s: demand.renew_demand_claim(
            s, demand_id=demand_id, worker=worker, lease_s=lease_s))

    def finish(self, demand_id: int, *, worker: str, status: DemandStatus, note: str
               ) -> bool:
        return run_in_transaction(self.database_url, lambda s: demand.finish_demand(
            s, demand_id=demand_id, worker=worker, status=status, note=note))

    def release(self, demand_id: int, *, worker: str, note: str) -> bool:
        return run_in_transaction(self.database_url, lambda s: demand.release_demand(
            s, demand_id=demand_id, worker=worker, note=note))

    def publish(self, job: Job, *, device_key: str, results_db_url: str) -> str:
        return ""  # stored in this very database as they were measured
