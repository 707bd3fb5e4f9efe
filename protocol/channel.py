"""One message connection, whatever carries it: ids, replies, streams, chunking, validation.

The coordinator, the worker agent and the client all speak :mod:`protocol.messages` over a
WebSocket; this module is what they share, so that request/reply matching, chunking of large
frames and the answer to a bad message exist once. It knows nothing of ``websockets``: it drives
any object with ``async send(bytes | list of bytes-like)``, ``async recv() -> bytes`` and
``async close(code, reason)`` (a ``websockets`` connection is one).

(``protocol`` otherwise holds no asyncio: this module is the exception, because the three
packages that need it may not import each other.)

* :meth:`Channel.request` sends a message with a fresh ``id`` and waits, with a timeout, for the
  message whose ``reply_to`` is that id; an :class:`~protocol.messages.Error` reply raises
  :class:`RemoteError`. :meth:`Channel.stream` does the same for a request answered by several
  messages, ending at the first ``ack``/``result``/``error``.
* Every other incoming message goes to the ``handler`` in a task of its own, so a slow request
  never holds up heartbeats or replies behind it; what the handler returns is sent as the reply.
* A frame larger than :data:`~protocol.messages.CHUNK_BYTES` is sent as chunk messages cut
  straight from the codec's parts (:func:`chunk_messages`) and reassembled into a writable buffer
  (tensors decode zero-copy over it); other messages may interleave.
* A message that is not a frame, or fails validation, is answered with an ``error`` reply that
  names the field; the connection stays up.
* Limits, each a typed error reply with the connection kept: a message over
  ``max_message_bytes`` (``too_large``, refused from its first chunk's header, before its buffer
  exists: see :class:`Reassembler`), a request beyond ``max_inflight`` being handled (``busy``;
  heartbeats are always handled). A peer that does not read its error replies within
  ``reply_timeout`` is disconnected instead of piling them up.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import orjson
from pydantic import BaseModel, ValidationError

from protocol import PROTOCOL_VERSION
from protocol.codec import decode, encode, frame_nbytes
from protocol.errors import (
    BadMessage,
    ChannelClosed,
    ErrorCode,
    ErrorInfo,
    FrameError,
    MessageTooLarge,
    ProtocolError,
    RemoteError,
    RequestRefused,
    VersionMismatch,
)
from protocol.messages import (
    CHUNK_BYTES,
    REPLY_KINDS,
    Error,
    message_adapter,
)

__all__ = [
    "BadMessage",
    "Channel",
    "ChannelClosed",
    "RemoteError",
    "RequestRefused",
    "VersionMismatch",
]

log = logging.getLogger(__name__)

DEFAULT_MAX_MESSAGE_BYTES = 1 << 31
"""Largest message accepted (2 GiB), reassembled from its chunks, unless the channel's owner
says otherwise."""
DEFAULT_MAX_INFLIGHT = 64
"""Incoming requests handled at once on one connection; one more gets a ``busy`` error."""
NEVER_BUSY = frozenset({"heartbeat"})
"""Kinds handled whatever the number in flight: refusing a heartbeat would lose the worker."""
ERROR_REPLY_TIMEOUT = 30.0
"""Seconds an error reply may take to go out before the peer is disconnected."""
MAX_OPEN_STREAMS = 64
"""Chunked messages in progress at once on one connection (a sender has one per concurrent
send of a large message)."""
_MAX_REPORTED_ERRORS = 20
"""Validation errors listed in an error reply's detail (the count of the rest follows)."""
_REFUSED_MEMORY = 1024
"""Refused chunk streams remembered, so that their later chunks are dropped without an error."""


class Transport(Protocol):
    """What a :class:`Channel` needs from a connection (a ``websockets`` connection fits)."""

    async def send(self, message: Any) -> None: ...

    async def recv(self) -> Any: ...

    async def close(self, code: int = 1000, reason: str = "") -> None: ...


