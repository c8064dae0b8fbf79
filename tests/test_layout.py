"""``supervisor/`` is arranged by concern (docs/architecture.md, "The parts"): its sub-packages
import each other in one direction only, and the docs name every module where it lives."""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SUPERVISOR = ROOT / "supervisor"
PACKAGES = {"cycle", "wire", "keys", "observe", "operator", "cli", "ui"}


def _package_of(path: Path) -> str:
    parts = path.relative_to(SUPERVISOR).with_suffix("").parts
    return parts[0] if len(parts) > 1 else parts[0].removesuffix(".py")


def _imports_at_load() -> dict[str, set[str]]:
    """Sub-package -> the sub-packages its modules import when loaded (module-level imports:
    those under ``if TYPE_CHECKING`` or inside functions never run at import)."""
    edges: dict[str, set[str]] = defaultdict(set)
    for path in SUPERVISOR.rglob("*.py"):
        source = _package_of(path)
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("supervisor."):
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names if a.name.startswith("supervisor.")]
            else:
                continue
            for name in names:
                target = name.split(".")[1]
                if target in PACKAGES and target != source:
                    edges[source].add(target)
    return edges


def _cycles(edges: dict[str, set[str]]) -> set[tuple[str, ...]]:
    found: set[tuple[str, ...]] = set()

    def walk(node: str, path: list[str]) -> None:
        for nxt in edges.get(node, ()):
            if nxt in path:
                found.add(tuple(path[path.index(nxt):] + [nxt]))
            else:
                walk(nxt, [*path, nxt])

    for start in list(edges):
        walk(start, [start])
    return found


def test_supervisor_sub_packages_form_no_import_circle():
    edges = _imports_at_load()
    assert edges["cycle"] and edges["cli"], edges  # the walk sees real imports
    assert _cycles(edges) == set(), dict(edges)


def test_every_supervisor_module_lives_in_a_sub_package_the_docs_name():
    loose = sorted(p.name for p in SUPERVISOR.glob("*.py") if p.name not in ("__init__.py", "sdk.py"))
    assert loose == [], "a module directly in supervisor/ belongs in a sub-package by concern"
    packages = {p.name for p in SUPERVISOR.iterdir() if (p / "__init__.py").exists()}
    assert packages == PACKAGES
    architecture = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    for package in packages:
        assert f"`supervisor/{package}/`" in architecture, package
        assert re.search(rf"`{package}/`", readme), package


def test_no_test_module_imports_another():
    """What several test modules share lives in a support module (tests/ledger.py,
    tests/wire_peers.py, ...). Imported from another test module, a helper hides where it is
    shared, a ``test_`` function imported with it runs twice, and an autouse fixture imported
    with it applies itself to the importer's tests. ``conftest.py`` is pytest's to load, not
    a module to import from (pytest may load it under another name, running it twice)."""
    importing = {}
    for path in sorted((ROOT / "tests").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            modules = ([node.module] if isinstance(node, ast.ImportFrom) and node.module
                       else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            taken = [m for m in modules if m.startswith("tests.test_") or m == "tests.conftest"]
            if taken:
                importing[path.name] = taken
    assert importing == {}
