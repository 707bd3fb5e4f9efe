"""The packages import one way: somatize → engine/protocol, worker → engine → protocol,
coordinator → protocol; nothing imports back up. Inside a package, its rooms import one way too
(:data:`ORDERS`), and no module imports itself through others.

The coordinator never runs user code, so it never imports the engine (torch training) or the
worker; the protocol imports none of its users. Read from every module's import statements
(``ast``: at the top, in functions, and under ``TYPE_CHECKING``, which are arrows too), with no
package imported.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping
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

ORDERS = {
    "coordinator": [
        ["coordinator.cli"],
        ["coordinator.server"],
        ["coordinator.jobs"],
        ["coordinator.scheduling"],
        ["coordinator.strategies.__init__"],  # the registry: every strategy by its wire name
        ["coordinator.strategies.model_parallel"],
        ["coordinator.strategies.data_parallel"],
        ["coordinator.strategies.federated"],
        ["coordinator.strategies"],  # what the strategies share: base, rounds, steps, ...
        ["coordinator.workers"],
        ["coordinator.storage"],
        ["coordinator.context"],
        ["coordinator.errors"],
    ],
    "protocol": [
        ["protocol.asyncio"],
        ["protocol.rules"],
        ["protocol.files", "protocol.security"],
        ["protocol.options"],
        ["protocol"],
        # what the wire itself carries, parsed, and how its refusals are worded
        ["protocol.options.compression", "protocol.options.refusals", "protocol.options.training"],
        ["protocol.text"],
    ],
    "engine": [
        ["engine.engine"],  # the parts wired together
        ["engine.data_parallel", "engine.pipeline"],
        ["engine"],  # the training core: nodes, optimizers, the loop, a group to train in
        ["engine.data"],
        ["engine.errors"],
    ],
    "somatize": [
        ["somatize.__init__"],  # the public names, imported on first use
        ["somatize.cli"],
        ["somatize.remote"],
        ["somatize.options"],
        ["somatize"],  # graphs of filters, fitted in-process; saved; keywords
        ["somatize.errors"],
    ],
    "worker": [
        ["worker"],  # the agent: its link, its jobs, its peers
        ["worker.supervision"],  # its filter daemons: started, kept, talked to, survived
        ["worker.config"],
        ["worker.daemon"],  # the daemon process, and the pipes both ends speak
        ["worker.confinement"],  # what a daemon runs inside: sandbox, cgroup, limits
        ["worker.errors", "worker.tasks"],
    ],
}
"""Each package's rooms from the top down: a module may import its own room and the rooms below
it, never one above. A module's room is the longest name listed that is its own or a package
holding it; ``pkg.__init__`` names the package's ``__init__.py`` alone."""


def module_name(path: Path) -> str:
    """``coordinator/jobs/manager.py`` → ``coordinator.jobs.manager``; a package's
    ``__init__.py`` → ``pkg.__init__``."""
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def modules(packages: list[str]) -> dict[str, Path]:
    """Every module of ``packages``, by :func:`module_name`."""
    return {module_name(p): p for pkg in packages for p in sorted((ROOT / pkg).rglob("*.py"))}


def imported_names(path: Path) -> Iterator[tuple[str, int]]:
    """Every name the module at ``path`` imports absolutely (``a.b`` and, for ``from a.b import
    c``, ``a.b.c``), with its line."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from ((alias.name, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module, node.lineno
            yield from ((f"{node.module}.{alias.name}", node.lineno) for alias in node.names)


def imported_packages(path: Path) -> set[tuple[str, int]]:
    """Our top-level packages that the module at ``path`` imports, with the line of each."""
    found = {(name.split(".")[0], line) for name, line in imported_names(path)}
    return {(package, line) for package, line in found if package in ALLOWED}


def imported_modules(path: Path, known: Mapping[str, Path]) -> dict[str, int]:
    """The modules of ``known`` that the module at ``path`` imports, each with a line: ``from
    a.b import c`` imports module ``a.b.c`` where there is one, else ``a.b``."""
    found: dict[str, int] = {}
    for name, line in imported_names(path):
        module = name if name in known else f"{name}.__init__"
        if module in known:
            found.setdefault(module, line)
    found.pop(module_name(path), None)
    return found


def room(module: str, order: list[list[str]]) -> int:
    """The index in ``order`` of the room that holds ``module``."""
    held = [
        (len(name), i)
        for i, names in enumerate(order)
        for name in names
        if module == name or module.startswith(f"{name}.")
    ]
    assert held, f"{module} is in no room of its package's order: add it to ORDERS"
    return max(held)[1]


def cycles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """The strongly connected parts of ``graph`` with more than one module (Tarjan's)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = [stack.pop()]
            while part[-1] != v:
                part.append(stack.pop())
            if len(part) > 1:
                found.append(sorted(part))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_a_package_imports_only_what_is_below_it(package: str) -> None:
    wrong = [
        f"{path.relative_to(ROOT)}:{line} imports {imported}"
        for path in sorted((ROOT / package).rglob("*.py"))
        for imported, line in sorted(imported_packages(path))
        if imported not in ALLOWED[package]
    ]
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("package", sorted(ORDERS))
def test_a_packages_rooms_import_only_the_rooms_below_them(package: str) -> None:
    known = modules([package])
    order = ORDERS[package]
    wrong = [
        f"{path.relative_to(ROOT)}:{line} imports {imported} (a room above it)"
        for name, path in known.items()
        for imported, line in sorted(imported_modules(path, known).items())
        if room(imported, order) < room(name, order)
    ]
    assert not wrong, "\n".join(wrong)


def test_no_module_imports_itself_through_others() -> None:
    known = modules(sorted(ALLOWED))
    graph = {name: set(imported_modules(path, known)) for name, path in known.items()}
    found = cycles(graph)
    assert not found, "modules that import one another:\n" + "\n".join(map(" ".join, found))


def test_the_checks_see_a_wrong_import_and_a_circle(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("import os\nfrom engine.nodes import Nodes\nimport worker.agent as a\n")
    assert imported_packages(module) == {("engine", 2), ("worker", 3)}

    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []

    order = ORDERS["coordinator"]
    assert room("coordinator.strategies.__init__", order) < room(
        "coordinator.strategies.base", order
    )
    assert room("coordinator.strategies.data_parallel.diloco", order) < room(
        "coordinator.strategies.rounds", order
    )
    assert room("coordinator.storage.store", order) > room("coordinator.jobs.manager", order)
