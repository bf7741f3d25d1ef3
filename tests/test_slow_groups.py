"""The slow groups of tests/conftest.py name tests that exist: a renamed test or file would
otherwise drop out of them silently and make `make test` slow again."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.conftest import SLOW, is_slow

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("group", sorted(SLOW))
def test_each_slow_group_names_a_test(group: str) -> None:
    path, _, function = group.partition("::")
    assert (ROOT / path).is_file(), f"{path} does not exist"
    if function:
        tree = ast.parse((ROOT / path).read_text())
        names = {node.name for node in ast.walk(tree)
                 if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)}
        assert function in names, f"{path} has no {function}"


def test_the_slow_marker_reaches_the_groups() -> None:
    assert is_slow("tests/api/test_schemathesis.py::test_bundles_broken_at_random")
    assert is_slow("tests/templates/flash/test_flash_bwd.py::test_grads_match_reference_fp16[x-1]")
    assert not is_slow("tests/templates/flash/test_flash_bwd.py::test_grads_match_reference_fp16x")
    assert not is_slow("tests/test_slow_groups.py::test_the_slow_marker_reaches_the_groups")
