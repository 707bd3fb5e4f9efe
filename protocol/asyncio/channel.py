"""One message connection over asyncio, whatever carries it: ids, replies, streams.

The coordinator, the worker agent and the client all speak :mod:`protocol.messages` over a
WebSocket; this is what they share, so that request/reply matching and the answer to a bad message
exist once. It feeds what the transport receives to the sans-I/O core (:class:`~protocol.inbox.
Inbox`: chunks, limits, validation; :class:`~protocol.session.Session`: the connection's state)
and writes out what it sends (:func:`~protocol.chunking.chunk_messages`). It knows nothing of
``websockets``: it drives any object with ``async send(bytes | list of bytes-like)``,
``async recv() -> bytes`` and ``async close(code, reason)`` (a ``websockets`` connection is one).

* :meth:`Channel.request` sends a message with a fresh ``id`` and waits, with a timeout, for the
  message whose ``reply_to`` is that id; an :class:`~protocol.messages.Error` reply raises
  :class:`RemoteError`. :meth:`Channel.stream` does the same for a request answered by several
  messages, ending at the first ``ack``/``result``/``error``.
* Every other incoming message goes to the ``handler`` in a task of its own, so a slow request
  never holds up heartbeats or replies behind it; what the handler returns is sent as the reply,
  and a :class:`~protocol.errors.RequestRefused` it raises as an ``error`` reply.
* A frame larger than :data:`~protocol.messages.CHUNK_BYTES` is sent as chunk messages cut
  straight from the codec's parts and reassembled on the other side; other messages may
  interleave. A request may be sent *paced* (:class:`Pacer`: bytes of it are still being
  written, each chunk leaves once its bytes are final), and its reply may land in a buffer the
  caller gives and watches fill (a :class:`~protocol.chunking.StreamSink`).
* A message that is not a frame, or fails validation, is answered with an ``error`` reply that
  names the field; the connection stays up.
* Limits, each a typed error reply with the connection kept: a message over
  ``max_message_bytes`` (``too_large``, refused from its first chunk's header, before its buffer
  exists), a request beyond ``max_inflight`` being handled (``busy``; heartbeats are always
  handled). A peer that does not read its error replies within ``reply_timeout`` is
  disconnected instead of piling them up.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, Protocol

from pydantic import BaseModel

from protocol.asyncio.turns import TurnGate
from protocol.asyncio.websocket import as_sent, close_reason
from protocol.chunking import (
    DEFAULT_STALL_SECONDS,
    Budget,
    StreamSink,
    chunk_messages,
    frame_buffer,
)
from protocol.codec import Part, encode, frame_nbytes
from protocol.errors import (
    BadMessage,
    ChannelClosed,
    ErrorCode,
    ErrorInfo,
    MessageTooLarge,
    ProtocolError,
    ReassemblyFull,
    RemoteError,
    RequestRefused,
)
from protocol.inbox import Inbox, check_first
from protocol.messages import CHUNK_BYTES, REPLY_KINDS, Error
from protocol.parsing import dump, parse, peek_ids
from protocol.session import Event, Session

__all__ = [
    "DEFAULT_MAX_INFLIGHT",
    "DEFAULT_MAX_MESSAGE_BYTES",
    "Channel",
    "Handler",
    "Pacer",
    "Transport",
]

log = logging.getLogger(__name__)

DEFAULT_MAX_MESSAGE_BYTES = 1 << 31
"""Largest message accepted (2 GiB), reassembled from its chunks, unless the channel's owner
says otherwise."""
DEFAULT_MAX_INFLIGHT = 64
"""Incoming requests handled at once on one connection; one more gets a ``busy`` error."""
NEVER_BUSY = frozenset({"heartbeat"})
"""Kinds handled whatever the number in flight: refusing a heartbeat would lose the worker."""
PARSE_ON_LOOP_BYTES = CHUNK_BYTES
"""Messages up to this size are parsed on the event loop; larger ones in a thread."""
TURN_BYTES = 16 << 10
"""Messages over this size go through the channel's :class:`~protocol.asyncio.turns.TurnGate`:
encoding and writing them is what a turn of the loop can fill up with."""
ERROR_REPLY_TIMEOUT = 30.0
"""Seconds an error reply may take to go out before the peer is disconnected."""


class Transport(Protocol):
    """What a :class:`Channel` needs from a connection (a ``websockets`` connection fits)."""

    async def send(self, message: Any) -> None:
        """Send one message: bytes, or an iterable of bytes sent as the fragments of one
        message (:func:`~protocol.asyncio.websocket.as_sent`)."""

    async def recv(self) -> Any: ...

    async def close(self, code: int = 1000, reason: str = "") -> None: ...


Handler = Callable[[Any], Awaitable[BaseModel | None]]

_ANSWER_KINDS = REPLY_KINDS | {"job_event"}


class Pacer(Protocol):
    """A message sent while some of its bytes are still being written (a mean that is still
    being folded, :mod:`coordinator.strategies.data_parallel.mean_fold`): it goes out a chunk at a
    time, each chunk once the bytes it carries are final."""

    def bind(self, parts: Sequence[Part]) -> Callable[[int], Awaitable[None]]:
        """For the frame made of ``parts``: an awaitable that returns once its first ``n``
        bytes are final (and raises when they never will be: nothing more of it is sent)."""
        ...


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
        budget: shared by the owner's channels, bounds the bytes of the chunked messages in
            progress on all of them (:class:`~protocol.chunking.Budget`; ``None``: only
            ``max_message_bytes`` per connection).
        stall_timeout: seconds a chunked message in progress may wait for its next chunk; then
            it is dropped and its memory freed (``None``: it may wait forever).
        bulk_gate: shared by the owner's channels, bounds how many messages larger than
            :data:`TURN_BYTES` they write at once (``None``: no bound). Each holds a slot until
            it (its last chunk) has left the send buffer, so a fan-out of a large model
            to many peers buffers a few copies at a time instead of one per peer, and the
            owner's other messages do not queue behind all of them.
        turns: shared by the owner's channels, bounds how many messages of over
            :data:`TURN_BYTES` they start writing per turn of the event loop
            (:class:`~protocol.asyncio.turns.TurnGate`; ``None``: no bound): a model sent to
            thousands of connections at once does not keep the loop from reading theirs.
        buffer_for: where a chunked message that no request of ours awaits is reassembled: a
            writable buffer of so many bytes (default: memory,
            :func:`~protocol.chunking.frame_buffer`).
        relay_tensors: its messages' tensors are only passed on (a worker agent's): read as
            :class:`~protocol.arrays.RelayedTensor`, torch never imported for them.
    """

    def __init__(
        self,
        transport: Transport,
        name: str,
        handler: Handler | None = None,
        *,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        max_inflight: int = DEFAULT_MAX_INFLIGHT,
        reply_timeout: float = ERROR_REPLY_TIMEOUT,
        bulk_gate: asyncio.Semaphore | None = None,
        budget: Budget | None = None,
        stall_timeout: float | None = DEFAULT_STALL_SECONDS,
        turns: TurnGate | None = None,
        buffer_for: Callable[[int], memoryview] = frame_buffer,
        relay_tensors: bool = False,
    ) -> None:
        if max_message_bytes < 1 or max_inflight < 1:
            raise ValueError("max_message_bytes and max_inflight must be positive")
        self.transport = transport
        self.bulk_gate = bulk_gate
        self.turns = turns
        self.name = name
        self.handler = handler
        self.max_message_bytes = max_message_bytes
        self.max_inflight = max_inflight
        self.reply_timeout = reply_timeout
        self.relay_tensors = relay_tensors
        self.inflight = 0
        self.refused_busy = 0
        self.session = Session(name)
        # Where the replies to some of our requests land (request id → sink), see request().
        self._sinks: dict[int, StreamSink] = {}
        # The waiter of each request: a future for one reply, a queue for a stream of them.
        self._waiting: dict[int, asyncio.Future[Any] | asyncio.Queue[Any]] = {}
        self._inbox = Inbox(
            max_message_bytes,
            budget,
            stall_timeout,
            claim=self._claim,
            buffer_for=buffer_for,
        )
        # The dict's own method, not a closure over the channel: no cycle to wait for the GC.
        self._inbox.reassembler.awaited = self._waiting.__contains__
        self._sweeper: asyncio.Task[None] | None = None  # drops stalled chunk streams
        self._next_id = 0
        self._next_stream = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self._send_lock = asyncio.Lock()
        self.closed = asyncio.Event()
        self.close_reason = ""
        self.bytes_out = 0
        # When the last WebSocket message (a chunk counts) came in, and when the transport last
        # took a chunk of a large message going out (once a cut link's buffers fill it takes
        # none; small messages it takes for minutes): signs of a live link while a large
        # message streams past the heartbeats, pings and pongs queued behind it.
        self.received_at = self.chunk_sent_at = time.monotonic()

    @property
    def bytes_in(self) -> int:
        """Bytes received on this connection so far."""
        return self._inbox.bytes_in

    @property
    def budget(self) -> Budget | None:
        """What the chunks of its messages still arriving are charged to (the owner may give
        it another once it knows who the peer is: the messages begun before keep theirs)."""
        return self._inbox.reassembler.budget

    @budget.setter
    def budget(self, budget: Budget | None) -> None:
        self._inbox.reassembler.budget = budget

    @property
    def reply_budget(self) -> Budget | None:
        """What the chunks of replies to this channel's own requests are charged to (``None``:
        :attr:`budget`): room a peer's unasked messages cannot take."""
        return self._inbox.reassembler.reply_budget

    @reply_budget.setter
    def reply_budget(self, budget: Budget | None) -> None:
        self._inbox.reassembler.reply_budget = budget

    # -- sending -----------------------------------------------------------------------------

    def next_id(self) -> int:
        self._next_id += 1
        return self._next_id

    async def send(
        self,
        message: BaseModel,
        *,
        pace: Pacer | None = None,
        admitted: bool = False,
        **fields: Any,
    ) -> None:
        """Send one message, in chunks when its frame is larger than ``CHUNK_BYTES``.

        ``fields`` are sent instead of the message's own (``id``, ``reply_to``): cheaper than a
        copy of the model for every request and reply. With ``pace``, each chunk waits until
        the bytes it carries are final (the first before the message takes a ``bulk_gate``
        slot, so a paced message holds none while nothing of it can go). ``admitted``: the
        caller took a turn of the channel's ``turns`` for it already (:meth:`request` does,
        before the message is encoded).

        Raises:
            ChannelClosed: the connection is closed (or closed while sending).
        """
        body = dump(message)
        body.update(fields)
        parts = encode(body)
        size = frame_nbytes(parts)
        until = None if pace is None else pace.bind(parts)
        if self.closed.is_set():
            raise ChannelClosed(f"{self.name}: connection closed ({self.close_reason})")
        large = size > TURN_BYTES
        if self.turns is not None and large and not admitted:
            await self.turns.enter()
        if size <= CHUNK_BYTES:
            if until is not None:
                await until(size)
            # A large one holds a bulk slot while it is joined and written: 10,000 of 100 KB
            # sent at once are 16 in memory, not 1 GB waiting in the write buffers.
            slot = self.bulk_gate if large and self.bulk_gate else contextlib.nullcontext()
            async with slot, self._send_lock:
                await self._write(b"".join(parts))
            self.bytes_out += size
            return
        self._next_stream += 1
        chunks = chunk_messages(parts, self._next_stream)
        if until is not None:
            await until(CHUNK_BYTES)
        async with self.bulk_gate or contextlib.nullcontext():
            end = 0
            while end < size:
                end = min(size, end + CHUNK_BYTES)
                if until is not None:
                    await until(end)  # before the chunk is cut: cutting copies its bytes
                chunk = next(chunks)
                # One lock per chunk, not per message: a heartbeat or reply may pass in between.
                async with self._send_lock:
                    await self._write(chunk, last=end == size)
                self.chunk_sent_at = time.monotonic()
        self.bytes_out += size

    async def _write(self, data: bytes, *, last: bool = True) -> None:
        try:
            await self.transport.send(as_sent(data, last))
        except Exception as exc:  # the transport's own "connection closed"
            raise ChannelClosed(f"{self.name}: connection closed while sending: {exc}") from exc

    async def reply(self, to: Any, message: BaseModel) -> None:
        """Send ``message`` as the reply to ``to``."""
        await self.send(message, reply_to=to.id, id=self.next_id())

    async def request(
        self,
        message: BaseModel,
        timeout: float,  # noqa: ASYNC109
        *,
        pace: Pacer | None = None,
        sink: StreamSink | None = None,
    ) -> Any:
        """Send ``message`` and return its reply.

        Args:
            message: the request.
            timeout: seconds to wait for the reply once the request is sent.
            pace: send it paced (see :meth:`send`).
            sink: where the reply's frame lands, watched as it arrives; the reply is returned
                as any other (its tensors views over the sink's buffer).

        Raises:
            RemoteError: the reply was an ``error``.
            TimeoutError: no reply within ``timeout`` seconds.
            ChannelClosed: the connection closed first.
        """
        request_id = self.next_id()
        waiter: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._waiting[request_id] = waiter
        if sink is not None:
            self._sinks[request_id] = sink
        try:
            if self.turns is not None:
                # A request may carry a model, to thousands of workers at once: it takes its
                # turn before it is encoded, or their encoding fills one turn of the loop.
                await self.turns.enter()
            await self.send(message, pace=pace, admitted=True, id=request_id)
            async with asyncio.timeout(timeout):
                reply = await waiter
        finally:
            self._waiting.pop(request_id, None)
            self._sinks.pop(request_id, None)
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

    def _claim(self, head: memoryview) -> StreamSink | None:
        """The sink of the request a message starting with ``head`` answers, if it has one."""
        if not self._sinks:
            return None
        _, reply_to = peek_ids(head)
        return None if reply_to is None else self._sinks.pop(reply_to, None)

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
            self.received_at = time.monotonic()
            if first:
                check_first(payload)
            message = self._take(payload)
            if message is not None:
                return message

    def _take(self, payload: Any) -> Any:
        """The message ``payload`` completes, or ``None``; a refused reply fails its request.

        Raises:
            BadMessage: with the error reply to send.
        """
        frame = self._frame(payload)
        return None if frame is None else parse(frame, self.relay_tensors)

    async def _parsed(self, frame: Any) -> Any:
        """The message of ``frame``: decoded and validated on the loop when small, in a thread
        when over :data:`PARSE_ON_LOOP_BYTES` (a 5 MB submit takes a few hundred milliseconds
        to validate: every other connection's heartbeats would wait for it). The reading loop
        waits for it either way, so the connection's messages stay in order.

        Raises:
            BadMessage: not a valid message.
        """
        if len(frame) <= PARSE_ON_LOOP_BYTES:
            return parse(frame, self.relay_tensors)
        return await asyncio.to_thread(parse, frame, self.relay_tensors)

    def _frame(self, payload: Any) -> Any:
        """The frame ``payload`` completes, or ``None``; a refused reply fails its request.

        Raises:
            BadMessage: with the error reply to send.
        """
        try:
            return self._inbox.frame(payload)
        except BadMessage as exc:
            if isinstance(exc.__cause__, MessageTooLarge):
                self._fail_waiter(exc.__cause__)
            raise
        finally:
            if self._sweeper is None and self._inbox.reassembler.next_stall() is not None:
                self._sweeper = asyncio.ensure_future(self._sweep())

    async def _sweep(self) -> None:
        """While chunked messages are in progress: drop those that stall (no chunk for the
        stall timeout), also when nothing else arrives on the connection."""
        reassembler = self._inbox.reassembler
        try:
            while (deadline := reassembler.next_stall()) is not None:
                await asyncio.sleep(max(0.0, deadline - reassembler.clock()) + 0.01)
                for stream in reassembler.expire():
                    log.warning(
                        "%s: chunked message %d got no chunk for %gs: dropped",
                        self.name,
                        stream,
                        reassembler.stall_seconds,
                    )
        finally:
            self._sweeper = None

    def _fail_waiter(self, exc: MessageTooLarge) -> None:
        """A refused message that answers one of our requests fails that request now."""
        waiter = None if exc.answers is None else self._waiting.get(exc.answers)
        code = ErrorCode.BUSY if isinstance(exc, ReassemblyFull) else ErrorCode.TOO_LARGE
        info = ErrorInfo(code=code, message=f"{self.name}: reply refused: {exc}")
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
        self.session.handle(Event.READY)
        try:
            while True:
                try:
                    payload = await self.transport.recv()
                except Exception as exc:  # the transport's own "connection closed"
                    self.close_reason = self.close_reason or str(exc) or type(exc).__name__
                    return
                self.received_at = time.monotonic()
                try:
                    frame = self._frame(payload)
                    if frame is not None:
                        self._route(await self._parsed(frame))
                except BadMessage as exc:
                    log.info("%s: refused a message: %s", self.name, exc.info.message)
                    if not await self._answer(exc.info, exc.reply_to):
                        return
                # Hold nothing of it while waiting for the next message, which may be seconds
                # away: the last reply of each of a thousand connections, each holding a state
                # of 1 MB, would otherwise stay alive until its next heartbeat.
                del payload
                frame = None
        finally:
            self._shut(Event.LOST)
            self._release()

    def _release(self) -> None:
        """Free what the connection held for incoming messages: its chunked ones in progress
        (their budget too), the sweeper, the handler and the claim of replies (each would keep
        the channel alive until the cyclic GC)."""
        self._inbox.reassembler.close()
        # The claim is a bound method of this channel: held by the inbox, it is a cycle.
        self._inbox.claim = self._inbox.reassembler.claim = None
        self._sinks.clear()
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        self.handler = None

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
            self._shut(Event.CLOSE)
            with contextlib.suppress(Exception):
                async with asyncio.timeout(self.reply_timeout):
                    await self.transport.close(1008, close_reason(reason))
            self.session.handle(Event.CLOSED)
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

    def _shut(self, event: Event) -> None:
        """Advance the session; when that ends sending, fail every waiting request."""
        self.session.handle(event)
        if self.session.sending or self.closed.is_set():
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
        self._shut(Event.CLOSE)
        for task in list(self._tasks):
            task.cancel()
        with contextlib.suppress(Exception):
            await self.transport.close(code, close_reason(reason))
        self.session.handle(Event.CLOSED)