Handler = Callable[[Any], Awaitable[BaseModel | None]]

_ANSWER_KINDS = REPLY_KINDS | {"job_event"}


def dump(message: BaseModel) -> dict[str, Any]:
    """A message as the dict the codec encodes (tensors are passed through, not copied)."""
    return message.model_dump()


CHUNK_MAGIC = b"\xff\xff\xff\xffSZCK"
"""First bytes of a chunk message. A frame never starts so: its first four bytes are its header
length, and a 4 GiB header is refused by the codec."""
_CHUNK_HEAD = struct.Struct("<8sQQQ")  # magic, stream, offset, total
_PREFIX = struct.Struct("<I")  # a frame's header length


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
        pieces: list[bytes | memoryview] = [_CHUNK_HEAD.pack(CHUNK_MAGIC, stream, offset, total)]
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
        if len(payload) < _CHUNK_HEAD.size:
            raise FrameError(f"chunk of {len(payload)} bytes is shorter than its header")
        _, stream, offset, total = _CHUNK_HEAD.unpack_from(payload)
        data = memoryview(payload)[_CHUNK_HEAD.size :]
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
        raise MessageTooLarge(why, *_peek_ids(data))

    def _refuse(self, stream: int, more: bool) -> None:
        """Drop the rest of ``stream``'s chunks (when ``more`` are to come) without an error."""
        if not more:
            return
        self._refused[stream] = None
        while len(self._refused) > _REFUSED_MEMORY:
            del self._refused[next(iter(self._refused))]


def _peek_ids(data: memoryview) -> tuple[int | None, int | None]:
    """``id`` and ``reply_to`` of the message whose frame starts with ``data``, when ``data``
    holds the frame's whole header (a chunk of a refused message: whom to tell)."""
    if len(data) < _PREFIX.size:
        return None, None
    (length,) = _PREFIX.unpack_from(data)
    if _PREFIX.size + length > len(data):
        return None, None
    try:
        header = orjson.loads(data[_PREFIX.size : _PREFIX.size + length])
    except orjson.JSONDecodeError:
        return None, None
    body = header.get("body") if isinstance(header, dict) else None
    if not isinstance(body, dict):
        return None, None
    return _message_id(body.get("id")), _message_id(body.get("reply_to"))


