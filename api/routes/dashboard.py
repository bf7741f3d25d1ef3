from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import HTMLResponse, RedirectResponse

from api.answers import template_version, template_version_of
from api.dashboard_demand import render_demand
from api.dashboard_html import render_dashboard
from api.deps import SessionDep
from db import crud, demand
from db.models import utcnow
from templates.registry import all_templates
from tuner.dispatch.winners import stored_winners

router = APIRouter(tags=["dashboard"])

# The page shows at most this many best configs; /v1/configs pages through the rest.
DASHBOARD_ROWS = 500
# The demand queue's most reported rows shown; /v1/demand pages through the rest.
DASHBOARD_DEMAND_ROWS = 100
# The newest snapshots shown; /v1/snapshots pages through the rest.
DASHBOARD_SNAPSHOTS = 50


@router.get("/", include_in_schema=False)
def root() -> RedirectResponse:
    return RedirectResponse("/dashboard")


@router.get("/dashboard", response_class=HTMLResponse)
def dashboard(session: SessionDep) -> HTMLResponse:
    """Devices, templates, best configs, TFLOP/s charts, which implementation runs each
    problem, the demand queue and what each worker holds, snapshots, as one HTML page."""
    templates = [{"name": t.name, "version": template_version(t), "description": t.description,
                  "grid_size": t.config_cls.grid_size()} for t in all_templates()]
    rows = crud.list_best(session, limit=DASHBOARD_ROWS)
    devices = crud.list_devices(session)
    winners = [found for d in devices
               if (found := stored_winners(session, device=d.key,
                                           version_of=template_version_of)).items]
    now = utcnow()
    held = [r for status in ("claimed", demand.EXPIRED)
            for r in demand.list_demand(session, status=status, limit=DASHBOARD_DEMAND_ROWS,
                                        now=now)]
    demand_html = render_demand(
        demand.list_demand(session, limit=DASHBOARD_DEMAND_ROWS, now=now), held,
        demand.count_demand(session, now=now), now)
    html = render_dashboard(
        devices=devices, templates=templates, rows=rows,
        total_rows=crud.count_best(session), sweeps=crud.list_sweeps(session, limit=20),
        readings=crud.best_readings(session, rows), winners=winners,
        winners_limit=DASHBOARD_ROWS, demand_html=demand_html,
        snapshots=crud.list_snapshots(session, limit=DASHBOARD_SNAPSHOTS),
        total_snapshots=crud.count_snapshots(session))
    return HTMLResponse(html)
