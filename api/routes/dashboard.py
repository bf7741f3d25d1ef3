from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import HTMLResponse, RedirectResponse

from api.answers import template_version
from api.dashboard_html import render_dashboard
from api.deps import SessionDep
from db import crud
from templates.registry import all_templates

router = APIRouter(tags=["dashboard"])

# The page shows at most this many best configs; /v1/configs pages through the rest.
DASHBOARD_ROWS = 500


@router.get("/", include_in_schema=False)
def root() -> RedirectResponse:
    return RedirectResponse("/dashboard")


@router.get("/dashboard", response_class=HTMLResponse)
def dashboard(session: SessionDep) -> HTMLResponse:
    """Devices, templates, best configs and TFLOP/s charts, as one HTML page."""
    templates = [{"name": t.name, "version": template_version(t), "description": t.description,
                  "grid_size": t.config_cls.grid_size()} for t in all_templates()]
    rows = crud.list_best(session, limit=DASHBOARD_ROWS)
    html = render_dashboard(
        devices=crud.list_devices(session), templates=templates, rows=rows,
        total_rows=crud.count_best(session), sweeps=crud.list_sweeps(session, limit=20),
        readings=crud.best_readings(session, rows))
    return HTMLResponse(html)
