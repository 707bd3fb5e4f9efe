"""What the coordinator keeps on disk of each live job so that a restart loses nothing: its
submit message (:class:`SubmitMessages`) and its checkpoints
(:mod:`coordinator.storage.checkpoints`); and of a sharded job, its result's pieces
(:mod:`coordinator.jobs.result_pieces`).

A job's submit message (its graph's pickled filters, its data or dataset name, its strategy) and
the client that submitted it are written to ``<state_dir>/jobs/<job id>.submit`` (one
:mod:`protocol.codec` frame, ``0600`` in a ``0700`` directory, synced) when the job is accepted,
and removed when it ends. A coordinator that dies leaves the files of its live jobs behind: the
next one on the same state directory reads them back and queues those jobs again, each from its
last checkpoint. The job's inputs are that file, too: once it is written the coordinator reads
the filters and data back over a memory map of it (:meth:`SubmitMessages.load`) and drops the
message it received, so a queued or running job's model and rows wait in the page cache, not in
the coordinator's own memory, however long the job.

:class:`JobFiles` is what the job manager calls: at submit (:meth:`JobFiles.keep`), when a run
starts (:meth:`JobFiles.checkpoints_for`: the checkpoint to resume from and the saving of new
ones), when a restarted coordinator queues a job again (:meth:`JobFiles.load`) and when a job ends
(:meth:`JobFiles.ended`: a succeeded job keeps only its newest checkpoint, the one at its end,
from which it can be continued; a failed or cancelled one keeps them all). Every method blocks
on file I/O except :meth:`JobFiles.checkpoints_for`: callers run them in a thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from coordinator.errors import StrategyFailed
from coordinator.jobs.result_pieces import ResultPieces
from coordinator.storage.checkpoints import Checkpoint, CheckpointStore, JobCheckpoints
from coordinator.storage.disk import (
    job_path,
    map_whole,
    private_directory,
    read_whole,
    tree_bytes,
    write_atomically,
)
from coordinator.storage.kept_files import PIECE_BYTES, WHOLE_BYTES
from coordinator.storage.store import JobRecord
from coordinator.strategies import Strategy
from protocol.codec import decode, encode
from protocol.errors import ErrorCode, FrameError, RequestRefused
from protocol.messages import Submit

__all__ = ["JobFiles", "SubmitMessages"]

log = logging.getLogger(__name__)

SUBMIT_SUFFIX = ".submit"
"""The suffix of a live job's submit message in ``<state_dir>/jobs``."""

MAP_MIN_BYTES = 1 << 20
"""Submit messages smaller than this are read into memory rather than mapped: a map holds a
file descriptor for as long as its job lives, worth it only where the bytes are."""


class SubmitMessages:
    """The directory of live jobs' submit messages.

    Args:
        directory: ``<state_dir>/jobs`` (made ``0700``).
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        private_directory(directory)

    def _path(self, job_id: str) -> Path:
        return job_path(self.directory, job_id, SUBMIT_SUFFIX)

    def write(self, job_id: str, msg: Submit, owner: str) -> int:
        """Write the job's submit message and owner (atomically, synced); the bytes written."""
        parts = encode({"owner": owner, "submit": msg.model_dump()})
        return write_atomically(self._path(job_id), parts)

    def load(self, job_id: str) -> tuple[Submit, str]:
        """The job's submit message and owner, as :meth:`write` wrote them: its arrays (the
        filters as the SDK sends them, the data) views over a memory map of the file
        (:func:`~coordinator.storage.disk.map_whole`), none of it read until used; under
        :data:`MAP_MIN_BYTES`, over a copy of it read into memory.

        Raises:
            OSError: there is none, or it cannot be read.
            protocol.errors.FrameError, pydantic.ValidationError: it is not what was written.
        """
        path = self._path(job_id)
        small = path.stat().st_size < MAP_MIN_BYTES
        data = decode(read_whole(path) if small else map_whole(path))
        return Submit.model_validate(data["submit"]), str(data["owner"])

    def has(self, job_id: str) -> bool:
        return self._path(job_id).is_file()

    def ids(self) -> set[str]:
        """The jobs whose submit messages are here."""
        return {p.stem for p in self.directory.glob(f"*{SUBMIT_SUFFIX}")}

    def drop(self, job_id: str) -> None:
        """Remove the job's submit message (it ended)."""
        with contextlib.suppress(OSError):
            self._path(job_id).unlink(missing_ok=True)


