"""Snapshots: the best configs frozen under the hash of their content
(``tuner.lookup.snapshot``)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, HTTPException, Path, Response, status
from starlette.concurrency import run_in_threadpool

from api.deps import SessionDep, SettingsDep, WriteAuth
from api.query import openapi_parameters, parse_query
from api.schemas import SnapshotFilters, SnapshotsQuery
from db import crud
from db.session import run_in_transaction
from tuner.lookup.snapshot import SNAPSHOT_ID, SnapshotError, freeze, stored_bundle
from tuner.wire import ErrorOut, SnapshotCreated, SnapshotList, SnapshotOut, SnapshotSummary

router = APIRouter(prefix="/v1", tags=["snapshots"])


@router.post("/snapshots", response_model=SnapshotCreated, status_code=status.HTTP_201_CREATED,
             dependencies=[WriteAuth], openapi_extra=openapi_parameters(SnapshotFilters),
             responses={200: {"model": SnapshotCreated,
                              "description": "the same content was frozen before: its id"},
                        401: {"model": ErrorOut}, 403: {"model": ErrorOut},
                        422: {"model": ErrorOut}, 503: {"model": ErrorOut}})
async def create_snapshot(
    filters: Annotated[SnapshotFilters, Depends(parse_query(SnapshotFilters))],
    settings: SettingsDep, response: Response,
) -> SnapshotCreated:
    """Freeze the stored best configs matching the filters (none: all of them) into an
    immutable snapshot (needs ``Authorization: Bearer <token>``). Its id is the SHA-256 of
    its content: freezing the same configs again answers the same id (200, not 201)."""
    try:
        frozen = await run_in_threadpool(freeze, settings.database_url,
                                         **filters.model_dump(exclude_none=True))
    except SnapshotError as exc:  # nothing matches the filters
        raise HTTPException(422, detail=exc.message) from None
    if not frozen.created:
        response.status_code = status.HTTP_200_OK
    return SnapshotCreated(id=frozen.id, items=frozen.items, created_at=frozen.created_at,
                           created=frozen.created)


@router.get("/snapshots", response_model=SnapshotList,
            openapi_extra=openapi_parameters(SnapshotsQuery),
            responses={422: {"model": ErrorOut}})
def list_snapshots(query: Annotated[SnapshotsQuery, Depends(parse_query(SnapshotsQuery))],
                   session: SessionDep) -> SnapshotList:
    """Stored snapshots, newest first: ids, sizes and dates (``/v1/snapshots/{id}`` has one
    whole)."""
    rows = crud.list_snapshots(session, offset=query.offset, limit=query.limit)
    return SnapshotList(items=[SnapshotSummary(id=sid, items=items, created_at=created)
                               for sid, items, created in rows],
                        total=crud.count_snapshots(session), offset=query.offset,
                        limit=query.limit)


SnapshotId = Annotated[str, Path(pattern=SNAPSHOT_ID.pattern,
                                 description="64 lowercase hex digits: the SHA-256 of the "
                                             "snapshot's content")]


def _unknown(snapshot_id: str) -> HTTPException:
    return HTTPException(404, detail=f"no snapshot {snapshot_id} on this service "
                                     "(GET /v1/snapshots lists them)")


@router.get("/snapshots/{snapshot_id}", response_model=SnapshotOut,
            responses={404: {"model": ErrorOut}, 422: {"model": ErrorOut}})
def get_snapshot(snapshot_id: SnapshotId, session: SessionDep) -> Response:
    """One snapshot, whole: its bundle, whose canonical JSON text hashes to the id."""
    row = crud.get_snapshot(session, snapshot_id=snapshot_id)
    if row is None:
        raise _unknown(snapshot_id)
    answer = SnapshotOut(id=row.id, items=row.items, created_at=row.created_at,
                         bundle=stored_bundle(row.content, row.id, "this service's database"))
    # Serialized here, once: the bundle can be large, and response_model would check it again.
    return Response(answer.model_dump_json(), media_type="application/json")


@router.delete("/snapshots/{snapshot_id}", response_model=SnapshotSummary,
               dependencies=[WriteAuth],
               responses={401: {"model": ErrorOut}, 403: {"model": ErrorOut},
                          404: {"model": ErrorOut}, 422: {"model": ErrorOut},
                          503: {"model": ErrorOut}})
async def delete_snapshot(snapshot_id: SnapshotId, settings: SettingsDep) -> SnapshotSummary:
    """Delete a snapshot that no job pins any more (needs ``Authorization: Bearer <token>``);
    answers what was deleted. A job already running keeps the copy it loaded at its first
    lookup; one started later with ``TUNER_SNAPSHOT=<id>`` stops with an error naming the id,
    as for any unknown snapshot (it never runs other configs instead)."""
    deleted = await run_in_threadpool(run_in_transaction, settings.database_url,
                                      lambda s: crud.delete_snapshot(s, snapshot_id=snapshot_id))
    if deleted is None:
        raise _unknown(snapshot_id)
    sid, items, created = deleted
    return SnapshotSummary(id=sid, items=items, created_at=created)
