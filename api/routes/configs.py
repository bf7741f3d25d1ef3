from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends

from api.deps import SessionDep
from api.query import openapi_parameters, parse_query
from api.schemas import ConfigsQuery
from db import crud
from tuner.wire import ConfigPage, ConfigRow, ErrorOut

router = APIRouter(prefix="/v1", tags=["configs"])


@router.get("/configs", response_model=ConfigPage, openapi_extra=openapi_parameters(ConfigsQuery),
            responses={422: {"model": ErrorOut}})
def list_configs(
    query: Annotated[ConfigsQuery, Depends(parse_query(ConfigsQuery))], session: SessionDep
) -> ConfigPage:
    """Stored best configs, filtered, one page at a time (``total`` counts every match)."""
    filters = {
        "device": query.device,
        "template": query.template,
        "dtype": query.dtype,
        "variant": query.variant,
    }
    rows = crud.list_best(session, **filters, offset=query.offset, limit=query.limit)
    readings = crud.best_readings(session, rows)
    items = [
        ConfigRow(
            device=r.device.key,
            device_name=r.device.name,
            template=r.template.name,
            template_version=r.template.version,
            problem_key=r.problem_key,
            problem=dict(r.problem),
            dtype=r.dtype,
            variant=r.variant,
            config=dict(r.config),
            tflops=r.tflops,
            median_ms=r.median_ms,
            default_tflops=r.default_tflops,
            speedup=r.speedup,
            readings=readings[r.id].count,
            spread=readings[r.id].spread,
            sweep_id=r.sweep_id,
            updated_at=r.updated_at,
        )
        for r in rows
    ]
    return ConfigPage(
        items=items,
        total=crud.count_best(session, **filters),
        offset=query.offset,
        limit=query.limit,
    )
