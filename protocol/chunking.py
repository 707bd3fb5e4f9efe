"""Messages larger than one WebSocket message, cut into chunks and joined again: no I/O.

A frame larger than :data:`~protocol.messages.CHUNK_BYTES` travels as chunk messages, each
``magic | u64 stream | u64 offset | u64 total | up to CHUNK_BYTES of the frame``
(:func:`chunk_messages`), cut straight from the codec's parts; other messages may interleave.
A :class:`Reassembler` per connection joins them back into a writable buffer (tensors decode
zero-copy over it), refusing what would go over its limits before any buffer exists.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from protocol.codec import frame_nbytes
from protocol.errors import FrameError, MessageTooLarge
from protocol.messages import CHUNK_BYTES
from protocol.parsing import peek_ids

__all__ = ["CHUNK_HEAD", "CHUNK_MAGIC", "Reassembler", "chunk_messages", "frame_buffer", "is_chunk"]

CHUNK_MAGIC = b"\xff\xff\xff\xffSZCK"
"""First bytes of a chunk message. A frame never starts so: its first four bytes are its header
length, and a 4 GiB header is refused by the codec."""
CHUNK_HEAD = struct.Struct("<8sQQQ")  # magic, stream, offset, total
"""The fixed header in front of each chunk's bytes."""
MAX_OPEN_STREAMS = 64
"""Chunked messages in progress at once on one connection (a sender has one per concurrent
send of a large message)."""
REFUSED_MEMORY = 1024
"""Refused chunk streams remembered, so that their later chunks are dropped without an error."""


def is_chunk(payload: bytes | bytearray | memoryview) -> bool:
    """Whether a WebSocket message is a chunk (else it is a whole frame)."""
    return payload[: len(CHUNK_MAGIC)] == CHUNK_MAGIC


def chunk_messages(parts: Sequence[bytes | memoryview], stream: int) -> Iterator[bytes]:
    """The WebSocket messages that carry a frame larger than :data:`CHUNK_BYTES`.

    Each is ``magic | u64 stream | u64 offset | u64 total | up to CHUNK_BYTES of the frame``,
    cut straight out of the codec's parts: the frame is never joined whole, and no model is
    validated per chunk.
    """
    total = frame_nbytes(parts)
    views = [memoryview(p).cast("B") for p in parts]
    offset, index, start = 0, 0, 0
    while offset < total:
        pieces: list[bytes | memoryview] = [CHUNK_HEAD.pack(CHUNK_MAGIC, stream, offset, total)]
        room = CHUNK_BYTES
        while room and index < len(views):
            view = views[index]
            piece = view[start : start + room]
            pieces.append(piece)
            room -= len(piece)
            start += len(piece)
            if start == len(view):
                index, start = index + 1, 0
        offset += CHUNK_BYTES - room
        yield b"".join(pieces)


@dataclass
class _Stream:
    """A chunked message being received: its buffer and how far it is filled."""

    buffer: memoryview
    received: int = 0


def frame_buffer(nbytes: int) -> memoryview:
    """An uninitialised, writable buffer to reassemble a frame of ``nbytes`` into.

    ``bytearray(n)`` zero-fills it first and so faults in every 4 KiB page at once (~150 ms for
    64 MB on this project's VMs, as slow as the transfer itself); numpy's allocator leaves the
    bytes uninitialised and asks for transparent huge pages, so the chunks' copies fault it in
    2 MiB at a time, about ten times faster. Decoded tensors are views over it.
    """
    return np.empty(nbytes, dtype=np.uint8).data


