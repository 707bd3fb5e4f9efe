"""Two asyncio helpers the agent's modules share: owned tasks and "am I being cancelled"."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any

__all__ = ["cancelling", "owned_task"]


def owned_task(coro: Awaitable[Any]) -> asyncio.Task[Any]:
    """A task whose failure is read even when its waiter went away (no "never retrieved")."""
    task: asyncio.Task[Any] = asyncio.ensure_future(coro)
    task.add_done_callback(lambda t: t.cancelled() or t.exception())
    return task


def cancelling() -> bool:
    """True when the current task itself is being cancelled (not merely what it awaited)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0
