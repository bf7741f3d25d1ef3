from __future__ import annotations

import pytest

from tuner.settings import SettingsError, load_log_settings, load_settings


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


def test_a_bad_value_lists_its_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TUNER_LOG_LEVEL", "LOUD")
    monkeypatch.setenv("TUNER_LOOKUP_TIMEOUT", "-1")
    with pytest.raises(SettingsError) as err:
        load_settings()
    assert set(err.value.variables) == {"TUNER_LOG_LEVEL", "TUNER_LOOKUP_TIMEOUT"}
    with pytest.raises(SettingsError) as err:
        load_log_settings()  # the log level alone: no other variable is read
    assert err.value.variables == ("TUNER_LOG_LEVEL",)


def test_the_log_level_says_whether_it_was_given(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TUNER_LOG_LEVEL", raising=False)
    default = load_log_settings()
    assert default.log_level == "WARNING" and not default.log_level_set
    monkeypatch.setenv("TUNER_LOG_LEVEL", "info")
    given = load_log_settings()
    assert given.log_level == "INFO" and given.log_level_set
