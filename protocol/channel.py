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
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from typing import Any, Protocol

import numpy as np
from pydantic import BaseModel, ValidationError

from protocol import PROTOCOL_VERSION
from protocol.codec import decode, encode, frame_nbytes
from protocol.errors import ErrorCode, ErrorInfo, FrameError, ProtocolError
from protocol.messages import (
    CHUNK_BYTES,
    REPLY_KINDS,
    Error,
    message_adapter,
)

log = logging.getLogger(__name__)

DEFAULT_MAX_MESSAGE_BYTES = 1 << 34
"""Largest reassembled message accepted (16 GiB) unless the owner of the channel says less."""


class Transport(Protocol):
    """What a :class:`Channel` needs from a connection (a ``websockets`` connection fits)."""

    async def send(self, message: Any) -> None: ...

    async def recv(self) -> Any: ...

    async def close(self, code: int = 1000, reason: str = "") -> None: ...


class RemoteError(ProtocolError):
    """The peer answered a request with an ``error`` reply."""

    def __init__(self, info: ErrorInfo) -> None:
        super().__init__(info.message)
        self.info = info
        self.code = info.code


class ChannelClosed(ProtocolError):
    """The connection closed before the reply came (``reason`` says why, when known)."""


class VersionMismatch(ProtocolError):
    """The peer speaks another protocol version."""


class BadMessage(ProtocolError):
    """An incoming message that is not a frame or not a valid message."""

    def __init__(self, info: ErrorInfo, reply_to: int | None) -> None:
        super().__init__(info.message)
        self.info = info
        self.reply_to = reply_to


Handler = Callable[[Any], Awaitable[BaseModel | None]]

_ANSWER_KINDS = REPLY_KINDS | {"job_event"}


def dump(message: BaseModel) -> dict[str, Any]:
    """A message as the dict the codec encodes (tensors are passed through, not copied)."""
    return message.model_dump()


CHUNK_MAGIC = b"\xff\xff\xff\xffSZCK"
"""First bytes of a chunk message. A frame never starts so: its first four bytes are its header
length, and a 4 GiB header is refused by the codec."""
_CHUNK_HEAD = struct.Struct("<8sQQQ")  # magic, stream, offset, total


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


def frame_buffer(nbytes: int) -> memoryview:
    """An uninitialised, writable buffer to reassemble a frame of ``nbytes`` into.

    ``bytearray(n)`` zero-fills it first and so faults in every 4 KiB page at once (~150 ms for
    64 MB on this project's VMs, as slow as the transfer itself); numpy's allocator leaves the
    bytes uninitialised and asks for transparent huge pages, so the chunks' copies fault it in
    2 MiB at a time, about ten times faster. Decoded tensors are views over it.
    """
    return np.empty(nbytes, dtype=np.uint8).data


