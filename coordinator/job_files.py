"""What the coordinator keeps on disk of each live job so that a restart loses nothing: its
submit message (:mod:`coordinator.job_specs`) and its checkpoints (:mod:`coordinator.checkpoints`).

:class:`JobFiles` is what the job manager calls: at submit (:meth:`JobFiles.keep`), when a run
starts (:meth:`JobFiles.checkpoints_for`: the checkpoint to resume from and the saving of new
ones), when a restarted coordinator queues a job again (:meth:`JobFiles.load`) and when a job ends
(:meth:`JobFiles.ended`: a succeeded job's checkpoints go, its result is kept; a failed or
cancelled one keeps them). Every method blocks on file I/O except :meth:`checkpoints_for`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any

from coordinator.checkpoints import CheckpointStore
from coordinator.job_checkpoints import JobCheckpoints
from coordinator.job_specs import JobSpecs
from coordinator.strategies import Strategy
from protocol.messages import Submit

__all__ = ["JobFiles"]

log = logging.getLogger(__name__)


class JobFiles:
    """``<state_dir>/jobs`` and ``<state_dir>/checkpoints``."""

    def __init__(self, state_dir: Path) -> None:
        self.specs = JobSpecs(state_dir / "jobs")
        self.checkpoints = CheckpointStore(state_dir / "checkpoints")

    def resumable(self) -> set[str]:
        """The jobs a restarted coordinator can queue again (their submit message is here)."""
        return self.specs.ids()

    def keep(self, job_id: str, msg: Submit, owner: str) -> None:
        """Keep a new job's submit message; one that cannot be written is said in the log (the
        job runs, but would not outlive a restart of the coordinator)."""
        try:
            self.specs.save(job_id, msg, owner)
        except OSError as exc:
            log.warning("job %s: kept in memory only, it will not resume: %s", job_id, exc)

    def load(self, job_id: str) -> tuple[Submit, str]:
        """The submit message and owner of a job to queue again (see :meth:`JobSpecs.load`)."""
        return self.specs.load(job_id)

    async def checkpoints_for(
        self,
        job_id: str,
        strategy: Strategy,
        emit: Callable[[str, dict[str, Any]], Awaitable[None]],
    ) -> JobCheckpoints | None:
        """The checkpoints of a run of ``job_id`` (``None`` when its strategy saves none):
        its latest checkpoint to resume from, if it has one."""
        if not strategy.saves_checkpoints or strategy.checkpoint_every == 0:
            return None
        latest = await asyncio.to_thread(self.checkpoints.latest, job_id)
        return JobCheckpoints(job_id, self.checkpoints, strategy.keep_checkpoints, emit, latest)

    def ended(self, job_id: str, succeeded: bool) -> None:
        """A job ended: its submit message goes; its checkpoints too if it succeeded."""
        self.specs.drop(job_id)
        if succeeded:
            self.checkpoints.drop(job_id)

    def forget_others(self, live: Iterable[str]) -> None:
        """Remove the submit messages of jobs not ``live`` (ended under a coordinator that died
        before it could remove them)."""
        for job_id in self.specs.ids() - set(live):
            self.specs.drop(job_id)