class JobFiles:
    """``<state_dir>/jobs``, ``<state_dir>/checkpoints`` and ``<state_dir>/results`` (a
    sharded job's pieces: :mod:`coordinator.jobs.result_pieces`)."""

    def __init__(
        self, state_dir: Path, piece_bytes: int = PIECE_BYTES, whole_bytes: int = WHOLE_BYTES
    ) -> None:
        self.piece_bytes = piece_bytes  # of a file left on a worker, read at once
        self.whole_bytes = whole_bytes  # of a file left on a worker, read whole
        self.submits = SubmitMessages(state_dir / "jobs")
        self.checkpoints = CheckpointStore(state_dir / "checkpoints")
        self.results = ResultPieces(state_dir / "results")

    def resumable(self) -> set[str]:
        """The jobs a restarted coordinator can queue again (their submit message is here)."""
        return self.submits.ids()

    def keep(self, job_id: str, msg: Submit, owner: str) -> Submit:
        """Keep a new job's submit message; the message read back over its file, for the job
        to run from (the one received can then be dropped: :class:`SubmitMessages`). One
        that cannot be written or read back is said in the log and given back as it is (the
        job runs from memory, but would not outlive a restart of the coordinator)."""
        try:
            self.submits.write(job_id, msg, owner)
            return self.submits.load(job_id)[0]
        except (OSError, FrameError, ValidationError) as exc:
            log.warning("job %s: kept in memory only, it will not resume: %s", job_id, exc)
            return msg

    def load(self, job_id: str) -> tuple[Submit, str]:
        """The submit message and owner of a job to queue again (:meth:`SubmitMessages.load`)."""
        return self.submits.load(job_id)

    async def checkpoints_for(
        self,
        job_id: str,
        strategy: Strategy,
        emit: Callable[[str, dict[str, Any]], Awaitable[None]],
        resume_from: str | None = None,
    ) -> JobCheckpoints | None:
        """The checkpoints of a run of ``job_id`` (``None`` when its strategy saves none):
        its latest checkpoint to resume from, if it has one — else, for a job that continues
        another (``resume_from``), that one's.

        Raises:
            StrategyFailed: ``bad_request``: the job to continue has no checkpoint left.
        """
        if not strategy.saves_checkpoints or strategy.checkpoint_every == 0:
            return None
        latest = await asyncio.to_thread(self.checkpoints.latest, job_id)
        source = job_id
        if latest is None and resume_from is not None:
            latest = await asyncio.to_thread(self.checkpoints.latest, resume_from)
            source = resume_from
            if latest is None:  # it had one at submit: removed, or damaged, since
                raise StrategyFailed(
                    ErrorCode.BAD_REQUEST,
                    f"resume_from={resume_from!r}: no checkpoint of that job reads back now",
                )
        return JobCheckpoints(
            job_id,
            self.checkpoints,
            strategy.keep_checkpoints,
            emit,
            latest,
            source=source,
            piece_bytes=self.piece_bytes,
            whole_bytes=self.whole_bytes,
        )

    def continuable(self, source: JobRecord, strategy: Strategy) -> None:
        """Refuse continuing job ``source`` with ``strategy`` when it cannot be: another kind
        of strategy (its checkpoint holds another kind of state), a strategy that keeps none,
        no checkpoint left of it, or a sharded run's checkpoint for a run not sharded.

        Raises:
            RequestRefused: ``bad_request`` saying which.
        """
        said = f"resume_from={source.id!r}"
        if source.strategy != strategy.name:
            raise RequestRefused.of(
                ErrorCode.BAD_REQUEST,
                f"{said}: that job ran {source.strategy} and this one {strategy.name}; a job "
                "continues one of its own strategy (its checkpoint holds that kind of state)",
            )
        if not strategy.saves_checkpoints or strategy.checkpoint_every == 0:
            raise RequestRefused.of(
                ErrorCode.BAD_REQUEST,
                f"{said}: this job's strategy keeps no checkpoints to start from "
                "(checkpoint_every=0, or a strategy that saves none)",
            )
        if not self.checkpoints.has(source.id):
            raise RequestRefused.of(
                ErrorCode.BAD_REQUEST,
                f"{said}: that job ({source.state}) kept no checkpoint to start from "
                "(it saved none, or they were removed)",
            )
        if self.checkpoints.sharded(source.id) and not strategy.shards_checkpoints:
            raise RequestRefused.of(
                ErrorCode.BAD_REQUEST,
                f"{said}: that job's checkpoint holds each replica's shards of the model "
                "(it ran sharded) and this job's replicas would each load the whole model: "
                "continue it with sharding='full' or 'gradients'",
            )

    def checkpoint(self, job_id: str, seq: int | None = None, verify: bool = True) -> Checkpoint:
        """The job's checkpoint ``seq`` (``None``: its newest that reads back); ``verify``:
        as :meth:`CheckpointStore.read`.

        Raises:
            RequestRefused: ``no_checkpoint``, naming the ones it has.
        """
        found = None
        if seq is None:
            found = self.checkpoints.latest(job_id)
        else:
            with contextlib.suppress(OSError, FrameError, ValueError):
                found = self.checkpoints.read(job_id, seq, verify)
        if found is None:
            there = [s for s, _ in self.checkpoints.positions(job_id)]
            which = "no checkpoint" if seq is None else f"no checkpoint {seq}"
            has = f"it has {there}" if there else "it has none"
            raise RequestRefused.of(
                ErrorCode.NO_CHECKPOINT, f"job {job_id!r} has {which} ({has})", job_id=job_id
            )
        return found

    def ended(self, job_id: str, succeeded: bool, keep: str = "newest") -> None:
        """A job ended: its submit message goes; if it succeeded, its checkpoints as ``keep``
        says (``keep_on_success``): all but the newest (its end: what continues it,
        ``resume_from``), none, or all."""
        self.submits.drop(job_id)
        if succeeded and keep == "newest":
            self.checkpoints.keep_newest(job_id)
        elif succeeded and keep == "none":
            self.checkpoints.drop(job_id)

    def bytes_of(self, job_id: str) -> int:
        """What a job holds here apart from the store: its checkpoints and its result's
        pieces, in bytes."""
        return sum(
            tree_bytes(folder)
            for folder in (self.checkpoints.folder(job_id), self.results.folder(job_id))
        )

    def delete(self, job_id: str) -> None:
        """Remove what a job holds here: its submit message, checkpoints and result's
        pieces."""
        self.submits.drop(job_id)
        self.checkpoints.drop(job_id)
        self.results.drop(job_id)

    def forget_others(self, live: Iterable[str]) -> None:
        """Remove the submit messages of jobs not ``live`` (ended under a coordinator that died
        before it could remove them)."""
        for job_id in self.submits.ids() - set(live):
            self.submits.drop(job_id)
