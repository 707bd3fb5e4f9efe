"""The agent's link to the coordinator: dial, hello, heartbeats, the dead-link watch, backoff.

Each function is one step of a connection's life (see :mod:`worker.agent` for the loop that
strings them together): :func:`dial` opens the WebSocket, :func:`handshake` trades the hello
for a welcome, :func:`serve` runs the heartbeats and the ping watch until something ends the
connection and says what. :class:`Backoff` spaces the attempts. No job state lives here.
"""

from __future__ import annotations

import asyncio
import logging
import random
import ssl
import time
from collections.abc import Awaitable, Callable
from typing import Any

from pydantic import BaseModel
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import InvalidStatus, WebSocketException

from protocol.asyncio.channel import Channel
from protocol.asyncio.handshake import send_hello
from protocol.asyncio.websocket import client_tls, tls_hint, ws_options
from protocol.chunking import Budget, frame_buffer
from protocol.errors import ErrorCode, ErrorInfo, ProtocolError, RemoteError, UnexpectedReply
from protocol.messages import Heartbeat, Welcome, WorkerHello
from worker.config import AgentConfig
from worker.errors import (
    HandshakeFailed,
    LinkDead,
    RegistrationRefused,
    UntrustedCoordinator,
    WorkerError,
)

__all__ = [
    "FATAL_CODES",
    "RETRYABLE",
    "Backoff",
    "Handler",
    "agent_ws_options",
    "channel_over",
    "describe",
    "dial",
    "handshake",
    "serve",
]

log = logging.getLogger(__name__)

FATAL_CODES = frozenset({ErrorCode.VERSION_MISMATCH, ErrorCode.UNAUTHORIZED})
"""Hello errors that end :meth:`~worker.agent.Agent.run`: the same hello would be refused again."""

_FATAL_HTTP_STATUSES = frozenset({401, 403})

RETRYABLE = (OSError, WebSocketException, ProtocolError, WorkerError)
"""What a failed connection attempt raises (``TimeoutError`` is an ``OSError``)."""

Handler = Callable[[Any], Awaitable[BaseModel | None]]


class Backoff:
    """Reconnection delays: exponential with full jitter, no I/O.

    The n-th delay (from 0) is uniform in ``[0, min(cap, base * 2**n)]`` — "full jitter" of
    Brooker, *Exponential Backoff And Jitter* (AWS Architecture Blog, 2015): a fleet of agents
    that lost the same coordinator spreads its reconnections instead of arriving together.

    Args:
        base: ceiling of the first delay, in seconds.
        cap: largest ceiling, in seconds.
        rng: uniform on ``[0, 1)``; replaced in tests.
    """

    def __init__(
        self, base: float = 0.1, cap: float = 5.0, rng: Callable[[], float] = random.random
    ) -> None:
        self.base = base
        self.cap = cap
        self.rng = rng
        self.attempt = 0

    def ceiling(self) -> float:
        """The largest value the next delay can take."""
        # min() on the exponent first: 2**attempt would overflow a float after ~1000 failures.
        return min(self.cap, self.base * 2.0 ** min(self.attempt, 64))

    def next_delay(self) -> float:
        """The delay before the next attempt; each call doubles the ceiling, up to ``cap``."""
        delay = self.rng() * self.ceiling()
        self.attempt += 1
        return delay

    def reset(self) -> None:
        """Start again from ``base`` (after a successful handshake)."""
        self.attempt = 0


# -- small helpers, one each ----------------------------------------------------------------------


def agent_ws_options(config: AgentConfig) -> dict[str, Any]:
    """The websockets settings of both of an agent's endpoints (the coordinator link and
    ``/peer``), with the agent's own timeouts."""
    return ws_options(
        open_timeout=config.open_timeout,
        ping_interval=config.ping_interval,
        ping_timeout=config.ping_timeout,
        close_timeout=config.close_timeout,
    )


