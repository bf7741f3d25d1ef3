"""TUNER_TEMPLATE_MODULES: the service imports the modules that register templates from
outside the package, as a sweep imports its spec's template_modules."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from api.main import create_app
from tuner.settings import SettingsError, load_settings


def test_the_service_imports_the_modules_it_is_told(db_url: str, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # A module that registers nothing: the registry of this test process stays as it was.
    (tmp_path / "probe_templates_xyz.py").write_text("IMPORTED = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "probe_templates_xyz", raising=False)
    create_app(load_settings(database_url=db_url, template_modules=["probe_templates_xyz"]))
    assert sys.modules["probe_templates_xyz"].IMPORTED
    monkeypatch.delitem(sys.modules, "probe_templates_xyz")


def test_a_module_that_cannot_be_imported_stops_the_start(db_url: str) -> None:
    with pytest.raises(SettingsError, match="TUNER_TEMPLATE_MODULES.*no_such_module_xyz"):
        create_app(load_settings(database_url=db_url, template_modules=["no_such_module_xyz"]))


def test_the_modules_come_from_the_environment_as_json(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TUNER_TEMPLATE_MODULES", '["my.templates", "more"]')
    assert load_settings().template_modules == ["my.templates", "more"]
