"""The demand queue through the config service (``tuner worker --service URL``), for GPU hosts
that reach only the service, over HTTP with the write token.

The service claims, renews, finishes and releases with the database logic of the workers that
share its database (``api/routes/demand_claims.py``); the worker tunes into a database of its
own (``--db``) and uploads the job's best config, with its trials and re-measurements, through
``POST /v1/results`` before it marks the job done. The service checks the upload as any other
(template at its own version, config in the space, ...), which is why a worker tunes only the
templates whose version the service runs (``accepted_versions``).

Failures: a refusal that the same request would meet again (401/403: the token; 422) is
raised at once, a ``TunerError`` naming the fix for the token, ``ResultsRefused`` for results;
the service unreachable or overloaded (after the client's retries) is ``QueueUnavailable``,
and the worker waits and asks again.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any, TypeVar

from db.models import DemandStatus
from db.session import session_scope
from templates.base import Problem
from templates.registry import get_template
from tuner.client import TunerClient
from tuner.demand.queue import Job, QueueUnavailable, ResultsRefused
from tuner.errors import ServiceError, TunerError
from tuner.lookup.bundle import make_bundle
from tuner.wire import DemandRow

__all__ = ["ServiceQueue"]

log = logging.getLogger(__name__)

T = TypeVar("T")
# Per request: an upload of one problem's bundle is small, but the service may be busy storing
# another; the client retries transient failures (connection, 429, 502-504) 3 times besides.
TIMEOUT_S = 30.0
TOKEN_FIX = "set TUNER_TOKEN to the service's write token (the one `tuner serve` runs with)"


class ServiceQueue:
    def __init__(self, url: str, token: str | None, *, timeout_s: float = TIMEOUT_S,
                 retries: int = 3, client: TunerClient | None = None) -> None:
        if not token:
            raise TunerError(f"tuner worker --service {url} needs the service's write token: "
                             "claims and uploads are writes", TOKEN_FIX)
        try:
            self.client = client or TunerClient(url, token=token, timeout=timeout_s,
                                                retries=retries)
        except ValueError as exc:
            raise TunerError(str(exc), "pass --service http://host:8000") from None
        self.where = f"service {self.client.url}"

    def close(self) -> None:
        self.client.close()

    def _call(self, call: Callable[[], T]) -> T:
        """``call()``; the service's refusals sorted: the token (``TunerError``), passing
        (``QueueUnavailable``); other refusals are raised as they are, for the caller."""
        try:
            return call()
        except ServiceError as exc:
            if exc.status in (401, 403):
                raise TunerError(str(exc), TOKEN_FIX) from None
            if exc.status is None or exc.status == 429 or exc.status >= 500:
                raise QueueUnavailable(str(exc)) from None
            raise

    def _asked(self, call: Callable[[], T]) -> T:
        """``_call`` for requests that a refusal makes impossible to go on with."""
        try:
            return self._call(call)
        except ServiceError as exc:
            raise TunerError(str(exc), f"check that {self.client.url} is the config service "
                                       "(tuner serve) of this release") from None

    # -- the queue ----------------------------------------------------------------------------
    def accepted_versions(self, versions: Mapping[str, str]) -> dict[str, str]:
        """The templates this worker runs at the version the service runs: the service keeps
        demand and takes results of its own versions only."""
        served = {t.name: t.version for t in self._asked(self.client.templates)}
        kept = {name: v for name, v in versions.items() if served.get(name) == v}
        differ = [f"{name} {versions[name]} here, {served.get(name, 'not registered')} there"
                  for name in sorted(set(versions) - set(kept))]
        if differ:
            log.warning("templates at other versions on %s (their demand is left to workers "
                        "that run the service's): %s", self.where, "; ".join(differ))
        if not kept:
            raise TunerError(f"none of this worker's templates runs at the version "
                             f"{self.where} runs: {'; '.join(differ)}",
                             "install the same release of the package (and the same "
                             "TUNER_TEMPLATE_MODULES) on the worker as on the service")
        return kept

    def claim(self, *, device_key: str, versions: Mapping[str, str], worker: str,
              lease_s: float, max_attempts: int) -> Job | None:
        row = self._asked(lambda: self.client.claim_demand(
            device=device_key, templates=versions, worker=worker, lease_s=lease_s,
            max_attempts=max_attempts))
        return None if row is None else _job(row)

    def renew(self, demand_id: int, *, worker: str, lease_s: float) -> bool:
        return self._held(lambda: self.client.renew_demand_claim(
            demand_id, worker=worker, lease_s=lease_s))

    def finish(self, demand_id: int, *, worker: str, status: DemandStatus, note: str
               ) -> bool:
        return self._held(lambda: self.client.finish_demand(
            demand_id, worker=worker, status=status.value, note=note))

    def release(self, demand_id: int, *, worker: str, note: str) -> bool:
        return self._held(lambda: self.client.release_demand(demand_id, worker=worker,
                                                             note=note))

    def _held(self, call: Callable[[], DemandRow]) -> bool:
        try:
            self._call(call)
        except ServiceError as exc:
            if exc.status == 409:  # its lease passed and another worker took the row over
                return False
            raise TunerError(str(exc), f"check that {self.client.url} is the config service "
                                       "(tuner serve) of this release") from None
        return True

    # -- results ------------------------------------------------------------------------------
    def publish(self, job: Job, *, device_key: str, results_db_url: str) -> str:
        """Upload the best config this worker stored for ``job``'s problem (its trials and
        re-measurements with it) from ``results_db_url``."""
        bundle = job_bundle(job, device_key=device_key, database_url=results_db_url)
        if not bundle["items"]:
            raise ResultsRefused(f"no best config of {job.template} for problem "
                                 f"{job.problem_key} in this worker's database to upload")
        try:
            uploaded = self._call(lambda: self.client.upload(bundle))
        except ServiceError as exc:  # 4xx: the same bundle would be refused again
            raise ResultsRefused(f"{self.where} refused the results: {exc.detail}") from None
        return (f"uploaded to {self.where} ({uploaded.best_updated} best config(s) changed, "
                f"{uploaded.trials} trial(s) stored)")


def job_bundle(job: Job, *, device_key: str, database_url: str) -> dict[str, Any]:
    """A bundle of the best config stored for ``job``'s shape bucket on ``device_key`` at the
    job's kernel version (``tuner export``'s format, what ``POST /v1/results`` takes)."""
    template = get_template(job.template)
    with session_scope(database_url, write=False) as s:
        bundle = make_bundle(s, device=device_key, template=job.template,
                             host=socket.gethostname(), exported_at=datetime.now(UTC))
    bundle["items"] = [
        item for item in bundle["items"]
        if item["device"]["key"] == device_key
        and item["template_version"] == job.template_version
        and template.problem_key(Problem.from_dict(item["problem"])) == job.problem_key]
    return bundle


def _job(row: DemandRow) -> Job:
    if row.id is None:
        raise TunerError("the service answered a claim without the row's id: it is of an "
                         "older release", "upgrade the service before its workers")
    return Job(row.id, row.template, row.template_version, row.problem_key, dict(row.problem),
               row.reports, row.attempts)
