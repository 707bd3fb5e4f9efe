"""The documentation holds together: the README is the way in to every page of ``docs/``, and no
link between them points at a file or a heading that is not there (pure: reads files only).

The README's walk from the demo to one's own model is run by
``tests/integration/user_facing/test_readme.py``; the generated pages (benchmarks, reliability,
security) are checked by ``tests/benchmarks/``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = sorted((ROOT / "docs").glob("*.md"))
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it: lower case, punctuation dropped, spaces to ``-``."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)
    return {slug(h) for h in re.findall(r"^#+ (.+)$", text, re.MULTILINE)}


def links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)
    return [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t)]


@pytest.mark.parametrize("page", [README, *PAGES], ids=lambda p: p.name)
def test_every_link_reaches_a_file_and_a_heading_there(page: Path) -> None:
    for target in links(page):
        path, _, anchor = target.partition("#")
        reached = (page.parent / path).resolve() if path else page
        assert reached.is_file(), f"{page.name}: {target} names no file"
        if anchor:
            assert anchor in anchors(reached), f"{page.name}: {target} names no heading there"


def test_the_readme_links_every_page_of_the_docs() -> None:
    linked = {(README.parent / t.partition("#")[0]).resolve() for t in links(README)}
    assert [p.name for p in PAGES if p.resolve() not in linked] == []


def test_the_two_commands_stay_two() -> None:
    text = README.read_text()
    section = text[text.index("## Two commands") :]
    section = section[: section.index("\n## ", 1)]
    (block,) = re.findall(r"```sh\n(.*?)```", section, re.DOTALL)
    commands = [line.split("#")[0].strip() for line in block.strip().splitlines()]
    assert commands == ["make demo", "make test"]


PACKAGES = ("protocol", "engine", "worker", "coordinator", "somatize")
MAP = ROOT / "docs" / "architecture.md"
NOT_MAPPED = {"__init__.py", "__main__.py"}
"""Files a package holds that the map does not name: they say only that it is one."""


def mapped_modules() -> set[str]:
    """The modules ``docs/architecture.md``'s package map names, as paths from the root: each
    ``### `package/``` section's table names its modules in its first column, and a row whose
    first column names a folder (``options/``) names that folder's modules in its second."""
    named: set[str] = set()
    text = MAP.read_text()
    for package, body in re.findall(r"^### `([\w/]+/)`[^\n]*\n(.*?)(?=^#)", text, re.M | re.S):
        for first, second in re.findall(r"^\| ([^|]+) \| ([^\n]+) \|$", body, re.M):
            for name in re.findall(r"`([\w/.]+)`", first):
                if name.endswith("/"):
                    named |= {package + name + m for m in re.findall(r"`(\w+\.py)`", second)}
                elif name.endswith(".py"):
                    named.add(package + name)
    return named


def test_the_map_names_every_module_and_no_module_that_is_not_there() -> None:
    """docs/architecture.md is the one map of the code: a module missing from it, or one it
    names that is gone, fails here."""
    named = mapped_modules()
    modules = {
        str(path.relative_to(ROOT))
        for package in PACKAGES
        for path in (ROOT / package).rglob("*.py")
        if path.name not in NOT_MAPPED
    }
    assert sorted(named - modules) == [], "named by the map, not in the tree"
    assert sorted(modules - named) == [], "in the tree, not on the map"
