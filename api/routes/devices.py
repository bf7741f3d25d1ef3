from __future__ import annotations

from fastapi import APIRouter

from api.deps import SessionDep
from db import crud
from tuner.wire import DeviceOut

router = APIRouter(prefix="/v1", tags=["devices"])


@router.get("/devices", response_model=list[DeviceOut])
def list_devices(session: SessionDep) -> list[DeviceOut]:
    """Every device with stored results; its ``key`` is what /v1/best takes as ``device``."""
    return [DeviceOut.model_validate(d, from_attributes=True) for d in crud.list_devices(session)]