class Reassembler:
    """Joins chunk messages back into frames: no I/O, one per connection.

    Bounded by construction, whatever the peer announces:

    * a stream whose announced total is over ``max_bytes`` is refused on its first chunk, before
      any buffer exists; so is one that would take the announced totals of the streams in
      progress over ``max_bytes``, or their number over ``max_streams``;
    * a stream's buffer (:func:`frame_buffer`) is uninitialised memory of its announced size,
      whose pages the kernel commits only as bytes are written into them: announcing a size
      costs nothing until the bytes come (a ``bytearray`` would be zero-filled, committed, up
      front);
    * a stream that was refused (too large, out of order) has the rest of its chunks dropped
      silently: one error per stream, not one per chunk.
    """

    def __init__(self, max_bytes: int, max_streams: int = MAX_OPEN_STREAMS) -> None:
        self.max_bytes = max_bytes
        self.max_streams = max_streams
        self._streams: dict[int, _Stream] = {}
        self._refused: dict[int, None] = {}  # insertion-ordered: the oldest is forgotten first

    @property
    def pending_bytes(self) -> int:
        """The announced totals of the streams in progress."""
        return sum(len(s.buffer) for s in self._streams.values())

    def add(self, payload: bytes | bytearray | memoryview) -> memoryview | None:
        """Take one chunk message; the whole frame once its last byte arrived, else ``None``.

        The frame is a writable view (tensors decode zero-copy over it).

        Raises:
            MessageTooLarge: a new stream over the limits above (``reply_to``/``answers`` read
                from its first bytes when they hold the frame's header).
            FrameError: a malformed chunk or bytes out of order.
        """
        if len(payload) < CHUNK_HEAD.size:
            raise FrameError(f"chunk of {len(payload)} bytes is shorter than its header")
        _, stream, offset, total = CHUNK_HEAD.unpack_from(payload)
        data = memoryview(payload)[CHUNK_HEAD.size :]
        end = offset + len(data)
        if stream in self._refused:
            if end >= total:  # its last chunk: the id may be used again
                del self._refused[stream]
            return None
        current = self._streams.get(stream)
        if current is None:
            current = self._open(stream, offset, total, data)
        size = len(current.buffer)
        if offset != current.received or total != size or end > size:
            del self._streams[stream]
            self._refuse(stream, end < total)
            raise FrameError(
                f"chunk stream {stream}: got bytes {offset}..{end} of {total}, "
                f"expected the next at {current.received} of {size}"
            )
        current.buffer[offset:end] = data
        current.received = end
        if end < size:
            return None
        del self._streams[stream]
        return memoryview(current.buffer)

    def _open(self, stream: int, offset: int, total: int, data: memoryview) -> _Stream:
        more = offset + len(data) < total  # chunks of this stream will follow
        if offset != 0 or total == 0:
            self._refuse(stream, more)
            raise FrameError(
                f"chunk stream {stream} starts at offset {offset} of {total} bytes: "
                "a stream starts at 0 of a positive total"
            )
        why = None
        if total > self.max_bytes:
            why = f"chunked message of {total} bytes exceeds the limit of {self.max_bytes} bytes"
        elif len(self._streams) >= self.max_streams:
            why = (
                f"chunked message of {total} bytes refused: {len(self._streams)} are already in "
                f"progress on this connection (the limit is {self.max_streams})"
            )
        elif (pending := self.pending_bytes) + total > self.max_bytes:
            why = (
                f"chunked message of {total} bytes refused: with the {pending} bytes of the "
                f"{len(self._streams)} in progress it exceeds the limit of {self.max_bytes} bytes"
            )
        if why is None:
            try:
                buffer = frame_buffer(total)
            except (MemoryError, ValueError) as exc:  # it cannot be had
                why = f"chunked message of {total} bytes refused: cannot reserve it: {exc}"
            else:
                self._streams[stream] = _Stream(buffer)
                return self._streams[stream]
        self._refuse(stream, more)
        raise MessageTooLarge(why, *peek_ids(data))

    def _refuse(self, stream: int, more: bool) -> None:
        """Drop the rest of ``stream``'s chunks (when ``more`` are to come) without an error."""
        if not more:
            return
        self._refused[stream] = None
        while len(self._refused) > REFUSED_MEMORY:
            del self._refused[next(iter(self._refused))]
