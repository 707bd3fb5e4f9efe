"""protocol's core is sans-I/O: outside protocol/asyncio/, no module imports an event loop,
a socket library, mmap or os-level I/O."""

from __future__ import annotations

import ast
from pathlib import Path

import protocol

FORBIDDEN = {"asyncio", "websockets", "mmap", "os", "socket", "ctypes", "fcntl", "subprocess"}


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_the_core_imports_no_io():
    root = Path(protocol.__file__).parent
    core = [p for p in root.rglob("*.py") if "asyncio" not in p.relative_to(root).parts]
    assert len(core) >= 10
    for path in core:
        assert not _imports(path) & FORBIDDEN, (path.name, _imports(path) & FORBIDDEN)


def test_the_core_never_imports_its_binding():
    root = Path(protocol.__file__).parent
    for path in root.glob("*.py"):
        source = path.read_text()
        assert "protocol.asyncio" not in "".join(
            line for line in source.splitlines() if line.startswith(("import", "from"))
        ), path.name
