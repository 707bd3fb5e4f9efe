"""Whose code a module or a source file is: the user's own, this project's, Python's or an
installed package's.

Two things ask: :mod:`protocol.filters` (a user's own modules are pickled by value, everything
else by reference) and :mod:`protocol.text.user_tracebacks` (a user's frames are shown, the others
folded).
"""

from __future__ import annotations

import functools
import sys
import sysconfig
from pathlib import Path

__all__ = ["OUR_PACKAGES", "file_owner", "is_user_module"]

# This project's top-level packages: installed on every worker, never the user's.
OUR_PACKAGES = ("protocol", "engine", "worker", "coordinator", "somatize")
_ROOT = str(Path(__file__).resolve().parents[2])
# The standard library's and the installed packages' folders, longest first: site-packages may
# lie inside the standard library's folder.
_INSTALLED = tuple(
    sorted(
        {
            str(Path(sysconfig.get_paths()[k]).resolve())
            for k in ("stdlib", "platstdlib", "purelib", "platlib")
        },
        key=len,
        reverse=True,
    )
)


def is_user_module(name: str) -> bool:
    """True for a loaded module defined by the user's own files (not the standard library, not
    an installed package, not ours, not ``__main__``)."""
    if name == "__main__" or name.split(".")[0] in OUR_PACKAGES:
        return False
    module = sys.modules.get(name)
    file = getattr(module, "__file__", None)
    if module is None or not isinstance(file, str):
        return False
    return not _installed(file)


@functools.lru_cache(maxsize=8192)
def _installed(file: str) -> bool:
    """Whether ``file`` lies in the standard library's or an installed package's folder (asked
    of every loaded module each time a filter is pickled: the answer does not change)."""
    return str(Path(file).resolve()).startswith(_INSTALLED)


def file_owner(filename: str) -> str | None:
    """Whose a source file is: ``"somatize"`` (this project), ``"python"`` (the standard library
    or frozen code) or an installed package's name; ``None`` for the user's own."""
    if filename.startswith("<frozen") or filename.startswith("<string"):
        return "python"
    path = str(Path(filename).resolve()) if filename.startswith("/") else filename
    for package in OUR_PACKAGES:
        if path.startswith(f"{_ROOT}/{package}/"):
            return "somatize"
    for root in _INSTALLED:
        if path.startswith(root + "/"):
            top = path[len(root) + 1 :].split("/", 1)[0]
            return top if "site-packages" in root or "dist-packages" in root else "python"
    return None
