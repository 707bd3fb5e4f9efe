"""How error messages name many things: a few of them and how many in all, so that a message
about a 50,000-node graph stays a line long; the one a mistyped name was probably meant to be;
and text others wrote (a job's name, a filter's error) shown as what it is, never as terminal
escape sequences or as lines of a log."""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence

__all__ = ["LISTED", "capped", "did_you_mean", "listed", "visible"]

LISTED = 8
"""The most items a message lists."""


def visible(text: str, lines: bool = True) -> str:
    """``text`` with each character that does not print (ESC, CR, backspace, C1 controls, a
    right-to-left override...) written as its Python escape (``\\x1b``, ``\\u202e``): what a
    terminal or a log shows of it is what it says. ``lines``: newlines and tabs kept (a
    traceback); else they are escaped too, so that none can start a forged log line."""
    if text.isprintable():
        return text
    kept = "\n\t" if lines else ""
    return "".join(c if c.isprintable() or c in kept else repr(c)[1:-1] for c in text)


def listed(items: Sequence[object], limit: int = LISTED) -> str:
    """``items`` as a list literal, cut to the first ``limit`` with how many there are in all:
    ``['a', 'b', ... (50000 in all)]``."""
    if len(items) <= limit:
        return repr(list(items))
    shown = ", ".join(repr(item) for item in items[:limit])
    return f"[{shown}, ... ({len(items)} in all)]"


def did_you_mean(given: str, choices: Iterable[str], most: int = 3) -> str:
    """``" (did you mean 'dp'?)"``: the choices nearest to a mistyped ``given`` (``'dpp'``;
    the same letters swapped, ``'pd'``, too), at most ``most`` of them; nothing when none is
    near."""
    options = sorted(set(choices))
    swapped = [c for c in options if sorted(c) == sorted(given) and c != given]
    close = difflib.get_close_matches(given, options, n=most, cutoff=0.6)
    near = sorted(dict.fromkeys(swapped + close))[:most]
    return f" (did you mean {' or '.join(map(repr, near))}?)" if near else ""


def capped(text: str, limit: int) -> str:
    """``text`` cut to its first ``limit`` characters (and a note of how many more there were)
    when it is longer: a record, a status answer or a log line stays bounded whatever a peer
    or a filter said."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}… ({len(text) - limit} more characters)"