def _message_id(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def parse(payload: bytes | bytearray | memoryview) -> Any:
    """Decode and validate one frame into a message.

    Raises:
        BadMessage: with the error reply to send (``reply_to`` when the id could be read).
    """
    try:
        raw = decode(payload)
    except FrameError as exc:
        raise BadMessage(ErrorInfo(code=ErrorCode.BAD_FRAME, message=str(exc)), None) from exc
    reply_to = _message_id(raw.get("id")) if isinstance(raw, dict) else None
    try:
        return message_adapter.validate_python(raw)
    except ValidationError as exc:
        raise BadMessage(_validation_info(exc, raw), reply_to) from exc


def _validation_info(exc: ValidationError, raw: Any) -> ErrorInfo:
    errors = exc.errors(include_url=False, include_input=False)
    first = errors[0] if errors else {"loc": (), "msg": str(exc)}
    kind = raw.get("kind") if isinstance(raw, dict) else None
    name = kind if isinstance(kind, str) else None  # a peer's kind may be anything
    loc = list(first["loc"])
    if loc and name is not None and loc[0] == name:  # the union's tag leads the location
        loc = loc[1:]
    where = _preview(".".join(str(p) for p in loc))
    if first.get("type") == "union_tag_invalid":
        message = f"unknown message kind {_preview(kind)}"
    elif first.get("type") == "union_tag_not_found":
        message = "message has no 'kind'"
    else:
        message = f"invalid {name[:60] if name else 'message'}: field {where}: {first['msg']}"
    # Bounded, whatever the message: an error reply never echoes a peer's megabytes back.
    detail: dict[str, Any] = {
        "errors": [
            {"loc": [_preview(str(p)) for p in e["loc"][:8]], "msg": e["msg"][:200]}
            for e in errors[:_MAX_REPORTED_ERRORS]
        ]
    }
    if len(errors) > _MAX_REPORTED_ERRORS:
        detail["more"] = len(errors) - _MAX_REPORTED_ERRORS
    return ErrorInfo(code=ErrorCode.BAD_REQUEST, message=message, detail=detail)


def _preview(value: Any, limit: int = 60) -> str:
    """``repr(value)``, cut to ``limit`` characters (it goes into an error message)."""
    text = repr(value) if not isinstance(value, str) or len(value) <= limit else repr(value[:limit])
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_version(payload: bytes | bytearray | memoryview) -> None:
    """Refuse a hello from another protocol version, before reading anything else of it."""
    try:
        raw = decode(payload)
    except FrameError:
        return  # parse() reports it
    version = raw.get("v") if isinstance(raw, dict) else None
    # An int that is not a bool: ``v`` may be anything a peer sent (an array, whose ``!=`` is
    # an array too).
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise VersionMismatch(
            f"protocol version mismatch: peer speaks {_preview(version)}, this side speaks "
            f"{PROTOCOL_VERSION}"
        )


class Channel:
    """Requests, replies and handled messages over one :class:`Transport`.

    Args:
        transport: the connection.
        name: for logs and errors (``"worker w1"``, ``"coordinator"``...).
        handler: called with each incoming message that is not a reply; its return value (a
            message) is sent with ``reply_to`` set. ``None``: incoming requests are refused.
        max_message_bytes: largest message accepted (reassembled from its chunks, or the
            chunked ones in progress together): a larger one is refused before its buffer is
            allocated, with a ``too_large`` error reply.
        max_inflight: incoming requests handled at once; one more is answered at once with a
            ``busy`` error (heartbeats never are) and the connection stays up.
        reply_timeout: seconds an error reply may take to go out; a peer that does not read
            them within it is disconnected (a flood of bad messages cannot pile up replies).
        max_message_bytes: largest reassembled message accepted.
        bulk_gate: shared by the owner's channels, bounds how many messages larger than
            ``CHUNK_BYTES`` they write at once (``None``: no bound). Each chunked message holds
            a slot until its last chunk has left the send buffer, so a fan-out of a large model
            to many peers buffers a few copies at a time instead of one per peer, and the
            owner's other messages do not queue behind all of them.
    """

    def __init__(
        self,
        transport: Transport,
        name: str,
        handler: Handler | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        max_inflight: int = DEFAULT_MAX_INFLIGHT,
        reply_timeout: float = ERROR_REPLY_TIMEOUT,
        bulk_gate: asyncio.Semaphore | None = None,
    ) -> None:
        if max_message_bytes < 1 or max_inflight < 1:
            raise ValueError("max_message_bytes and max_inflight must be positive")
        self.transport = transport
        self.bulk_gate = bulk_gate
        self.name = name
        self.handler = handler
        self.max_message_bytes = max_message_bytes
        self.max_inflight = max_inflight
        self.reply_timeout = reply_timeout
        self.inflight = 0
        self.refused_busy = 0
        self._reassembler = Reassembler(max_message_bytes)
        self._next_id = 0
        self._next_stream = 0
        # The waiter of each request: a future for one reply, a queue for a stream of them.
        self._waiting: dict[int, asyncio.Future[Any] | asyncio.Queue[Any]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._send_lock = asyncio.Lock()
        self.closed = asyncio.Event()
        self.close_reason = ""
        self.bytes_in = 0
        self.bytes_out = 0

    # -- sending -----------------------------------------------------------------------------

    def next_id(self) -> int:
        self._next_id += 1
        return self._next_id

    async def send(self, message: BaseModel, **fields: Any) -> None:
        """Send one message, in chunks when its frame is larger than ``CHUNK_BYTES``.

        ``fields`` are sent instead of the message's own (``id``, ``reply_to``): cheaper than a
        copy of the model for every request and reply.

        Raises:
            ChannelClosed: the connection is closed (or closed while sending).
        """
        body = dump(message)
        body.update(fields)
        parts = encode(body)
        size = frame_nbytes(parts)
        if self.closed.is_set():
            raise ChannelClosed(f"{self.name}: connection closed ({self.close_reason})")
        if size <= CHUNK_BYTES:
            async with self._send_lock:
                await self._write(b"".join(parts))
            self.bytes_out += size
            return
        self._next_stream += 1
        async with self.bulk_gate or contextlib.nullcontext():
            for chunk in chunk_messages(parts, self._next_stream):
                # One lock per chunk, not per message: a heartbeat or reply may pass in between.
                async with self._send_lock:
                    await self._write(chunk)
        self.bytes_out += size

    async def _write(self, data: bytes) -> None:
        try:
            await self.transport.send(data)
        except Exception as exc:  # the transport's own "connection closed"
            raise ChannelClosed(f"{self.name}: connection closed while sending: {exc}") from exc

    async def reply(self, to: Any, message: BaseModel) -> None:
        """Send ``message`` as the reply to ``to``."""
        await self.send(message, reply_to=to.id, id=self.next_id())

    async def request(self, message: BaseModel, timeout: float) -> Any:  # noqa: ASYNC109
        """Send ``message`` and return its reply.

        Raises:
            RemoteError: the reply was an ``error``.
            TimeoutError: no reply within ``timeout`` seconds.
            ChannelClosed: the connection closed first.
        """
        request_id = self.next_id()
        waiter: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._waiting[request_id] = waiter
        try:
            await self.send(message, id=request_id)
            async with asyncio.timeout(timeout):
                reply = await waiter
        finally:
            self._waiting.pop(request_id, None)
        if isinstance(reply, BaseException):
            raise reply
        if isinstance(reply, Error):
            raise RemoteError(reply.error)
        return reply

    async def stream(self, message: BaseModel, timeout: float | None) -> AsyncIterator[Any]:  # noqa: ASYNC109
        """Send ``message`` and yield its replies until an ``ack``, ``result`` or ``error``.

        ``timeout`` bounds the wait for each reply (``None``: no bound, for event streams).
        """
        request_id = self.next_id()
        queue: asyncio.Queue[Any] = asyncio.Queue()
        self._waiting[request_id] = queue
        try:
            await self.send(message, id=request_id)
            while True:
                async with asyncio.timeout(timeout):
                    reply = await queue.get()
                if isinstance(reply, BaseException):
                    raise reply
                if isinstance(reply, Error):
                    raise RemoteError(reply.error)
                yield reply
                if reply.kind in REPLY_KINDS:
                    return
        finally:
            self._waiting.pop(request_id, None)

    # -- receiving ---------------------------------------------------------------------------

    async def receive(self, *, first: bool = False) -> Any:
        """Read the next message directly, for a handshake, before :meth:`run`.

        Args:
            first: this is the connection's first message (a hello): refuse another protocol
                version before validating anything else of it, and a chunked one (a hello
                fits one message: no buffer is reserved for a peer that has not said hello).

        Raises:
            VersionMismatch: ``first`` and the peer speaks another version.
            BadMessage: the message is not a frame, not valid, or too large.
        """
        while True:
            payload = await self.transport.recv()
            if first and isinstance(payload, bytes | bytearray | memoryview):
                if payload[: len(CHUNK_MAGIC)] == CHUNK_MAGIC:
                    info = ErrorInfo(
                        code=ErrorCode.TOO_LARGE,
                        message=f"a chunked first message: a hello fits in {CHUNK_BYTES} bytes",
                    )
                    raise BadMessage(info, None)
                check_version(payload)
            message = self._take(payload)
            if message is not None:
                return message

    def _take(self, payload: Any) -> Any:
        """The message ``payload`` completes, or ``None`` (a chunk of one still coming).

        Raises:
            BadMessage: with the error reply to send.
        """
        if isinstance(payload, str):
            raise BadMessage(
                ErrorInfo(code=ErrorCode.BAD_FRAME, message="text message: frames are binary"),
                None,
            )
        size = len(payload)
        self.bytes_in += size
        try:
            if payload[: len(CHUNK_MAGIC)] != CHUNK_MAGIC:
                if size > self.max_message_bytes:
                    raise MessageTooLarge(
                        f"message of {size} bytes exceeds the limit of "
                        f"{self.max_message_bytes} bytes",
                        *_peek_ids(memoryview(payload)),
                    )
                return parse(payload)
            frame = self._reassembler.add(payload)
        except MessageTooLarge as exc:
            self._fail_waiter(exc)
            info = ErrorInfo(
                code=ErrorCode.TOO_LARGE,
                message=str(exc),
                detail={"limit": self.max_message_bytes},
            )
            raise BadMessage(info, exc.reply_to) from exc
        except FrameError as exc:
            raise BadMessage(ErrorInfo(code=ErrorCode.BAD_FRAME, message=str(exc)), None) from exc
        return None if frame is None else parse(frame)

    def _fail_waiter(self, exc: MessageTooLarge) -> None:
        """A refused message that answers one of our requests fails that request now."""
        waiter = None if exc.answers is None else self._waiting.get(exc.answers)
        info = ErrorInfo(code=ErrorCode.TOO_LARGE, message=f"{self.name}: reply refused: {exc}")
        if isinstance(waiter, asyncio.Queue):
            waiter.put_nowait(RemoteError(info))
        elif waiter is not None and not waiter.done():
            waiter.set_result(RemoteError(info))

    async def run(self) -> None:
        """Read until the connection closes: route replies, hand the rest to the handler.

        Refusals (a bad message, a busy one) are answered here, in the reading loop: a peer that
        floods them and does not read the answers is slowed down by its own unread replies, and
        disconnected when one cannot go out within ``reply_timeout``.
        """
        try:
            while True:
                try:
                    payload = await self.transport.recv()
                except Exception as exc:  # the transport's own "connection closed"
                    self.close_reason = self.close_reason or str(exc) or type(exc).__name__
                    return
                try:
                    message = self._take(payload)
                    if message is not None:
                        self._route(message)
                except BadMessage as exc:
                    log.info("%s: refused a message: %s", self.name, exc.info.message)
                    if not await self._answer(exc.info, exc.reply_to):
                        return
                # Hold nothing of it while waiting for the next message, which may be seconds
                # away: the last reply of each of a thousand connections, each holding a state
                # of 1 MB, would otherwise stay alive until its next heartbeat.
                del payload
                message = None
        finally:
            self._shut()

    async def _answer(self, info: ErrorInfo, reply_to: int | None) -> bool:
        """Send a refusal; ``False`` (and the connection closed) if the peer does not take it."""
        try:
            async with asyncio.timeout(self.reply_timeout):
                await self.send(Error(id=self.next_id(), reply_to=reply_to, error=info))
        except ChannelClosed as exc:
            self.close_reason = self.close_reason or str(exc)
            return False
        except TimeoutError:
            reason = f"the peer did not read an error reply within {self.reply_timeout:g}s"
            log.warning("%s: %s: disconnecting", self.name, reason)
            self.close_reason = reason
            self._shut()
            with contextlib.suppress(Exception):
                async with asyncio.timeout(self.reply_timeout):
                    await self.transport.close(1008, close_reason(reason))
            return False
        return True

    def _route(self, message: Any) -> None:
        """Hand a request to the handler, or an answer to the request waiting for it.

        Raises:
            BadMessage: a ``busy`` refusal: ``max_inflight`` requests are being handled.
        """
        if message.kind not in _ANSWER_KINDS:
            if self.inflight >= self.max_inflight and message.kind not in NEVER_BUSY:
                self.refused_busy += 1
                info = ErrorInfo(
                    code=ErrorCode.BUSY,
                    message=f"{self.name}: {self.inflight} requests in flight on this connection "
                    f"(the limit is {self.max_inflight}); {message.kind!r} refused, retry later",
                    detail={"limit": self.max_inflight},
                )
                raise BadMessage(info, message.id)
            self.inflight += 1
            self._spawn(self._handle(message))
            return
        waiter = None if message.reply_to is None else self._waiting.get(message.reply_to)
        if isinstance(waiter, asyncio.Queue):
            waiter.put_nowait(message)
        elif waiter is not None and not waiter.done():
            waiter.set_result(message)
        else:  # a late answer to a request that gave up, or an error about a frame we sent
            self.on_unsolicited(message)

    def on_unsolicited(self, message: Any) -> None:
        """An answer nobody waits for; logged (replace to observe them)."""
        log.info("%s: unsolicited %s (reply_to=%s)", self.name, message.kind, message.reply_to)

    async def _handle(self, message: Any) -> None:
        try:
            await self._handle_one(message)
        except ChannelClosed as exc:  # the reply had nowhere to go
            log.info("%s: no reply to %s: %s", self.name, message.kind, exc)
        finally:
            self.inflight -= 1

    async def _handle_one(self, message: Any) -> None:
        if self.handler is None:
            info = ErrorInfo(
                code=ErrorCode.BAD_REQUEST, message=f"{self.name} takes no {message.kind!r}"
            )
            await self._send_error(info, message.id)
            return
        try:
            reply = await self.handler(message)
        except (RequestRefused, RemoteError) as exc:
            await self._send_error(exc.info, message.id)
            return
        except ProtocolError as exc:
            await self._send_error(
                ErrorInfo(code=ErrorCode.BAD_REQUEST, message=str(exc)), message.id
            )
            return
        except Exception as exc:
            log.exception("%s: handler of %s failed", self.name, message.kind)
            info = ErrorInfo(
                code=ErrorCode.INTERNAL,
                message=f"{type(exc).__name__} while handling {message.kind}: {exc}",
            )
            await self._send_error(info, message.id)
            return
        if reply is not None:
            await self.reply(message, reply)

    async def _send_error(self, info: ErrorInfo, reply_to: int | None) -> None:
        with contextlib.suppress(ChannelClosed):
            await self.send(Error(id=self.next_id(), reply_to=reply_to, error=info))

    def _spawn(self, coro: Awaitable[None]) -> None:
        task: asyncio.Task[None] = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _shut(self) -> None:
        if self.closed.is_set():
            return
        self.closed.set()
        failure = ChannelClosed(f"{self.name}: connection closed ({self.close_reason})")
        for waiter in self._waiting.values():
            if isinstance(waiter, asyncio.Queue):
                waiter.put_nowait(failure)
            elif not waiter.done():
                waiter.set_result(failure)

    async def close(self, code: int = 1000, reason: str = "") -> None:
        """Close the connection; waiting requests fail with :class:`ChannelClosed`."""
        self.close_reason = self.close_reason or reason or "closed by this side"
        # Fail the waiters first: closing the transport may take its close timeout when the
        # peer is gone, and nobody should wait on a connection this side has given up on.
        self._shut()
        for task in list(self._tasks):
            task.cancel()
        with contextlib.suppress(Exception):
            await self.transport.close(code, close_reason(reason))


def close_reason(reason: str) -> str:
    """``reason`` cut to what a WebSocket close frame carries (RFC 6455 §5.5: 123 bytes)."""
    return reason.encode()[:123].decode(errors="ignore")


def encode_small(message: BaseModel) -> bytes:
    """Encode a message known to fit one WebSocket message."""
    return b"".join(encode(dump(message)))
