"""Each job's event stream: stored in order, handed to the clients watching it live.

Every change of a job is an event in the store (``queued``, ``placed``, ``progress``,
``restarting``, ``succeeded``, ``failed``, ``cancelled``...). A watcher reads the history after
the sequence number it has, then the live events until the terminal one; it subscribes before it
reads the history, so that nothing falls in between, and skips what it already had.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import time
from collections.abc import AsyncIterator
from typing import Any

from coordinator.jobs.log import life_line
from coordinator.storage.store import EventRecord, JobStore, StoreError, UnknownJob
from protocol.errors import ErrorCode, RequestRefused

__all__ = ["TERMINAL_EVENTS", "JobEvents"]

log = logging.getLogger(__name__)

TERMINAL_EVENTS = frozenset({"succeeded", "failed", "cancelled"})


class JobEvents:
    """The event streams of the jobs in ``store``."""

    def __init__(self, store: JobStore) -> None:
        self.store = store
        self._watchers: dict[str, set[asyncio.Queue[EventRecord]]] = {}
        self._last_seq: dict[str, int] = {}  # of each live job's last event, for emit
        self._metrics: dict[str, dict[str, Any]] = {}  # each live job's last epoch's figures
        self._placed: dict[str, float] = {}  # when each running job was placed, for the log

    async def watch(self, job_id: str, after_seq: int, live: bool) -> AsyncIterator[EventRecord]:
        """The job's events after ``after_seq``, until its terminal event if it is ``live``
        (else its history is all there is)."""
        queue: asyncio.Queue[EventRecord] = asyncio.Queue()
        if live:  # subscribe before reading the history, so nothing falls in between
            self._watchers.setdefault(job_id, set()).add(queue)
        try:
            try:
                history = await asyncio.to_thread(self.store.events, job_id, after_seq)
            except UnknownJob as exc:
                raise RequestRefused.of(
                    ErrorCode.UNKNOWN_JOB, f"no job {job_id!r}", job_id=job_id
                ) from exc
            last = after_seq
            for event in history:
                yield event
                last = event.seq
                if event.kind in TERMINAL_EVENTS:
                    return
            if not live:
                return  # it ended before (or the coordinator restarted): the history is all
            while True:
                event = await queue.get()
                if event.seq <= last:
                    continue
                yield event
                last = event.seq
                if event.kind in TERMINAL_EVENTS:
                    return
        finally:
            if live:
                watchers = self._watchers.get(job_id, set())
                watchers.discard(queue)
                if not watchers:  # (kept, it would be one more entry for every job ever watched)
                    self._watchers.pop(job_id, None)

    async def emit(self, job_id: str, event: str, data: dict[str, Any]) -> None:
        """Store a job's event and hand it to its watchers. A terminal event the store cannot
        take still reaches them (numbered after the last one they got): a client learns how its
        job ended even with the disk full."""
        if event == "progress":
            figures = _figures(data)
            if figures:
                self._metrics[job_id] = figures
            # The job's progress keeps its last epoch's (round's) figures beside its last
            # step's: what the status page shows of a running job.
            latest = self._metrics.get(job_id)
            progress = data | {"metrics": latest} if latest else data
            await asyncio.to_thread(self.store.progress, job_id, progress)
        try:
            recorded = await asyncio.to_thread(self.store.add_event, job_id, event, data)
        except (sqlite3.Error, StoreError):
            if event not in TERMINAL_EVENTS:
                raise
            log.error(
                "job %s: its %s event could not be stored; told to its watchers", job_id, event
            )
            seq = self._last_seq.get(job_id, 0) + 1
            recorded = EventRecord(job_id, seq, time.time(), event, data)
        self._last_seq[job_id] = recorded.seq
        if event == "placed":
            self._placed[job_id] = time.monotonic()
        placed = self._placed.pop(job_id, None) if event in TERMINAL_EVENTS else None
        level, line = life_line(job_id, event, data, _since(placed))
        log.log(level, "%s", line)
        if event in TERMINAL_EVENTS:
            self._last_seq.pop(job_id, None)
            self._metrics.pop(job_id, None)
        for queue in self._watchers.get(job_id, ()):
            queue.put_nowait(recorded)


def _figures(data: dict[str, Any]) -> dict[str, Any] | None:
    """The figures of an epoch's (a round's) history row, from its progress event; ``None``
    for any other event."""
    unit = data.get("phase")
    if unit not in ("epoch", "round") or "loss" not in data:
        return None
    skip = {"phase", "rounds", "rows"}
    return {
        k: v
        for k, v in data.items()
        if k not in skip and isinstance(v, int | float) and not isinstance(v, bool)
    }


def _since(start: float | None) -> float | None:
    return None if start is None else time.monotonic() - start
