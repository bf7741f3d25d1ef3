"""``tuner snapshot create|list`` and ``tuner export --snapshot ID`` (issue 18, item 4)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from api.main import create_app
from db.session import dispose_engine, session_scope
from tests.api.serving_data import TOKEN, bundle, item, live_server, problem
from tests.tuner.test_sweep_cli import cli
from tuner.bundle import store_bundle, validate_bundle
from tuner.settings import get_settings, load_settings
from tuner.snapshot import snapshot_id_of


@pytest.fixture(autouse=True)
def fresh_settings() -> None:
    get_settings.cache_clear()  # the settings are read once per process: read this test's


def stored(tmp_path: Path, name: str, *items: dict[str, Any]) -> str:
    url = f"sqlite:///{tmp_path / name}"
    with session_scope(url) as s:
        store_bundle(s, validate_bundle(bundle(*items)))
    return url


def test_create_then_export_writes_a_bundle_that_hashes_to_the_id_and_imports(
        tmp_path: Path) -> None:
    url = stored(tmp_path, "a.db", item(problem(1024)), item(problem(4096)))
    code, out, err = cli("snapshot", "create", "--db", url, "--json")
    assert code == 0, err
    created = json.loads(out)
    assert created["created"] is True and created["items"] == 2
    code, out, _ = cli("snapshot", "create", "--db", url)
    assert code == 0 and f"TUNER_SNAPSHOT={created['id']}" in out
    assert "frozen before" in out
    code, out, _ = cli("snapshot", "list", "--db", url, "--json")
    assert [s["id"] for s in json.loads(out)] == [created["id"]]

    file = tmp_path / "pinned.json"
    code, out, err = cli("export", str(file), "--snapshot", created["id"], "--db", url)
    assert code == 0, err
    data = json.loads(file.read_text())
    assert snapshot_id_of(data) == created["id"] and len(data["items"]) == 2
    other = f"sqlite:///{tmp_path / 'b.db'}"
    code, out, err = cli("import", str(file), "--db", other, "--json")
    assert code == 0 and json.loads(out)["items"] == 2, err
    dispose_engine(url)
    dispose_engine(other)


def test_create_through_the_service_needs_its_token(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    url = stored(tmp_path, "service.db", item(problem(1024)))
    with live_server(create_app(load_settings(database_url=url, token=TOKEN,
                                              url=None))) as service:
        code, out, _ = cli("snapshot", "create", "--url", service, "--json")
        assert code == 2 and "answered 401" in json.loads(out)["error"]
        assert "TUNER_TOKEN" in json.loads(out)["fix"]
        monkeypatch.setenv("TUNER_TOKEN", TOKEN)
        get_settings.cache_clear()
        code, out, err = cli("snapshot", "create", "--url", service, "--json")
        assert code == 0, err
        created = json.loads(out)
        code, out, _ = cli("snapshot", "list", "--url", service, "--json")
        assert [s["id"] for s in json.loads(out)] == [created["id"]]
    dispose_engine(url)


def test_bad_snapshot_commands_say_what_was_wrong(tmp_path: Path) -> None:
    url = stored(tmp_path, "a.db", item(problem(1024)))
    code, out, _ = cli("export", str(tmp_path / "x.json"), "--snapshot", "e" * 64, "--db", url,
                       "--json")
    assert code == 2 and f"no snapshot {'e' * 64}" in json.loads(out)["error"]
    code, out, _ = cli("export", str(tmp_path / "x.json"), "--snapshot", "HEAD", "--db", url,
                       "--json")
    assert code == 2 and "64 lowercase hex digits" in json.loads(out)["error"]
    code, out, _ = cli("export", str(tmp_path / "x.json"), "--snapshot", "e" * 64,
                       "--template", "flash_fwd", "--db", url, "--json")
    assert code == 2 and "--template cannot be combined" in json.loads(out)["error"]
    code, out, _ = cli("snapshot", "create", "--template", "nope", "--db", url, "--json")
    assert code == 2 and "nothing to freeze" in json.loads(out)["error"]
    assert not (tmp_path / "x.json").exists()
    dispose_engine(url)
