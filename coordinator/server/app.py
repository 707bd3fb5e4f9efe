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
the clients' requests (:class:`~coordinator.server.client_requests.ClientRequests`), each given
what it uses. What runs when a worker connects is here: its hello read, its identity key checked,
its record attached in the registry, its heartbeats and relayed tensors served.

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

This module and :mod:`coordinator.server.http` are the only ones of the coordinator that import
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
from coordinator.storage.disk import private_directory
from coordinator.storage.kept_files import piece_bytes
from coordinator.storage.store import JobState, JobStore
from coordinator.workers.registry import DuplicateWorker, Registry, WorkerRecord
from protocol.asyncio.channel import Channel
from protocol.asyncio.handshake import receive_hello, refuse_hello
from protocol.asyncio.landing import Landing
from protocol.asyncio.turns import TurnGate
from protocol.asyncio.websocket import WS_MAX_SIZE, ws_options
from protocol.chunking import frame_buffer
from protocol.errors import (
    BadMessage,
    ChannelClosed,
    ErrorCode,
    RemoteError,
    RequestRefused,
    UnexpectedHello,
    VersionMismatch,
)
from protocol.messages import (
    Ack,
    ClientHello,
    Deliver,
    Shutdown,
    Welcome,
    WorkerHello,
    sandboxed,
)
from protocol.security.identity_proof import fingerprint, verified

__all__ = ["WS_MAX_SIZE", "Coordinator", "connection_class_counted_in"]

log = logging.getLogger(__name__)

