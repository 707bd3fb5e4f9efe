"""Queued jobs' inputs, kept on disk instead of in the coordinator's memory.

A job that cannot start when it is submitted may wait behind others for hours; its pickled
filters and its data (``x``, ``y``: hundreds of MB, say) need not wait in memory. Over
:data:`PARK_MIN_BYTES` they are written to ``<state_dir>/queued/<job id>.frame`` (the codec's
frame, the file ``0600`` in a ``0700`` directory, like the store) and read back when the job is
placed. Files left by a previous process belong to jobs the store has failed on recovery: they
are removed when the coordinator starts. File I/O here blocks: the job manager calls it in a
thread.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from pathlib import Path

from coordinator.jobs.disk import private_directory, read_whole
from coordinator.strategies import JobInputs
from protocol.arrays import data_nbytes
from protocol.codec import decode, encode, frame_nbytes

__all__ = ["PARK_MIN_BYTES", "QueuedInputs", "input_bytes"]

log = logging.getLogger(__name__)

PARK_MIN_BYTES = 1 << 20
"""Inputs smaller than this stay in memory while their job is queued (a write is not worth it)."""


def input_bytes(inputs: JobInputs) -> int:
    """Bytes of a job's pickled filters and data arrays (what parking it would free)."""
    data = data_nbytes(inputs.x) + data_nbytes(inputs.y)
    data += data_nbytes(inputs.x_val) + data_nbytes(inputs.y_val)
    return sum(len(b) for b in inputs.filters.values()) + data


class QueuedInputs:
    """The directory of parked inputs.

    Args:
        directory: where the files go (created ``0700``; what is in it is removed).
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        private_directory(directory)
        for stale in directory.glob("*.frame*"):
            log.info("removing %s: its job ended with the previous coordinator", stale.name)
            stale.unlink(missing_ok=True)

    def _path(self, job_id: str) -> Path:
        return self.directory / f"{job_id}.frame"

    def park(self, job_id: str, inputs: JobInputs) -> JobInputs:
        """Write ``inputs``' filters and data to disk; the inputs without them (what placement
        needs: node ids, node info, the dataset's name)."""
        path = self._path(job_id)
        partial = path.with_suffix(".frame.partial")
        parts = encode(
            {
                "filters": inputs.filters,
                "x": inputs.x,
                "y": inputs.y,
                "x_val": inputs.x_val,
                "y_val": inputs.y_val,
            }
        )
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            with os.fdopen(fd, "wb") as file:
                for part in parts:
                    file.write(part)
            os.replace(partial, path)
        except BaseException:
            partial.unlink(missing_ok=True)
            raise
        log.info(
            "job %s: %d bytes of queued inputs parked in %s", job_id, frame_nbytes(parts), path
        )
        return dataclasses.replace(inputs, filters={}, x=None, y=None, x_val=None, y_val=None)

    def take(self, job_id: str, parked: JobInputs) -> JobInputs:
        """The inputs :meth:`park` wrote, read back (the file is removed).

        Raises:
            OSError: the file cannot be read.
            protocol.errors.FrameError: it is not the frame that was written.
        """
        path = self._path(job_id)
        data = decode(read_whole(path))  # arrays are views over the bytes read, writable
        path.unlink(missing_ok=True)
        return dataclasses.replace(
            parked,
            filters=data["filters"],
            x=data["x"],
            y=data["y"],
            x_val=data.get("x_val"),
            y_val=data.get("y_val"),
        )

    def drop(self, job_id: str) -> None:
        """Remove a job's parked inputs, if any (it ended while queued)."""
        with contextlib.suppress(OSError):
            self._path(job_id).unlink(missing_ok=True)
