from __future__ import annotations

import pytest

from tuner.settings import SettingsError, load_settings


def test_defaults_point_at_a_local_sqlite_file(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TUNER_DATABASE_URL", raising=False)
    s = load_settings()
    assert s.database_url == "sqlite:///tuner.db"
    assert s.url is None


@pytest.mark.parametrize(
    ("var", "value", "needle"),
    [
        ("TUNER_DATABASE_URL", "not a url", "TUNER_DATABASE_URL"),
        ("TUNER_DATABASE_URL", "mysql://x/y", "not supported"),
        ("TUNER_URL", "ftp://host", "http://"),
        ("TUNER_LOG_LEVEL", "LOUD", "DEBUG"),
        ("TUNER_LOOKUP_TIMEOUT", "-1", "TUNER_LOOKUP_TIMEOUT"),
    ],
)
def test_bad_values_name_the_variable(
    monkeypatch: pytest.MonkeyPatch, var: str, value: str, needle: str
) -> None:
    monkeypatch.setenv(var, value)
    with pytest.raises(SettingsError, match=needle):
        load_settings()


def test_write_token_refuses_placeholders() -> None:
    with pytest.raises(SettingsError, match="placeholder"):
        load_settings(token="changeme").require_write_token()
    with pytest.raises(SettingsError, match="not set"):
        load_settings(token=None).require_write_token()
    assert load_settings(token="a" * 24).require_write_token() == "a" * 24
