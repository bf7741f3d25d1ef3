"""``tuner snapshot create|list`` and ``tuner export --snapshot ID`` (issue 18, item 4)."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest

from api.main import create_app
from db.session import dispose_engine, session_scope
from tests.api.serving_data import TOKEN, bundle, item, live_server, problem
from tests.tuner.cli.test_sweep_cli import cli
from tuner.lookup.bundle import store_bundle, validate_bundle
from tuner.lookup.snapshot import snapshot_id_of
from tuner.settings import get_settings, load_settings


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


def test_show_prints_the_entries_from_the_database_or_the_service(tmp_path: Path) -> None:
    url = stored(tmp_path, "a.db", item(problem(4096)), item(problem(512)),
                 item(problem(1024, causal="top_left")))
    code, out, err = cli("snapshot", "create", "--db", url, "--json")
    assert code == 0, err
    sid = json.loads(out)["id"]
    code, out, err = cli("snapshot", "show", sid, "--db", url)
    assert code == 0, err
    assert f"snapshot {sid}: 3 best config(s)" in out and f"TUNER_SNAPSHOT={sid}" in out
    rows = [line for line in out.splitlines() if "flash_fwd" in line]
    assert len(rows) == 3
    # Numbers in numeric order (512 before 4096), dense before causal; each row's config.
    assert ["N512" in rows[0], "N4096" in rows[1], "causal-top_left" in rows[2]] == [True] * 3
    assert all("BLOCK_M=" in r and "NVIDIA H100" in r for r in rows)
    code, out, _ = cli("snapshot", "show", sid, "--db", url, "--json")
    shown = json.loads(out)
    assert (shown["id"], shown["items"]) == (sid, 3) and snapshot_id_of(shown["bundle"]) == sid

    with live_server(create_app(load_settings(database_url=url, token=TOKEN,
                                              url=None))) as service:
        code, out, err = cli("snapshot", "show", sid, "--url", service, "--json")
        assert code == 0, err
        assert json.loads(out) == shown
        code, out, _ = cli("snapshot", "show", "e" * 64, "--url", service, "--json")
        assert code == 2 and "answered 404" in json.loads(out)["error"]
        assert "tuner snapshot list" in json.loads(out)["fix"]
    code, out, _ = cli("snapshot", "show", "e" * 64, "--db", url, "--json")
    assert code == 2 and f"no snapshot {'e' * 64} in database" in json.loads(out)["error"]
    code, out, _ = cli("snapshot", "show", "HEAD", "--db", url, "--json")
    assert code == 2 and "64 lowercase hex digits" in json.loads(out)["error"]
    code, out, _ = cli("snapshot", "show", sid, "--db", url, "--url", "http://x:1", "--json")
    assert code == 2 and "--url and --db" in json.loads(out)["error"]
    dispose_engine(url)


def test_delete_asks_first_and_removes_only_that_snapshot(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    url = stored(tmp_path, "a.db", item(problem(1024)))
    kept = json.loads(cli("snapshot", "create", "--db", url, "--json")[1])["id"]
    stored(tmp_path, "a.db", item(problem(2048)))
    doomed = json.loads(cli("snapshot", "create", "--db", url, "--json")[1])["id"]

    monkeypatch.setattr("sys.stdin", io.StringIO("n\n"))
    code, out, _ = cli("snapshot", "delete", doomed, "--db", url)
    assert code == 1 and "2 best config(s)" in out and "kept" in out
    code, out, _ = cli("snapshot", "delete", doomed, "--db", url, "--json")
    assert code == 2 and "needs --yes" in json.loads(out)["error"]
    assert len(json.loads(cli("snapshot", "list", "--db", url, "--json")[1])) == 2

    monkeypatch.setattr("sys.stdin", io.StringIO("y\n"))
    code, out, err = cli("snapshot", "delete", doomed, "--db", url)
    assert code == 0 and f"deleted snapshot {doomed}" in out, err
    listed = json.loads(cli("snapshot", "list", "--db", url, "--json")[1])
    assert [s["id"] for s in listed] == [kept]
    code, out, _ = cli("snapshot", "delete", doomed, "--db", url, "--yes", "--json")
    assert code == 2 and f"no snapshot {doomed} in database" in json.loads(out)["error"]

    with live_server(create_app(load_settings(database_url=url, token=TOKEN,
                                              url=None))) as service:
        code, out, _ = cli("snapshot", "delete", kept, "--url", service, "--yes", "--json")
        assert code == 2 and "answered 401" in json.loads(out)["error"]
        assert "TUNER_TOKEN" in json.loads(out)["fix"]
        monkeypatch.setenv("TUNER_TOKEN", TOKEN)
        get_settings.cache_clear()
        code, out, err = cli("snapshot", "delete", kept, "--url", service, "--yes", "--json")
        assert code == 0, err
        assert (json.loads(out)["id"], json.loads(out)["deleted"]) == (kept, True)
        code, out, _ = cli("snapshot", "delete", kept, "--url", service, "--yes", "--json")
        assert code == 2 and "answered 404" in json.loads(out)["error"]
        assert json.loads(cli("snapshot", "list", "--url", service, "--json")[1]) == []
    dispose_engine(url)
