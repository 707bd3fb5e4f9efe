"""The agent ↔ filter-daemon pipes: length-prefixed frames, split and joined without I/O.

The worker agent drives one filter daemon (``python -m worker.daemon``) per job through the
daemon's stdin/stdout (the messages are :mod:`protocol.daemon`'s). Each direction carries a
stream of frames, each one preceded by its length::

    u64 little-endian frame length | frame          (frame = protocol.codec)

:class:`FrameReader` and :class:`FrameWriter` split and join that stream without doing any I/O
themselves, so the blocking daemon and the non-blocking supervisor share them: the reader hands
out the buffer the next bytes belong in (a frame is read straight into a writable buffer of its
own, which keeps decoded tensors writable and zero-copy), the writer hands out the memoryviews
still to send (tensor bytes go from their own memory to the pipe, never joined into one big
``bytes``).

Large frames can skip the pipe: with a :class:`~worker.daemon.shared_memory.SharedRegion` per
direction (a memfd both processes map, set up by the supervisor), a frame of
:data:`SHARED_MIN_BYTES` to :data:`SHARED_MAX_BYTES` is copied into the region and only its length
goes down the pipe, flagged with :data:`SHARED_FLAG`::

    u64 little-endian (SHARED_FLAG | frame length)  (the frame is in the region, from byte 0)

The reader copies it out into a buffer of its own as soon as it reads that length. One frame per
region at a time, which the protocol guarantees: a request is written only after the reply to
the previous one was read, and a reply only after its request was.
"""

from __future__ import annotations

import struct
from collections import deque
from collections.abc import Callable, Iterable

from protocol.errors import FrameError
from worker.daemon.shared_memory import SharedRegion, allocate_paged

__all__ = [
    "LENGTH",
    "MAX_FRAME_BYTES",
    "SHARED_FLAG",
    "SHARED_MAX_BYTES",
    "SHARED_MIN_BYTES",
    "FrameReader",
    "FrameWriter",
]

LENGTH = struct.Struct("<Q")
"""The length prefix in front of every frame on the daemon pipes."""

MAX_FRAME_BYTES = 1 << 36
"""Largest frame either side accepts (64 GiB): a longer length prefix means a garbled stream."""

SHARED_FLAG = 1 << 63
"""Set in a length prefix: the frame is in the direction's :class:`SharedRegion`, not the pipe."""

SHARED_MIN_BYTES = 256 << 10
"""Frames from this size on go through the shared region when there is one."""

SHARED_MAX_BYTES = 32 << 20
"""Larger frames still go down the pipe: a copy in or out of the region is one call (~3 ms for
32 MiB), and an event loop must not stall on a GB-sized one; the pipe moves them in slices."""


