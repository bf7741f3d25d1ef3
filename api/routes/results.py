from __future__ import annotations

from email.message import Message

from fastapi import APIRouter, HTTPException, Request, status

from api.deps import BestCacheDep, SettingsDep, WriteAuth
from api.store_process import StoreProcess, registered_template_modules
from tuner.lookup.bundle import BUNDLE_FORMAT
from tuner.wire import ErrorOut, UploadResult

router = APIRouter(prefix="/v1", tags=["results"])

# The body is documented by hand: a Body() parameter would make FastAPI read and parse it
# before the token is checked (issue 19: an 8 MB POST without a token took 560 ms to refuse).
_REQUEST_BODY = {
    "required": True,
    "content": {"application/json": {"schema": {
        "type": "object", "additionalProperties": True, "title": "Bundle",
        "description": f"a bundle as `tuner export` writes it (format {BUNDLE_FORMAT})"}}},
}


@router.post("/results", response_model=UploadResult, status_code=status.HTTP_201_CREATED,
             dependencies=[WriteAuth], openapi_extra={"requestBody": _REQUEST_BODY},
             responses={400: {"model": ErrorOut,
                              "description": "the body is not JSON text (e.g. not UTF-8)"},
                        401: {"model": ErrorOut}, 403: {"model": ErrorOut},
                        413: {"model": ErrorOut}, 422: {"model": ErrorOut},
                        503: {"model": ErrorOut}})
async def upload_results(request: Request, settings: SettingsDep,
                         cache: BestCacheDep) -> UploadResult:
    """Store a bundle of measured best configs (needs ``Authorization: Bearer <token>``).

    Every item is checked first (template registered at the item's version, valid problem,
    config inside the template's space and allowed on the item's device). One bad item rejects
    the whole upload with its index and reason, and nothing is stored.
    """
    _check_content_type(request.headers.get("content-type"))
    body = await request.body()  # after the token check: WriteAuth runs first
    if not body:
        raise HTTPException(422, detail={"index": None, "reason": "the body is empty; it must "
                                                                  "be a bundle (JSON)"})
    # Parsed, checked and stored in the store process (api/store_process.py: in this process,
    # that Python work made the event loop wait for the GIL, and every read with it).
    store: StoreProcess = request.app.state.bundle_store
    outcome = await store.store(settings.database_url, body, registered_template_modules())
    if outcome.summary is None:
        raise HTTPException(outcome.refused_status or 422, detail=outcome.refused_detail)
    summary = outcome.summary
    if summary.trials:
        await cache.refresh(summary.changed)
    return UploadResult(items=summary.items, trials=summary.trials,
                        best_updated=summary.best_updated,
                        remeasurements=summary.remeasurements)


def _check_content_type(value: str | None) -> None:
    """JSON or no declared type, as FastAPI's own body parsing takes."""
    if value is None:
        return
    message = Message()
    message["content-type"] = value
    subtype = message.get_content_subtype()
    if message.get_content_maintype() != "application" or not (
            subtype == "json" or subtype.endswith("+json")):
        raise HTTPException(422, detail={"index": None, "reason": f"the body must be JSON "
                                         f"(Content-Type application/json), but it is {value!r}"})