class Reassembler:
    """Joins chunk messages back into frames: no I/O, one per connection."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._streams: dict[int, tuple[memoryview, int]] = {}

    def add(self, payload: bytes | bytearray | memoryview) -> memoryview | None:
        """Take one chunk message; the whole frame once its last byte arrived, else ``None``.

        Raises:
            FrameError: a malformed chunk, a stream over the size limit, or bytes out of order.
        """
        if len(payload) < _CHUNK_HEAD.size:
            raise FrameError(f"chunk of {len(payload)} bytes is shorter than its header")
        _, stream, offset, total = _CHUNK_HEAD.unpack_from(payload)
        data = memoryview(payload)[_CHUNK_HEAD.size :]
        if stream not in self._streams:
            if total > self.max_bytes:
                raise FrameError(
                    f"chunked message of {total} bytes exceeds the limit of {self.max_bytes} bytes"
                )
            if offset != 0 or total == 0:
                raise FrameError(
                    f"chunk stream {stream} starts at offset {offset} of {total} bytes: "
                    "a stream starts at 0 of a positive total"
                )
            self._streams[stream] = (frame_buffer(total), 0)
        buffer, received = self._streams[stream]
        end = offset + len(data)
        if offset != received or total != len(buffer) or end > len(buffer):
            del self._streams[stream]
            raise FrameError(
                f"chunk stream {stream}: got bytes {offset}..{end} of {total}, "
                f"expected the next at {received} of {len(buffer)}"
            )
        buffer[offset:end] = data
        if end < len(buffer):
            self._streams[stream] = (buffer, end)
            return None
        del self._streams[stream]
        return buffer


def parse(payload: bytes | bytearray | memoryview) -> Any:
    """Decode and validate one frame into a message.

    Raises:
        BadMessage: with the error reply to send (``reply_to`` when the id could be read).
    """
    try:
        raw = decode(payload)
    except FrameError as exc:
        raise BadMessage(ErrorInfo(code=ErrorCode.BAD_FRAME, message=str(exc)), None) from exc
    reply_to = raw.get("id") if isinstance(raw, dict) else None
    reply_to = reply_to if isinstance(reply_to, int) and not isinstance(reply_to, bool) else None
    try:
        return message_adapter.validate_python(raw)
    except ValidationError as exc:
        raise BadMessage(_validation_info(exc, raw), reply_to) from exc


def _validation_info(exc: ValidationError, raw: Any) -> ErrorInfo:
    errors = exc.errors(include_url=False, include_input=False)
    first = errors[0] if errors else {"loc": (), "msg": str(exc)}
    kind = raw.get("kind") if isinstance(raw, dict) else None
    loc = list(first["loc"])
    if loc and loc[0] == kind:  # the union's tag leads the location: drop it
        loc = loc[1:]
    where = ".".join(str(p) for p in loc)
    if first.get("type") == "union_tag_invalid":
        message = f"unknown message kind {kind!r}"
    elif first.get("type") == "union_tag_not_found":
        message = "message has no 'kind'"
    else:
        message = f"invalid {kind or 'message'}: field {where!r}: {first['msg']}"
    detail = {"errors": [{"loc": [str(p) for p in e["loc"]], "msg": e["msg"]} for e in errors]}
    return ErrorInfo(code=ErrorCode.BAD_REQUEST, message=message, detail=detail)


def check_version(payload: bytes | bytearray | memoryview) -> None:
    """Refuse a hello from another protocol version, before reading anything else of it."""
    try:
        raw = decode(payload)
    except FrameError:
        return  # parse() reports it
    version = raw.get("v") if isinstance(raw, dict) else None
    if version != PROTOCOL_VERSION:
        raise VersionMismatch(
            f"protocol version mismatch: peer speaks {version!r}, this side speaks "
            f"{PROTOCOL_VERSION}"
        )


class Channel:
    """Requests, replies and handled messages over one :class:`Transport`.

    Args:
        transport: the connection.
        name: for logs and errors (``"worker w1"``, ``"coordinator"``...).
        handler: called with each incoming message that is not a reply; its return value (a
            message) is sent with ``reply_to`` set. ``None``: incoming requests are refused.
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
        bulk_gate: asyncio.Semaphore | None = None,
    ) -> None:
        self.transport = transport
        self.bulk_gate = bulk_gate
        self.name = name
        self.handler = handler
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
        """
        body = dump(message)
        body.update(fields)
        parts = encode(body)
        size = frame_nbytes(parts)
        if self.closed.is_set():
            raise ChannelClosed(f"{self.name}: connection closed ({self.close_reason})")
        if size <= CHUNK_BYTES:
            async with self._send_lock:
                await self.transport.send(b"".join(parts))
            self.bytes_out += size
            return
        self._next_stream += 1
        async with self.bulk_gate or contextlib.nullcontext():
            for chunk in chunk_messages(parts, self._next_stream):
                # One lock per chunk, not per message: a heartbeat or reply may pass in between.
                async with self._send_lock:
                    await self.transport.send(chunk)
        self.bytes_out += size

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
                version before validating anything else of it.

        Raises:
            VersionMismatch: ``first`` and the peer speaks another version.
            BadMessage: the message is not a frame or not valid.
        """
        while True:
            payload = await self.transport.recv()
            if first and not isinstance(payload, str):
                check_version(payload)
            message = self._take(payload)
            if message is not None:
                return message

    def _take(self, payload: Any) -> Any:
        if isinstance(payload, str):
            raise BadMessage(
                ErrorInfo(code=ErrorCode.BAD_FRAME, message="text message: frames are binary"),
                None,
            )
        self.bytes_in += len(payload)
        if payload[: len(CHUNK_MAGIC)] != CHUNK_MAGIC:
            return parse(payload)
        try:
            frame = self._reassembler.add(payload)
        except FrameError as exc:
            raise BadMessage(ErrorInfo(code=ErrorCode.BAD_FRAME, message=str(exc)), None) from exc
        return None if frame is None else parse(frame)

    async def run(self) -> None:
        """Read until the connection closes: route replies, hand the rest to the handler."""
        try:
            while True:
                try:
                    payload = await self.transport.recv()
                except Exception as exc:  # the transport's own "connection closed"
                    self.close_reason = self.close_reason or str(exc) or type(exc).__name__
                    return
                self._receive(payload)
                # Hold nothing of it while waiting for the next message, which may be seconds
                # away: the last reply of each of a thousand connections, each holding a state
                # of 1 MB, would otherwise stay alive until its next heartbeat.
                del payload
        finally:
            self._shut()

    def _receive(self, payload: Any) -> None:
        try:
            message = self._take(payload)
        except BadMessage as exc:
            log.info("%s: bad message: %s", self.name, exc.info.message)
            self._spawn(self._send_error(exc.info, exc.reply_to))
            return
        if message is not None:
            self._route(message)

    def _route(self, message: Any) -> None:
        if message.kind not in _ANSWER_KINDS:
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
        if self.handler is None:
            info = ErrorInfo(
                code=ErrorCode.BAD_REQUEST, message=f"{self.name} takes no {message.kind!r}"
            )
            await self._send_error(info, message.id)
            return
        try:
            reply = await self.handler(message)
        except RemoteError as exc:
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
            await self.transport.close(code, reason)


def encode_small(message: BaseModel) -> bytes:
    """Encode a message known to fit one WebSocket message."""
    return b"".join(encode(dump(message)))
