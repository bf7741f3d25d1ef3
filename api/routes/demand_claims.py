"""The workers' side of the demand queue, for GPU hosts that reach only the service
(``tuner worker --service URL``): claim the most reported problem of a device, renew the
claim's lease while tuning, finish it (done or failed) or give it back. Every call needs the
write token: a claim takes a problem away from the other workers.

The service claims with the logic of workers that use the database directly
(``db.demand.claim_demand``: on PostgreSQL ``FOR UPDATE SKIP LOCKED``, so claims at once get
different rows), and a claim is the same lease: a worker that stops renewing it (killed, or cut
off from the service) loses it once it passes, and the next claim takes the problem over.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Path, Request
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from api.body import parsed_body, request_body
from api.deps import SettingsDep, WriteAuth
from api.routes.demand import demand_row
from api.schemas import (
    DemandClaimIn,
    DemandClaimOut,
    DemandFinishIn,
    DemandLeaseIn,
    DemandReleaseIn,
    DemandRow,
)
from db import demand
from db.models import Demand, DemandStatus, utcnow
from db.session import run_in_transaction
from tuner.wire import ErrorOut

router = APIRouter(prefix="/v1/demand", tags=["demand"])

# The row ids of the demand table (an INTEGER column): larger ones would be a database error.
DemandId = Annotated[int, Path(ge=1, le=2**31 - 1, description="the demand row's id")]
_WRITE_ERRORS: dict[int | str, dict[str, Any]] = {
    401: {"model": ErrorOut}, 403: {"model": ErrorOut}, 422: {"model": ErrorOut},
    503: {"model": ErrorOut}}
_CLAIM_ERRORS: dict[int | str, dict[str, Any]] = {
    **_WRITE_ERRORS, 404: {"model": ErrorOut, "description": "no demand row of that id"},
    409: {"model": ErrorOut, "description": "the worker does not hold the claim (any more)"}}


@router.post("/claim", response_model=DemandClaimOut, dependencies=[WriteAuth],
             openapi_extra={"requestBody": request_body(DemandClaimIn)},
             responses=_WRITE_ERRORS)
async def claim(request: Request, settings: SettingsDep) -> DemandClaimOut:
    """Claim for a worker the most reported problem of its device whose template runs at a
    version it names (needs ``Authorization: Bearer <token>``); ``claim`` is null when none
    waits. Asked again while it holds a claim, the worker gets that one back (a retried
    request takes no second problem)."""
    ask = await parsed_body(request, DemandClaimIn)

    def take(s: Session) -> DemandRow | None:
        row = demand.held_claim(s, device_key=ask.device, worker=ask.worker) or \
            demand.claim_demand(s, device_key=ask.device, versions=ask.templates,
                                worker=ask.worker, lease_s=ask.lease_s,
                                max_attempts=ask.max_attempts)
        return None if row is None else demand_row(row, utcnow())

    return DemandClaimOut(claim=await run_in_threadpool(run_in_transaction,
                                                        settings.database_url, take))


async def _changed(settings: Any, demand_id: int, worker: str,
                   change: Callable[[Session], bool]) -> DemandRow:
    """The row after ``change`` (True: ``worker``'s claim was changed); 404, or 409 saying
    whose the row is, when it changed nothing."""

    def run(s: Session) -> DemandRow:
        held = change(s)
        row = s.get(Demand, demand_id)
        if row is None:
            raise HTTPException(404, detail=f"no demand row {demand_id} (GET /v1/demand lists "
                                            "them)")
        if not held:
            raise HTTPException(409, detail=(
                f"worker {worker!r} does not hold a claim on demand row {demand_id}: it is "
                f"{demand.demand_status(row)}"
                + (f", held by {row.worker!r}" if row.worker else "")
                + " (a lease not renewed in time passes, and another worker may take the "
                "row over)"))
        return demand_row(row, utcnow())

    return await run_in_threadpool(run_in_transaction, settings.database_url, run)


@router.post("/{demand_id}/lease", response_model=DemandRow, dependencies=[WriteAuth],
             openapi_extra={"requestBody": request_body(DemandLeaseIn)},
             responses=_CLAIM_ERRORS)
async def renew(demand_id: DemandId, request: Request, settings: SettingsDep) -> DemandRow:
    """Extend a worker's claim: it holds ``lease_s`` seconds from now (a worker renews every
    third of its lease while it tunes)."""
    ask = await parsed_body(request, DemandLeaseIn)
    return await _changed(settings, demand_id, ask.worker, lambda s: demand.renew_demand_claim(
        s, demand_id=demand_id, worker=ask.worker, lease_s=ask.lease_s))


@router.post("/{demand_id}/finish", response_model=DemandRow, dependencies=[WriteAuth],
             openapi_extra={"requestBody": request_body(DemandFinishIn)},
             responses=_CLAIM_ERRORS)
async def finish(demand_id: DemandId, request: Request, settings: SettingsDep) -> DemandRow:
    """Mark a worker's claim done (its results uploaded first: ``POST /v1/results``) or
    failed (``note`` says why)."""
    ask = await parsed_body(request, DemandFinishIn)
    return await _changed(settings, demand_id, ask.worker, lambda s: demand.finish_demand(
        s, demand_id=demand_id, worker=ask.worker, status=DemandStatus(ask.status),
        note=ask.note))


@router.post("/{demand_id}/release", response_model=DemandRow, dependencies=[WriteAuth],
             openapi_extra={"requestBody": request_body(DemandReleaseIn)},
             responses=_CLAIM_ERRORS)
async def release(demand_id: DemandId, request: Request, settings: SettingsDep) -> DemandRow:
    """Give a worker's claim back, open, as if never taken (stopped, or its results could not
    be uploaded): the next claim takes it at once."""
    ask = await parsed_body(request, DemandReleaseIn)
    return await _changed(settings, demand_id, ask.worker, lambda s: demand.release_demand(
        s, demand_id=demand_id, worker=ask.worker, note=ask.note))
