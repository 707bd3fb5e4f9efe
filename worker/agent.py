"""The worker agent: one WebSocket to the coordinator, one filter daemon per open job.

The agent dials out (so it works behind NAT), registers, heartbeats, and runs what the
coordinator asks for in filter daemons (:class:`~worker.supervision.supervisor.DaemonSupervisor`).
The conversation itself is
:class:`~protocol.asyncio.channel.Channel`'s; :class:`Agent` composes the rooms
that do the rest:

* :mod:`worker.config`: :class:`AgentConfig`, every setting, built by :mod:`worker.cli`;
* :mod:`worker.lifecycle`: where the agent is (connecting, registered, draining, ...), no I/O;
* :mod:`worker.link`: the steps of one connection (dial, hello, heartbeats, ping watch, backoff);
* :mod:`worker.job_handlers`: the jobs' requests and the mailbox input/output of calls;
* :mod:`worker.supervision.pool`: the daemons, and the spare one kept warm;
* :mod:`worker.peer_server` and :mod:`worker.peer`: the ``/peer`` endpoint and the outgoing links.

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
  ``close_job``, ``links``, ``deliver``, ``probe``, ``read_kept``, ``drop_kept``,
  ``shutdown``); each runs in a task of the channel's, so a long ``call`` never holds up
  another job, a reply or a heartbeat. Heartbeats
  go out every ``heartbeat_interval`` from their own task; daemon I/O never blocks the loop (see
  :mod:`worker.supervision.supervisor`), so they keep flowing while a filter computes.
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
  :meth:`Agent.stop`): every daemon is closed first — a running call is cancelled, which kills
  its daemon, and its error reply still goes out if the connection is up — then the connection
  is closed. The coordinator fails the
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
import ssl
import tempfile
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from websockets.asyncio.client import ClientConnection

from engine.data.datasets import summaries
from protocol.asyncio.channel import Channel
from protocol.asyncio.landing import Landing
from protocol.asyncio.websocket import close_reason, tls_hint
from protocol.errors import ErrorCode, RequestRefused
from protocol.messages import Shutdown, WorkerHello
from protocol.security.identity_proof import CHALLENGE_HEADER, prove, public_key
from worker.capabilities import detect
from worker.config import AgentConfig, worker_url
from worker.errors import (
    AgentError,
    HandshakeFailed,
    LinkDead,
    RegistrationRefused,
    UntrustedCoordinator,
)
from worker.job_handlers import JobHandlers
from worker.kept_files import KeptFiles
from worker.lifecycle import Lifecycle, Phase
from worker.link import (
    FATAL_CODES,
    RETRYABLE,
    Backoff,
    Handler,
    channel_over,
    describe,
    dial,
    handshake,
    serve,
)
from worker.peer import Mailbox, PeerLinks
from worker.peer_server import PeerServer
from worker.supervision.pool import DaemonPool
from worker.supervision.supervisor import DaemonSupervisor

__all__ = [
    "FATAL_CODES",
    "Agent",
    "AgentConfig",
    "AgentError",
    "Backoff",
    "HandshakeFailed",
    "LinkDead",
    "RegistrationRefused",
    "worker_url",
]

log = logging.getLogger(__name__)


class Agent:
    """Connects to a coordinator and runs its jobs' filters in daemons, until :meth:`stop`.

    A composition: :class:`~worker.lifecycle.Lifecycle` says where it is, :mod:`worker.link`
    runs each connection's steps, :class:`~worker.job_handlers.JobHandlers` answers the jobs'
    requests, :class:`~worker.supervision.pool.DaemonPool` holds the daemons and
    :class:`~worker.peer_server.PeerServer` the ``/peer`` endpoint.

    Args:
        config: what to connect to, announce and allow (see :class:`AgentConfig`).
        backoff: reconnection delays (default: 0.1 s doubling to 5 s, full jitter).

    Raises:
        OSError: ``config.ca_file`` cannot be read.

    One :meth:`run` per agent: its events belong to the loop that runs it.
    """

    def __init__(self, config: AgentConfig, *, backoff: Backoff | None = None) -> None:
        self.config = config
        self.url = config.endpoint
        self._worker_id = config.worker_id
        self._capabilities = config.capabilities
        self._datasets = summaries(config.datasets)
        self._backoff = backoff or Backoff()
        # For wss://: the certificate(s) to trust (a coordinator's own CA); None: the system's.
        self._ssl = ssl.create_default_context(cafile=config.ca_file) if config.ca_file else None
        self._lifecycle = Lifecycle()
        self._connected = asyncio.Event()  # wake-ups for Lifecycle.connected and .stopping
        self._stopping = asyncio.Event()
        self._channel: Channel | None = None
        self._shutdown: asyncio.Future[str] | None = None  # the coordinator's shutdown reason
        self._handling = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._pool = DaemonPool(config, lambda: self._lifecycle.accepting)
        self._links = PeerLinks(
            lambda: self._worker_id,
            open_timeout=min(config.open_timeout, 3.0),
            max_message_bytes=config.max_message_bytes,
            tls=self._ssl,
        )
        self._kept = KeptFiles()
        # A job's filters, kept for as long as it lives (a daemon restart loads them again),
        # wait in an unnamed file's map, not in the agent's memory (protocol.asyncio.landing).
        self._landing = Landing(Path(tempfile.gettempdir()), 2 * config.max_message_bytes)
        self._jobs = JobHandlers(
            config,
            self._pool,
            self._links,
            self._lifecycle,
            worker_id=lambda: self._worker_id,
            coordinator=lambda: self._channel,
            kept=self._kept,
        )
        self._peer_server = None
        if config.peer_listen:
            self._peer_server = PeerServer(config, self._jobs.admit_peer, self._jobs.put)
        self._handlers: dict[str, Handler] = {
            "open_job": self._jobs.open_job,
            "call": self._jobs.call,
            "links": self._jobs.links,
            "deliver": self._jobs.deliver,
            "close_job": self._jobs.close_job,
            "probe": self._jobs.probe,
            "read_kept": self._jobs.read_kept,
            "drop_kept": self._jobs.drop_kept,
            "shutdown": self.on_shutdown,
        }

    # -- properties ---------------------------------------------------------------------------

    @property
    def worker_id(self) -> str | None:
        """The id asked for, then the one the coordinator gave (kept across reconnections)."""
        return self._worker_id

    @property
    def connected(self) -> asyncio.Event:
        """Set from the welcome until the connection's teardown (or :meth:`stop`) begins."""
        return self._connected

    @property
    def lifecycle(self) -> Lifecycle:
        """Where the agent is: connecting, registered, draining, ..."""
        return self._lifecycle

    @property
    def jobs(self) -> dict[str, DaemonSupervisor]:
        """The open jobs and their daemons (a snapshot)."""
        return {job_id: job.supervisor for job_id, job in self._jobs.jobs.items()}

    @property
    def peer_address(self) -> str | None:
        """``ws://HOST:PORT`` of the ``/peer`` endpoint while it listens, else ``None``."""
        return self._peer_server.address if self._peer_server is not None else None

    @property
    def mailbox(self) -> Mailbox:
        """Tensors delivered to this worker, until a call takes them."""
        return self._jobs.mailbox

    @property
    def stopping(self) -> bool:
        """True once :meth:`stop` was called."""
        return self._lifecycle.stopping

    # -- lifecycle ----------------------------------------------------------------------------

    async def run(self) -> None:
        """Connect, serve, and reconnect with backoff until :meth:`stop`.

        With ``reconnect=False`` it returns when the first connection (or attempt) ends.

        Raises:
            RegistrationRefused: the coordinator refused this worker for good (see
                :data:`FATAL_CODES`); retrying would not help.
            UntrustedCoordinator: its TLS certificate fails verification; nor would that.
        """
        if self._capabilities is None:
            # detect() may import torch (CUDA devices): keep it off the loop.
            loop = asyncio.get_running_loop()
            self._capabilities = await loop.run_in_executor(None, detect, self.config.device)
        sandbox = self.config.sandbox
        announced = {
            "sandbox": sandbox.level,
            "network": sandbox.network,
            "slots": self.config.slots,
        }
        self._capabilities = self._capabilities.model_copy(update=announced)
        if sandbox.level == "none":
            log.warning(
                "NO SANDBOX for job code (--sandbox none): %s. Install bubblewrap (apt-get "
                "install bubblewrap) for --sandbox auto to use it.",
                sandbox.describe(),
            )
        else:
            log.info("job code runs sandboxed: %s", sandbox.describe())
        log.info("filter daemons allocate with %s", self.config.daemon_malloc.describe())
        await asyncio.to_thread(self._pool.find_cgroups)
        self._pool.start_fork_server()
        if self._peer_server is not None:
            await self._peer_server.start()
        try:
            while not self._lifecycle.stopping:
                try:
                    await self._attempt()
                except RegistrationRefused as exc:
                    log.error("the coordinator at %s refused this worker: %s", self.url, exc)
                    raise
                except UntrustedCoordinator as exc:
                    log.error("cannot trust the coordinator at %s: %s", self.url, exc)
                    raise
                except RETRYABLE as exc:
                    hint = tls_hint(self.url, exc, self.config.ca_file, "--ca-file")
                    said = describe(exc) + (f"; {hint}" if hint else "")
                    log.warning("connection to %s failed: %s", self.url, said)
                except Exception:
                    log.exception("connection to %s failed unexpectedly", self.url)
                if not self.config.reconnect or self._lifecycle.stopping:
                    break
                delay = self._backoff.next_delay()
                log.info("reconnecting to %s in %.2fs", self.url, delay)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(delay):
                        await self._stopping.wait()
        finally:
            await self._jobs.close_all()  # a backstop: each connection's teardown already did it
            await self._links.close()
            if self._peer_server is not None:
                await self._peer_server.stop()
            await self._pool.close_fork_server()
            await asyncio.to_thread(self._pool.release)
            await asyncio.to_thread(self.config.sandbox.close)
            await asyncio.to_thread(self._kept.close)
            self._lifecycle.finish()
            self._sync()

    def stop(self) -> None:
        """Stop accepting work, close the daemons and the connection; :meth:`run` then returns.

        Safe to call from a signal handler installed with ``loop.add_signal_handler``.
        """
        self._lifecycle.stop()
        self._sync()
        self._stopping.set()

    def kill_daemons(self) -> None:
        """SIGKILL every daemon now, without waiting: the forced exit of a second signal."""
        self._pool.kill_all()

    def _sync(self) -> None:
        """Mirror the lifecycle's ``connected`` in the event callers wait on."""
        if self._lifecycle.connected:
            self._connected.set()
        else:
            self._connected.clear()

    # -- one connection -----------------------------------------------------------------------

    async def _attempt(self) -> None:
        """One connection from dial to teardown; :meth:`stop` aborts it while not connected."""
        session = asyncio.ensure_future(self._session())
        stopped = asyncio.ensure_future(self._stopping.wait())
        try:
            await asyncio.wait({session, stopped}, return_when=asyncio.FIRST_COMPLETED)
            if not session.done() and self._lifecycle.phase is not Phase.DRAINING:
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
        self._lifecycle.dial()
        try:
            ws = await dial(self.config, self._ssl)
            await self._connection(ws)
        finally:
            self._lifecycle.disconnected()
            self._sync()

    async def _connection(self, ws: ClientConnection) -> None:
        """Hello, serve, teardown: one connection's life once the WebSocket is open."""
        name = f"coordinator {self.url}"
        channel = channel_over(ws, name, self._dispatch, self.config, buffer_for=self._landing)
        self._channel = channel
        shutdown: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._shutdown = shutdown
        reader: asyncio.Task[None] | None = None
        reason = "handshake failed"
        welcomed = False
        try:
            issued = ws.response.headers.get(CHALLENGE_HEADER) if ws.response else None
            hello = self._hello(channel, issued)
            welcome = await handshake(channel, hello, self.config.open_timeout)
            # -- serve
            self._backoff.reset()
            if welcome.worker_id is not None:
                self._worker_id = welcome.worker_id
            interval = self.config.heartbeat_interval_override or welcome.heartbeat_interval
            self._lifecycle.welcome()
            self._sync()
            welcomed = True
            self._pool.prewarm()
            log.info(
                "connected to %s as worker %s (%s; heartbeat every %.3gs)",
                self.url,
                self._worker_id,
                welcome.server,
                interval,
            )
            reader = asyncio.ensure_future(channel.run())
            reason = await serve(
                channel,
                ws,
                reader,
                interval,
                welcome.heartbeat_timeout,
                url=self.url,
                current_job=self._jobs.current_job,
                stopping=self._stopping,
                shutdown=shutdown,
            )
        finally:
            await self._teardown(channel, reader, reason, welcomed)

    async def _teardown(
        self, channel: Channel, reader: asyncio.Task[None] | None, reason: str, welcomed: bool
    ) -> None:
        """Daemons first, so that the calls they fail can still be answered; then the socket."""
        self._lifecycle.drain()
        self._sync()
        await self._pool.close_spare()
        await self._jobs.close_all()
        await self._wait_idle()
        code = 1001 if self._lifecycle.stopping else 1000
        await channel.close(code, close_reason(reason))
        if reader is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(reader, self.config.close_timeout)
        await self._jobs.close_all()  # one that opened while the connection closed
        self._jobs.mailbox.clear()
        await self._links.close()
        self._channel = None
        if welcomed:
            log.info("disconnected from %s: %s", self.url, reason)

    def _hello(self, channel: Channel, issued: str | None) -> WorkerHello:
        """This agent's hello; with an id its operator chose, its public identity key and its
        proof of it for the coordinator's challenge ``issued``
        (:mod:`protocol.security.identity_proof`): the key itself never leaves the agent. (An id the
        coordinator assigned may be handed to another agent after a coordinator restart: it is bound
        to no key.)"""
        assert self._capabilities is not None
        secret, worker_id = self.config.identity_key, self.config.worker_id
        proven = secret is not None and worker_id is not None
        return WorkerHello(
            id=channel.next_id(),
            worker_id=self._worker_id,
            tags=list(self.config.tags),
            capabilities=self._capabilities,
            peer_address=self.peer_address,
            datasets=self._datasets,
            public_key=public_key(secret) if proven and secret is not None else None,
            proof=(
                prove(secret, issued, worker_id)
                if proven and secret is not None and worker_id is not None and issued
                else None
            ),
        )

    async def _wait_idle(self) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.config.close_timeout):
                await self._idle.wait()

    # -- dispatch -----------------------------------------------------------------------------

    async def _dispatch(self, message: Any) -> BaseModel | None:
        handler = self._handlers.get(message.kind)
        if handler is None:
            raise RequestRefused.of(
                ErrorCode.BAD_REQUEST,
                f"worker {self._worker_id} takes no {message.kind!r} "
                f"(it takes {sorted(self._handlers)})",
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

    async def on_shutdown(self, message: Shutdown) -> None:
        """The coordinator is going away: end this connection (and reconnect)."""
        log.info("the coordinator is shutting down: %s", message.reason)
        if self._shutdown is not None and not self._shutdown.done():
            self._shutdown.set_result(message.reason)