class FrameReader:
    """Cuts a byte stream into length-prefixed frames, each read straight into its own buffer.

    Usage: read up to ``len(reader.buffer())`` bytes into ``reader.buffer()``, then call
    ``reader.advance(n)``; it returns the frame once its last byte arrived. The frame is a
    writable memoryview over a buffer of its own, which then belongs to the caller (the reader
    starts a new one), so arrays and tensors decoded over it stay valid and are zero-copy.

    Args:
        max_frame: the largest frame accepted.
        allocate: makes the writable, byte-format buffer of a frame of the given size (see
            :func:`allocate_paged`, the default, and :func:`allocate_fast`).
        shared: the region the other side writes large frames into (see the module docstring);
            ``None``: every frame comes down the pipe.
    """

    def __init__(
        self,
        max_frame: int = MAX_FRAME_BYTES,
        allocate: Callable[[int], memoryview] = allocate_paged,
        shared: SharedRegion | None = None,
    ) -> None:
        self._max_frame = max_frame
        self._allocate = allocate
        self._shared = shared
        self._prefix = bytearray(LENGTH.size)
        self._frame: memoryview | None = None  # None while reading the length prefix
        self._filled = 0

    def buffer(self) -> memoryview:
        """Where the next bytes of the stream go (never empty while a frame is incomplete)."""
        if self._frame is None:
            return memoryview(self._prefix)[self._filled :]
        return self._frame[self._filled :]

    @property
    def mid_frame(self) -> bool:
        """True when part of a frame (or of its prefix) has been read: EOF now is a truncation."""
        return self._filled > 0 or self._frame is not None

    def advance(self, nbytes: int) -> memoryview | None:
        """Account for ``nbytes`` written into :meth:`buffer`; return the frame they completed.

        Raises:
            FrameError: the length prefix exceeds ``max_frame``, or no buffer that large can be
                had; either way the stream cannot be followed any further.
        """
        self._filled += nbytes
        if self._frame is None:
            if self._filled < LENGTH.size:
                return None
            (length,) = LENGTH.unpack(self._prefix)
            if length & SHARED_FLAG and self._shared is not None:
                return self._take_shared(length ^ SHARED_FLAG)
            if length > self._max_frame:
                raise FrameError(f"frame length {length} exceeds the limit of {self._max_frame}")
            try:
                self._frame = self._allocate(length)
            except (MemoryError, OSError) as exc:
                raise FrameError(f"cannot allocate a frame of {length} bytes: {exc}") from exc
            self._filled = 0
            if length > 0:
                return None
        elif self._filled < self._frame.nbytes:
            return None
        frame, self._frame, self._filled = self._frame, None, 0
        return frame

    def _take_shared(self, length: int) -> memoryview:
        assert self._shared is not None
        if length > self._max_frame:
            raise FrameError(f"frame length {length} exceeds the limit of {self._max_frame}")
        self._filled = 0
        try:
            return self._shared.read(length, self._allocate)
        except (MemoryError, OSError, ValueError) as exc:
            raise FrameError(
                f"cannot take a frame of {length} bytes from shared memory: {exc}"
            ) from exc


class FrameWriter:
    """The bytes of length-prefixed frames still to be written, as a queue of memoryviews.

    Usage: ``writer.add(parts)`` with the codec's ``encode(obj)`` parts, then write
    ``writer.buffers()`` (e.g. with ``os.writev``) and report the count with ``advance(n)`` until
    ``writer.done``. Nothing is copied: partial writes only re-slice the views. With ``shared``,
    a frame of :data:`SHARED_MIN_BYTES` to :data:`SHARED_MAX_BYTES` is copied into that region at
    once and only its flagged length is queued.
    """

    def __init__(
        self,
        parts: Iterable[bytes | bytearray | memoryview] = (),
        shared: SharedRegion | None = None,
    ) -> None:
        self._views: deque[memoryview] = deque()
        self._shared = shared
        if parts:
            self.add(parts)

    def add(self, parts: Iterable[bytes | bytearray | memoryview]) -> None:
        """Queue one frame made of ``parts`` (their concatenation is the frame)."""
        views = [memoryview(p).cast("B") for p in parts]
        views = [v for v in views if v.nbytes]
        total = sum(v.nbytes for v in views)
        if self._shared is not None and SHARED_MIN_BYTES <= total <= SHARED_MAX_BYTES:
            try:
                self._shared.write(views)
            except (OSError, ValueError):
                pass  # no memory for the region: this frame goes down the pipe instead
            else:
                self._views.append(memoryview(LENGTH.pack(total | SHARED_FLAG)))
                return
        self._views.append(memoryview(LENGTH.pack(total)))
        self._views.extend(views)

    @property
    def done(self) -> bool:
        """True once every queued byte was reported written."""
        return not self._views

    def buffers(self, limit: int = 64) -> list[memoryview]:
        """The next views to write, at most ``limit`` of them (stay under ``IOV_MAX``)."""
        return [self._views[i] for i in range(min(limit, len(self._views)))]

    def advance(self, nbytes: int) -> None:
        """Drop ``nbytes`` from the front of the queue: they were written."""
        while nbytes:
            head = self._views[0]
            if nbytes < head.nbytes:
                self._views[0] = head[nbytes:]
                return
            nbytes -= head.nbytes
            self._views.popleft()
