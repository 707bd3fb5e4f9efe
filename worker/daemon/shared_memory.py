"""Shared memory between the worker agent and its filter daemon, and the buffers frames land in.

A pipe moves each byte twice through the kernel, in 4 KiB pages it allocates and frees (23 MB of
gradients took the daemon ~5 ms to write and the agent ~3 ms to read); a :class:`SharedRegion` is
one copy in and one copy out of memory that stays mapped. :mod:`worker.daemon.pipe` decides which
frames take it. :func:`allocate_paged` and :func:`allocate_fast` make the buffer a frame is read
into, for a reader on an event loop and for one that only blocks itself.
"""

from __future__ import annotations

import fcntl
import mmap
import os
from collections.abc import Callable, Iterable

import numpy as np

from protocol.errors import FrameError

__all__ = ["HEAP_FRAME_BYTES", "SharedRegion", "allocate_fast", "allocate_paged"]

HEAP_FRAME_BYTES = 32 << 20
"""Frames up to this size are read into heap memory by :func:`allocate_paged` (see there)."""


def allocate_paged(nbytes: int) -> memoryview:
    """A frame buffer for a reader on an event loop: cheap in steady state, no long stalls.

    Frames up to :data:`HEAP_FRAME_BYTES` get a ``bytearray``: glibc serves blocks up to its
    largest mmap threshold (32 MiB on 64-bit) from its heap once such a block has been freed, so
    a frame of the size of the previous one lands in memory already faulted in. Reading a
    23 MB gradient frame from a pipe measured 3 ms of CPU so, 17 ms into fresh pages: the
    data-parallel steady state, one such frame per step. Larger frames get an anonymous
    ``mmap``, whose pages are faulted in as the bytes arrive, 4 KiB at a time: ``bytearray(n)``
    would zero-fill all of them first (~40 ms for 100 MB of fresh memory, at once) and numpy's
    allocator asks for transparent huge pages, whose allocation can stall for milliseconds
    (compaction) in the middle of one read.
    """
    return memoryview(bytearray(nbytes) if nbytes <= HEAP_FRAME_BYTES else mmap.mmap(-1, nbytes))


def allocate_fast(nbytes: int) -> memoryview:
    """A frame buffer for a reader that only blocks itself: uninitialised, huge pages allowed.

    About twice the throughput of :func:`allocate_paged` for 100 MB frames, at the price of
    occasional multi-millisecond page faults — fine for the daemon, not for an event loop.
    """
    return np.empty(nbytes, dtype=np.uint8).data


class SharedRegion:
    """One direction's shared memory between the agent and its daemon: a memfd both map.

    The agent creates one per direction (:meth:`create`) as it starts the daemon
    (:func:`worker.supervision.start.shared_regions`) and hands the daemon their file
    descriptors. The region only grows (sealed against shrinking, so the other process cannot
    make our mapping fault), to the largest frame sent so far, rounded up to a MiB; its pages
    stay allocated for the next frame. :attr:`frames` and :attr:`nbytes` count what went through.
    """

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.frames = 0
        self.nbytes = 0
        self._map: mmap.mmap | None = None

    @classmethod
    def create(cls, name: str) -> SharedRegion | None:
        """A new, empty region; ``None`` where there are no sealable memfds (not Linux)."""
        try:
            fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        except (AttributeError, OSError):
            return None
        try:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
        except (AttributeError, OSError):
            os.close(fd)
            return None
        return cls(fd)

    def _mapping(self, nbytes: int, grow: bool) -> mmap.mmap:
        size = os.fstat(self.fd).st_size
        if size < nbytes:
            if not grow:
                raise FrameError(
                    f"a frame of {nbytes} bytes in shared memory, which holds {size} bytes"
                )
            size = -(-nbytes // (1 << 20)) * (1 << 20)
            os.ftruncate(self.fd, size)
        if self._map is None or len(self._map) != size:
            if self._map is not None:
                self._map.close()
            self._map = mmap.mmap(self.fd, size)
        return self._map

    def write(self, views: Iterable[memoryview]) -> int:
        """Copy a frame (its parts, in order) to the start of the region; return its length."""
        views = list(views)
        total = sum(v.nbytes for v in views)
        region = self._mapping(total, grow=True)
        position = 0
        for view in views:
            region[position : position + view.nbytes] = view
            position += view.nbytes
        self.frames += 1
        self.nbytes += total
        return total

    def read(self, nbytes: int, allocate: Callable[[int], memoryview]) -> memoryview:
        """Copy the ``nbytes``-long frame at the start of the region into a new buffer.

        Raises:
            FrameError: the region is shorter than ``nbytes``.
        """
        region = self._mapping(nbytes, grow=False)
        frame = allocate(nbytes)
        with memoryview(region) as whole, whole[:nbytes] as source:
            frame[:] = source
        self.frames += 1
        self.nbytes += nbytes
        return frame

    def close(self) -> None:
        """Unmap and close (the daemon's side stays valid until it exits)."""
        if self._map is not None:
            self._map.close()
            self._map = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
