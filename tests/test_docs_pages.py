"""docs/ for users: every relative link of the README and the pages reaches a file and a
heading that exist, the README reaches install, use, tune, serve and deploy in one click, the
pages stay short enough to read, and no path of one machine is written in the repository."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted((ROOT / "docs").glob("*.md"))
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
MAX_LINES = 2000  # all user pages together (issue 41)


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    text = FENCE.sub("", page.read_text())
    headings = re.findall(r"^#+\s+(.*)$", text, re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def links(page: Path) -> list[str]:
    return [t for t in LINK.findall(FENCE.sub("", page.read_text()))
            if not re.match(r"[a-z]+:", t)]


@pytest.mark.parametrize("page", [ROOT / "README.md", *PAGES], ids=lambda p: p.name)
def test_relative_links_reach_a_file_and_a_heading(page: Path) -> None:
    for target in links(page):
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        assert file.is_file(), f"{page.name}: {target} names no file"
        if anchor:
            assert anchor in anchors(file), f"{page.name}: {target}: no such heading"


def test_the_readme_reaches_each_step_in_one_click() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "import tuner" in readme and "tuner.attention(q, k, v" in readme
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| \*\*(\w+)\*\* \| (.*) \|$",
                                                        readme, re.MULTILINE)}
    assert sorted(rows) == ["Deploy", "Install", "Serve", "Tune", "Use"]
    for step, cell in rows.items():
        assert LINK.search(cell), f"the README's {step} row links nowhere"


def test_user_pages_are_short() -> None:
    total = sum(len(p.read_text().splitlines()) for p in PAGES)
    assert total <= MAX_LINES, f"docs/*.md hold {total} lines; the limit is {MAX_LINES}"


def test_no_path_of_one_machine_in_the_repository() -> None:
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                           check=True).stdout.decode().split("\0")
    machine_path = re.compile(r"(/work/|/home/|/root/|/Users/|(?<![\w.])\.gpu/|/opt/torch/)")
    found = []
    for name in filter(None, files):
        path = ROOT / name
        if not path.is_file() or path.suffix in {".png", ".whl"}:
            continue
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if machine_path.search(line) and Path(__file__).name not in name:
                found.append(f"{name}:{number}: {line.strip()[:100]}")
    assert not found, "paths of one machine (write repo-relative commands):\n" + "\n".join(found)
