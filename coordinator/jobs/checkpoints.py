"""A running job's checkpoints, as its strategy sees them: the one to resume from, and saving.

The job manager gives each run a :class:`JobCheckpoints` (``JobInputs.checkpoints``): the
checkpoint the job resumes from, if any, and :meth:`JobCheckpoints.save`, which writes the next
one off the event loop (:class:`~coordinator.jobs.checkpoint_store.CheckpointStore`) and says so in
the job's events — ``checkpoint`` with its position, size and time, or ``checkpoint_failed`` with
why (the disk full, say): training goes on, the checkpoints before it stand.

The write runs while training goes on (the payload is the coordinator's own copy): only reading
the state stalls the run. One write is in flight at a time, in order; :meth:`flush` waits for
it (a run does before it returns, the job manager before it records a job's end).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from coordinator.jobs.checkpoint_store import Checkpoint, CheckpointStore
from protocol.errors import FrameError

__all__ = ["JobCheckpoints"]

log = logging.getLogger(__name__)


@dataclass
class JobCheckpoints:
    """One job's checkpoints (module docstring).

    Attributes:
        job_id: the job.
        store: where they are written.
        keep: how many are kept.
        emit: the job's event callback.
        resume: what the run starts from (``None``: the beginning).
        source: the job ``resume`` is a checkpoint of: this one, or the one it continues.
    """

    job_id: str
    store: CheckpointStore
    keep: int
    emit: Callable[[str, dict[str, Any]], Awaitable[None]]
    resume: Checkpoint | None = None
    source: str | None = None
    _writing: asyncio.Task[bool] | None = field(default=None, repr=False)

    def resumed(self) -> dict[str, Any]:
        """What the ``resumed`` event says of ``resume``: its position, its number, and the
        job it comes from when that is another (``from_job``)."""
        assert self.resume is not None
        said = self.resume.position | {"checkpoint": self.resume.seq}
        return said | ({"from_job": self.source} if self.source not in (None, self.job_id) else {})

    async def save(self, position: dict[str, Any], payload: dict[str, Any]) -> None:
        """Start writing a checkpoint of the run at ``position`` (once the one before is
        written); ``payload`` must not change meanwhile."""
        await self.flush()
        self._writing = asyncio.create_task(self._write(position, payload))

    async def flush(self) -> bool | None:
        """Wait for the checkpoint being written, if any; whether it was written."""
        task, self._writing = self._writing, None
        return None if task is None else await task

    async def _write(self, position: dict[str, Any], payload: dict[str, Any]) -> bool:
        began = time.perf_counter()
        try:
            saved = await asyncio.to_thread(
                self.store.save, self.job_id, position, payload, self.keep
            )
        except (OSError, FrameError) as exc:
            log.warning("job %s: the checkpoint at %s failed: %s", self.job_id, position, exc)
            await self.emit("checkpoint_failed", position | {"error": f"{exc}"})
            return False
        seconds = time.perf_counter() - began
        await self.emit(
            "checkpoint",
            position | {"seq": saved.seq, "bytes": saved.nbytes, "seconds": round(seconds, 4)},
        )
        return True
