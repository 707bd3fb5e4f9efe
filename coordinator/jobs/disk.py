"""Files a coordinator keeps per job in its state directory: where they go, how they are
written so that a crash never leaves a torn one in their place, and how they are read back."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

__all__ = ["job_path", "private_directory", "read_whole", "write_atomically"]


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


def write_atomically(path: Path, parts: Iterable[bytes | bytearray | memoryview]) -> int:
    """Write ``parts`` to ``path`` (``0600``) whole or not at all: into ``<path>.partial``,
    synced, renamed over ``path``, the directory synced. Returns the bytes written.

    Raises:
        OSError: it could not be written; ``path`` is as it was, no ``.partial`` is left.
    """
    partial = path.with_suffix(".partial")
    nbytes = 0
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "wb") as file:
            for part in parts:
                nbytes += file.write(part)
            file.flush()
            os.fsync(file.fileno())
        os.replace(partial, path)
        folder = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(folder)
        finally:
            os.close(folder)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    return nbytes


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
