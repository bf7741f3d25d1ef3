from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Body, HTTPException, status

from api.deps import BestCacheDep, SettingsDep, WriteAuth
from db.session import run_in_transaction
from tuner.bundle import BundleError, store_bundle, validate_bundle
from tuner.wire import ErrorOut, UploadResult

router = APIRouter(prefix="/v1", tags=["results"])


@router.post("/results", response_model=UploadResult, status_code=status.HTTP_201_CREATED,
             dependencies=[WriteAuth],
             responses={400: {"model": ErrorOut,
                              "description": "the body is not JSON text (e.g. not UTF-8)"},
                        401: {"model": ErrorOut}, 403: {"model": ErrorOut},
                        413: {"model": ErrorOut}, 422: {"model": ErrorOut},
                        503: {"model": ErrorOut}})
def upload_results(
    bundle: Annotated[dict[str, Any], Body(description="a bundle as `tuner export` writes it "
                                                       "(format attention-tuner/bundle)")],
    settings: SettingsDep,
    cache: BestCacheDep,
) -> UploadResult:
    """Store a bundle of measured best configs (needs ``Authorization: Bearer <token>``).

    Every item is checked first (template registered at the item's version, valid problem,
    config inside the template's space and allowed on the item's device). One bad item rejects
    the whole upload with its index and reason, and nothing is stored.
    """
    try:
        items = validate_bundle(bundle)
    except BundleError as exc:
        raise HTTPException(422,
                            detail={"index": exc.index, "reason": exc.reason}) from None
    host = bundle.get("host") if isinstance(bundle.get("host"), str) else None
    summary = run_in_transaction(settings.database_url,
                                 lambda session: store_bundle(session, items, host=host))
    cache.invalidate()
    return UploadResult(items=summary.items, trials=summary.trials,
                        best_updated=summary.best_updated,
                        remeasurements=summary.remeasurements)
