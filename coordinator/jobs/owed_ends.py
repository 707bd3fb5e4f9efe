"""Job ends the store could not record when they happened, kept until it can.

A job that is cancelled, fails or is refused its result while the store cannot write (the disk
is full, a backup holds the database) has ended all the same: its task is gone, its workers are
freed and its watchers were told. Its record must not stay ``running`` once the store can write
again. :class:`OwedEnds` keeps each such end, answers for it in place of the stale record
(:meth:`OwedEnds.as_recorded`), and writes it as soon as the store takes it
(:meth:`OwedEnds.pay_forever`, tried again every :data:`RETRY_EVERY` seconds).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import sqlite3
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from coordinator.errors import InvalidJobTransition, StoreError, UnknownJob
from coordinator.storage.store import JobRecord, JobState

log = logging.getLogger(__name__)

__all__ = ["RETRY_EVERY", "OwedEnds"]

RETRY_EVERY = 5.0
"""Seconds between two tries of writing the ends the store refused."""


@dataclass(frozen=True, slots=True)
class _End:
    state: JobState
    error: dict[str, Any]
    finished: float
    write: Callable[[], object]


class OwedEnds:
    """The job ends the store refused, by job id, written again until it takes them.

    Args:
        retry_every: seconds between the tries.
    """

    def __init__(self, retry_every: float = RETRY_EVERY) -> None:
        self.retry_every = retry_every
        self._ends: dict[str, _End] = {}
        self._owed = asyncio.Event()

    def __contains__(self, job_id: object) -> bool:
        return job_id in self._ends

    def __len__(self) -> int:
        return len(self._ends)

    def owe(
        self,
        job_id: str,
        state: JobState,
        error: dict[str, Any],
        finished: float,
        write: Callable[[], object],
    ) -> None:
        """Keep the end of ``job_id`` the store refused: ``write()`` records it."""
        self._ends[job_id] = _End(state, error, finished, write)
        self._owed.set()

    def as_recorded(self, record: JobRecord) -> JobRecord:
        """``record`` as it will read once its owed end is written (itself when none is)."""
        end = self._ends.get(record.id)
        if end is None or record.state.terminal:
            return record
        return dataclasses.replace(record, state=end.state, error=end.error, finished=end.finished)

    async def pay(self) -> int:
        """Try each owed end once (in a thread); returns how many are still owed."""
        for job_id, end in list(self._ends.items()):
            try:
                await asyncio.to_thread(end.write)
            except (InvalidJobTransition, UnknownJob) as exc:  # ended or gone another way
                log.warning("job %s: its %s end is not stored: %s", job_id, end.state, exc)
            except (sqlite3.Error, StoreError, OSError) as exc:
                log.warning("job %s: its end is still not stored: %s", job_id, exc)
                continue
            log.info("job %s: its %s end is stored at last", job_id, end.state)
            if self._ends.get(job_id) is end:
                del self._ends[job_id]
        if not self._ends:
            self._owed.clear()
        return len(self._ends)

    async def pay_forever(self) -> None:
        """Write the owed ends whenever there are some, every ``retry_every`` seconds."""
        while True:
            await self._owed.wait()
            await asyncio.sleep(self.retry_every)
            await self.pay()
