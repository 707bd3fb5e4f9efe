"""What each live job was submitted with, on disk: what a restarted coordinator resumes it from.

A job's submit message (its graph's pickled filters, its data or dataset name, its strategy) and
the client that submitted it are written to ``<state_dir>/jobs/<job id>.submit`` (one
:mod:`protocol.codec` frame, ``0600`` in a ``0700`` directory, synced) when the job is accepted,
and removed when it ends. A coordinator that dies leaves the files of its live jobs behind: the
next one on the same state directory reads them back and queues those jobs again, each from its
last checkpoint (:mod:`coordinator.jobs.checkpoint_store`). File I/O here blocks: callers run it in
a thread.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from coordinator.jobs.paths import job_path, write_atomically
from protocol.codec import decode, encode
from protocol.messages import Submit

__all__ = ["JobSpecs"]

SUFFIX = ".submit"


class JobSpecs:
    """The directory of live jobs' submit messages.

    Args:
        directory: ``<state_dir>/jobs`` (made ``0700``).
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(directory, 0o700)

    def _path(self, job_id: str) -> Path:
        return job_path(self.directory, job_id, SUFFIX)

    def save(self, job_id: str, msg: Submit, owner: str) -> int:
        """Write the job's submit message and owner (atomically, synced); the bytes written."""
        parts = encode({"owner": owner, "submit": msg.model_dump()})
        return write_atomically(self._path(job_id), parts)

    def load(self, job_id: str) -> tuple[Submit, str]:
        """The job's submit message and owner, as :meth:`save` wrote them.

        Raises:
            OSError: there is none, or it cannot be read.
            protocol.errors.FrameError, pydantic.ValidationError: it is not what was written.
        """
        with self._path(job_id).open("rb") as file:
            frame = bytearray(os.fstat(file.fileno()).st_size)
            file.readinto(frame)
        data = decode(frame)
        return Submit.model_validate(data["submit"]), str(data["owner"])

    def has(self, job_id: str) -> bool:
        return self._path(job_id).is_file()

    def ids(self) -> set[str]:
        """The jobs whose submit messages are here."""
        return {p.stem for p in self.directory.glob(f"*{SUFFIX}")}

    def drop(self, job_id: str) -> None:
        """Remove the job's submit message (it ended)."""
        with contextlib.suppress(OSError):
            self._path(job_id).unlink(missing_ok=True)
