"""The worker agent: one WebSocket to the coordinator, one filter daemon per open job.

The agent dials out (so it works behind NAT), registers, heartbeats, and runs what the
coordinator asks for in filter daemons (:class:`~worker.supervisor.DaemonSupervisor`). It is the
only module of :mod:`worker` that imports ``websockets``; the conversation itself is
:class:`~protocol.channel.Channel`'s.

Lifecycle of :meth:`Agent.run`, one turn per connection::

    dial ──► hello / welcome ──► serve: channel.run() + heartbeats ──► teardown ──► backoff ─┐
     ▲                                                                                       │
     └───────────────────────────────────────────────────────────────────────────────────────┘

* **Dial and hello.** ``WorkerHello`` carries the id (``--id``, or the one the coordinator gave
  on an earlier connection), tags and :func:`~worker.capabilities.detect`'s capabilities; the
  reply is a ``Welcome`` (the id to keep, the heartbeat contract) or an ``Error``. An error that
  retrying cannot fix (:data:`FATAL_CODES`, or HTTP 401/403 on the upgrade) ends :meth:`run` with
  :class:`RegistrationRefused`; anything else is retried.
* **Serve.** Requests are dispatched through a handler table (``open_job``, ``call``,
  ``close_job``, ``links``, ``deliver``, ``probe``, ``shutdown``); each runs in a task of the
  channel's, so a long ``call`` never holds up another job, a reply or a heartbeat. Heartbeats
  go out every ``heartbeat_interval`` from their own task; daemon I/O never blocks the loop (see
  :mod:`worker.supervisor`), so they keep flowing while a filter computes.
* **Pipeline tensors** (:mod:`worker.peer`). With ``peer_listen`` the agent serves ``/peer``
  and announces it in the hello; ``links`` makes it dial the job's peers. A ``call`` with
  ``output_to`` sends its result, encoded, to that worker's mailbox — over the direct link, or
  as a ``deliver`` to the coordinator, which relays it — and one with ``input_from`` waits for
  its mailbox key before running. A job's mailbox goes with the job.
* **A dead link.** Heartbeats only go one way, so the agent also pings the coordinator (a
  WebSocket ping) every heartbeat interval; when no pong has come for ``heartbeat_timeout`` —
  the cable was cut, a firewall drops the packets, the coordinator's host froze — the connection
  is given up (:class:`LinkDead`) the way the coordinator gives up on a silent worker, and the
  agent dials again until the link is back.
* **Teardown** (the connection dropped, a heartbeat could not be sent within
  ``heartbeat_timeout``, no pong within it, the coordinator sent ``shutdown``, or
  :meth:`Agent.stop`): every daemon
  is closed first — a running call is cancelled, which kills its daemon, and its error reply still
  goes out if the connection is up — then the connection is closed. The coordinator fails the
  jobs of a worker it lost; a job never survives its connection here.
* **Backoff.** Exponential with full jitter (:class:`Backoff`), reset by every successful
  handshake; :meth:`Agent.stop` interrupts it.

Failures are data: a daemon error (a filter that raised, a crash, a timeout) becomes an ``error``
reply carrying the daemon's :class:`~protocol.errors.ErrorInfo` plus ``worker_id`` and ``job_id``
in its detail. A crashed daemon is not restarted behind the coordinator's back: every later call
of that job fails with ``daemon_crashed`` until an ``open_job`` brings up a fresh one, because the
states the job had built died with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import signal
import ssl
import sys
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from pydantic import BaseModel
from websockets.asyncio.client import ClientConnection, connect
from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.exceptions import ConnectionClosed, InvalidStatus, WebSocketException

from protocol.asyncio.channel import DEFAULT_MAX_INFLIGHT, DEFAULT_MAX_MESSAGE_BYTES, Channel
from protocol.codec import decode, encode_frame
from protocol.errors import ErrorCode, ErrorInfo, ProtocolError, RemoteError
from protocol.messages import (
    CHUNK_BYTES,
    Ack,
    Call,
    Capabilities,
    CloseJob,
    Deliver,
    Error,
    Heartbeat,
    Links,
    OpenJob,
    PeerHello,
    Probe,
    Result,
    Shutdown,
    Welcome,
    WorkerHello,
)
from worker.capabilities import detect
from worker.datasets import environment as dataset_environment
from worker.datasets import rows
from worker.errors import DaemonError, WorkerError
from worker.peer import CallOrder, Mailbox, MailboxDropped, MailboxFull, OutOfOrder, PeerLinks
from worker.supervisor import DaemonSupervisor

__all__ = [
    "FATAL_CODES",
    "Agent",
    "AgentError",
    "Backoff",
    "HandshakeFailed",
    "LinkDead",
    "RegistrationRefused",
    "worker_url",
]

log = logging.getLogger(__name__)

FATAL_CODES = frozenset({ErrorCode.VERSION_MISMATCH, ErrorCode.UNAUTHORIZED})
"""Hello errors that end :meth:`Agent.run`: the same hello would be refused again."""

_FATAL_HTTP_STATUSES = frozenset({401, 403})

_RETRYABLE = (OSError, WebSocketException, ProtocolError, WorkerError)
"""What a failed connection attempt raises (``TimeoutError`` is an ``OSError``)."""

Handler = Callable[[Any], Awaitable[BaseModel | None]]


class AgentError(WorkerError):
    """A connection attempt failed in a way the agent understands (it retries)."""


class HandshakeFailed(AgentError):
    """The coordinator answered the hello with something other than a welcome."""


class LinkDead(AgentError):
    """The coordinator answered no ping for longer than the heartbeat timeout."""


class RegistrationRefused(AgentError):
    """The coordinator refused this worker for good (another protocol version, a wrong token).

    ``info`` is the coordinator's error; :meth:`Agent.run` raises this instead of retrying.
    """

    def __init__(self, info: ErrorInfo) -> None:
        super().__init__(f"{info.code}: {info.message}")
        self.info = info


def worker_url(url: str) -> str:
    """The agents' endpoint of a coordinator URL: ``ws://h:p`` → ``ws://h:p/worker``.

    A URL with a path is used as it is; one without a scheme gets ``ws://``.

    Raises:
        ValueError: not a ``ws://`` or ``wss://`` URL with a host.
    """
    parts = urlsplit(url if "://" in url else f"ws://{url}")
    if parts.scheme not in ("ws", "wss") or not parts.hostname:
        raise ValueError(f"not a coordinator URL: {url!r} (expected ws://HOST:PORT or wss://...)")
    if parts.path in ("", "/"):
        parts = parts._replace(path="/worker")
    return urlunsplit(parts)


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


@dataclass(eq=False)
class _Job:
    """One open job: its daemon and the tasks working on it (owned here, not by a handler)."""

    job_id: str
    supervisor: DaemonSupervisor
    opening: asyncio.Task[None] | None = None
    calls: set[asyncio.Task[Any]] = field(default_factory=set)
    order: CallOrder = field(default_factory=CallOrder)  # its sequenced calls (Call.seq)


class Agent:
    """Connects to a coordinator and runs its jobs' filters in daemons, until :meth:`stop`.

    Args:
        url: the coordinator, ``ws://HOST:PORT`` (``/worker`` is appended when there is no path).
        worker_id: the id to ask for; ``None`` lets the coordinator choose. Either way the id of
            the last welcome is asked for again on every reconnection.
        tags: what jobs can select this worker by.
        threads: torch threads per daemon when ``open_job`` names none (default: all cores).
        token: sent as ``Authorization: Bearer <token>`` on the WebSocket upgrade.
        heartbeat_interval_override: heartbeat period instead of the welcome's.
        reconnect: ``False``: :meth:`run` returns when the first connection ends.
        capabilities: what the hello reports (default: :func:`~worker.capabilities.detect`).
        backoff: reconnection delays (default: 0.1 s doubling to 5 s, full jitter).
        open_timeout: seconds for the TCP connect, the upgrade, and the hello/welcome exchange.
        ping_interval: seconds between WebSocket pings (``websockets``' own keepalive, a second
            line of defence behind the heartbeats); ``None`` disables them.
        ping_timeout: seconds a ping may go unanswered before the connection is dropped.
        close_timeout: seconds each closing step may take (closing handshake, daemon shutdown,
            in-flight replies).
        startup_timeout: seconds a daemon may take to start and load a job's filters.
        call_timeout: seconds a ``call`` without its own ``timeout`` may take.
        python: the interpreter that runs the daemons.
        datasets: local datasets by name (``--data NAME=PATH``), announced in the hello and
            readable by the job daemons (the data itself never leaves this machine).
        spare: keep one daemon started ahead of the next job (``open_job`` then only loads the
            filters: importing torch in a new daemon takes seconds); it also answers ``probe``.
        peer_listen: ``HOST:PORT`` to serve ``/peer`` on, where other workers deliver pipeline
            tensors directly (port 0: any free port). The hello announces it as
            ``ws://HOST:PORT``, with ``127.0.0.1`` for a wildcard host (``0.0.0.0``/``::``/empty):
            a wildcard is not an address a peer can dial, and loopback is what tests use — pass
            the machine's reachable address to span machines. ``None``: no direct links; every
            tensor for this worker is relayed by the coordinator.

    One :meth:`run` per agent: its events belong to the loop that runs it.
    """

    def __init__(
        self,
        url: str,
        worker_id: str | None = None,
        tags: Iterable[str] = (),
        threads: int | None = None,
        token: str | None = None,
        heartbeat_interval_override: float | None = None,
        reconnect: bool = True,
        *,
        capabilities: Capabilities | None = None,
        backoff: Backoff | None = None,
        open_timeout: float = 10.0,
        ping_interval: float | None = 20.0,
        ping_timeout: float | None = 20.0,
        close_timeout: float = 5.0,
        startup_timeout: float = 60.0,
        call_timeout: float = 3600.0,
        python: str = sys.executable,
        spare: bool = True,
        datasets: Mapping[str, Path] | None = None,
        peer_listen: str | None = None,
        peer_advertise: str | None = None,
        ca_file: str | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        max_inflight: int = DEFAULT_MAX_INFLIGHT,
    ) -> None:
        self.url = worker_url(url)
        self.tags = list(tags)
        self.threads = threads
        self.heartbeat_interval_override = heartbeat_interval_override
        self.reconnect = reconnect
        self.open_timeout = open_timeout
        self.ping_interval = ping_interval
        self.ping_timeout = ping_timeout
        self.close_timeout = close_timeout
        self.startup_timeout = startup_timeout
        self.call_timeout = call_timeout
        if max_message_bytes < 1 or max_inflight < 1:
            raise ValueError("max_message_bytes and max_inflight must be positive")
        self.max_message_bytes = max_message_bytes
        self.max_inflight = max_inflight
        self.python = python
        self.spare = spare
        self.datasets = dict(datasets or {})
        self._dataset_rows = {name: rows(path) for name, path in self.datasets.items()}
        self._spare: asyncio.Task[DaemonSupervisor] | None = None
        self._worker_id = worker_id
        self._token = token
        self._capabilities = capabilities
        self._backoff = backoff or Backoff()
        self._connected = asyncio.Event()
        self._stopping = asyncio.Event()
        self._session_over = asyncio.Event()
        self._shutdown_reason = ""
        self._accepting = False
        self._jobs: dict[str, _Job] = {}
        self._daemons: set[DaemonSupervisor] = set()  # until closed, open or not: kill_daemons()
        self._handling = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self.peer_listen = peer_listen
        self.peer_advertise = peer_advertise  # HOST:PORT other workers dial (behind NAT, Docker)
        # For wss://: the certificate(s) to trust (a coordinator's own CA); None: the system's.
        self._ssl = ssl.create_default_context(cafile=ca_file) if ca_file else None
        if peer_listen is not None:
            _split_host_port(peer_listen)  # a ValueError now, not at run()
        self._peer_address: str | None = None
        self._peer_server: Server | None = None
        self._channel: Channel | None = None
        self._mailbox = Mailbox()
        self._links = PeerLinks(
            lambda: self._worker_id,
            open_timeout=min(open_timeout, 3.0),
            max_message_bytes=max_message_bytes,
        )
        self._handlers: dict[str, Handler] = {
            "open_job": self.on_open_job,
            "call": self.on_call,
            "links": self.on_links,
            "deliver": self.on_deliver,
            "close_job": self.on_close_job,
            "probe": self.on_probe,
            "shutdown": self.on_shutdown,
        }

    # -- properties ---------------------------------------------------------------------------

    @property
    def worker_id(self) -> str | None:
        """The id asked for, then the one the coordinator gave (kept across reconnections)."""
        return self._worker_id

    @property
    def connected(self) -> asyncio.Event:
        """Set from the welcome until the connection's teardown begins."""
        return self._connected

    @property
    def jobs(self) -> dict[str, DaemonSupervisor]:
        """The open jobs and their daemons (a snapshot)."""
        return {job_id: job.supervisor for job_id, job in self._jobs.items()}

    @property
    def peer_address(self) -> str | None:
        """``ws://HOST:PORT`` of the ``/peer`` endpoint while it listens, else ``None``."""
        return self._peer_address

    @property
    def mailbox(self) -> Mailbox:
        """Tensors delivered to this worker, until a call takes them."""
        return self._mailbox

    @property
    def stopping(self) -> bool:
        """True once :meth:`stop` was called."""
        return self._stopping.is_set()

    # -- lifecycle ----------------------------------------------------------------------------

    async def run(self) -> None:
        """Connect, serve, and reconnect with backoff until :meth:`stop`.

        With ``reconnect=False`` it returns when the first connection (or attempt) ends.

        Raises:
            RegistrationRefused: the coordinator refused this worker for good (see
                :data:`FATAL_CODES`); retrying would not help.
        """
        if self._capabilities is None:
            # detect() may import torch (CUDA devices): keep it off the loop.
            loop = asyncio.get_running_loop()
            self._capabilities = await loop.run_in_executor(None, detect)
        if self.peer_listen is not None:
            await self._start_peer_server(self.peer_listen)
        try:
            while not self._stopping.is_set():
                try:
                    await self._attempt()
                except RegistrationRefused as exc:
                    log.error("the coordinator at %s refused this worker: %s", self.url, exc)
                    raise
                except _RETRYABLE as exc:
                    log.warning("connection to %s failed: %s", self.url, _describe(exc))
                except Exception:
                    log.exception("connection to %s failed unexpectedly", self.url)
                if not self.reconnect or self._stopping.is_set():
                    break
                delay = self._backoff.next_delay()
                log.info("reconnecting to %s in %.2fs", self.url, delay)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(delay):
                        await self._stopping.wait()
        finally:
            await self._close_jobs()  # a backstop: each connection's teardown already did it
            await self._links.close()
            await self._stop_peer_server()

    def stop(self) -> None:
        """Stop accepting work, close the daemons and the connection; :meth:`run` then returns.

        Safe to call from a signal handler installed with ``loop.add_signal_handler``.
        """
        self._accepting = False
        self._stopping.set()

    def kill_daemons(self) -> None:
        """SIGKILL every daemon now, without waiting: the forced exit of a second signal."""
        for supervisor in list(self._daemons):
            pid = supervisor.pid
            if pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

    # -- one connection -----------------------------------------------------------------------

    async def _attempt(self) -> None:
        """One connection from dial to teardown; :meth:`stop` aborts it while not connected."""
        session = asyncio.ensure_future(self._session())
        stopped = asyncio.ensure_future(self._stopping.wait())
        try:
            await asyncio.wait({session, stopped}, return_when=asyncio.FIRST_COMPLETED)
            if not session.done() and not self._connected.is_set():
                session.cancel()  # still dialing or in the hello: nothing to drain
            await asyncio.wait({session})
        finally:
            stopped.cancel()
            if not session.done():  # run() itself was cancelled: still tear down
                session.cancel()
                await asyncio.wait({session})
        if not session.cancelled() and (exc := session.exception()) is not None:
            raise exc

    async def _session(self) -> None:
        ws = await self._dial()
        channel = self._channel_over(ws, f"coordinator {self.url}", self._dispatch)
        self._channel = channel
        self._session_over = asyncio.Event()
        reader: asyncio.Task[None] | None = None
        reason = "handshake failed"
        try:
            welcome = await self._handshake(channel)
            # -- serve
            self._backoff.reset()
            if welcome.worker_id is not None:
                self._worker_id = welcome.worker_id
            interval = self.heartbeat_interval_override or welcome.heartbeat_interval
            self._accepting = not self._stopping.is_set()
            self._connected.set()
            self._prewarm()
            log.info(
                "connected to %s as worker %s (%s; heartbeat every %.3gs)",
                self.url,
                self._worker_id,
                welcome.server,
                interval,
            )
            reader = asyncio.ensure_future(channel.run())
            reason = await self._serve(channel, ws, reader, interval, welcome.heartbeat_timeout)
        finally:
            # -- teardown: daemons first, so that the calls they fail can still be answered
            was_connected = self._connected.is_set()
            self._accepting = False
            self._connected.clear()
            await self._close_spare()
            await self._close_jobs()
            await self._wait_idle()
            code = 1001 if self._stopping.is_set() else 1000
            await channel.close(code, _close_reason(reason))
            if reader is not None:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(reader, self.close_timeout)
            await self._close_jobs()  # one that opened while the connection closed
            self._mailbox.clear()
            await self._links.close()
            self._channel = None
            if was_connected:
                log.info("disconnected from %s: %s", self.url, reason)

    async def _dial(self) -> ClientConnection:
        headers = {"Authorization": f"Bearer {self._token}"} if self._token else None
        try:
            return await connect(
                self.url,
                **_tls(self.url, self._ssl),
                additional_headers=headers,
                **self._ws_options(),
            )
        except InvalidStatus as exc:
            status = exc.response.status_code
            if status in _FATAL_HTTP_STATUSES:
                raise RegistrationRefused(
                    ErrorInfo(
                        code=ErrorCode.UNAUTHORIZED,
                        message=f"the coordinator refused the connection with HTTP {status}"
                        + (" (no token given)" if self._token is None else " (check the token)"),
                        detail={"status": status},
                    )
                ) from exc
            raise

    async def _handshake(self, channel: Channel) -> Welcome:
        assert self._capabilities is not None
        hello = WorkerHello(
            id=channel.next_id(),
            worker_id=self._worker_id,
            tags=self.tags,
            capabilities=self._capabilities,
            peer_address=self._peer_address,
            datasets=self._dataset_rows,
        )
        async with asyncio.timeout(self.open_timeout):
            await channel.send(hello)
            reply = await channel.receive()
        if isinstance(reply, Welcome):
            return reply
        if isinstance(reply, Error):
            if reply.error.code in FATAL_CODES:
                raise RegistrationRefused(reply.error)
            raise HandshakeFailed(
                f"the coordinator refused the hello: {reply.error.code}: {reply.error.message}"
            )
        raise HandshakeFailed(f"the coordinator answered the hello with {reply.kind!r}")

    async def _serve(
        self,
        channel: Channel,
        ws: ClientConnection,
        reader: asyncio.Task[None],
        interval: float,
        heartbeat_timeout: float,
    ) -> str:
        """Wait until the connection ends, and say why."""
        beats = asyncio.ensure_future(self._heartbeat(channel, interval, heartbeat_timeout))
        link = asyncio.ensure_future(self._watch_link(ws, interval, heartbeat_timeout))
        stopped = asyncio.ensure_future(self._stopping.wait())
        over = asyncio.ensure_future(self._session_over.wait())
        ours = (beats, link, stopped, over)
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
            return f"the coordinator is shutting down ({self._shutdown_reason})"
        if link.done() and not link.cancelled() and isinstance(link.exception(), LinkDead):
            return str(link.exception())
        if beats.done() and not beats.cancelled() and (exc := beats.exception()) is not None:
            if isinstance(exc, TimeoutError):
                return f"a heartbeat could not be sent within {heartbeat_timeout}s"
            return f"a heartbeat could not be sent: {_describe(exc)}"
        return f"connection lost ({channel.close_reason or 'closed'})"

    async def _watch_link(self, ws: ClientConnection, interval: float, timeout: float) -> None:  # noqa: ASYNC109
        """Ping the coordinator every ``interval`` seconds; raise :class:`LinkDead` once no pong
        has come for ``timeout`` seconds.

        Heartbeats go one way, and a cut link fails no send until the kernel's buffers fill:
        with nothing to wait for, an agent would sit on a dead connection for as long as TCP
        retries (many minutes). A pong is the answer to wait for — any pong, since one
        acknowledges every ping before it (RFC 6455 §5.5.3) — under the coordinator's own
        contract: silent for longer than the heartbeat timeout is gone.
        """
        loop = asyncio.get_running_loop()
        interval = max(interval, 0.01)
        answered = loop.time()

        def on_pong(waiter: asyncio.Future[float]) -> None:
            nonlocal answered
            # exception() also marks a ping failed by the connection's end as retrieved.
            if not waiter.cancelled() and waiter.exception() is None:
                answered = loop.time()

        while True:
            silent = loop.time() - answered
            if silent > timeout:
                dead = LinkDead(
                    f"the coordinator answered no ping for {silent:.1f}s (timeout {timeout}s)"
                )
                log.warning("giving up the connection to %s: %s", self.url, dead)
                raise dead
            try:
                async with asyncio.timeout(timeout):
                    waiter = await ws.ping()
            except TimeoutError:
                raise LinkDead(f"a ping could not be sent within {timeout}s") from None
            asyncio.ensure_future(waiter).add_done_callback(on_pong)  # a future already
            await asyncio.sleep(interval)

    async def _heartbeat(self, channel: Channel, interval: float, timeout: float) -> None:  # noqa: ASYNC109
        """Send a heartbeat every ``interval`` seconds; raise when one cannot go out in time."""
        loop = asyncio.get_running_loop()
        interval = max(interval, 0.01)  # a zero interval from a misconfigured peer: no busy loop
        due = loop.time()
        while True:
            beat = Heartbeat(id=channel.next_id(), sent_at=time.time(), job_id=self._current_job())
            async with asyncio.timeout(timeout):
                await channel.send(beat)
            # A fixed schedule rather than sleep(interval) after each send: no drift; and no burst
            # to catch up after a late beat.
            due = max(due + interval, loop.time())
            await asyncio.sleep(due - loop.time())

    def _current_job(self) -> str | None:
        """The job to name in heartbeats: the newest with a call running, else the newest open."""
        jobs = list(reversed(self._jobs.values()))
        busy = [job for job in jobs if job.calls]
        return (busy or jobs)[0].job_id if jobs else None

    # -- dispatch -----------------------------------------------------------------------------

    async def _dispatch(self, message: Any) -> BaseModel | None:
        handler = self._handlers.get(message.kind)
        if handler is None:
            raise RemoteError(
                ErrorInfo(
                    code=ErrorCode.BAD_REQUEST,
                    message=f"worker {self._worker_id} takes no {message.kind!r} "
                    f"(it takes {sorted(self._handlers)})",
                )
            )
        # Counted so the teardown can let in-flight handlers send their replies first.
        self._handling += 1
        self._idle.clear()
        try:
            return await handler(message)
        finally:
            self._handling -= 1
            if self._handling == 0:
                self._idle.set()

    async def on_open_job(self, message: OpenJob) -> Ack:
        """Start a daemon for the job (replacing one of the same id) and load its filters."""
        self._refuse_unless_accepting(message.job_id)
        while (previous := self._jobs.pop(message.job_id, None)) is not None:
            log.info("job %s: opened again; closing its previous daemon", message.job_id)
            await self._close_job(previous)
        self._refuse_unless_accepting(message.job_id)  # stop() may have come meanwhile
        supervisor = await self._take_spare(message.threads)
        fresh = supervisor is None
        if supervisor is None:
            supervisor = self._new_supervisor(message.threads)
        self._prewarm()
        job = _Job(message.job_id, supervisor)
        job.opening = _owned_task(self._open(job, message.filters, start=fresh))
        self._jobs[job.job_id] = job
        try:
            # Shielded: the job owns the opening (see _close_job), this handler only waits.
            await asyncio.shield(job.opening)
        except asyncio.CancelledError:
            if not job.opening.cancelled() or _cancelling():
                raise
            raise RemoteError(
                self._job_info(job, ErrorCode.CANCELLED, "closed while opening")
            ) from None
        except DaemonError as exc:
            if self._jobs.get(job.job_id) is job:
                del self._jobs[job.job_id]
            await self._close_supervisor(supervisor)
            raise self._job_error(job, "open_job", exc) from exc
        log.info(
            "job %s: opened (daemon pid %s, %d filters, %d threads)",
            job.job_id,
            supervisor.pid,
            len(message.filters),
            supervisor.threads,
        )
        return Ack()

    async def on_call(self, message: Call) -> Result:
        """Forward one daemon command of the job and return its result (sequenced calls wait
        for their turn, see :class:`~worker.peer.CallOrder`)."""
        job = self._jobs.get(message.job_id)
        if job is not None and job.opening is not None and not job.opening.done():
            # Normally the coordinator waits for open_job's ack; if not, wait for the daemon
            # rather than fail with "not running". asyncio.wait never cancels the opening.
            await asyncio.wait({job.opening})
            job = self._jobs.get(message.job_id)
        if job is None:
            raise RemoteError(self._unknown_job(message.job_id))
        cmd = str(message.request.get("cmd"))
        timeout = self.call_timeout if message.timeout is None else message.timeout
        if message.seq is None:
            result = await self._run_call(job, message, cmd, timeout)
        else:
            try:
                async with job.order.turn(message.seq, cmd, timeout):
                    result = await self._run_call(job, message, cmd, timeout)
            except OutOfOrder as exc:
                raise RemoteError(
                    self._job_info(job, ErrorCode.CANCELLED, str(exc), cmd=cmd)
                ) from None
        if message.output_to is not None:
            return await self._deliver_output(
                job, message.output_to.worker, message.output_to.key, result
            )
        return Result(result=result)

    async def _run_call(self, job: _Job, message: Call, cmd: str, timeout: float) -> Any:  # noqa: ASYNC109
        """Take the call's input from the mailbox if it names one, then run it on the daemon."""
        request = message.request
        if message.input_from is not None:
            payload = await self._take_input(job, message.input_from, timeout, cmd)
            # A bytearray: the tensors decode zero-copy over it and stay writable.
            request = {**request, message.input_field: decode(bytearray(payload))}
        task = _owned_task(job.supervisor.request(request, timeout))
        job.calls.add(task)
        task.add_done_callback(job.calls.discard)
        try:
            # Shielded: close_job cancels the task itself (which kills the daemon), and a
            # cancelled handler (the connection went) leaves it to the teardown.
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if not task.cancelled() or _cancelling():
                raise
            raise RemoteError(
                self._job_info(job, ErrorCode.CANCELLED, f"closed while running {cmd}", cmd=cmd)
            ) from None
        except DaemonError as exc:
            raise self._job_error(job, cmd, exc) from exc

    async def _take_input(self, job: _Job, key: str, timeout: float, cmd: str) -> bytes:  # noqa: ASYNC109
        try:
            return await self._mailbox.take(job.job_id, key, timeout)
        except TimeoutError:
            raise RemoteError(
                self._job_info(
                    job, ErrorCode.TIMEOUT, f"waiting {timeout}s for input {key!r}", cmd=cmd
                )
            ) from None
        except MailboxDropped:
            raise RemoteError(
                self._job_info(job, ErrorCode.CANCELLED, f"closed while waiting for {key!r}")
            ) from None

    async def _deliver_output(self, job: _Job, to: str, key: str, result: Any) -> Result:
        """Send a call's result to worker ``to``'s mailbox: directly, else through the
        coordinator (which relays it)."""
        payload = encode_frame(result)
        deliver = Deliver(job_id=job.job_id, to=to, key=key, payload=payload)
        if not await self._links.send(to, deliver):
            channel = self._channel
            if channel is None:
                raise RemoteError(
                    self._job_info(job, ErrorCode.WORKER_LOST, f"unable to deliver {key!r}")
                )
            await channel.send(deliver.model_copy(update={"id": channel.next_id()}))
        return Result(result={"delivered": len(payload)})

    async def on_links(self, message: Links) -> Result:
        """Open direct links to the job's peers that have an address; say which work."""
        direct: list[str] = []
        relay: list[str] = []
        for worker_id, address in message.peers.items():
            if address is not None and await self._links.connect(worker_id, address):
                direct.append(worker_id)
            else:
                relay.append(worker_id)
        log.info("job %s: direct links %s, relayed %s", message.job_id, direct, relay)
        return Result(result={"direct": direct, "relay": relay})

    async def on_deliver(self, message: Deliver) -> Ack:
        """A tensor relayed by the coordinator: into the mailbox."""
        return self._put(message)

    def _put(self, message: Deliver) -> Ack:
        """Into the mailbox, if its job is open here: a delivery for another job (unknown, or
        closed already) would sit there forever."""
        if message.job_id not in self._jobs:
            raise RemoteError(self._unknown_job(message.job_id))
        try:
            self._mailbox.put(message.job_id, message.key, message.payload)
        except MailboxFull as exc:
            raise RemoteError(ErrorInfo(code=ErrorCode.BUSY, message=str(exc))) from None
        return Ack()

    # -- the peer endpoint --------------------------------------------------------------------

    def _ws_options(self) -> dict[str, Any]:
        """The websockets settings of both of this agent's endpoints (the coordinator link and
        ``/peer``): larger frames arrive as chunk messages of CHUNK_BYTES (plus their header)."""
        return {
            "compression": None,
            "max_size": 4 * CHUNK_BYTES,
            "open_timeout": self.open_timeout,
            "ping_interval": self.ping_interval,
            "ping_timeout": self.ping_timeout,
            "close_timeout": self.close_timeout,
        }

    async def _start_peer_server(self, listen: str) -> None:
        host, port = _split_host_port(listen)
        self._peer_server = await serve(
            self._peer_connection,
            host or None,
            port,
            **self._ws_options(),
        )
        bound = next(iter(self._peer_server.sockets)).getsockname()[1]
        shown = "127.0.0.1" if host in ("", "0.0.0.0", "::") else host
        shown = f"[{shown}]" if ":" in shown else shown
        self._peer_address = f"ws://{shown}:{bound}"
        if self.peer_advertise is not None:
            self._peer_address = f"ws://{self.peer_advertise}"
        log.info("serving peer links on %s (announced as %s)", listen, self._peer_address)

    async def _stop_peer_server(self) -> None:
        server, self._peer_server = self._peer_server, None
        self._peer_address = None
        if server is not None:
            server.close()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.close_timeout):
                    await server.wait_closed()

    async def _peer_connection(self, ws: ServerConnection) -> None:
        """One incoming peer link: ``PeerHello`` (answered by ``Ack``), then ``Deliver``s.

        The same limits as on the coordinator's link: ``open_timeout`` for the upgrade and
        again for the hello, ``max_message_bytes`` and ``max_inflight``.
        """
        if ws.request is None or ws.request.path != "/peer":
            with contextlib.suppress(Exception):
                async with asyncio.timeout(self.close_timeout):
                    await ws.close(1008, "not found: peer links are at /peer")
            return
        channel = self._channel_over(ws, "peer (incoming)", self._on_peer_message)
        try:
            await self._serve_peer(channel)
        except (ConnectionClosed, ProtocolError, TimeoutError) as exc:  # gone, or not reading
            log.info("peer link closed: %s", exc)
        finally:
            await channel.close(1000, "peer link over")

    async def _serve_peer(self, channel: Channel) -> None:
        try:
            async with asyncio.timeout(self.open_timeout):
                hello = await channel.receive(first=True)
        except (TimeoutError, ProtocolError) as exc:
            log.info("peer link refused: %s", exc)
            await channel.close(1008, f"expected a peer_hello: {exc}")
            return
        if not isinstance(hello, PeerHello):
            info = ErrorInfo(
                code=ErrorCode.BAD_REQUEST,
                message=f"a peer link starts with peer_hello, not {hello.kind!r}",
            )
            async with asyncio.timeout(self.close_timeout):
                await channel.send(Error(id=channel.next_id(), reply_to=hello.id, error=info))
            await channel.close(1008, "expected a peer_hello")
            return
        async with asyncio.timeout(self.close_timeout):
            await channel.reply(hello, Ack())
        log.info("peer link from worker %s", hello.worker_id)
        await channel.run()

    def _channel_over(self, ws: Any, name: str, handler: Handler) -> Channel:
        """A channel with this agent's limits."""
        return Channel(ws, name, handler, self.max_message_bytes, self.max_inflight)

    async def _on_peer_message(self, message: Any) -> Ack:
        if not isinstance(message, Deliver):
            raise RemoteError(
                ErrorInfo(
                    code=ErrorCode.BAD_REQUEST,
                    message=f"a peer link carries deliver messages, not {message.kind!r}",
                )
            )
        return self._put(message)

    async def on_close_job(self, message: CloseJob) -> Ack:
        """Close the job's daemon (cancelling a running call); an unknown job is already closed."""
        job = self._jobs.pop(message.job_id, None)
        if job is not None:
            await self._close_job(job)
            log.info("job %s: closed", job.job_id)
        return Ack()

    async def on_shutdown(self, message: Shutdown) -> None:
        """The coordinator is going away: end this connection (and reconnect)."""
        log.info("the coordinator is shutting down: %s", message.reason)
        self._shutdown_reason = message.reason
        self._session_over.set()

    # -- jobs ---------------------------------------------------------------------------------

    async def _open(self, job: _Job, filters: dict[str, bytes], start: bool) -> None:
        if start:
            await job.supervisor.start()
        await job.supervisor.request({"cmd": "load", "filters": filters})

    # -- the spare daemon ---------------------------------------------------------------------

    def _new_supervisor(self, threads: int | None) -> DaemonSupervisor:
        supervisor = DaemonSupervisor(
            python=self.python,
            threads=threads or self.threads,
            env=dataset_environment(self.datasets),
            default_timeout=self.startup_timeout,
        )
        self._daemons.add(supervisor)
        return supervisor

    def _prewarm(self) -> None:
        """Start the next job's daemon now, off the critical path of its ``open_job``."""
        if not self.spare or self._spare is not None or not self._accepting:
            return
        supervisor = self._new_supervisor(None)

        async def start() -> DaemonSupervisor:
            await supervisor.start()
            return supervisor

        self._spare = _owned_task(start())

    async def _take_spare(self, threads: int | None) -> DaemonSupervisor | None:
        """The warm daemon when it has the thread count asked for and came up; else ``None``."""
        task = self._spare
        if task is None or (threads or self.threads) != self.threads:
            return None
        self._spare = None
        try:
            supervisor = await asyncio.shield(task)
        except DaemonError as exc:
            log.warning("the spare filter daemon failed to start: %s", exc)
            return None
        if not supervisor.running:
            await self._close_supervisor(supervisor)
            return None
        return supervisor

    async def _close_spare(self) -> None:
        task, self._spare = self._spare, None
        if task is None:
            return
        try:
            supervisor = await asyncio.shield(task)
        except (DaemonError, asyncio.CancelledError):
            return
        await self._close_supervisor(supervisor)

    async def on_probe(self, message: Probe) -> Result:
        """Ping the spare daemon: the no-op round trip through coordinator, agent and daemon."""
        self._prewarm()
        if self._spare is None:
            raise RemoteError(
                ErrorInfo(
                    code=ErrorCode.BAD_REQUEST,
                    message=f"worker {self._worker_id} keeps no spare daemon to probe",
                )
            )
        spare = self._spare
        try:
            supervisor = await asyncio.shield(spare)
            await supervisor.request({"cmd": "ping"}, self.startup_timeout)
        except DaemonError as exc:
            if self._spare is spare:  # it is broken: the next probe or job starts another
                self._spare = None
                with contextlib.suppress(DaemonError):
                    await self._close_supervisor(await asyncio.shield(spare))
            raise RemoteError(exc.info()) from exc
        return Result(result={"worker_id": self._worker_id, "daemon_pid": supervisor.pid})

    async def _close_job(self, job: _Job) -> None:
        self._mailbox.drop(job.job_id)
        for task in list(job.calls):
            task.cancel()  # the supervisor kills a daemon whose request is cancelled
        opening = job.opening
        # Cancelling while the process is being spawned would lose it (the fork finishes in an
        # executor thread nobody waits on): wait for the pid, then cancel the ping/load, which
        # kills it.
        while opening is not None and not opening.done():
            if job.supervisor.pid is not None:
                opening.cancel()
            await asyncio.wait({opening}, timeout=0.02)
        await self._close_supervisor(job.supervisor)

    async def _close_supervisor(self, supervisor: DaemonSupervisor) -> None:
        try:
            await supervisor.close(self.close_timeout)
        finally:
            self._daemons.discard(supervisor)

    async def _close_jobs(self) -> None:
        jobs = list(self._jobs.values())
        self._jobs.clear()
        if jobs:
            await asyncio.gather(*(self._close_job(job) for job in jobs))
            log.info("closed %d job(s): %s", len(jobs), ", ".join(job.job_id for job in jobs))

    async def _wait_idle(self) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.close_timeout):
                await self._idle.wait()

    def _refuse_unless_accepting(self, job_id: str) -> None:
        if not self._accepting:
            raise RemoteError(
                ErrorInfo(
                    code=ErrorCode.SHUTTING_DOWN,
                    message=f"worker {self._worker_id} is shutting down: job {job_id!r} refused",
                    detail={"worker_id": self._worker_id, "job_id": job_id},
                )
            )

    # -- errors -------------------------------------------------------------------------------

    def _unknown_job(self, job_id: str) -> ErrorInfo:
        open_jobs = sorted(self._jobs)
        return ErrorInfo(
            code=ErrorCode.UNKNOWN_JOB,
            message=f"worker {self._worker_id} has no open job {job_id!r} (open: {open_jobs})",
            detail={"worker_id": self._worker_id, "job_id": job_id, "open_jobs": open_jobs},
        )

    def _job_info(self, job: _Job, code: ErrorCode, what: str, **detail: Any) -> ErrorInfo:
        log.warning("job %s: %s", job.job_id, what)
        return ErrorInfo(
            code=code,
            message=f"job {job.job_id!r} on worker {self._worker_id} was {what}",
            detail={**detail, "worker_id": self._worker_id, "job_id": job.job_id},
        )

    def _job_error(self, job: _Job, cmd: str, exc: DaemonError) -> RemoteError:
        """A daemon error as the reply: its own code, message and detail, plus where."""
        info = exc.info()
        first_line = info.message.splitlines()[0] if info.message else ""
        log.warning("job %s: %s failed: %s: %s", job.job_id, cmd, info.code, first_line)
        detail = {**info.detail, "worker_id": self._worker_id, "job_id": job.job_id}
        return RemoteError(info.model_copy(update={"detail": detail}))


def _owned_task(coro: Awaitable[Any]) -> asyncio.Task[Any]:
    """A task whose failure is read even when its waiter went away (no "never retrieved")."""
    task: asyncio.Task[Any] = asyncio.ensure_future(coro)
    task.add_done_callback(lambda t: t.cancelled() or t.exception())
    return task


def _cancelling() -> bool:
    """True when the current task itself is being cancelled (not merely what it awaited)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def _split_host_port(listen: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` too) → ``(host, port)``.

    Raises:
        ValueError: no port, or one that is not a number in 0..65535.
    """
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"not HOST:PORT: {listen!r}")
    return host.strip("[]"), int(port)


def _close_reason(reason: str) -> str:
    """``reason`` cut to what a WebSocket close frame carries (RFC 6455 §5.5: 123 bytes)."""
    return reason.encode()[:123].decode(errors="ignore")


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _tls(url: str, context: ssl.SSLContext | None) -> dict[str, Any]:
    """``ssl=`` for :func:`websockets.connect`: a custom context for ``wss://`` only (the
    system's trust store otherwise)."""
    return {"ssl": context} if context is not None and url.startswith("wss:") else {}
