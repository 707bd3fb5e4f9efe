"""How error messages name many things: a few of them and how many in all, so that a message
about a 50,000-node graph stays a line long."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["LISTED", "listed"]

LISTED = 8
"""The most items a message lists."""


def listed(items: Sequence[object], limit: int = LISTED) -> str:
    """``items`` as a list literal, cut to the first ``limit`` with how many there are in all:
    ``['a', 'b', ... (50000 in all)]``."""
    if len(items) <= limit:
        return repr(list(items))
    shown = ", ".join(repr(item) for item in items[:limit])
    return f"[{shown}, ... ({len(items)} in all)]"
