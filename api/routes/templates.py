from __future__ import annotations

from collections import defaultdict

from fastapi import APIRouter

from api.answers import template_version
from api.deps import SessionDep
from db import crud
from templates.registry import all_templates
from tuner.wire import TemplateOut

router = APIRouter(prefix="/v1", tags=["templates"])


@router.get("/templates", response_model=list[TemplateOut])
def list_templates(session: SessionDep) -> list[TemplateOut]:
    """The kernel templates this service runs: version, search space (JSON schema), size."""
    stored: dict[str, list[str]] = defaultdict(list)
    for row in reversed(crud.list_templates(session)):  # listed oldest first
        stored[row.name].append(row.version)
    return [TemplateOut(name=t.name, version=template_version(t), description=t.description,
                        config_schema=t.config_cls.json_schema(),
                        grid_size=t.config_cls.grid_size(),
                        versions_in_database=stored.get(t.name, []))
            for t in all_templates()]
