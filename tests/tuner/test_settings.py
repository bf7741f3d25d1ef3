from __future__ import annotations

from pathlib import Path

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
        ("TUNER_SHIPPED", "maybe", "TUNER_SHIPPED: .*must be on, off or the path of a folder"),
    ],
)
def test_bad_values_name_the_variable(
    monkeypatch: pytest.MonkeyPatch, var: str, value: str, needle: str
) -> None:
    monkeypatch.setenv(var, value)
    with pytest.raises(SettingsError, match=needle):
        load_settings()


@pytest.mark.parametrize(("token", "needle"), [
    (None, "not set"),
    ("", "not set"),  # docker-compose passes an unset variable on as ""
    ("            ", "not set"),  # stripped: twelve spaces are no token
    ("changeme", "at least 16"),
    ("changeme1234567890", "placeholder 'changeme'"),
    ("${TUNER_TOKEN}", "cannot carry"),
    ("<your-token-here>", "cannot carry"),
    ("correct horse battery staple", "cannot carry"),
    ("aaaaaaaaaaaaaaaaaaaaaaaa", "1 distinct"),
    ("abcdefabcdefabcdefab", "repeats a pattern of 6"),
    ("my-password-is-9f8e7d", "placeholder 'password'"),
])
def test_write_token_refuses_what_protects_nothing(token: str | None, needle: str) -> None:
    with pytest.raises(SettingsError, match=needle):
        load_settings(token=token).require_write_token()


def test_write_token_is_stripped_and_random_ones_pass() -> None:
    # Configured with a trailing space (a .env file, a YAML value): the same token as sent.
    assert load_settings(token=" 3f9c2a7e1b5d8c04a6e2 \n").require_write_token() == \
        "3f9c2a7e1b5d8c04a6e2"
    for token in ("3f9c2a7e1b5d8c04", "dGhpcyBpcyBhIHRva2VuIQ==", "Xk_9-aB.c~d+e/f0g1h2"):
        assert load_settings(token=token).require_write_token() == token


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


@pytest.mark.parametrize(("value", "read"), [
    ("on", "on"), ("ON", "on"), ("true", "on"), ("1", "on"), ("", "on"), ("  yes ", "on"),
    ("off", "off"), ("Off", "off"), ("false", "off"), ("0", "off"), ("no", "off"),
])
def test_tuner_shipped_reads_on_and_off_as_the_other_switches_do(
        monkeypatch: pytest.MonkeyPatch, value: str, read: str) -> None:
    monkeypatch.setenv("TUNER_SHIPPED", value)
    assert load_settings().shipped == read


def test_tuner_shipped_is_on_by_default_or_an_existing_folder(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TUNER_SHIPPED", raising=False)
    assert load_settings().shipped == "on"
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tables").mkdir()
    # A relative folder is kept absolute: the same folder if the process changes directory.
    assert load_settings(shipped="tables").shipped == str(tmp_path.resolve() / "tables")
    (tmp_path / "h200.json").write_text("{}")
    for not_a_folder in ("missing", "h200.json"):
        with pytest.raises(SettingsError, match="which is no folder") as err:
            load_settings(shipped=not_a_folder)
        assert err.value.variables == ("TUNER_SHIPPED",)