def describe(exc: BaseException) -> str:
    """``Type: message`` (just ``Type`` when the message is empty), for logs and reasons."""
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def channel_over(
    ws: Any,
    name: str,
    handler: Handler | None,
    config: AgentConfig,
    budget: Budget | None = None,
    buffer_for: Callable[[int], memoryview] = frame_buffer,
) -> Channel:
    """A channel with the agent's limits (its chunked messages in progress also under
    ``budget``, shared with other channels; reassembled where ``buffer_for`` says:
    :mod:`protocol.asyncio.landing`)."""
    return Channel(
        ws,
        name,
        handler,
        max_message_bytes=config.max_message_bytes,
        max_inflight=config.max_inflight,
        budget=budget,
        stall_timeout=config.stall_timeout,
        buffer_for=buffer_for,
        relay_tensors=True,  # between the coordinator and the daemons: no torch in the agent
    )


# -- the steps of one connection ----------------------------------------------------------------


async def dial(config: AgentConfig, context: ssl.SSLContext | None) -> ClientConnection:
    """Open the WebSocket to the coordinator's ``/worker``.

    Raises:
        RegistrationRefused: the upgrade was refused with HTTP 401 or 403.
        UntrustedCoordinator: the coordinator's certificate fails verification.
    """
    url = config.endpoint
    token = config.token
    headers = {"Authorization": f"Bearer {token}"} if token else None
    try:
        return await connect(
            url, **client_tls(url, context), additional_headers=headers, **agent_ws_options(config)
        )
    except ssl.SSLCertVerificationError as exc:
        hint = tls_hint(url, exc, config.ca_file, "--ca-file")
        raise UntrustedCoordinator(f"{describe(exc)}: {hint}") from exc
    except InvalidStatus as exc:
        status = exc.response.status_code
        if status in _FATAL_HTTP_STATUSES:
            raise RegistrationRefused(
                ErrorInfo(
                    code=ErrorCode.UNAUTHORIZED,
                    message=f"the coordinator refused the connection with HTTP {status}"
                    + (" (no token given)" if token is None else " (check the token)"),
                    detail={"status": status},
                )
            ) from exc
        raise


async def handshake(channel: Channel, hello: WorkerHello, timeout: float) -> Welcome:  # noqa: ASYNC109
    """Send ``hello``; the coordinator's ``Welcome``, within ``timeout`` seconds.

    Raises:
        RegistrationRefused: an error of :data:`FATAL_CODES`.
        HandshakeFailed: any other error, or another kind of reply.
    """
    try:
        return await send_hello(channel, hello, Welcome, timeout, peer="the coordinator")
    except RemoteError as exc:
        if exc.code in FATAL_CODES:
            raise RegistrationRefused(exc.info) from exc
        raise HandshakeFailed(
            f"the coordinator refused the hello: {exc.code}: {exc.info.message}"
        ) from exc
    except UnexpectedReply as exc:
        raise HandshakeFailed(str(exc)) from exc


