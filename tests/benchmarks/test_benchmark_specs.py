"""Every sweep spec under benchmarks/specs/ loads (a spec that no longer parses, or names a
template that is gone, fails here on the CPU instead of in a GPU session's device call)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tuner.tuning.suites import load_spec_file

SPECS = sorted((Path(__file__).resolve().parents[2] / "benchmarks" / "specs").glob("*.toml"))


def test_the_specs_folder_is_found() -> None:
    assert len(SPECS) >= 5, SPECS


@pytest.mark.parametrize("path", SPECS, ids=lambda p: p.name)
def test_a_spec_loads_with_problems_of_known_templates(path: Path) -> None:
    from templates import all_templates

    spec = load_spec_file(path)
    assert spec.problems, f"{path.name} holds no problem"
    known = {template.name for template in all_templates()}
    unknown = [name for name in spec.templates if name not in known]
    assert not unknown, f"{path.name} names templates that are not registered: {unknown}"