RELAY_TIMEOUT = 60.0
"""Seconds a worker has to take a relayed tensor into its mailbox."""
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

    A worker's hello for an id its operator chose carries the agent's identity key: the first
    one enrols the id (the store keeps the key's SHA-256), and a later hello for that id with
    another key, or none, is refused ``unauthorized`` — a worker token alone cannot take over
    another worker's id.

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
        self._client_requests: ClientRequests | None = None
        self._server: Server | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._channels: set[Channel] = set()
        self._closing: set[asyncio.Task[None]] = set()  # connections of reaped workers
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
        self._server = await serve(
            self._connection,
            config.host,
            self.port,
            ssl=config.tls,
            process_request=self._http.process_request,
            process_response=self._http.process_response,
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
            asyncio.create_task(self._reap_forever(), name="heartbeat reaper"),
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

    async def _reap_forever(self) -> None:
        period = min(self.config.heartbeat_interval, self.config.heartbeat_timeout / 4)
        loop = asyncio.get_running_loop()
        while True:
            woke = loop.time() + period
            await asyncio.sleep(period)
            if loop.time() - woke > period:
                # The loop itself was held up (importing torch for a first job, a long fold):
                # the heartbeats that waited meanwhile are read before anyone is judged silent.
                continue
            for record in self.registry.reap():
                log.warning("worker %s lost: %s", record.id, record.reason)
                if record.channel is not None:
                    # Not awaited: over a dead link the closing handshake takes its whole
                    # timeout, and the next silent worker must not wait for it to be reaped.
                    task = asyncio.ensure_future(record.channel.close(4000, "heartbeat timeout"))
                    self._closing.add(task)
                    task.add_done_callback(self._closing.discard)

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
        )
        if worker_shares is not None:
            channel.reply_budget = worker_shares.replies
        self._channels.add(channel)
        try:
            hello = await self._hello(ws, channel, path, is_worker)
            if hello is None:
                return
            if isinstance(hello, WorkerHello):
                await self._serve_worker(channel, hello)
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

    async def _serve_worker(self, channel: Channel, hello: WorkerHello) -> None:
        enrolled = self.config.enrolled
        if enrolled and hello.worker_id not in enrolled:
            who = "a worker without --id" if hello.worker_id is None else f"{hello.worker_id!r}"
            message = (
                f"{who} is not enrolled on this coordinator: its operator enrolls a worker id "
                "with somatize-coordinator --enroll ID"
            )
            await self._refuse(channel.transport, ErrorCode.UNAUTHORIZED, message)  # type: ignore[arg-type]
            return
        if self.config.require_sandbox and not sandboxed(hello.capabilities):
            said = hello.capabilities.sandbox or "no sandbox said"
            message = (
                f"this coordinator runs job code sandboxed only (--require-sandbox), and this "
                f"worker runs it with {said!r}: start it with --sandbox auto, bwrap or uid"
            )
            await self._refuse(channel.transport, ErrorCode.UNAUTHORIZED, message)  # type: ignore[arg-type]
            return
        if hello.worker_id is not None:
            assert self._http is not None  # made by start(), before any connection
            transport: Any = channel.transport
            issued: str | None = self._http.challenges.pop(transport, None)
            problem = await self._identity_problem(hello, issued)
            if problem is not None:
                await self._refuse(transport, ErrorCode.UNAUTHORIZED, problem)
                return
        try:
            record = self.registry.attach(
                hello.worker_id,
                hello.tags,
                hello.capabilities,
                channel,
                hello.datasets,
                peer_address=hello.peer_address,
                remote_host=_remote_host(channel.transport),
            )
        except DuplicateWorker as exc:
            await self._refuse(channel.transport, ErrorCode.BAD_REQUEST, str(exc))  # type: ignore[arg-type]
            return
        channel.name = f"worker {record.id}"
        shares = self.reassembly.of_worker(record.id)  # over all its connections
        channel.budget, channel.reply_budget = shares.unasked, shares.replies
        channel.handler = lambda message: self._on_worker_message(record, message)
        await channel.reply(
            hello,
            Welcome(
                worker_id=record.id,
                heartbeat_interval=self.config.heartbeat_interval,
                heartbeat_timeout=self.config.heartbeat_timeout,
                server=SERVER,
            ),
        )
        log.info(
            "worker %s connected (tags %s, %s cpus)",
            record.id,
            sorted(record.tags),
            record.capabilities.cpus,
        )
        try:
            await channel.run()
        finally:
            self.registry.detach(record, channel, channel.close_reason or "disconnected")
            log.info("worker %s disconnected: %s", record.id, channel.close_reason)

    async def _identity_problem(self, hello: WorkerHello, issued: str | None) -> str | None:
        """Why a hello for an id its operator chose may not register (``None``: it may): it
        proves no key or another than the id enrolled with, or its proof does not verify
        against its connection's challenge ``issued`` (:mod:`protocol.security.identity_proof`). An
        id not enrolled yet is enrolled now with the key it proves (trust on first use)."""
        assert self.store is not None and hello.worker_id is not None
        worker_id = hello.worker_id
        other_key = (
            f"worker id {worker_id!r} is enrolled with another identity key: a worker "
            "registers only under its own id (if that machine lost its --identity-file, run "
            f"the coordinator once with --forget-worker {worker_id})"
        )
        if hello.public_key is None:
            if worker_id in self.config.enrolled:  # enrolled ids prove their key, always
                return (
                    f"worker id {worker_id!r} is enrolled on this coordinator and proves no "
                    "identity key: start it with --id and its --identity-file"
                )
            enrolled = await asyncio.to_thread(self.store.is_enrolled, worker_id)
            return other_key if enrolled else None
        if (
            issued is None
            or hello.proof is None
            or not verified(hello.public_key, hello.proof, issued, worker_id)
        ):
            return f"worker id {worker_id!r}: its hello does not prove its identity key"
        known = await asyncio.to_thread(
            self.store.identify, worker_id, fingerprint(hello.public_key)
        )
        return None if known else other_key

    async def _on_worker_message(self, record: WorkerRecord, message: Any) -> Any:
        if message.kind == "heartbeat":
            self.registry.heartbeat(record)
            return None
        if message.kind == "deliver":
            return await self._relay(record, message)
        raise RequestRefused.of(
            ErrorCode.BAD_REQUEST, f"the coordinator takes no {message.kind!r} from a worker"
        )

    async def _relay(self, sender: WorkerRecord, message: Deliver) -> Ack:
        """Forward a tensor between two workers of the same job with no direct link: the payload
        stays an opaque frame (its tensors are not decoded here), and the receiver learns who
        sent it from the connection it came on, not from the message.

        Raises:
            RequestRefused: the sender is not on that job, the target is not a connected worker
                of it, or the target refused it or did not answer within ``RELAY_TIMEOUT``.
        """
        job_id = message.job_id
        if job_id not in sender.jobs:
            raise RequestRefused.of(
                ErrorCode.BAD_REQUEST,
                f"worker {sender.id} is not on job {job_id!r}: nothing is relayed for it",
            )
        target = self.registry.get(message.to)
        if target is None or job_id not in target.jobs or target.channel is None:
            raise RequestRefused.of(
                ErrorCode.WORKER_LOST,
                f"relay for job {job_id!r}: worker {message.to!r} is not a connected worker "
                "of the job",
                job_id=job_id,
                to=message.to,
            )
        forwarded = message.model_copy(update={"sender": sender.id})
        try:
            await target.channel.request(forwarded, RELAY_TIMEOUT)  # request() gives it a new id
        except RemoteError as exc:
            raise RequestRefused(exc.info) from None
        except (ChannelClosed, TimeoutError) as exc:
            why = "its connection closed" if isinstance(exc, ChannelClosed) else "no answer"
            raise RequestRefused.of(
                ErrorCode.WORKER_LOST,
                f"relay of {message.key!r} to worker {message.to} for job {job_id!r} failed: {why}",
                job_id=job_id,
                to=message.to,
            ) from None
        self.metrics.relayed += len(message.payload)
        return Ack()

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


def _remote_host(transport: object) -> str | None:
    """The address a connection came from (``None`` when the transport does not say)."""
    address = getattr(transport, "remote_address", None)
    if isinstance(address, tuple) and address and isinstance(address[0], str):
        return address[0]
    return None