async def serve(
    channel: Channel,
    ws: ClientConnection,
    reader: asyncio.Task[None],
    interval: float,
    heartbeat_timeout: float,
    *,
    url: str,
    current_job: Callable[[], str | None],
    stopping: asyncio.Event,
    shutdown: asyncio.Future[str],
) -> str:
    """Heartbeat and watch the link until the connection ends; say why it ended.

    Args:
        reader: the channel's ``run()``; left running (the teardown's replies need it).
        url: the coordinator's, for the log.
        current_job: the job the heartbeats name.
        stopping: set when the agent stops.
        shutdown: resolved with the coordinator's reason when it sends ``shutdown``.
    """
    beats: asyncio.Future[None] = asyncio.ensure_future(
        _heartbeat(channel, interval, heartbeat_timeout, current_job)
    )
    link: asyncio.Future[None] = asyncio.ensure_future(
        _watch_link(ws, channel, interval, heartbeat_timeout, url)
    )
    stopped: asyncio.Future[Any] = asyncio.ensure_future(stopping.wait())
    over: asyncio.Future[Any] = asyncio.ensure_future(asyncio.shield(shutdown))
    ours: tuple[asyncio.Future[Any], ...] = (beats, link, stopped, over)
    try:
        await asyncio.wait({reader, *ours}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        # Not the reader: it must keep running so the teardown's error replies can go out.
        for task in ours:
            task.cancel()
        await asyncio.wait(ours)
    if stopped.done() and not stopped.cancelled():
        return "the worker is stopping"
    if over.done() and not over.cancelled():
        return f"the coordinator is shutting down ({over.result()})"
    if link.done() and not link.cancelled() and isinstance(link.exception(), LinkDead):
        return str(link.exception())
    if beats.done() and not beats.cancelled() and (exc := beats.exception()) is not None:
        if isinstance(exc, TimeoutError):
            return f"a heartbeat could not be sent within {heartbeat_timeout}s"
        return f"a heartbeat could not be sent: {describe(exc)}"
    return f"connection lost ({channel.close_reason or 'closed'})"


async def _watch_link(
    ws: ClientConnection,
    channel: Channel,
    interval: float,
    timeout: float,  # noqa: ASYNC109 - the coordinator's heartbeat timeout
    url: str,
) -> None:
    """Ping the coordinator every ``interval`` seconds; raise :class:`LinkDead` once for
    ``timeout`` seconds no pong has come and nothing went out.

    Heartbeats go one way, and a cut link fails no send until the kernel's buffers fill:
    with nothing to wait for, an agent would sit on a dead connection for as long as TCP
    retries (many minutes). A pong is the answer to wait for — any pong, since one
    acknowledges every ping before it (RFC 6455 §5.5.3) — under the coordinator's own
    contract: silent for longer than the heartbeat timeout is gone. But a ping sent while a
    large reply streams out waits behind it, and so does its pong: the link lives as long as
    the transport keeps taking the reply's chunks (``channel.chunk_sent_at``), which it stops
    doing once a cut link's buffers fill. (Heartbeats do not count: a cut link takes small
    messages into its buffers for minutes.)
    """
    interval = max(interval, 0.01)
    answered = time.monotonic()

    def on_pong(waiter: asyncio.Future[float]) -> None:
        nonlocal answered
        # exception() also marks a ping failed by the connection's end as retrieved.
        if not waiter.cancelled() and waiter.exception() is None:
            answered = time.monotonic()

    while True:
        silent = time.monotonic() - max(answered, channel.chunk_sent_at)
        if silent > timeout:
            dead = LinkDead(
                f"the coordinator answered no ping for {silent:.1f}s (timeout {timeout}s)"
            )
            log.warning("giving up the connection to %s: %s", url, dead)
            raise dead
        try:
            async with asyncio.timeout(timeout):
                waiter = await ws.ping()
        except TimeoutError:
            raise LinkDead(f"a ping could not be sent within {timeout}s") from None
        asyncio.ensure_future(waiter).add_done_callback(on_pong)  # a future already
        await asyncio.sleep(interval)


async def _heartbeat(
    channel: Channel,
    interval: float,
    timeout: float,  # noqa: ASYNC109
    current_job: Callable[[], str | None],
) -> None:
    """Send a heartbeat every ``interval`` seconds; raise when one cannot go out in time."""
    loop = asyncio.get_running_loop()
    interval = max(interval, 0.01)  # a zero interval from a misconfigured peer: no busy loop
    due = loop.time()
    while True:
        beat = Heartbeat(id=channel.next_id(), sent_at=time.time(), job_id=current_job())
        async with asyncio.timeout(timeout):
            await channel.send(beat)
        # A fixed schedule rather than sleep(interval) after each send: no drift; and no burst
        # to catch up after a late beat.
        due = max(due + interval, loop.time())
        await asyncio.sleep(due - loop.time())
