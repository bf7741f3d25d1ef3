from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from sqlalchemy import text
from sqlalchemy.exc import SQLAlchemyError

from api.deps import SessionDep
from templates.registry import all_templates
from tuner.wire import HealthOut

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=HealthOut,
            responses={503: {"model": HealthOut, "description": "the database does not answer"}})
def healthz(session: SessionDep) -> HealthOut | JSONResponse:
    """Liveness and readiness: answers 200 only when the database answers a query."""
    try:
        session.execute(text("SELECT 1"))
    except SQLAlchemyError as exc:
        body = HealthOut(status="degraded", database=f"error: {type(exc).__name__}",
                         templates=len(all_templates()))
        return JSONResponse(body.model_dump(), status_code=503)
    return HealthOut(status="ok", database="ok", templates=len(all_templates()))
