"""GET /v1/winners: per stored problem of a device, which implementation ``tuner.attention``
runs, the runner-up, the margin and every measured implementation's TFLOP/s.

The ranking is ``tuner.dispatch.winners`` (what ``tuner winners`` prints), at the kernel versions
this service runs: the versions it accepts uploads for. /v1/best stays one template's answer.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, HTTPException, status
from starlette.concurrency import run_in_threadpool

from api.answers import template_version_of
from api.deps import BestCacheDep, SettingsDep
from api.query import openapi_parameters, parse_query
from api.schemas import WinnersQuery
from db.session import get_sessionmaker
from tuner.dispatch.winners import stored_winners
from tuner.wire import ErrorOut, WinnersOut

router = APIRouter(prefix="/v1", tags=["configs"])


@router.get(
    "/winners",
    response_model=WinnersOut,
    openapi_extra=openapi_parameters(WinnersQuery),
    responses={404: {"model": ErrorOut}, 422: {"model": ErrorOut}},
)
async def winners(
    query: Annotated[WinnersQuery, Depends(parse_query(WinnersQuery))],
    cache: BestCacheDep,
    settings: SettingsDep,
) -> WinnersOut:
    """Per stored problem of the device: the implementation that runs it (``winner``), the
    fastest other (``runner_up``), the winner's TFLOP/s over the runner-up's (``margin``), and
    each implementation's stored best (TFLOP/s, time, config).

    Implementations are priced by their forward templates' bests (torch_sdpa, flash_fwd,
    gluon_fwd, flash_decode); a problem without a torch_sdpa best runs torch SDPA whatever
    else is stored (``margin`` null). Bests of other kernel versions than this service's are
    left out and counted in ``stale``.
    """
    catalog = await cache.catalog()
    device_key = catalog.resolve(query.device)  # a name or prefix of several: 422
    if device_key is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND,
                            detail=f"no stored device has the key, name or key prefix "
                                   f"{query.device!r}; /v1/devices lists the stored ones")

    def load() -> WinnersOut:
        with get_sessionmaker(settings.database_url, write=False)() as session:
            return stored_winners(session, device=device_key, dtype=query.dtype,
                                  version_of=template_version_of)

    answer = await run_in_threadpool(load)
    # A stored device without bests of these templates: named as the catalog knows it.
    return answer.model_copy(update={"device": device_key,
                                     "device_name": catalog.devices[device_key].name})
