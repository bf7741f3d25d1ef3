"""The product packages' imports, read statically (issue 41, "Zero import cycles and no
cross-module private imports"): no module imports itself back through others, and none takes
another module's private (``_``) names. A cycle says two modules are one concept or a third is
missing; a private name taken across modules is a public one that is not said to be. And "the
package layout drawn in docs/ARCHITECTURE.md matches the code": its layout table has a row for
every package and none for another, and the modules it names are there."""

from __future__ import annotations

import ast
import functools
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("tuner", "templates", "db", "api")

# Cycles and private names taken across modules that are known and allowed: none. (A test
# below fails if an entry here no longer applies, so that it cannot hide a new one.)
KNOWN_CYCLE_EDGES: set[tuple[str, str]] = set()
KNOWN_PRIVATE: set[tuple[str, str, str]] = set()


@dataclass(frozen=True)
class Import:
    importer: str  # module name
    line: int
    target: str  # module imported (a module of ours)
    names: tuple[str, ...]  # names taken from it (from-imports), else ()


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def product_modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if "migrations" not in path.parts:  # Alembic's scripts, run by Alembic
                found[module_name(path)] = path
    return found


MODULES = product_modules()


def _type_checking_block(node: ast.AST) -> bool:
    return (isinstance(node, ast.If) and isinstance(node.test, ast.Name | ast.Attribute)
            and ast.unparse(node.test).endswith("TYPE_CHECKING"))


def _runtime_nodes(tree: ast.AST) -> Iterator[ast.AST]:
    """Every node but those under ``if TYPE_CHECKING:`` (imports for annotations only)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        stack.extend(child for child in ast.iter_child_nodes(node)
                     if not _type_checking_block(child))


def _ours(name: str) -> str | None:
    """The module of ours that ``name`` is or lies in (None: not ours)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


@functools.cache
def imports_of(module: str) -> list[Import]:
    path = MODULES[module]
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in _runtime_nodes(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = _ours(alias.name)
                if target:
                    found.append(Import(module, node.lineno, target, ()))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                if submodule in MODULES:  # `from package import module`
                    found.append(Import(module, node.lineno, submodule, ()))
                elif (target := _ours(base)) is not None:
                    found.append(Import(module, node.lineno, target, (alias.name,)))
    return found


def import_graph() -> dict[str, dict[str, Import]]:
    """Importer -> imported module -> the first import of it (a package's ``__init__`` is an
    edge only where it is imported by name: every submodule's import runs it)."""
    graph: dict[str, dict[str, Import]] = {m: {} for m in MODULES}
    for module in MODULES:
        for imp in imports_of(module):
            if imp.target != module:
                graph[module].setdefault(imp.target, imp)
    return graph


def cycles(graph: dict[str, dict[str, Import]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_graph_sees_the_imports_it_checks() -> None:
    # The walk must see what it judges: a top-level, a function-local and a relative import.
    graph = import_graph()
    assert "tuner.errors" in graph["tuner.cli.app"]
    assert "tuner.settings" in graph["tuner.cli.common"]  # function-local there too
    assert len(MODULES) > 100
    assert cycles({"a": {"b": None}, "b": {"a": None}, "c": {}}) == [["a", "b"]]  # type: ignore[dict-item]


def test_the_known_private_imports_are_still_there() -> None:
    # An exception that no longer applies must go, so that it cannot hide a new one.
    taken = {(imp.importer, imp.target, name) for module in MODULES
             for imp in imports_of(module) for name in imp.names}
    assert taken >= KNOWN_PRIVATE, KNOWN_PRIVATE - taken


def test_no_import_cycles() -> None:
    graph = import_graph()
    for importer, target in KNOWN_CYCLE_EDGES:
        assert target in graph[importer], f"{importer} -> {target} is gone: drop the exception"
        del graph[importer][target]
    found = cycles(graph)
    described = []
    for component in found:
        members = set(component)
        edges = [f"{a} -> {b} ({MODULES[a].relative_to(ROOT)}:{imp.line})"
                 for a in component for b, imp in graph[a].items() if b in members]
        described.append("; ".join(edges))
    assert not found, "import cycles:\n" + "\n".join(described)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_private_name_is_imported_from_another_module(module: str) -> None:
    private = [f"{MODULES[module].relative_to(ROOT)}:{imp.line} takes {name} from {imp.target}"
               for imp in imports_of(module) if imp.target != module
               for name in imp.names if name.startswith("_") and not name.startswith("__")
               and (module, imp.target, name) not in KNOWN_PRIVATE]
    private += [f"{MODULES[module].relative_to(ROOT)}:{imp.line} imports {imp.target}"
                for imp in imports_of(module)
                if any(p.startswith("_") and not p.startswith("__")
                       for p in imp.target.split("."))]
    assert not private, "\n".join(private)


def test_one_error_hierarchy() -> None:
    # "One of each fact" (issue 41): there were two TunerError classes (tuner.errors and the
    # client's). Every error class of the product packages has its own name, and the tuner's
    # derive from tuner.errors.TunerError (db's, which imports nothing of the tuner's, aside).
    from tuner.errors import ServiceError, TunerError
    from tuner.lookup.bundle import BundleError
    from tuner.lookup.snapshot import SnapshotError
    from tuner.settings import SettingsError

    names = [node.name for module, path in MODULES.items()
             for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.ClassDef) and node.name.endswith("Error")]
    assert len(names) == len(set(names)), sorted(names)
    assert all(issubclass(e, TunerError)
               for e in (BundleError, ServiceError, SettingsError, SnapshotError))


# ------------------------------------------------------------------ the drawn layout
ARCHITECTURE = ROOT / "docs" / "ARCHITECTURE.md"
_LAYOUT_ROW = re.compile(r"^\| `(?P<package>[\w/]+/)` \| (?P<owns>.*) \|$")


def drawn_layout(text: str) -> dict[str, str]:
    """The layout table of docs/ARCHITECTURE.md: package folder -> what its row says."""
    section = text.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    return {m["package"].rstrip("/"): m["owns"]
            for line in section.splitlines() if (m := _LAYOUT_ROW.match(line))}


def code_packages() -> set[str]:
    """Every package folder of the product packages (Alembic's scripts aside)."""
    return {path.parent.relative_to(ROOT).as_posix() for module, path in MODULES.items()
            if path.name == "__init__.py"}


def test_docs_architecture_draws_every_package_and_no_other() -> None:
    drawn = drawn_layout(ARCHITECTURE.read_text())
    code = code_packages()
    assert "tuner/dispatch/implementations" in code and len(drawn) > 10
    undrawn, made_up = sorted(code - drawn.keys()), sorted(drawn.keys() - code)
    assert not undrawn, f"docs/ARCHITECTURE.md's layout has no row for {undrawn}"
    assert not made_up, f"docs/ARCHITECTURE.md's layout draws {made_up}, not in the code"
    named = [f"{package}/{name}" for package, owns in drawn.items()
             for name in re.findall(r"`(\w+\.py)`", owns)]
    missing = [path for path in named if not (ROOT / path).is_file()]
    assert named and not missing, f"docs/ARCHITECTURE.md names modules not there: {missing}"


def test_the_layout_check_sees_a_missing_or_a_made_up_row() -> None:
    text = ARCHITECTURE.read_text()
    row = next(line for line in text.splitlines() if line.startswith("| `tuner/lookup/` |"))
    assert "tuner/lookup" not in drawn_layout(text.replace(row + "\n", ""))
    made_up = text.replace(row, row + "\n| `tuner/nowhere/` | nothing |")
    assert drawn_layout(made_up).keys() - code_packages() == {"tuner/nowhere"}
