"""The coordinator's side of a worker's session, from its upgrade's answer to its detach.

A ``/worker`` connection passes the door every connection does — its bearer token checked on the
upgrade (:mod:`coordinator.server.http`), its hello read by the handshake timeout
(``Coordinator._connection`` in :mod:`coordinator.server.app`) — and the rest happens here, in
this order:

1. its upgrade's answer carries a fresh challenge (:meth:`WorkerSessions.process_response`);
2. its hello is checked (:meth:`WorkerSessions.serve`): an id the operator enrolled
   (``--enroll``), a sandbox where the coordinator requires one (``--require-sandbox``), and for
   an id its operator chose, the identity key it proves by signing that challenge
   (:meth:`WorkerSessions._identity_problem`, :mod:`protocol.security.identity_proof`); a
   refusal is an ``error`` with its reason, then a close;
3. its record is attached in the registry (:meth:`~coordinator.workers.registry.Registry.attach`;
   a change there lets the job manager place queued jobs on it), its connection given its
   worker id's share of reassembly, and a ``welcome`` sent;
4. what it sends unasked is served: heartbeats, and tensors relayed to another worker of its job
   (:meth:`WorkerSessions._relay`);
5. its record is detached when the connection ends — or, when it falls silent past the
   heartbeat timeout, declared lost and its connection closed (:meth:`WorkerSessions.reap_forever`).
"""

from __future__ import annotations

import asyncio
import http
import logging
import weakref
from typing import Any

from websockets.asyncio.server import ServerConnection
from websockets.http11 import Request, Response

from coordinator.server.config import SERVER, CoordinatorConfig
from coordinator.server.metrics import Metrics
from coordinator.server.reassembly_shares import ReassemblyShares
from coordinator.storage.store import JobStore
from coordinator.workers.registry import DuplicateWorker, Registry, WorkerRecord
from protocol.asyncio.channel import Channel
from protocol.asyncio.handshake import refuse_hello
from protocol.errors import ChannelClosed, ErrorCode, RemoteError, RequestRefused
from protocol.messages import Ack, Deliver, Welcome, WorkerHello, sandboxed
from protocol.security.identity_proof import CHALLENGE_HEADER, challenge, fingerprint, verified

__all__ = ["RELAY_TIMEOUT", "WorkerSessions"]

log = logging.getLogger(__name__)

RELAY_TIMEOUT = 60.0
"""Seconds a worker has to take a relayed tensor into its mailbox."""


class WorkerSessions:
    """Every worker's session on the coordinator (the module docstring): the challenges its
    upgrades were answered with, and the connections of reaped workers still closing.

    A worker's hello for an id its operator chose carries the agent's identity key: the first
    one enrols the id (the store keeps the key's SHA-256), and a later hello for that id with
    another key, or none, is refused ``unauthorized`` — a worker token alone cannot take over
    another worker's id.

    Args:
        config: the coordinator's settings (enrolled ids, ``require_sandbox``, the heartbeat
            and handshake timeouts).
        registry: the workers, where each session attaches its record.
        store: the job store, which keeps each enrolled id's identity key.
        metrics: the counters (relayed bytes).
        reassembly: what chunked messages in progress each worker id may hold.
    """

    def __init__(
        self,
        config: CoordinatorConfig,
        *,
        registry: Registry,
        store: JobStore,
        metrics: Metrics,
        reassembly: ReassemblyShares,
    ) -> None:
        self.config = config
        self.registry = registry
        self.store = store
        self.metrics = metrics
        self.reassembly = reassembly
        self.challenges: weakref.WeakKeyDictionary[ServerConnection, str] = (
            weakref.WeakKeyDictionary()
        )
        """The challenge each ``/worker`` connection's hello must sign."""
        self._closing: set[asyncio.Task[None]] = set()  # connections of reaped workers

    def process_response(
        self, connection: ServerConnection, request: Request, response: Response
    ) -> Response:
        """A ``/worker`` upgrade's answer carries a fresh challenge the worker's hello signs
        (:mod:`protocol.security.identity_proof`), kept for its connection; ``websockets``'
        ``process_response`` hook."""
        if response.status_code == http.HTTPStatus.SWITCHING_PROTOCOLS and (
            request.path.split("?", 1)[0] == "/worker"
        ):
            issued = challenge()
            self.challenges[connection] = issued
            response.headers[CHALLENGE_HEADER] = issued
        return response

    async def serve(self, channel: Channel, hello: WorkerHello) -> None:
        """Check a worker's ``hello``, attach its record, serve its connection until it ends
        and detach it (the module docstring)."""
        enrolled = self.config.enrolled
        if enrolled and hello.worker_id not in enrolled:
            who = "a worker without --id" if hello.worker_id is None else f"{hello.worker_id!r}"
            message = (
                f"{who} is not enrolled on this coordinator: its operator enrolls a worker id "
                "with somatize-coordinator --enroll ID"
            )
            await self._refuse(channel, ErrorCode.UNAUTHORIZED, message)
            return
        if self.config.require_sandbox and not sandboxed(hello.capabilities):
            said = hello.capabilities.sandbox or "no sandbox said"
            message = (
                f"this coordinator runs job code sandboxed only (--require-sandbox), and this "
                f"worker runs it with {said!r}: start it with --sandbox auto, bwrap or uid"
            )
            await self._refuse(channel, ErrorCode.UNAUTHORIZED, message)
            return
        if hello.worker_id is not None:
            transport: Any = channel.transport
            issued: str | None = self.challenges.pop(transport, None)
            problem = await self._identity_problem(hello, issued)
            if problem is not None:
                await self._refuse(channel, ErrorCode.UNAUTHORIZED, problem)
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
            await self._refuse(channel, ErrorCode.BAD_REQUEST, str(exc))
            return
        channel.name = f"worker {record.id}"
        shares = self.reassembly.of_worker(record.id)  # over all its connections
        channel.budget, channel.reply_budget = shares.unasked, shares.replies
        channel.handler = lambda message: self._on_message(record, message)
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

    async def reap_forever(self) -> None:
        """Declare workers silent past the heartbeat timeout lost and close their connections
        (:meth:`~coordinator.workers.registry.Registry.reap`), every quarter of the timeout or
        every heartbeat interval, whichever is shorter."""
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

    async def _refuse(self, channel: Channel, code: ErrorCode, message: str) -> None:
        transport: Any = channel.transport  # the websockets connection
        log.info("refused %s: %s", transport.remote_address, message)
        await refuse_hello(transport, code, message, self.config.handshake_timeout)

    async def _identity_problem(self, hello: WorkerHello, issued: str | None) -> str | None:
        """Why a hello for an id its operator chose may not register (``None``: it may): it
        proves no key or another than the id enrolled with, or its proof does not verify
        against its connection's challenge ``issued`` (:mod:`protocol.security.identity_proof`). An
        id not enrolled yet is enrolled now with the key it proves (trust on first use)."""
        assert hello.worker_id is not None
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

    async def _on_message(self, record: WorkerRecord, message: Any) -> Any:
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


def _remote_host(transport: object) -> str | None:
    """The address a connection came from (``None`` when the transport does not say)."""
    address = getattr(transport, "remote_address", None)
    if isinstance(address, tuple) and address and isinstance(address[0], str):
        return address[0]
    return None
