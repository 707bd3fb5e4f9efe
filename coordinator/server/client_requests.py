"""What a connected client asks the coordinator, answered on behalf of who it is.

Each request of a ``/client`` connection (``submit``, ``watch``, ``get_result``, ``cancel``,
``get_job``, ``list_jobs``, ``get_queue``, ``prune_jobs``, ``status``, ``ping``) is one method
here. The client
is who its token says (:mod:`coordinator.server.clients`): it submits as itself, and sees only
its own jobs unless it is an admin — another's job is ``unknown_job``, as one that does not exist.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from coordinator.jobs.manager import JobManager
from coordinator.jobs.retention import Retention
from coordinator.server.clients import ClientIdentity, ConnectedClients
from coordinator.server.status import compact, status_snapshot, visible_records
from coordinator.workers.registry import Registry
from protocol.asyncio.channel import Channel
from protocol.errors import ChannelClosed, ErrorCode, RequestRefused
from protocol.messages import Ack, JobEvent, Probe, Result

__all__ = ["PROBE_TIMEOUT", "ClientRequests"]

PROBE_TIMEOUT = 60.0
"""Seconds a worker has to answer a ping (its spare daemon may still be starting)."""


class ClientRequests:
    """The requests of the clients connected to a coordinator.

    Args:
        jobs: the jobs they submit, watch, fetch and cancel.
        registry: the workers (``ping`` through one, ``status``).
        clients: who each client connection is (its token said, at the upgrade).
    """

    def __init__(self, jobs: JobManager, registry: Registry, clients: ConnectedClients) -> None:
        self.jobs = jobs
        self.registry = registry
        self.clients = clients
        self._handlers: dict[str, Callable[[Channel, Any], Awaitable[Any]]] = {
            "submit": self.on_submit,
            "watch": self.on_watch,
            "get_result": self.on_get_result,
            "get_checkpoint": self.on_get_checkpoint,
            "cancel": self.on_cancel,
            "get_job": self.on_get_job,
            "list_jobs": self.on_list_jobs,
            "get_queue": self.on_get_queue,
            "prune_jobs": self.on_prune_jobs,
            "status": self.on_status,
            "ping": self.on_ping,
        }

    def _client(self, channel: Channel) -> ClientIdentity:
        """Who the client on ``channel`` is (its token said, at the upgrade)."""
        return self.clients.of(channel.transport)

    async def _visible(self, channel: Channel, job_id: str) -> ClientIdentity:
        """The client of ``channel``, once it is found to own ``job_id`` (or be an admin).

        Raises:
            RequestRefused: ``unknown_job`` for another client's job, as for none at all.
        """
        client = self._client(channel)
        if not client.admin and not client.may_see(await self.jobs.owner(job_id)):
            raise RequestRefused.of(ErrorCode.UNKNOWN_JOB, f"no job {job_id!r}", job_id=job_id)
        return client

    # -- connections --------------------------------------------------------------------------

    async def handle(self, channel: Channel, message: Any) -> Any:
        """Answer one request of the client on ``channel``.

        Raises:
            RequestRefused: a kind no client sends, or the request's own refusal.
        """
        handler = self._handlers.get(message.kind)
        if handler is None:
            raise RequestRefused.of(
                ErrorCode.BAD_REQUEST, f"the coordinator takes no {message.kind!r} from a client"
            )
        return await handler(channel, message)

    async def on_submit(self, channel: Channel, message: Any) -> Any:
        client = self._client(channel)
        if message.resume_from is not None:  # another client's job is not there to continue
            await self._visible(channel, message.resume_from)
        job_id = await self.jobs.submit(message, client.name)
        return Result(result={"job_id": job_id})

    async def on_watch(self, channel: Channel, message: Any) -> Any:
        await self._visible(channel, message.job_id)
        async with _while_open(channel):
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
        await self._visible(channel, message.job_id)
        if message.offset is not None and message.replica is None:
            raise RequestRefused.of(
                ErrorCode.BAD_REQUEST, "an offset reads a replica's file: name the replica too"
            )
        async with _while_open(channel):
            result = await self.jobs.result(
                message.job_id, message.wait, message.replica, message.offset, message.length
            )
            return Result(result=result)

    async def on_get_checkpoint(self, channel: Channel, message: Any) -> Any:
        await self._visible(channel, message.job_id)
        await self.jobs.owner(message.job_id)  # an unknown job is said so, not "no checkpoint"
        if self.jobs.files is None:
            raise RequestRefused.of(
                ErrorCode.NO_CHECKPOINT, "this coordinator keeps no checkpoints (no --state-dir)"
            )
        job_id, seq, name = message.job_id, message.seq, message.file
        if message.offset is not None and name is None:
            raise RequestRefused.of(
                ErrorCode.BAD_REQUEST, "an offset reads a checkpoint's file: name the file too"
            )
        if name is not None:  # one file of a sharded checkpoint, checked as it is read
            if seq is None:
                raise RequestRefused.of(
                    ErrorCode.BAD_REQUEST, "a checkpoint's file is asked for with its seq"
                )
            found = await asyncio.to_thread(self.jobs.files.checkpoint, job_id, seq, False)
            offset = message.offset
            try:
                if offset is None:  # whole, hashed again
                    data = await asyncio.to_thread(found.shard, name, True)
                else:  # a piece (the client checks the digest of the whole)
                    data = await asyncio.to_thread(found.shard_range, name, offset, message.length)
            except FileNotFoundError as exc:
                raise RequestRefused.of(ErrorCode.NO_CHECKPOINT, str(exc), job_id=job_id) from exc
            except (OSError, ValueError) as exc:
                raise RequestRefused.of(ErrorCode.INTERNAL, str(exc), job_id=job_id) from exc
            said = {"seq": found.seq, "file": name, "data": data}
            return Result(result=said | ({} if offset is None else {"offset": offset}))
        found = await asyncio.to_thread(self.jobs.files.checkpoint, job_id, seq)
        payload = found.payload
        said = {"seq": found.seq, "position": found.position}
        if "shards" in payload:  # a sharded run's: the client asks for each file and joins them
            kept = payload["shards"]
            names = sorted(kept["files"])
            shards = {
                "names": names,
                "files": kept["files"],
                "rest": kept["rest"],
                "plain": kept["plain"],
            }
            return Result(result=said | {"shards": shards})
        # A pipeline's or replicas' checkpoint holds every node's state; FedAvg's the global
        # state of its differentiable nodes.
        states = payload.get("states", payload.get("global_state", {}))
        return Result(result=said | {"states": states})

    async def on_cancel(self, channel: Channel, message: Any) -> Any:
        await self._visible(channel, message.job_id)
        await self.jobs.cancel(message.job_id)
        return Ack()

    async def on_get_job(self, channel: Channel, message: Any) -> Any:
        await self._visible(channel, message.job_id)
        return Result(result={"record": await self.jobs.record(message.job_id)})

    async def on_list_jobs(self, channel: Channel, message: Any) -> Any:
        client = self._client(channel)
        return Result(result={"jobs": await visible_records(self.jobs, client, message.limit)})

    async def on_get_queue(self, channel: Channel, message: Any) -> Any:
        client = self._client(channel)
        jobs = [r for r in await self.jobs.queue() if client.may_see(r["summary"].get("owner"))]
        said: dict[str, Any] = {"jobs": [compact(r) for r in jobs]}
        if client.admin:
            said["clients"] = self.jobs.shares()
        return Result(result=said)

    async def on_prune_jobs(self, channel: Channel, message: Any) -> Any:
        """Remove the client's ended jobs that the message says (an admin's: anyone's)."""
        client = self._client(channel)
        retention = Retention(message.older_than, message.keep, message.max_bytes)
        owner = None if client.admin else client.name
        said = await self.jobs.pruning.prune(retention, message.job_ids, owner, message.dry_run)
        return Result(result=said)

    async def on_ping(self, channel: Channel, message: Any) -> Any:
        """A no-op round trip: to the coordinator, or on through a worker to its daemon — a
        worker that is idle or runs this client's job (an admin: any)."""
        if message.worker_id is None:
            return Result(result={"worker_id": None})
        record = self.registry.get(message.worker_id)
        if record is None or record.channel is None:
            known = [w.id for w in self.registry if w.connected]
            raise RequestRefused.of(
                ErrorCode.BAD_REQUEST,
                f"no connected worker {message.worker_id!r} (connected: {known})",
            )
        client = self._client(channel)
        if record.job_id is not None and not client.admin:
            try:
                others = not client.may_see(await self.jobs.owner(record.job_id))
            except RequestRefused:  # a job that just ended: the worker is free
                others = False
            if others:
                raise RequestRefused.of(
                    ErrorCode.BUSY,
                    f"worker {record.id!r} is busy with another client's job: ping it once it "
                    "is free",
                )
        try:
            reply = await record.channel.request(Probe(), PROBE_TIMEOUT)
        except TimeoutError as exc:
            raise RequestRefused.of(
                ErrorCode.TIMEOUT, f"worker {record.id!r} did not answer within {PROBE_TIMEOUT}s"
            ) from exc
        except ChannelClosed as exc:
            raise RequestRefused.of(
                ErrorCode.WORKER_LOST, f"worker {record.id!r} disconnected"
            ) from exc
        return Result(result=reply.result)

    async def on_status(self, channel: Channel, message: Any) -> Any:
        client = self._client(channel)
        return Result(result=await status_snapshot(self.registry, self.jobs, client))


@contextlib.asynccontextmanager
async def _while_open(channel: Channel) -> AsyncIterator[None]:
    """Cancel the body when ``channel``'s connection ends: a client's wait (a watch of a job
    that stays queued, a long ``get_result``) must not outlive the client."""
    task = asyncio.current_task()
    assert task is not None
    closed = asyncio.ensure_future(channel.closed.wait())
    closed.add_done_callback(lambda done: None if done.cancelled() else task.cancel())
    try:
        yield
    finally:
        closed.cancel()
