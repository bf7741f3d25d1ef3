from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from api.main import create_app
from db.session import dispose_engine
from tests.api.serving_data import TOKEN
from tuner.settings import Settings, load_settings


@pytest.fixture
def db_url(tmp_path: Path) -> Iterator[str]:
    url = f"sqlite:///{tmp_path / 'service.db'}"
    yield url
    dispose_engine(url)


@pytest.fixture
def settings(db_url: str) -> Settings:
    return load_settings(database_url=db_url, token=TOKEN, url=None)


@pytest.fixture
def app(settings: Settings) -> FastAPI:
    return create_app(settings)


@pytest.fixture
def client(app: FastAPI) -> Iterator[TestClient]:
    with TestClient(app) as c:
        yield c


@pytest.fixture
def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKEN}"}
