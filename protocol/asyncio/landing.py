"""Where a large incoming message is reassembled: on disk, not in the receiver's memory.

A model travels in one message: a submit to the coordinator, and a job's filters from there to
each worker agent, which keeps them for as long as the job lives (to load them again into a
daemon that restarts). Reassembled in memory, each would cost its receiver the model's size
(an agent its replica's share, for the job's life: memory its training would want). So a
chunked message of :data:`LAND_ON_DISK_BYTES` or more lands in a file of a directory
(:class:`Landing`): opened without a name (``O_TMPFILE``: a crash leaves nothing behind, and
its blocks go when its map does), its space reserved at once (``fallocate``: a full disk
refuses the message, rather than failing a write into the map later), and mapped shared. The
chunks are written into the page cache, which the kernel writes back or keeps as it sees fit,
and the decoded message's arrays are views over the map. The coordinator lands its clients'
messages in ``<state_dir>/incoming`` (until the job's submit file has them:
:mod:`coordinator.jobs.files`); an agent the coordinator's in its temporary directory.

A file's space is its message's announced size, reserved before its bytes come (memory is
committed only as they do): so the files alive together hold at most ``max_bytes`` (the
coordinator's: its clients' reassembly pool), and a peer that announces much and sends little
holds no more of the disk than it could have of memory. Past that, where no such file
can be made (a filesystem without ``O_TMPFILE`` or ``fallocate``, a full disk), the message is
reassembled in memory as any other (:func:`~protocol.chunking.frame_buffer`). The calls are
the reassembler's, on the event loop: an open, a reservation of extents and a map, no data
written.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import threading
import weakref
from pathlib import Path

from protocol.chunking import frame_buffer

__all__ = ["LAND_ON_DISK_BYTES", "Landing"]

log = logging.getLogger(__name__)

LAND_ON_DISK_BYTES = 32 << 20
"""Chunked messages of at least this many bytes are reassembled on disk."""

_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]


def _reserve(fd: int, nbytes: int) -> None:
    """Reserve ``nbytes`` of disk for the file ``fd`` (Linux's ``fallocate``, which a
    filesystem does at once or refuses: glibc's ``posix_fallocate`` would write zeros instead).

    Raises:
        OSError: the filesystem cannot, or the disk has not the room.
    """
    if _libc.fallocate(fd, 0, 0, nbytes) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno))


class Landing:
    """Buffers for a receiver's chunked messages: a file's shared map from ``min_bytes`` up,
    else memory.

    Args:
        directory: where the unnamed files are made (it must exist; a file made with
            ``O_TMPFILE`` has no name in it, and mode ``0600``).
        max_bytes: the most bytes the files whose maps are alive may hold together.
        min_bytes: the smallest message landed on disk.
    """

    def __init__(
        self, directory: Path, max_bytes: int, min_bytes: int = LAND_ON_DISK_BYTES
    ) -> None:
        self.directory = directory
        self.max_bytes = max_bytes
        self.min_bytes = min_bytes
        self.on_disk = 0
        """The bytes of the files whose maps are alive (a message, or arrays decoded from it)."""
        self._said = False  # that messages land in memory here: logged once
        self._lock = threading.Lock()  # a map may be freed in any thread

    def __call__(self, nbytes: int) -> memoryview:
        """A writable buffer of ``nbytes`` bytes for a message's frame."""
        with self._lock:
            if nbytes < self.min_bytes or self.on_disk + nbytes > self.max_bytes:
                return frame_buffer(nbytes)
            self.on_disk += nbytes  # (given back below if no file is had)
        try:
            fd = os.open(self.directory, os.O_TMPFILE | os.O_RDWR, 0o600)
        except OSError as exc:
            return self._in_memory(nbytes, exc)
        try:
            _reserve(fd, nbytes)
            mapped = mmap.mmap(fd, nbytes)
        except OSError as exc:
            return self._in_memory(nbytes, exc)
        finally:
            os.close(fd)
        weakref.finalize(mapped, self._freed, nbytes)  # its file's blocks go with it
        return memoryview(mapped)

    def _freed(self, nbytes: int) -> None:
        with self._lock:
            self.on_disk -= nbytes

    def _in_memory(self, nbytes: int, why: OSError) -> memoryview:
        self._freed(nbytes)
        if not self._said:
            log.warning(
                "large messages are received in memory: no file for them in %s: %s",
                self.directory,
                why,
            )
            self._said = True
        return frame_buffer(nbytes)
