"""Sizes and durations as a person writes them on a command line (``8G``, ``512M``; ``30d``,
``12h``, ``90m``, ``45``), for every CLI of the project's."""

from __future__ import annotations

import argparse

__all__ = ["byte_count", "seconds"]

_SIZES = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_DURATIONS = {"": 1.0, "S": 1.0, "M": 60.0, "H": 3600.0, "D": 86400.0}


def byte_count(text: str) -> int:
    """``8G``, ``512M``, ``1073741824``: a byte count (suffixes in powers of 1024).

    Raises:
        argparse.ArgumentTypeError: not a size.
    """
    number, unit = text.strip().upper().rstrip("IB"), ""
    if number and number[-1] in _SIZES:
        number, unit = number[:-1], number[-1]
    try:
        value = int(float(number) * _SIZES[unit])
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 8G, 512M)") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"a size is not negative: {text!r}")
    return value


def seconds(text: str) -> float:
    """``30d``, ``12h``, ``90m``, ``45s``, ``45``: a duration in seconds.

    Raises:
        argparse.ArgumentTypeError: not a duration.
    """
    number, unit = text.strip().upper(), ""
    if number and number[-1] in _DURATIONS:
        number, unit = number[:-1], number[-1]
    try:
        value = float(number) * _DURATIONS[unit]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a duration: {text!r} (e.g. 30d, 12h, 90m, 45)"
        ) from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"a duration is a finite number >= 0: {text!r}")
    return value
