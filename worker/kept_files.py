"""Files a job's call left on this worker's disk for the coordinator to read a piece at a time.

A call may ask the agent to keep a part of its result that holds files (:attr:`Call.keep
<protocol.messages.Call.keep>`: a sharded checkpoint's, as torch.distributed.checkpoint wrote
them on the replica): they are written here, under an id of the agent's making, and the reply
carries their names and sizes instead. The coordinator then reads them in pieces
(:class:`~protocol.messages.ReadKept`), so neither it nor the link ever holds one whole, and
drops them once read (:class:`~protocol.messages.DropKept`). A job's files go when it closes,
and all of them with the agent.

The folder is the agent's own (``0700``, made afresh at start): what a daemon sends is written
under names checked to be plain file names, and only files written here are read back. File
I/O blocks: the handlers call it in a thread.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from protocol.errors import ErrorCode, FrameError, RequestRefused
from protocol.files.kept_files import file_parts

__all__ = ["KeptFiles"]


class KeptFiles:
    """This agent's kept files, one folder per job and call (module docstring).

    Args:
        directory: where they go; ``None``: a new temporary folder, made when a file is first
            kept. Removed by :meth:`close`.
    """

    def __init__(self, directory: Path | None = None) -> None:
        self._directory = directory
        self._sizes: dict[tuple[str, str], dict[str, int]] = {}

    def _root(self) -> Path:
        """The folder, made (``0700``) when a file is first kept."""
        if self._directory is None:
            self._directory = Path(tempfile.mkdtemp(prefix="somatize-kept-"))
        else:
            self._directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        return self._directory

    def keep(self, job_id: str, files: Mapping[str, Any]) -> dict[str, Any]:
        """Write ``files`` (by plain name: :func:`protocol.files.kept_files.files_at` checked them;
        each bytes, or a value written as its frame: :func:`~protocol.files.kept_files.file_parts`)
        of a call of ``job_id`` here; what the reply says in their place: ``{"kept": id,
        "files": {name: size}}``.

        Raises:
            RequestRefused: ``resource_limit``: they could not be written (the disk full);
                ``bad_request``: a value a frame cannot carry.
        """
        kept = secrets.token_hex(8)
        folder = None
        sizes: dict[str, int] = {}
        try:
            folder = self._root() / _job_name(job_id) / kept
            folder.mkdir(mode=0o700, parents=True)
            for name, data in files.items():
                fd = os.open(folder / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "wb") as file:
                    sizes[name] = sum(file.write(part) for part in file_parts(data))
        except (OSError, FrameError) as exc:
            if folder is not None:
                shutil.rmtree(folder, ignore_errors=True)
            code = ErrorCode.RESOURCE_LIMIT if isinstance(exc, OSError) else ErrorCode.BAD_REQUEST
            raise RequestRefused.of(
                code,
                f"job {job_id!r}: keeping {len(files)} files on the worker failed: {exc}",
                job_id=job_id,
            ) from exc
        self._sizes[(job_id, kept)] = sizes
        return {"kept": kept, "files": sizes}

    def read(self, job_id: str, kept: str, name: str, offset: int, length: int) -> bytes:
        """Bytes ``[offset, offset + length)`` of kept file ``name`` (fewer where it ends).

        Raises:
            RequestRefused: ``bad_request``: nothing of that name is kept under ``kept`` for
                the job.
        """
        sizes = self._sizes.get((job_id, kept))
        if sizes is None or name not in sizes:
            raise RequestRefused.of(
                ErrorCode.BAD_REQUEST,
                f"job {job_id!r} kept no file {name!r} under {kept!r} here",
                job_id=job_id,
            )
        with (self._folder(job_id, kept) / name).open("rb") as file:
            file.seek(offset)
            return file.read(length)

    def drop(self, job_id: str, kept: str | None = None) -> None:
        """Remove what ``job_id`` kept under ``kept`` (every call's, with ``None``)."""
        for key in [k for k in self._sizes if k[0] == job_id and kept in (None, k[1])]:
            del self._sizes[key]
            shutil.rmtree(self._folder(*key), ignore_errors=True)
        if kept is None and self._directory is not None:
            with contextlib.suppress(OSError):
                (self._directory / _job_name(job_id)).rmdir()

    def close(self) -> None:
        """Remove every job's files and the folder."""
        self._sizes.clear()
        if self._directory is not None:
            shutil.rmtree(self._directory, ignore_errors=True)

    def _folder(self, job_id: str, kept: str) -> Path:
        """Where a call's files lie (only asked of what :meth:`keep` wrote: the folder is)."""
        assert self._directory is not None
        return self._directory / _job_name(job_id) / kept


def _job_name(job_id: str) -> str:
    """A job's folder name: its id in hex, whatever characters the id holds."""
    return job_id.encode().hex()
