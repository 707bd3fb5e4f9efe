"""The event loop every somatize daemon and CLI runs on."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

__all__ = ["loop_factory"]


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's event loop when it is installed (about half the latency per message), else
    ``None``: asyncio's own (``asyncio.Runner(loop_factory=loop_factory())``)."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        return None
    return uvloop.new_event_loop
