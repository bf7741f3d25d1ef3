"""A database that cannot be opened (issue 41, items 8 and 9): ``tuner.attention``'s lookup
raises at its first config lookup, as the README says, instead of running silently on
defaults; and each refusal's fix names its cause."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy.engine import URL

from db.errors import DatabaseUnavailableError
from db.session import init_db
from tests.api.serving_data import TOKEN, live_server
from tests.tuner.cli.test_sweep_cli import cli
from tests.tuner.lookup.test_lookup import FWD, TINY, resolver
from tuner.settings import get_settings, load_settings

REFUSED = "postgresql+psycopg://nobody@127.0.0.1:1/tuner"  # port 1: nothing listens


def device():  # type: ignore[no-untyped-def]
    from templates.device import current_device

    return current_device()


def test_a_sqlite_file_in_a_missing_folder_raises_at_every_lookup(tmp_path: Path) -> None:
    lookup = resolver(f"sqlite:///{tmp_path / 'no' / 'such' / 'x.db'}")
    for _ in range(2):  # remembered: the second lookup says the same
        with pytest.raises(DatabaseUnavailableError, match="folder that does not exist") as err:
            lookup.resolve(FWD, TINY, device())
        assert f"mkdir -p {tmp_path / 'no' / 'such'}" in err.value.fix
    assert not (tmp_path / "no").exists()


def test_a_sqlite_file_not_made_yet_is_no_error(tmp_path: Path) -> None:
    got = resolver(f"sqlite:///{tmp_path / 'later.db'}").resolve(FWD, TINY, device())
    assert got.source == "default"


def test_a_server_that_refuses_the_first_connection_raises() -> None:
    with pytest.raises(DatabaseUnavailableError, match="cannot open the database") as err:
        resolver(REFUSED).resolve(FWD, TINY, device())
    assert err.value.fix.startswith("start the PostgreSQL server")


@pytest.mark.postgres
def test_a_missing_postgresql_database_is_not_a_server_to_start(postgres_server: URL) -> None:
    # Item 9: "start the PostgreSQL server" answered a server that runs without the database.
    url = postgres_server.set(database="tuner_no_such_database").render_as_string(
        hide_password=False)
    for open_it in (init_db, lambda u: resolver(u).resolve(FWD, TINY, device())):
        with pytest.raises(DatabaseUnavailableError) as err:
            open_it(url)
        assert "has no database 'tuner_no_such_database': create it" in err.value.fix
        assert "start the PostgreSQL server" not in err.value.fix


@pytest.mark.postgres
def test_a_refused_login_says_so(postgres_server: URL) -> None:
    url = postgres_server.set(username="tuner_no_such_role", password="x").render_as_string(
        hide_password=False)
    with pytest.raises(DatabaseUnavailableError) as err:
        init_db(url)
    assert "refused the login" in err.value.fix


def test_a_read_only_service_is_not_answered_with_check_the_url(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Item 9: a 503 "writes are disabled" was answered with "check --url".
    from api.main import create_app

    db = f"sqlite:///{tmp_path / 'svc.db'}"
    monkeypatch.setenv("TUNER_TOKEN", TOKEN)
    get_settings.cache_clear()
    try:
        with live_server(create_app(load_settings(database_url=db, token=None))) as url:
            code, out, err = cli("snapshot", "create", "--url", url, "--json")
    finally:
        get_settings.cache_clear()
    assert code == 2, out + err
    assert "writes are disabled" in out
    assert "serves reads only: start it with TUNER_TOKEN set" in out
    assert "--url" not in out.split('"fix"')[1]
