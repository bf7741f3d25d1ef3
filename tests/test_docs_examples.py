"""The code examples of docs/ run as written: every fenced ``python`` block holding ``>>>``
lines is a doctest, the blocks of one page sharing their names in order. A page's example
that drifts from the code (a result it no longer returns, a name that moved) fails here."""

from __future__ import annotations

import doctest
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from tuner.attention import clear_plans
from tuner.lookup.resolver import ConfigResolver, set_resolver
from tuner.settings import load_settings

DOCS = Path(__file__).resolve().parents[1] / "docs"
FENCED_PYTHON = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)
# Pages whose examples are cheap on the CPU; a page listed here must hold at least one.
PAGES = ["QUICKSTART.md", "SERVING.md"]


def doctest_blocks(page: Path) -> list[str]:
    return [block for block in FENCED_PYTHON.findall(page.read_text()) if ">>>" in block]


@pytest.fixture
def nothing_tuned(tmp_path: Path) -> Iterator[None]:
    """The state the examples describe: no database, no service, no kept plan."""
    set_resolver(ConfigResolver(load_settings(database_url=f"sqlite:///{tmp_path / 'no.db'}",
                                              url=None)))
    clear_plans()
    yield
    clear_plans()
    set_resolver(None)


@pytest.mark.parametrize("name", PAGES)
def test_the_examples_of_a_page_run_as_written(name: str, nothing_tuned: None) -> None:
    page = DOCS / name
    blocks = doctest_blocks(page)
    assert blocks, f"{name} has no ```python block with >>> examples"
    parser = doctest.DocTestParser()
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    names: dict[str, object] = {}
    for number, block in enumerate(blocks, 1):
        test = parser.get_doctest(block, names, f"{name} block {number}", str(page), 0)
        runner.run(test, clear_globs=False)
        names = test.globs
    failed, attempted = runner.summarize(verbose=False)
    assert attempted > 0
    assert failed == 0, f"{failed} of {attempted} examples of docs/{name} failed (printed above)"


def test_only_fenced_python_blocks_hold_examples() -> None:
    text = "```python\n>>> 1 + 1\n2\n```\n\n>>> 3\n\n```bash\n>>> not python\n```\n"
    assert FENCED_PYTHON.findall(text) == [">>> 1 + 1\n2\n"]
