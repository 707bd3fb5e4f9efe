"""The coordinator daemon: one port for workers, clients, health and metrics.

* ``ws://HOST:PORT/worker`` — worker agents (:class:`~protocol.messages.WorkerHello` first);
* ``ws://HOST:PORT/client`` — clients (:class:`~protocol.messages.ClientHello` first);
* ``GET /healthz`` — ``ok`` while the coordinator serves; ``GET /metrics`` — Prometheus text.

Lifecycle (one shape for every daemon here): :meth:`Coordinator.start` opens the store (failing
jobs a previous process left running), the server and the background tasks; :meth:`serve_forever`
waits; :meth:`stop` drains — it stops accepting jobs, gives running jobs a grace period, fails what
is left with the reason, tells workers it is going, closes connections and the store.

This module and the other ``ws_*`` modules are the only ones of the coordinator that import
``websockets``; the rest sees :class:`~protocol.channel.Channel` objects.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import http
import logging
import ssl
import time
from pathlib import Path
from typing import Any

from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.http11 import Request, Response

from coordinator.jobs import JobManager, record_dict, remote
from coordinator.metrics import Metrics
from coordinator.registry import DuplicateWorker, Registry, WorkerRecord
from coordinator.store import JobStore
from protocol import PROTOCOL_VERSION
from protocol.channel import (
    BadMessage,
    Channel,
    ChannelClosed,
    RemoteError,
    VersionMismatch,
    encode_small,
)
from protocol.errors import ErrorCode, ErrorInfo
from protocol.messages import (
    CHUNK_BYTES,
    Ack,
    ClientHello,
    Deliver,
    Error,
    JobEvent,
    Probe,
    Result,
    Shutdown,
    Welcome,
    WorkerHello,
)

log = logging.getLogger(__name__)

SERVER = "somatize-coordinator/0.1.0"
RELAY_TIMEOUT = 60.0
"""Seconds a worker has to take a relayed tensor into its mailbox."""
PROBE_TIMEOUT = 60.0
"""Seconds a worker has to answer a ping (its spare daemon may still be starting)."""
HANDSHAKE_TIMEOUT = 10.0
"""Seconds a new connection has to send its hello."""
WS_MAX_SIZE = 4 * CHUNK_BYTES
"""Largest single WebSocket message; anything bigger travels as chunks."""
BULK_SENDS = 16
"""Chunked messages the coordinator writes at once over all its connections (see
:class:`~protocol.channel.Channel`'s ``bulk_gate``): a 1 MB model sent to 1,000 workers keeps
~16 MB in send buffers, not 1 GB, and heartbeats and pings do not wait behind all of it."""


class Coordinator:
    """The coordinator daemon.

    Args:
        host, port: where to listen (port 0: any free port, see :attr:`port`).
        state_dir: the job store's directory.
        heartbeat_interval: seconds between an agent's heartbeats (told to agents).
        heartbeat_timeout: seconds of silence after which a worker is lost.
        call_timeout: seconds one command of a job may take on a worker.
        job_threads: torch threads of each job's daemon (``None``: the agent's default).
        max_message_bytes: largest (reassembled) message accepted from a peer.
        worker_token, client_token: the bearer tokens ``/worker`` and ``/client`` connections
            must present (``Authorization: Bearer ...``), checked in constant time on the HTTP
            upgrade, before any message is read. ``None``: that path is open (loopback only; the
            CLI refuses otherwise unless ``--insecure``). A worker token cannot submit jobs.
        tls: serve ``wss://`` (and ``https://`` health and metrics) with this context.
    """

    def __init__(
        self,
        host: str,
        port: int,
        state_dir: str | Path,
        *,
        heartbeat_interval: float = 2.0,
        heartbeat_timeout: float = 10.0,
        call_timeout: float = 3600.0,
        job_threads: int | None = None,
        max_message_bytes: int = 1 << 34,
        worker_token: str | None = None,
        client_token: str | None = None,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        if heartbeat_timeout <= heartbeat_interval:
            raise ValueError("the heartbeat timeout must be longer than the heartbeat interval")
        self.host = host
        self.port = port
        self.state_dir = Path(state_dir)
        self.heartbeat_interval = heartbeat_interval
        self.heartbeat_timeout = heartbeat_timeout
        self.call_timeout = call_timeout
        self.job_threads = job_threads
        self.max_message_bytes = max_message_bytes
        self.tokens = {"/worker": worker_token, "/client": client_token}
        self.tls = tls
        self.metrics = Metrics()
        self.registry = Registry(heartbeat_timeout)
        self.store: JobStore | None = None
        self.jobs: JobManager | None = None
        self._server: Server | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._channels: set[Channel] = set()
        self._bulk_gate = asyncio.Semaphore(BULK_SENDS)
        self._stopped = asyncio.Event()
        self._client_handlers = {
            "submit": self.on_submit,
            "watch": self.on_watch,
            "get_result": self.on_get_result,
            "cancel": self.on_cancel,
            "get_job": self.on_get_job,
            "list_jobs": self.on_list_jobs,
            "status": self.on_status,
            "ping": self.on_ping,
        }

    # -- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        """Open the store, listen, start the scheduler and the heartbeat reaper."""
        store, recovered = await asyncio.to_thread(JobStore.open, self.state_dir)
        self.store = store
        for record in recovered:
            log.warning(
                "job %s was %s when the coordinator stopped: marked failed",
                record.id,
                record.error and record.error.get("detail", {}).get("state"),
            )
        self.jobs = JobManager(
            store, self.registry, self.call_timeout, self.job_threads, self.metrics.observe
        )
        self.registry.on_change = self.jobs.kick
        self._server = await serve(
            self._connection,
            self.host,
            self.port,
            compression=None,
            max_size=WS_MAX_SIZE,
            ssl=self.tls,
            process_request=self._http,
            open_timeout=HANDSHAKE_TIMEOUT,
            ping_interval=max(self.heartbeat_interval, 1.0) * 5,
            ping_timeout=self.heartbeat_timeout * 2,
            server_header=SERVER,
        )
        self.port = self._server.sockets[0].getsockname()[1] if self.port == 0 else self.port
        self._tasks = [
            asyncio.create_task(self.jobs.schedule_forever(), name="scheduler"),
            asyncio.create_task(self._reap_forever(), name="heartbeat reaper"),
        ]
        log.info(
            "coordinator listening on ws://%s:%d (state in %s)",
            self.host,
            self.port,
            self.state_dir,
        )

    async def serve_forever(self) -> None:
        await self._stopped.wait()

    async def stop(self, grace: float = 10.0) -> None:
        """Drain and stop: see the module docstring. Safe to call twice."""
        if self._stopped.is_set() or self.jobs is None:
            self._stopped.set()
            return
        log.info("coordinator stopping (grace %.0fs)", grace)
        assert self._server is not None and self.store is not None
        self._server.close(close_connections=False)  # stop accepting new connections
        await self.jobs.shutdown(grace)
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
        period = min(self.heartbeat_interval, self.heartbeat_timeout / 4)
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
                    await record.channel.close(4000, "heartbeat timeout")

    # -- HTTP ---------------------------------------------------------------------------------

    async def _http(self, connection: ServerConnection, request: Request) -> Response | None:
        path = request.path.split("?", 1)[0]
        if path == "/healthz":
            return connection.respond(http.HTTPStatus.OK, "ok\n")
        if path == "/metrics":
            assert self.jobs is not None
            counts = await self.jobs.counts()
            workers = {str(k): v for k, v in self.registry.counts().items()}
            jobs = {str(k): v for k, v in counts.items()}
            text = self.metrics.render(workers, jobs, self._channels)
            response = connection.respond(http.HTTPStatus.OK, text)
            response.headers["Content-Type"] = "text/plain; version=0.0.4"
            return response
        if path in ("/worker", "/client"):
            if not _authorized(request, self.tokens[path]):
                log.info(
                    "refused %s on %s: missing or wrong token", connection.remote_address, path
                )
                return connection.respond(
                    http.HTTPStatus.UNAUTHORIZED, f"{path} needs a valid bearer token\n"
                )
            return None  # go on with the WebSocket handshake
        return connection.respond(http.HTTPStatus.NOT_FOUND, f"no such path {path!r}\n")

    # -- connections --------------------------------------------------------------------------

    async def _connection(self, ws: ServerConnection) -> None:
        path = ws.request.path.split("?", 1)[0] if ws.request is not None else ""
        is_worker = path == "/worker"
        channel = Channel(
            ws,
            f"{path[1:]} {ws.remote_address}",
            None,
            self.max_message_bytes,
            bulk_gate=self._bulk_gate,
        )
        self._channels.add(channel)
        try:
            try:
                async with asyncio.timeout(HANDSHAKE_TIMEOUT):
                    hello = await channel.receive(first=True)
            except TimeoutError:
                await ws.close(4008, "no hello within the handshake timeout")
                return
            except VersionMismatch as exc:
                await self._refuse(ws, ErrorCode.VERSION_MISMATCH, str(exc))
                return
            except BadMessage as exc:
                await self._refuse(ws, exc.info.code, exc.info.message)
                return
            expected = WorkerHello if is_worker else ClientHello
            if not isinstance(hello, expected):
                first = "worker_hello" if is_worker else "client_hello"
                message = f"{path} expects {first} first, got {hello.kind}"
                await self._refuse(ws, ErrorCode.BAD_REQUEST, message)
                return
            if isinstance(hello, WorkerHello):
                await self._serve_worker(channel, hello)
            else:
                await self._serve_client(channel, hello)
        finally:
            self.metrics.retire(channel)
            self._channels.discard(channel)

    async def _refuse(self, ws: ServerConnection, code: ErrorCode, message: str) -> None:
        log.info("refused %s: %s", ws.remote_address, message)
        error = Error(
            error=ErrorInfo(code=code, message=message, detail={"server_version": PROTOCOL_VERSION})
        )
        with contextlib.suppress(Exception):
            await ws.send(encode_small(error))
            await ws.close(4002, message[:120])

    async def _serve_worker(self, channel: Channel, hello: WorkerHello) -> None:
        try:
            record = self.registry.attach(
                hello.worker_id,
                hello.tags,
                hello.capabilities,
                channel,
                hello.datasets,
                hello.peer_address,
            )
        except DuplicateWorker as exc:
            await self._refuse(channel.transport, ErrorCode.BAD_REQUEST, str(exc))  # type: ignore[arg-type]
            return
        channel.name = f"worker {record.id}"
        channel.handler = lambda message: self._on_worker_message(record, message)
        await channel.reply(
            hello,
            Welcome(
                worker_id=record.id,
                heartbeat_interval=self.heartbeat_interval,
                heartbeat_timeout=self.heartbeat_timeout,
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

    async def _on_worker_message(self, record: WorkerRecord, message: Any) -> Any:
        if message.kind == "heartbeat":
            self.registry.heartbeat(record)
            return None
        if message.kind == "deliver":
            await self._relay(record, message)
            return None
        raise remote(
            ErrorCode.BAD_REQUEST, f"the coordinator takes no {message.kind!r} from a worker"
        )

    async def _relay(self, sender: WorkerRecord, message: Deliver) -> None:
        """Forward a tensor between two workers with no direct link: the payload stays an opaque
        frame (its tensors are not decoded here)."""
        target = self.registry.get(message.to)
        if target is None or target.channel is None:
            log.warning("relay from %s: no connected worker %r", sender.id, message.to)
            return
        try:
            await target.channel.request(message, RELAY_TIMEOUT)  # request() gives it a new id
        except (RemoteError, ChannelClosed, TimeoutError) as exc:
            log.warning("relay %s -> %s (%s) failed: %s", sender.id, message.to, message.key, exc)
            return
        self.metrics.relayed += len(message.payload)

    async def _serve_client(self, channel: Channel, hello: ClientHello) -> None:
        channel.name = f"client {hello.name or channel.name}"
        channel.handler = lambda message: self._on_client_message(channel, message)
        await channel.reply(
            hello,
            Welcome(
                heartbeat_interval=self.heartbeat_interval,
                heartbeat_timeout=self.heartbeat_timeout,
                server=SERVER,
            ),
        )
        await channel.run()

    async def _on_client_message(self, channel: Channel, message: Any) -> Any:
        handler = self._client_handlers.get(message.kind)
        if handler is None:
            raise remote(
                ErrorCode.BAD_REQUEST, f"the coordinator takes no {message.kind!r} from a client"
            )
        return await handler(channel, message)

    # -- client requests ----------------------------------------------------------------------

    async def on_submit(self, channel: Channel, message: Any) -> Any:
        assert self.jobs is not None
        job_id = await self.jobs.submit(message)
        return Result(result={"job_id": job_id})

    async def on_watch(self, channel: Channel, message: Any) -> Any:
        assert self.jobs is not None
        async for event in self.jobs.watch(message.job_id, message.after_seq):
            await channel.reply(
                message,
                JobEvent(
                    job_id=event.job_id,
                    seq=event.seq,
                    time=event.time,
                    event=event.kind,
                    data=event.data,
                ),
            )
        return Ack()

    async def on_get_result(self, channel: Channel, message: Any) -> Any:
        assert self.jobs is not None
        return Result(result=await self.jobs.result(message.job_id, message.wait))

    async def on_cancel(self, channel: Channel, message: Any) -> Any:
        assert self.jobs is not None
        await self.jobs.cancel(message.job_id)
        return Ack()

    async def on_get_job(self, channel: Channel, message: Any) -> Any:
        assert self.jobs is not None
        return Result(result={"record": await self.jobs.record(message.job_id)})

    async def on_list_jobs(self, channel: Channel, message: Any) -> Any:
        assert self.jobs is not None
        return Result(result={"jobs": await self.jobs.records(message.limit)})

    async def on_ping(self, channel: Channel, message: Any) -> Any:
        """A no-op round trip: to the coordinator, or on through a worker to its daemon."""
        if message.worker_id is None:
            return Result(result={"worker_id": None})
        record = self.registry.get(message.worker_id)
        if record is None or record.channel is None:
            known = [w.id for w in self.registry if w.connected]
            raise remote(
                ErrorCode.BAD_REQUEST,
                f"no connected worker {message.worker_id!r} (connected: {known})",
            )
        try:
            reply = await record.channel.request(Probe(), PROBE_TIMEOUT)
        except TimeoutError:
            raise remote(
                ErrorCode.TIMEOUT, f"worker {record.id!r} did not answer within {PROBE_TIMEOUT}s"
            ) from None
        except ChannelClosed:
            raise remote(ErrorCode.WORKER_LOST, f"worker {record.id!r} disconnected") from None
        return Result(result=reply.result)

    async def on_status(self, channel: Channel, message: Any) -> Any:
        assert self.jobs is not None
        now = time.monotonic()
        return Result(
            result={
                "workers": [w.summary(now) for w in self.registry],
                "jobs": await self.jobs.records(50),
            }
        )


def _authorized(request: Request, token: str | None) -> bool:
    """Whether the upgrade carries ``Authorization: Bearer <token>`` (compared in constant time)."""
    if token is None:
        return True
    header = request.headers.get("Authorization", "")
    scheme, _, given = header.partition(" ")
    expected, offered = token.encode(), given.strip().encode()
    return scheme.lower() == "bearer" and hmac.compare_digest(expected, offered)


__all__ = ["Coordinator", "RemoteError", "record_dict"]
