"""Removing ended jobs from the state directory: a client's ``somatize prune`` (its own jobs;
an admin's, anyone's) and the coordinator's retention, applied every :data:`RETAIN_EVERY`
seconds (:mod:`coordinator.jobs.retention` says which jobs are past it).

A job removed loses its record, event log, result and checkpoints; a live job is never removed.
Every removal runs off the event loop (file and SQLite I/O).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from coordinator.jobs.files import JobFiles
from coordinator.jobs.retention import Ended, Retention, expired
from coordinator.storage.disk import tree_bytes
from coordinator.storage.store import JobStore

__all__ = ["RETAIN_EVERY", "Pruning"]

log = logging.getLogger(__name__)

RETAIN_EVERY = 60.0
"""Seconds between two applications of the coordinator's retention."""


@dataclass
class Pruning:
    """The ended jobs of ``store`` and ``files``, and their removal."""

    store: JobStore
    files: JobFiles | None
    clock: Callable[[], float] = time.time
    held: int | None = None  # the state directory's bytes, when last counted

    async def prune(
        self,
        retention: Retention,
        job_ids: Iterable[str] = (),
        owner: str | None = None,
        dry_run: bool = False,
    ) -> dict[str, Any]:
        """Remove the ended jobs past ``retention`` and those of ``job_ids`` (``owner``'s
        alone, unless ``None``: an admin's, or the coordinator's own retention); what was
        (``dry_run``: would be) removed — ``jobs`` and the ``bytes`` they held — and what
        was asked for and is not an ended job here (``kept``)."""
        return await asyncio.to_thread(self._prune, retention, list(job_ids), owner, dry_run)

    def _prune(
        self, retention: Retention, job_ids: list[str], owner: str | None, dry_run: bool
    ) -> dict[str, Any]:
        ended = [e for e in self.store.ended() if owner is None or e[2] == owner]
        held = {job_id: size + self._bytes(job_id) for job_id, _, _, size in ended}
        candidates = [Ended(job_id, finished, held[job_id]) for job_id, finished, _, _ in ended]
        gone = expired(candidates, self.clock(), retention) if retention.limits else []
        gone += [job_id for job_id in job_ids if job_id in held and job_id not in gone]
        kept = [job_id for job_id in job_ids if job_id not in held]
        if not dry_run and gone:
            removed = self.store.delete(gone)
            for job_id in removed:
                if self.files is not None:
                    self.files.delete(job_id)
            gone = removed
        return {"jobs": gone, "bytes": sum(held[j] for j in gone), "kept": kept}

    def _bytes(self, job_id: str) -> int:
        return self.files.bytes_of(job_id) if self.files is not None else 0

    async def retain_forever(self, retention: Retention) -> None:
        """Apply ``retention`` (if it limits anything) and count the state directory's bytes
        (:attr:`held`), now and every :data:`RETAIN_EVERY` seconds."""
        while True:
            if retention.limits:
                await self._retain(retention)
            with contextlib.suppress(OSError):  # a file gone while counted: counted next time
                self.held = await asyncio.to_thread(tree_bytes, self.store.state_dir)
            await asyncio.sleep(RETAIN_EVERY)

    async def _retain(self, retention: Retention) -> None:
        try:
            said = await self.prune(retention)
        except Exception:  # a disk fault: said, and tried again next time
            log.exception("applying the retention (%s) failed", retention.describe())
            return
        if said["jobs"]:
            log.info(
                "retention (%s): removed %d ended jobs, %.1f MB",
                retention.describe(),
                len(said["jobs"]),
                said["bytes"] / 1e6,
            )
