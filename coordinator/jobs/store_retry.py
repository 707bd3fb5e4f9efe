"""A job's terminal write, retried while the store fails.

A full disk may get room, a database locked by a backup be let go: the write that records how a
job ended is tried again a few times (:data:`STORE_RETRIES`) before the job manager gives up on
storing it. It then tells the job's watchers anyway, and the job stays ``running`` in the
store until the next coordinator start marks it failed (``coordinator_restarted``).
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
from collections.abc import Callable
from typing import Any

from coordinator.errors import StoreError

__all__ = ["STORE_RETRIES", "stored"]

log = logging.getLogger(__name__)

STORE_RETRIES = (0.5, 1.0, 2.0, 4.0)
"""Seconds between the tries of a terminal write when the store fails."""


async def stored(job_id: str, write: Callable[..., Any], *args: Any) -> str | None:
    """``write(*args)`` in a thread, tried again after each of :data:`STORE_RETRIES` while the
    store fails: ``None`` once it is stored, else the last failure."""
    failure = ""
    for delay in (*STORE_RETRIES, None):
        try:
            await asyncio.to_thread(write, *args)
            return None
        except (sqlite3.Error, StoreError) as exc:
            failure = f"{type(exc).__name__}: {exc}"
        if delay is None:
            break
        log.warning("job %s: the store failed (%s); again in %gs", job_id, failure, delay)
        await asyncio.sleep(delay)
    log.error("job %s: its end could not be stored: %s", job_id, failure)
    return failure
