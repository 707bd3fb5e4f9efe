"""The coordinator daemon: one port for workers, clients, health and metrics.

* ``ws://HOST:PORT/worker`` — worker agents (:class:`~protocol.messages.WorkerHello` first);
* ``ws://HOST:PORT/client`` — clients (:class:`~protocol.messages.ClientHello` first);
* ``GET /healthz``, ``GET /metrics``, ``GET /`` and ``GET /api/status``: see
  :mod:`coordinator.server.http`, which also checks each upgrade's token.

:class:`Coordinator` takes its settings whole
(:class:`~coordinator.server.config.CoordinatorConfig`, built by :mod:`coordinator.cli`) and
makes its collaborators: the workers (:class:`~coordinator.workers.registry.Registry`), the jobs
(:class:`~coordinator.jobs.manager.JobManager`, over the store it opens at
:meth:`Coordinator.start`), the HTTP side (:class:`~coordinator.server.http.HttpEndpoints`) and
the workers' sessions (:class:`~coordinator.server.worker_sessions.WorkerSessions`) and the
clients' requests (:class:`~coordinator.server.client_requests.ClientRequests`), each given what
it uses. Here each connection is read up to its hello and routed: a ``/worker`` one to its
session (:mod:`coordinator.server.worker_sessions`: its identity key checked, its record attached
in the registry, its heartbeats and relayed tensors served), a ``/client`` one to the clients'
requests.

Limits (each breach is a typed error reply or a refusal with its reason, never a stuck loop or
an unbounded buffer): a connection is *pending* from its TCP accept until its hello is read; it
has ``handshake_timeout`` for the upgrade and the hello together (a half-sent HTTP request is
dropped then), and beyond ``max_pending_connections`` pending upgrades whose token was checked
a new one is answered ``503`` before any message is read (sockets without a valid upgrade are
not counted: they lock nobody out); beyond ``max_pending_per_address`` pending sockets from one
IP address a new one from it is closed at its accept (:mod:`coordinator.server.pending`). One
WebSocket message holds at most :data:`WS_MAX_SIZE` bytes (more: closed with 1009), one message
reassembled from chunks at most ``max_message_bytes`` (more: ``too_large``, refused from its
first chunk), and each connection handles at most ``max_inflight`` requests at once (more:
``busy``); see
:class:`~protocol.asyncio.channel.Channel`. A client's chunked message of 32 MiB or more (a
submit's model and data) is reassembled in a file's map, not in memory
(:mod:`protocol.asyncio.landing`).

Lifecycle (one shape for every daemon here): :meth:`Coordinator.start` opens the store (failing
jobs a previous process left running), the server and the background tasks; :meth:`serve_forever`
waits; :meth:`stop` drains — it stops accepting jobs, gives running jobs a grace period, fails what
is left with the reason, tells workers it is going, closes connections and the store.

This module, :mod:`coordinator.server.http` and :mod:`coordinator.server.worker_sessions` (whose
challenge a ``/worker`` upgrade's answer carries) are the only ones of the coordinator that import
``websockets``; the rest sees :class:`~protocol.asyncio.channel.Channel` objects.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import resource
from typing import Any

from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.exceptions import ConnectionClosed

from coordinator.jobs.files import JobFiles
from coordinator.jobs.manager import JobManager, Sharing
from coordinator.server.client_requests import ClientRequests
from coordinator.server.clients import ConnectedClients
from coordinator.server.config import SERVER, CoordinatorConfig
from coordinator.server.http import HttpEndpoints
from coordinator.server.metrics import Metrics
from coordinator.server.pending import PendingConnections
from coordinator.server.reassembly_shares import ReassemblyShares
from coordinator.server.worker_sessions import WorkerSessions
from coordinator.storage.disk import private_directory
from coordinator.storage.kept_files import piece_bytes
from coordinator.storage.store import JobState, JobStore
from coordinator.workers.registry import Registry
from protocol.asyncio.channel import Channel
from protocol.asyncio.handshake import receive_hello, refuse_hello
from protocol.asyncio.landing import Landing
from protocol.asyncio.turns import TurnGate
from protocol.asyncio.websocket import WS_MAX_SIZE, ws_options
from protocol.chunking import frame_buffer
from protocol.errors import BadMessage, ChannelClosed, ErrorCode, UnexpectedHello, VersionMismatch
from protocol.messages import ClientHello, Shutdown, Welcome, WorkerHello

__all__ = ["WS_MAX_SIZE", "Coordinator", "connection_class_counted_in"]

log = logging.getLogger(__name__)

SENDS_PER_TURN = 32
"""Messages over 16 KiB the coordinator starts sending per turn of its event loop, over all its
connections (:class:`~protocol.asyncio.turns.TurnGate`): a round's model sent to 10,000 workers
goes out 32 at a time between reads of what they send (a few milliseconds each)."""

BULK_SENDS = 16
"""Chunked messages the coordinator writes at once over all its connections (see
:class:`~protocol.asyncio.channel.Channel`'s ``bulk_gate``): a 1 MB model sent to 1,000 workers
keeps ~16 MB in send buffers, not 1 GB, and heartbeats and pings do not wait behind all of it."""


class Coordinator:
    """The coordinator daemon, configured by ``config`` (see
    :class:`~coordinator.server.config.CoordinatorConfig`).

    Attributes:
        config: the settings it was made with.
        port: the port it listens on (the one the system chose for port 0, once started).
        registry: the workers.
        metrics: the counters of ``/metrics``.
        store, jobs: the job store and the job manager, from :meth:`start` on (``None``
            before).
    """

    def __init__(self, config: CoordinatorConfig) -> None:
        self.config = config
        self.port = config.port
        files = resource.getrlimit(resource.RLIMIT_NOFILE)[0]  # (raised to the hard, by the CLI)
        sockets = config.max_pending_sockets
        if files != resource.RLIM_INFINITY:
            sockets = max(1, min(sockets, files // 4))
        self.pending = PendingConnections(
            config.max_pending_connections, config.max_pending_per_address, sockets
        )
        """Connections between their accept and their hello (:mod:`coordinator.server.pending`)."""
        self.clients = ConnectedClients()
        """Who each ``/client`` connection is, from its token
        (:mod:`coordinator.server.clients`)."""
        pool = max(config.max_reassembly_bytes, config.max_message_bytes)
        share = config.max_client_reassembly_bytes or pool // 3
        largest = config.max_message_bytes
        self.reassembly = ReassemblyShares(pool, max(share, largest), largest)
        """The bytes of chunked messages in progress each side and each client may hold
        (:mod:`coordinator.server.reassembly_shares`)."""
        self.metrics = Metrics()
        self.registry = Registry(config.heartbeat_timeout)
        self.landing = Landing(config.state_dir / "incoming", self.reassembly.clients.limit)
        """Where clients' large messages are reassembled (:mod:`protocol.asyncio.landing`;
        its directory made private as the coordinator starts)."""
        self.store: JobStore | None = None
        self.jobs: JobManager | None = None
        self._http: HttpEndpoints | None = None
        self._worker_sessions: WorkerSessions | None = None
        self._client_requests: ClientRequests | None = None
        self._server: Server | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._channels: set[Channel] = set()
        self._bulk_gate = asyncio.Semaphore(BULK_SENDS)
        self._turns = TurnGate(SENDS_PER_TURN)
        self._stopped = asyncio.Event()

    # -- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        """Open the store, listen, start the scheduler and the heartbeat reaper."""
        config = self.config
        pieces = piece_bytes(config.max_reassembly_bytes)
        whole = self.reassembly.reply_share
        files = await asyncio.to_thread(JobFiles, config.state_dir, pieces, whole)
        await asyncio.to_thread(private_directory, self.landing.directory)
        resumable = await asyncio.to_thread(files.resumable)
        store, recovered = await asyncio.to_thread(
            JobStore.open, config.state_dir, resumable=resumable
        )
        self.store = store
        requeued = [r for r in recovered if r.state is JobState.QUEUED]
        for record in recovered:
            if record.state is JobState.QUEUED:
                log.warning("job %s was live when the coordinator stopped: queued again", record.id)
            else:
                log.warning(
                    "job %s was %s when the coordinator stopped: marked failed",
                    record.id,
                    record.error and record.error.get("detail", {}).get("state"),
                )
        await asyncio.to_thread(files.forget_others, [r.id for r in requeued])
        for worker_id in config.forget_workers:
            if await asyncio.to_thread(store.forget_worker, worker_id):
                log.warning("worker %s: identity forgotten; its next hello enrols again", worker_id)
            else:
                log.warning("worker %s: no identity to forget", worker_id)
        for worker_id, key in config.enrolled.items():
            if key is None:
                log.warning(
                    "worker %s is enrolled without a fingerprint: the first to register under "
                    "it with a key claims it (--enroll %s=FINGERPRINT binds its own)",
                    worker_id,
                    worker_id,
                )
            elif await asyncio.to_thread(store.bind, worker_id, key):
                log.info("worker %s: enrolled with identity key %s", worker_id, key[:16])
        self.jobs = jobs = JobManager(
            store,
            self.registry,
            call_timeout=config.call_timeout,
            job_threads=config.job_threads,
            observe=self.metrics.observe,
            max_queued_jobs=config.max_queued_jobs,
            files=files,
            sharing=Sharing(
                policies=config.policy,
                preempt_grace=config.preempt_grace,
                share_wait=config.share_wait,
                half_life=config.usage_half_life,
                fifo=config.scheduler == "fifo",
            ),
        )
        for record in requeued:
            await jobs.requeue(record)
        self.registry.on_change = jobs.kick
        self._client_requests = ClientRequests(jobs, self.registry, self.clients)
        self._http = HttpEndpoints(
            config,
            registry=self.registry,
            jobs=jobs,
            metrics=self.metrics,
            pending=self.pending,
            clients=self.clients,
            channels=self._channels,
        )
        self._worker_sessions = worker_sessions = WorkerSessions(
            config,
            registry=self.registry,
            store=store,
            metrics=self.metrics,
            reassembly=self.reassembly,
        )
        self._server = await serve(
            self._connection,
            config.host,
            self.port,
            ssl=config.tls,
            process_request=self._http.process_request,
            process_response=worker_sessions.process_response,  # a /worker upgrade's challenge
            create_connection=connection_class_counted_in(self.pending),
            server_header=SERVER,
            **ws_options(
                open_timeout=config.handshake_timeout,
                ping_interval=max(config.heartbeat_interval, 1.0) * 5,
                ping_timeout=config.heartbeat_timeout * 2,
            ),
        )
        self.port = self._server.sockets[0].getsockname()[1] if self.port == 0 else self.port
        self._tasks = [
            asyncio.create_task(jobs.place_forever(), name="job placement"),
            asyncio.create_task(worker_sessions.reap_forever(), name="heartbeat reaper"),
            asyncio.create_task(jobs.owed_ends.pay_forever(), name="owed job ends"),
            asyncio.create_task(jobs.pruning.retain_forever(config.retention), name="retention"),
        ]
        log.info(
            "coordinator listening on ws://%s:%d (state in %s)",
            config.host,
            self.port,
            config.state_dir,
        )

    async def serve_forever(self) -> None:
        await self._stopped.wait()

    async def stop(self, grace: float | None = None) -> None:
        """Drain and stop: see the module docstring; running jobs get ``grace`` seconds
        (``None``: the config's). Safe to call twice."""
        if self._stopped.is_set() or self.jobs is None:
            self._stopped.set()
            return
        grace = self.config.grace if grace is None else grace
        log.info("coordinator stopping (grace %.0fs)", grace)
        assert self._server is not None and self.store is not None
        self._server.close(close_connections=False)  # stop accepting new connections
        await self.jobs.shutdown(grace)
        if await self.jobs.owed_ends.pay():  # a last try; the next start marks them failed
            log.error("%d job ends could not be stored", len(self.jobs.owed_ends))
        notice = Shutdown(reason="the coordinator is shutting down")
        for record in self.registry:
            if record.channel is not None:
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(2.0):
                        await record.channel.send(notice)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(
            *(c.close(1001, "coordinator shutting down") for c in list(self._channels))
        )
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(5.0):
                await self._server.wait_closed()
        await asyncio.to_thread(self.store.close)
        self._stopped.set()
        log.info("coordinator stopped")

    # -- connections ---------------------------------------------------------------------------

    async def _connection(self, ws: ServerConnection) -> None:
        path = ws.request.path.split("?", 1)[0] if ws.request is not None else ""
        is_worker = path == "/worker"
        worker_shares = self.reassembly.of_connection() if is_worker else None
        channel = Channel(
            ws,
            f"{path[1:]} {ws.remote_address}",
            None,
            max_message_bytes=self.config.max_message_bytes,
            max_inflight=self.config.max_inflight,
            bulk_gate=self._bulk_gate,
            budget=worker_shares.unasked if worker_shares else self.reassembly.clients,
            turns=self._turns,
            stall_timeout=self.config.stall_timeout,
            buffer_for=frame_buffer if is_worker else self.landing,
            # (a worker's tensors and a client's data are passed on as their bytes, torch
            # imported only for a strategy that computes on them: TransportContext)
            relay_tensors=True,
        )
        if worker_shares is not None:
            channel.reply_budget = worker_shares.replies
        self._channels.add(channel)
        try:
            hello = await self._hello(ws, channel, path, is_worker)
            if hello is None:
                return
            if isinstance(hello, WorkerHello):
                assert self._worker_sessions is not None  # made by start(), before any connection
                await self._worker_sessions.serve(channel, hello)
            else:
                await self._serve_client(channel, hello)
        except (ConnectionClosed, ChannelClosed) as exc:  # the peer went: nothing to answer
            log.info("%s: connection closed: %s", channel.name, exc)
        finally:
            self.pending.done(ws)
            self.metrics.retire(channel)
            self._channels.discard(channel)

    async def _hello(
        self, ws: ServerConnection, channel: Channel, path: str, is_worker: bool
    ) -> Any:
        """The connection's hello, read by ``handshake_timeout`` after its TCP accept; ``None``
        when it was refused (and the connection closed). It stops being pending."""
        loop = asyncio.get_running_loop()
        accepted = self.pending.accepted_at(ws)
        deadline = (loop.time() if accepted is None else accepted) + self.config.handshake_timeout
        expected = WorkerHello if is_worker else ClientHello
        first = "worker_hello" if is_worker else "client_hello"
        try:
            return await receive_hello(
                channel, expected, f"{path} expects {first} first, got {{kind}}", deadline=deadline
            )
        except UnexpectedHello as exc:
            self.pending.done(ws)  # a valid message: no longer waiting for a hello
            await self._refuse(ws, exc.info.code, exc.info.message)
        except TimeoutError:
            log.info("refused %s: no hello within the handshake timeout", ws.remote_address)
            with contextlib.suppress(Exception):
                async with asyncio.timeout(self.config.handshake_timeout):
                    await ws.close(4008, "no hello within the handshake timeout")
        except VersionMismatch as exc:
            await self._refuse(ws, ErrorCode.VERSION_MISMATCH, str(exc))
        except BadMessage as exc:
            await self._refuse(ws, exc.info.code, exc.info.message)
        finally:
            self.pending.done(ws)
        return None

    async def _refuse(self, ws: ServerConnection, code: ErrorCode, message: str) -> None:
        log.info("refused %s: %s", ws.remote_address, message)
        await refuse_hello(ws, code, message, self.config.handshake_timeout)

    async def _serve_client(self, channel: Channel, hello: ClientHello) -> None:
        channel.name = f"client {hello.name or channel.name}"
        channel.budget = self.reassembly.of_client(self.clients.of(channel.transport))
        channel.handler = lambda message: self._on_client_message(channel, message)
        await channel.reply(
            hello,
            Welcome(
                heartbeat_interval=self.config.heartbeat_interval,
                heartbeat_timeout=self.config.heartbeat_timeout,
                server=SERVER,
            ),
        )
        await channel.run()

    async def _on_client_message(self, channel: Channel, message: Any) -> Any:
        assert self._client_requests is not None  # made by start(), before any connection
        return await self._client_requests.handle(channel, message)


def connection_class_counted_in(pending: PendingConnections) -> type[ServerConnection]:
    """A :class:`ServerConnection` class whose connections are in ``pending`` from their TCP
    accept until they are taken out or close: idle sockets and half-sent upgrades count, not
    only upgraded connections. A socket from an address that holds its share of pending
    sockets takes the place of the address's oldest one without a valid token (closed), or,
    when each has shown a token, is closed at once, before a byte is read."""

    class Counted(ServerConnection):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            peer = transport.get_extra_info("peername")
            host = peer[0] if isinstance(peer, tuple) and isinstance(peer[0], str) else None
            accepted = pending.accepted(self, host, self.loop.time())
            super().connection_made(transport)
            if isinstance(accepted.displaced, ServerConnection):
                log.info(
                    "closed %s's oldest socket without a token: %d of its sockets wait for "
                    "their hello",
                    host,
                    pending.max_per_address,
                )
                accepted.displaced.transport.close()
            if not accepted.counted:
                log.info(
                    "refused %s at accept: %d sockets of that address with a token wait for "
                    "their hello",
                    host,
                    pending.max_per_address,
                )
                transport.close()

        def connection_lost(self, exc: Exception | None) -> None:
            pending.done(self)
            super().connection_lost(exc)

    return Counted
