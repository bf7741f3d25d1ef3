"""``POST /v1/demand``: jobs report the problems they ran without a tuned config (no token:
jobs hold none). ``GET /v1/demand``: the queue that ``tuner worker`` takes its work from.

A report is refused before its body is read when its client address has sent too many
(``api.rate_limit``, ``TUNER_DEMAND_RATE_LIMIT``); its body is capped at ``MAX_BODY_BYTES``
(``api.errors.BodySizeLimit``). A body that breaks the schema is refused whole (422); each
item is then checked on its own (``api.demand_check``): the valid ones are counted
(``api.demand_buffer``), the others listed in the answer with the reason; so are new problems
the queue has no room for (``TUNER_DEMAND_MAX_PENDING``).
"""

from __future__ import annotations

import math
from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Request, status
from starlette.concurrency import run_in_threadpool

from api.body import request_body, validated_body
from api.demand_buffer import DemandBuffer
from api.demand_check import DemandChecker
from api.deps import SessionDep, client_address, refusal_headers
from api.loop_share import LoopShare
from api.query import openapi_parameters, parse_query
from api.rate_limit import TokenBuckets
from api.schemas import DemandAccepted, DemandPage, DemandQuery, DemandReportIn, DemandRow
from db import demand
from db.models import utcnow
from tuner.wire import DemandRejection, ErrorOut

router = APIRouter(prefix="/v1", tags=["demand"])

# 500 items of ~300 bytes; a client sends at most 250 per request
# (tuner.demand.reporter.BATCH_ITEMS).
MAX_BODY_BYTES = 256 * 1024
LISTED_REJECTIONS = 20  # rejected items listed in an answer; the rest are counted


# Documented by hand, as POST /v1/results is: a body parameter would be read and parsed
# before the rate limit is checked, and a refused flood must cost the service nothing.
_REQUEST_BODY = request_body(DemandReportIn)
_RATE_LIMITED = {"model": ErrorOut, "description": "too many reports from this client address",
                 "headers": {"Retry-After": {"description": "seconds until one is taken",
                                             "schema": {"type": "integer"}}}}
_QUEUE_FULL = {"model": ErrorOut, "description": "every valid item is a new problem, and the "
               "queue holds as many waiting problems as it may (TUNER_DEMAND_MAX_PENDING)"}


async def within_rate_limit(request: Request) -> None:
    limiter: TokenBuckets = request.app.state.demand_limiter
    address = client_address(request)
    wait = limiter.take(address)
    if wait > 0:
        retry = max(1, math.ceil(wait))
        raise HTTPException(
            status.HTTP_429_TOO_MANY_REQUESTS,
            detail=f"too many demand reports from {address}: this service takes "
                   f"{limiter.rate:g} a second per client address (TUNER_DEMAND_RATE_LIMIT), "
                   f"bursts of {limiter.burst:g}; try again in {retry} s",
            headers={"Retry-After": str(retry), **refusal_headers(request)})


@router.post("/demand", response_model=DemandAccepted, status_code=status.HTTP_202_ACCEPTED,
             dependencies=[Depends(within_rate_limit)],
             openapi_extra={"requestBody": _REQUEST_BODY},
             responses={413: {"model": ErrorOut}, 422: {"model": ErrorOut},
                        429: _RATE_LIMITED, 507: _QUEUE_FULL})
async def report_demand(request: Request) -> DemandAccepted:
    """Count problems a job ran without a tuned config (no token needed).

    Each item: template, template_version (the service's own: others are refused), device (a
    device key), problem (its fields, as ``GET /v1/best`` takes them) and count. Counted per
    shape bucket and stored within a second; ``tuner worker`` tunes the most reported first.
    A new problem is refused while the queue holds ``TUNER_DEMAND_MAX_PENDING`` waiting ones
    (listed in ``rejected``; 507 when no item could be counted for that reason).
    """
    body = await request.body()  # received before the turn: a slow sender holds up no one
    checker: DemandChecker = request.app.state.demand_checker
    buffer: DemandBuffer = request.app.state.demand_buffer
    share: LoopShare = request.app.state.demand_share
    # One report at a time, its work in slices of the loop (api.loop_share): reports arriving
    # together used to hold every read back until all of them were counted.
    async with share.turn() as slices:
        report = validated_body(body, DemandReportIn)
        verdicts = []
        for item in report.items:
            verdicts.append(checker.check(item))
            await slices.pause()
        no_room = await buffer.refused_for_cap(v[0] for v in verdicts if not isinstance(v, str))
        accepted = reports = dropped = full = 0
        rejected: list[DemandRejection] = []
        for index, (item, verdict) in enumerate(zip(report.items, verdicts, strict=True)):
            if isinstance(verdict, str):
                rejected.append(DemandRejection(index=index, reason=verdict))
            elif verdict[0] in no_room:
                rejected.append(DemandRejection(index=index, reason=_queue_full(buffer)))
                buffer.over_cap += item.count
                full += 1
            elif buffer.add(*verdict, item.count):
                accepted += 1
                reports += item.count
            else:
                dropped += 1
            await slices.pause()
    buffer.store_soon()
    if full and not accepted:
        raise HTTPException(status.HTTP_507_INSUFFICIENT_STORAGE, detail=_queue_full(buffer))
    return DemandAccepted(accepted=accepted, reports=reports,
                          rejected=rejected[:LISTED_REJECTIONS], rejected_count=len(rejected),
                          dropped=dropped)


def _queue_full(buffer: DemandBuffer) -> str:
    return (f"the demand queue is full: {buffer.max_pending} problems wait to be tuned (the "
            f"service's cap, TUNER_DEMAND_MAX_PENDING); a new problem is refused until "
            f"workers take some, reports of problems already queued are still counted")


@router.get("/demand", response_model=DemandPage,
            openapi_extra=openapi_parameters(DemandQuery),
            responses={422: {"model": ErrorOut}})
async def list_demand(request: Request, session: SessionDep,
                      query: Annotated[DemandQuery, Depends(parse_query(DemandQuery))]
                      ) -> DemandPage:
    """The demand queue, most reported first: per device, template version and shape bucket,
    how often jobs ran it untuned and where its tuning stands (open, claimed by a worker
    until its lease ends, expired, done, failed)."""
    buffer: DemandBuffer = request.app.state.demand_buffer
    await buffer.flush()  # what was reported until now is in the answer
    return await run_in_threadpool(_page, session, query)


def _page(session: Any, query: DemandQuery) -> DemandPage:
    now = utcnow()
    filters = {"device": query.device, "template": query.template, "status": query.status}
    rows = demand.list_demand(session, **filters, offset=query.offset, limit=query.limit,
                              now=now)
    return DemandPage(items=[demand_row(r, now) for r in rows],
                      total=demand.count_demand(session, **filters, now=now),
                      offset=query.offset, limit=query.limit)


def demand_row(row: Any, now: Any) -> DemandRow:
    return DemandRow(id=row.id, device=row.device_key, template=row.template,
                     template_version=row.template_version, problem_key=row.problem_key,
                     problem=row.problem, reports=row.reports,
                     status=demand.demand_status(row, now),  # type: ignore[arg-type]
                     worker=row.worker, attempts=row.attempts, claimed_at=row.claimed_at,
                     lease_until=row.lease_until, finished_at=row.finished_at, note=row.note,
                     first_seen=row.first_seen, last_seen=row.last_seen)
