"""Files a coordinator keeps per job in its state directory: where they go, how they are
written so that a crash never leaves a torn one in their place, and how they are read back."""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import threading
from collections.abc import Iterable
from pathlib import Path

__all__ = [
    "DIRECT_ALIGNMENT",
    "AtomicFile",
    "DirectStaging",
    "job_path",
    "map_whole",
    "private_directory",
    "read_whole",
    "tree_bytes",
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


O_DIRECT = getattr(os, "O_DIRECT", 0)
"""Linux's flag for writes that go from the process's memory to the disk, not through the page
cache; ``0`` where there is none (files are written through the page cache there)."""

DIRECT_ALIGNMENT = 4096
"""What an ``O_DIRECT`` write's memory, offset and length are multiples of: a page, which
every block device's logical block size divides."""

STAGING_BYTES = 4 << 20
"""One staging buffer: the bytes of one ``O_DIRECT`` write."""


class DirectStaging:
    """Page-aligned buffers that large files are written to disk through, around the page cache.

    A file written through the page cache is copied into pages the kernel allocates for it,
    dirty until written back: on this project's 2-core VM a new 23 MB checkpoint took the
    coordinator 110–250 ms so beside a training job (its first ``keep`` of every job; one
    written over a retired file's cached pages 15–20 ms), and the copy came to more CPU than
    all the rest of a checkpoint (``perf``: ``copy_folio_from_iter_atomic``). Written
    ``O_DIRECT`` from a buffer that stays mapped, a file costs one copy into memory already
    faulted in and the disk's own transfer: 10–32 ms new or not (``python -m
    benchmarks.checkpoints``). Databases and checkpointers write so (DeepSpeed's FastPersist);
    what is written is read back rarely (a resume), so it is not worth the cache either.

    One buffer per file being written (:meth:`take`, :meth:`give`); at most ``kept`` are kept
    for the next file, the others unmapped. Safe from several threads.
    """

    def __init__(self, nbytes: int = STAGING_BYTES, kept: int = 2) -> None:
        if nbytes <= 0 or nbytes % DIRECT_ALIGNMENT:
            raise ValueError(f"staging buffers are whole pages, not {nbytes} bytes")
        self.nbytes = nbytes
        self.kept = kept
        self._free: list[mmap.mmap] = []
        self._lock = threading.Lock()

    def take(self) -> mmap.mmap:
        """A buffer of :attr:`nbytes` (page-aligned: a fresh anonymous map, or one given back)."""
        with self._lock:
            if self._free:
                return self._free.pop()
        return mmap.mmap(-1, self.nbytes)

    def give(self, buffer: mmap.mmap) -> None:
        """``buffer`` back, for the next file."""
        with self._lock:
            if len(self._free) < self.kept:
                self._free.append(buffer)
                return
        buffer.close()


class AtomicFile:
    """A file written whole or not at all, in as many writes as it takes: into
    ``<path>.partial`` (``0600``), then synced and renamed over ``path``, the directory synced
    (:meth:`commit`); :meth:`abandon` leaves ``path`` as it was and no ``.partial``. Its I/O
    blocks.

    ``reuse``: a file that is being thrown away (``None``: none), renamed to the ``.partial``
    and written over in place, so that the new file takes its disk blocks (and, through the
    page cache, its cached pages) instead of new ones being allocated while the old ones are
    freed (the coordinator
    wrote a 23 MB checkpoint so in 17–20 ms, a new file in 110–160 ms, ``fsync`` included,
    through the page cache: ``python -m benchmarks.checkpoints`` on this project's machine). It
    is gone once this is made, whether the new file is written or not.

    ``staging``: write around the page cache (``O_DIRECT``), through a buffer of these
    (:class:`DirectStaging`): whole buffers go to the disk as they fill, the last part of a page
    through the page cache (``O_DIRECT`` turned off for it). Where the file system refuses
    ``O_DIRECT`` (at the open or a write), the file is written through the page cache from
    there on all the same; :attr:`direct` says which.

    Raises:
        OSError: the ``.partial`` cannot be made.
    """

    def __init__(
        self, path: Path, reuse: Path | None = None, staging: DirectStaging | None = None
    ) -> None:
        self.path = path
        self._partial = path.with_suffix(path.suffix + ".partial")
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        if reuse is not None:
            try:
                os.replace(reuse, self._partial)
                flags &= ~os.O_TRUNC
            except FileNotFoundError:
                pass
        self.direct = staging is not None and O_DIRECT != 0
        try:
            fd = os.open(self._partial, flags | (O_DIRECT if self.direct else 0), 0o600)
        except OSError as exc:
            if not self.direct or exc.errno != errno.EINVAL:
                raise
            self.direct = False  # a file system without O_DIRECT (some FUSE, older tmpfs)
            fd = os.open(self._partial, flags, 0o600)
        self._fd = fd
        self._file = os.fdopen(fd, "wb")
        self._staging = staging if self.direct else None
        self._stage = self._staging.take() if self._staging is not None else None
        self._filled = 0  # bytes of the stage not yet written
        self.nbytes = 0

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Append ``data``.

        Raises:
            OSError: it could not be written (the file is then abandoned).
        """
        try:
            if self._stage is None:
                self.nbytes += self._file.write(data)
                return
            view = memoryview(data).cast("B")
            while view:
                room = min(len(view), len(self._stage) - self._filled)
                self._stage[self._filled : self._filled + room] = view[:room]
                self._filled += room
                self.nbytes += room
                view = view[room:]
                if self._filled == len(self._stage):
                    self._drain()
        except BaseException:
            self.abandon()
            raise

    def _drain(self, final: bool = False) -> None:
        """Write the stage's whole pages (``O_DIRECT``); with ``final``, the rest too (through
        the page cache). Where the file system refuses an ``O_DIRECT`` write, the file goes on
        through the page cache."""
        assert self._stage is not None
        aligned = self._filled - self._filled % DIRECT_ALIGNMENT
        if aligned:
            self._write_all(memoryview(self._stage)[:aligned])
        rest = self._filled - aligned
        if rest and (final or not self.direct):
            self._buffered()
            self._write_all(memoryview(self._stage)[aligned : self._filled])
            rest = 0
        self._stage[:rest] = self._stage[aligned : aligned + rest]
        self._filled = rest

    def _write_all(self, view: memoryview) -> None:
        while view:
            try:
                view = view[os.write(self._fd, view) :]
            except OSError as exc:
                if not self.direct or exc.errno != errno.EINVAL:
                    raise
                self._buffered()  # refused: nothing of it was written, so it is written again

    def _buffered(self) -> None:
        """``O_DIRECT`` off: what follows goes through the page cache."""
        if self.direct:
            fcntl.fcntl(self._fd, fcntl.F_SETFL, fcntl.fcntl(self._fd, fcntl.F_GETFL) & ~O_DIRECT)
            self.direct = False

    def _give_back(self) -> None:
        if self._stage is not None and self._staging is not None:
            self._staging.give(self._stage)
        self._stage = None

    def commit(self) -> int:
        """The file whole at its path; the bytes written.

        Raises:
            OSError: it could not be made so (the file is then abandoned).
        """
        try:
            if self._stage is not None:
                self._drain(final=True)
                self._give_back()
            self._file.flush()
            os.ftruncate(self._fd, self.nbytes)  # a reused file may have been longer
            os.fsync(self._fd)
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
        self._give_back()
        self._file.close()
        self._partial.unlink(missing_ok=True)


def tree_bytes(folder: Path) -> int:
    """The bytes of the files under ``folder`` (0 where there is none)."""
    if not folder.is_dir():
        return 0
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def write_atomically(
    path: Path,
    parts: Iterable[bytes | bytearray | memoryview],
    reuse: Path | None = None,
    staging: DirectStaging | None = None,
) -> int:
    """Write ``parts`` to ``path`` (``0600``) whole or not at all (:class:`AtomicFile`, over
    ``reuse``'s blocks where it is given, around the page cache through ``staging``'s buffers
    where that is given). Returns the bytes written.

    Raises:
        OSError: it could not be written; ``path`` is as it was, no ``.partial`` is left.
    """
    file = AtomicFile(path, reuse, staging)
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
