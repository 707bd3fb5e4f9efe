"""Messages larger than one WebSocket message, cut into chunks and joined again: no I/O.

A frame larger than :data:`~protocol.messages.CHUNK_BYTES` travels as chunk messages, each
``magic | u64 stream | u64 offset | u64 total | up to CHUNK_BYTES of the frame``
(:func:`chunk_messages`), cut straight from the codec's parts; other messages may interleave.
A :class:`Reassembler` per connection joins them back into a writable buffer (tensors decode
zero-copy over it), refusing what would go over its limits before any buffer exists. Its owner
may *claim* a message from its first chunk (:class:`StreamSink`): the message then lands in a
buffer the owner gives, which it watches fill chunk by chunk (a running mean folds each range of
gradients in as it arrives, :mod:`coordinator.strategies.data_parallel.mean_fold`). A
:class:`Budget` bounds the chunked messages in progress over all the connections that share
it, and a stream that gets no chunk for the stall timeout is dropped, its memory with it.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from protocol.codec import frame_nbytes
from protocol.errors import FrameError, MessageTooLarge, ReassemblyFull
from protocol.messages import CHUNK_BYTES
from protocol.parsing import peek_ids

__all__ = [
    "CHUNK_HEAD",
    "CHUNK_MAGIC",
    "DEFAULT_STALL_SECONDS",
    "Budget",
    "Reassembler",
    "StreamSink",
    "chunk_messages",
    "frame_buffer",
    "is_chunk",
]

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
DEFAULT_STALL_SECONDS = 60.0
"""Seconds a chunked message in progress may go without a chunk before it is dropped."""


class Budget:
    """The bytes received of chunked messages not yet whole, bounded: ``limit`` over every
    :class:`Reassembler` that charges it (all of an agent's peer links, one client's
    connections), and over the budgets below it — a budget with a ``parent`` is a share of it
    (a client's share of the coordinator's pool for clients), every charge counted in both.

    Bytes are charged as they arrive, not as announced: announcing a size costs nothing (a
    stream's buffer is committed only as its bytes are written, :func:`frame_buffer`), and a
    peer that sends slowly holds only what it sent — so one that announces 2 GiB and trickles
    it in cannot keep a message of another from being received.
    """

    def __init__(self, limit: int, name: str = "all connections", parent: Budget | None = None):
        if limit < 1:
            raise ValueError("a reassembly budget must be positive")
        self.limit = limit
        self.name = name
        self.parent = parent
        self.used = 0

    def refusal(self, nbytes: int) -> str | None:
        """Why ``nbytes`` more bytes cannot be charged (this budget, or one it is a share of,
        would be over its limit); ``None`` when they can."""
        budget: Budget | None = self
        while budget is not None:
            if budget.used + nbytes > budget.limit:
                return (
                    f"{budget.used} bytes of messages are in progress on {budget.name} (the "
                    f"budget is {budget.limit} bytes)"
                )
            budget = budget.parent
        return None

    def charge(self, nbytes: int) -> None:
        """Count ``nbytes`` received (here and in every budget this is a share of)."""
        budget: Budget | None = self
        while budget is not None:
            budget.used += nbytes
            budget = budget.parent

    def release(self, nbytes: int) -> None:
        """Give back ``nbytes`` charged: their message is whole, or dropped."""
        self.charge(-nbytes)


class StreamSink(Protocol):
    """Where a claimed message lands (see :class:`Reassembler`'s ``claim``).

    Neither method may raise: a sink that cannot use a message stops watching it, and the
    message is still received, parsed and answered as any other.
    """

    def buffer(self, nbytes: int) -> memoryview:
        """A writable buffer of exactly ``nbytes`` bytes for the message's frame."""
        ...

    def received(self, nbytes: int) -> None:
        """The frame's first ``nbytes`` bytes are in the buffer (called after every chunk)."""
        ...


Claim = Callable[[memoryview], StreamSink | None]
"""Given the first bytes of a message (its first chunk's, or the whole frame), the sink it
lands in, or ``None`` for a buffer of the reassembler's own."""


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
    """A chunked message being received: its buffer, how far it is filled, and when its last
    chunk came."""

    buffer: memoryview
    last: float
    received: int = 0
    sink: StreamSink | None = None
    ids: tuple[int | None, int | None] = (None, None)  # its id and reply_to (peek_ids)
    budget: Budget | None = None  # what its bytes are charged to


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
      silently: one error per stream, not one per chunk;
    * with a ``budget``, each chunk's bytes are charged to it as they arrive (:class:`Budget`):
      a chunk that would take it over its limit ends its stream, refused ``busy`` (retry
      later), and what the stream held is freed; a stream larger than the budget could ever
      hold is refused on its first chunk. With a :attr:`reply_budget` too, a stream that
      answers a request its owner awaits (:attr:`awaited` says, from the ``reply_to`` of its
      first bytes) is charged to that one instead: what a peer sends unasked cannot take the
      room of the replies its owner waits for;
    * a stream with no chunk for ``stall_seconds`` is dropped (its buffer freed, its later
      chunks dropped silently) at the next :meth:`add` or :meth:`expire`.

    Args:
        max_bytes: the largest message, and the most bytes of this connection's streams.
        max_streams: streams in progress at once.
        budget: shared with other connections' reassemblers (``None``: none).
        stall_seconds: how long a stream may wait for its next chunk (``None``: forever).
        clock: monotonic seconds (tests pass a fake one).
        claim: asked, once a new stream has passed the limits above, for the sink it lands in
            (:data:`Claim`); its buffer replaces the reassembler's own and it is told after
            every chunk how much of the frame is in.
        buffer_for: the reassembler's own buffer of a stream of so many bytes (default
            :func:`frame_buffer`; the coordinator lands its clients' large messages on disk:
            :mod:`protocol.asyncio.landing`). ``MemoryError`` or ``ValueError``: the stream
            is refused, as one that cannot be reserved.
    """

    def __init__(
        self,
        max_bytes: int,
        *,
        max_streams: int = MAX_OPEN_STREAMS,
        budget: Budget | None = None,
        stall_seconds: float | None = DEFAULT_STALL_SECONDS,
        clock: Callable[[], float] = time.monotonic,
        claim: Claim | None = None,
        buffer_for: Callable[[int], memoryview] = frame_buffer,
    ) -> None:
        self.max_bytes = max_bytes
        self.claim = claim
        self.buffer_for = buffer_for
        self.max_streams = max_streams
        self.budget = budget
        self.reply_budget: Budget | None = None
        """What a stream answering an awaited request is charged to (``None``: ``budget``)."""
        self.awaited: Callable[[int], bool] = lambda reply_to: False
        """Whether a request of that id awaits its reply (the owner's)."""
        self.stall_seconds = stall_seconds
        self.clock = clock
        self.stalled = 0
        """Streams dropped so far for want of their next chunk."""
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
        now = self.clock()
        self.expire(now)
        if stream in self._refused:
            if end >= total:  # its last chunk: the id may be used again
                del self._refused[stream]
            return None
        current = self._streams.get(stream)
        if current is None:
            current = self._open(stream, offset, total, data, now)
        size = len(current.buffer)
        if offset != current.received or total != size or end > size:
            self._drop(stream)
            self._refuse(stream, end < total)
            raise FrameError(
                f"chunk stream {stream}: got bytes {offset}..{end} of {total}, "
                f"expected the next at {current.received} of {size}"
            )
        budget = current.budget
        if budget is not None:
            why = budget.refusal(len(data))
            if why is not None:
                self._drop(stream)
                self._refuse(stream, end < total)
                raise ReassemblyFull(
                    f"chunked message of {total} bytes refused at byte {offset}: {why}; "
                    "retry later",
                    *current.ids,
                )
            budget.charge(len(data))
        current.buffer[offset:end] = data
        current.received, current.last = end, now
        if current.sink is not None:
            current.sink.received(end)
        if end < size:
            return None
        self._drop(stream)
        return memoryview(current.buffer)

    def next_stall(self) -> float | None:
        """When (on :attr:`clock`) the stream waiting longest stalls, if none comes before;
        ``None`` with no stream in progress or no stall timeout."""
        if self.stall_seconds is None or not self._streams:
            return None
        return min(s.last for s in self._streams.values()) + self.stall_seconds

    def expire(self, now: float | None = None) -> list[int]:
        """Drop the streams that got no chunk for ``stall_seconds``; their ids."""
        if self.stall_seconds is None:
            return []
        now = self.clock() if now is None else now
        stale = [k for k, s in self._streams.items() if now - s.last > self.stall_seconds]
        for stream in stale:
            self._drop(stream)
            self._refuse(stream, True)
        self.stalled += len(stale)
        return stale

    def close(self) -> None:
        """Drop every stream in progress (the connection is gone): its budget is freed."""
        for stream in list(self._streams):
            self._drop(stream)

    def _drop(self, stream: int) -> None:
        dropped = self._streams.pop(stream)
        if dropped.budget is not None:
            dropped.budget.release(dropped.received)

    def _open(self, stream: int, offset: int, total: int, data: memoryview, now: float) -> _Stream:
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
        elif (budget := self._budget_of(data)) is not None and total > (
            room := _least_limit(budget)
        ):
            why = (
                f"chunked message of {total} bytes exceeds the {room} bytes its sender may "
                "have in progress at once"
            )
        if why is None:
            sink = None if self.claim is None else self.claim(data)
            try:
                buffer = self.buffer_for(total) if sink is None else sink.buffer(total)
            except (MemoryError, ValueError) as exc:  # it cannot be had
                why = f"chunked message of {total} bytes refused: cannot reserve it: {exc}"
            else:
                ids = peek_ids(data)
                budget = self._budget_of(data)
                self._streams[stream] = _Stream(buffer, now, sink=sink, ids=ids, budget=budget)
                return self._streams[stream]
        self._refuse(stream, more)
        raise MessageTooLarge(why, *peek_ids(data))

    def _budget_of(self, head: memoryview) -> Budget | None:
        """What a stream starting with ``head`` is charged to: :attr:`reply_budget` when it
        answers an awaited request, else :attr:`budget`."""
        if self.reply_budget is not None:
            _, reply_to = peek_ids(head)
            if reply_to is not None and self.awaited(reply_to):
                return self.reply_budget
        return self.budget

    def _refuse(self, stream: int, more: bool) -> None:
        """Drop the rest of ``stream``'s chunks (when ``more`` are to come) without an error."""
        if not more:
            return
        self._refused[stream] = None
        while len(self._refused) > REFUSED_MEMORY:
            del self._refused[next(iter(self._refused))]


def _least_limit(budget: Budget) -> int:
    """The smallest limit of ``budget`` and those it is a share of: the largest message it can
    ever hold."""
    least = budget.limit
    while budget.parent is not None:
        budget = budget.parent
        least = min(least, budget.limit)
    return least
