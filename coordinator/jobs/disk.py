"""Files a coordinator keeps per job in its state directory: where they go, how they are
written so that a crash never leaves a torn one in their place, and how they are read back."""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterable
from pathlib import Path

__all__ = [
    "AtomicFile",
    "job_path",
    "map_whole",
    "private_directory",
    "read_whole",
    "write_atomically",
]


def private_directory(directory: Path) -> Path:
    """``directory``, made (with its parents) if missing and ``0700`` either way: what a
    coordinator keeps of its jobs may be private rows.

    Raises:
        OSError: it cannot be made, or its mode changed.
    """
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    return directory


def job_path(directory: Path, job_id: str, suffix: str = "") -> Path:
    """``directory/<job_id><suffix>``, for a ``job_id`` that names no other directory.

    Raises:
        ValueError: ``job_id`` is empty, ``.``, ``..`` or holds a ``/``.
    """
    if not job_id or "/" in job_id or job_id in (".", ".."):
        raise ValueError(f"not a job id: {job_id!r}")
    return directory / f"{job_id}{suffix}"


class AtomicFile:
    """A file written whole or not at all, in as many writes as it takes: into
    ``<path>.partial`` (``0600``), then synced and renamed over ``path``, the directory synced
    (:meth:`commit`); :meth:`abandon` leaves ``path`` as it was and no ``.partial``. Its I/O
    blocks.

    ``reuse``: a file that is being thrown away (``None``: none), renamed to the ``.partial``
    and written over in place, so that the new file takes its disk blocks and its cached
    pages instead of new ones being allocated while the old ones are freed (the coordinator
    wrote a 23 MB checkpoint so in 17–20 ms, a new file in 110–160 ms, ``fsync`` included:
    ``python -m benchmarks.checkpoints`` on this project's machine). It is gone once this is
    made, whether the new file is written or not.

    Raises:
        OSError: the ``.partial`` cannot be made.
    """

    def __init__(self, path: Path, reuse: Path | None = None) -> None:
        self.path = path
        self._partial = path.with_suffix(path.suffix + ".partial")
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        if reuse is not None:
            try:
                os.replace(reuse, self._partial)
                flags &= ~os.O_TRUNC
            except FileNotFoundError:
                pass
        fd = os.open(self._partial, flags, 0o600)
        self._file = os.fdopen(fd, "wb")
        self.nbytes = 0

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Append ``data``.

        Raises:
            OSError: it could not be written (the file is then abandoned).
        """
        try:
            self.nbytes += self._file.write(data)
        except BaseException:
            self.abandon()
            raise

    def commit(self) -> int:
        """The file whole at its path; the bytes written.

        Raises:
            OSError: it could not be made so (the file is then abandoned).
        """
        try:
            self._file.flush()
            os.ftruncate(self._file.fileno(), self.nbytes)  # a reused file may have been longer
            os.fsync(self._file.fileno())
            self._file.close()
            os.replace(self._partial, self.path)
            folder = os.open(self.path.parent, os.O_RDONLY)
            try:
                os.fsync(folder)
            finally:
                os.close(folder)
        except BaseException:
            self.abandon()
            raise
        return self.nbytes

    def abandon(self) -> None:
        """Give the file up: its path as it was, no ``.partial`` left."""
        self._file.close()
        self._partial.unlink(missing_ok=True)


def write_atomically(
    path: Path, parts: Iterable[bytes | bytearray | memoryview], reuse: Path | None = None
) -> int:
    """Write ``parts`` to ``path`` (``0600``) whole or not at all (:class:`AtomicFile`, over
    ``reuse``'s blocks where it is given). Returns the bytes written.

    Raises:
        OSError: it could not be written; ``path`` is as it was, no ``.partial`` is left.
    """
    file = AtomicFile(path, reuse)
    for part in parts:
        file.write(part)
    return file.commit()


def read_whole(path: Path) -> bytearray:
    """Every byte of ``path``, read into one writable buffer of its size (what a frame is
    decoded from: its arrays become views over it, no copy).

    Raises:
        OSError: it cannot be read.
    """
    with path.open("rb") as file:
        data = bytearray(os.fstat(file.fileno()).st_size)
        file.readinto(data)
    return data


def map_whole(path: Path) -> memoryview:
    """Every byte of ``path`` as a private, copy-on-write memory map (what a frame is decoded
    from when its arrays should stay on disk: they become views over the map, writable, and
    their pages are the file's cache, read when touched, until written to — which changes
    only this process's copy, never the file). The map lasts while a view of it does, and
    the file's may be removed meanwhile.

    Raises:
        OSError: it cannot be read or mapped.
    """
    with path.open("rb") as file:
        size = os.fstat(file.fileno()).st_size
        if not size:  # nothing to map (mmap refuses an empty file)
            return memoryview(bytearray())
        return memoryview(mmap.mmap(file.fileno(), size, access=mmap.ACCESS_COPY))
