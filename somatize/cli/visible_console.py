"""The CLI's console: rich's, showing what others wrote as what it is.

What ``somatize`` prints comes largely from others: a job's name, a filter's error and its
traceback, another client's job in the list. A filter that raises with an escape sequence in its
message once rewrote the terminal of whoever ran ``somatize result``. :class:`VisibleConsole`
writes the control characters of every string it prints as ``\\xNN``
(:func:`protocol.text.wording.visible`; lines and tabs kept). Imported when a command runs (rich
takes a moment to import).
"""

from __future__ import annotations

from typing import Any

from rich.console import Console

from protocol.text.wording import visible

__all__ = ["VisibleConsole"]


class VisibleConsole(Console):
    """A :class:`rich.console.Console` whose printed strings show their control characters."""

    def print(self, *objects: Any, **options: Any) -> None:
        shown = [visible(o) if isinstance(o, str) else o for o in objects]
        super().print(*shown, **options)
