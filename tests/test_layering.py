"""The packages import one way: somatize → engine/protocol, worker → engine → protocol,
coordinator → protocol; nothing imports back up.

The coordinator never runs user code, so it never imports the engine (torch training) or the
worker; the protocol imports none of its users. Read from every module's import statements
(``ast``), with no package imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

ALLOWED = {
    "protocol": {"protocol"},
    "engine": {"engine", "protocol"},
    "worker": {"worker", "engine", "protocol"},
    "coordinator": {"coordinator", "protocol"},
    "somatize": {"somatize", "engine", "protocol"},
}
"""What each package may import of ours (itself included)."""


def imported_packages(path: Path) -> set[tuple[str, int]]:
    """Our top-level packages that the module at ``path`` imports, with the line of each."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found |= {(name.split(".")[0], node.lineno) for name in names}
    return {(package, line) for package, line in found if package in ALLOWED}


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_a_package_imports_only_what_is_below_it(package: str) -> None:
    wrong = [
        f"{path.relative_to(ROOT)}:{line} imports {imported}"
        for path in sorted((ROOT / package).rglob("*.py"))
        for imported, line in sorted(imported_packages(path))
        if imported not in ALLOWED[package]
    ]
    assert not wrong, "\n".join(wrong)


def test_the_check_sees_a_wrong_import(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("import os\nfrom engine.nodes import Nodes\nimport worker.agent as a\n")
    assert imported_packages(module) == {("engine", 2), ("worker", 3)}
