"""``TransportContext``: a job's workers over their live WebSocket connections.

Each command becomes a :class:`~protocol.messages.Call` on the worker's connection; the agent runs
it on the job's filter daemon and answers with a ``result`` or a typed ``error``. Loading a job's
filters is an :class:`~protocol.messages.OpenJob` (the agent starts a fresh daemon for the job).

A worker that disconnects or stops heartbeating has its connection closed by the server, which
fails its pending command at once with ``worker_lost``: a strategy waiting on a dead worker learns
within the heartbeat timeout. A command waiting for its input in its worker's mailbox (a
pipeline stage's activation or gradient, :meth:`TransportContext.routed`) fails as soon as any
other worker of the job is lost, with that worker's ``worker_lost``: its input may never come (a
stage that answered its commands and left would otherwise hold the job up to the call timeout).
A strategy that can go on (elastic DataParallel) asks for a replacement with
:meth:`TransportContext.replace`; the job manager reserves it for the job.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from coordinator.context import DEFAULT_CALL_TIMEOUT, StrategyContext, WorkerIdentity
from coordinator.errors import NoReplacement, WorkerCallError
from coordinator.workers.registry import WorkerRecord
from protocol.arrays import holds_relayed, materialize
from protocol.asyncio.channel import Pacer
from protocol.chunking import StreamSink
from protocol.daemon import DaemonRequest, command_fields
from protocol.errors import ChannelClosed, ErrorCode, ErrorInfo, RemoteError
from protocol.filter_buffers import FilterBuffer, as_buffer
from protocol.messages import Call, CloseJob, DropKept, Links, OpenJob, PeerRoute, ReadKept
from protocol.security.peer_credentials import credential, link_key

CLOSE_TIMEOUT = 10.0
"""Seconds to wait for an agent to stop a job's daemon before giving up on it."""

OPEN_TIMEOUT = 120.0
"""Least seconds a worker has for ``open_job``, whatever the call timeout: it starts the job's
daemon (a new Python importing torch: seconds on a loaded machine) or waits for its warm spare."""

NETWORK_MARGIN = 5.0
"""Extra seconds the coordinator waits beyond a command's own timeout, for the reply to travel."""


class TransportContext(StrategyContext):
    """The workers of job ``job_id``, reached through their registry records.

    Args:
        job_id: the job the commands belong to (the agent keeps one daemon per job).
        workers: the records of the workers placed on the job, in strategy index order.
        timeout: seconds one command may take on a worker.
        threads: torch threads for each job daemon (``None``: the agent's default).
        observe: called with ``(command, seconds)`` after each successful command (metrics).
        recruit: waits up to the given seconds for an idle worker that matches the job's
            placement and reserves it for the job (:meth:`JobManager.recruit`); ``None``
            (the default) means lost workers are never replaced.
        shares: a worker's torch threads when ``threads`` is ``None`` (its share of a machine
            other workers run on: :meth:`~coordinator.workers.registry.Registry.thread_share`).
    """

    def __init__(
        self,
        job_id: str,
        workers: Sequence[WorkerRecord],
        timeout: float = DEFAULT_CALL_TIMEOUT,
        *,
        threads: int | None = None,
        observe: Callable[[str, float], None] = lambda cmd, seconds: None,
        recruit: Callable[[float], Awaitable[WorkerRecord | None]] | None = None,
        shares: Callable[[WorkerRecord], int | None] = lambda record: None,
    ) -> None:
        super().__init__([w.identity for w in workers], timeout)
        self.shares = shares
        self.job_id = job_id
        self.records = list(workers)
        self.threads = threads
        self._observe = observe
        self.recruit = recruit
        self.replaced: list[WorkerRecord] = []  # the records of lost workers, for close()
        self.peer_secret = secrets.token_urlsafe(32)
        """The job's secret its workers' link keys are made from (never sent:
        :mod:`protocol.security.peer_credentials`)."""
        self._loss: asyncio.Task[WorkerRecord] | None = None
        """Completes with the first of :attr:`records` whose connection closes
        (:meth:`_first_loss`)."""

    def observe(self, cmd: str, seconds: float) -> None:
        self._observe(cmd, seconds)

    async def load(self, worker_idx: int, filters: Mapping[str, FilterBuffer]) -> None:
        """Start the job's daemon on the worker and load the filters into it."""
        message = OpenJob(
            job_id=self.job_id,
            filters={node: as_buffer(data) for node, data in filters.items()},
            threads=self.threads
            if self.threads is not None
            else self.shares(self.records[worker_idx]),
            peer_secret=link_key(self.peer_secret, self.records[worker_idx].id),
        )
        await self._request(worker_idx, message, "open_job", max(self.timeout, OPEN_TIMEOUT))

    supports_peer_links = True
    supports_process_groups = True

    async def call(
        self,
        worker_idx: int,
        request: DaemonRequest,
        *,
        pace: Pacer | None = None,
        sink: StreamSink | None = None,
        relayed: bool = False,
    ) -> Any:
        message = Call(job_id=self.job_id, request=command_fields(request), timeout=self.timeout)
        reply = await self._request(worker_idx, message, request.cmd, pace=pace, sink=sink)
        return reply.result if relayed else await _computable(reply.result)

    async def call_keeping(
        self,
        worker_idx: int,
        request: DaemonRequest,
        keep: Sequence[str],
        *,
        relayed: bool = False,
    ) -> Any:
        message = Call(
            job_id=self.job_id,
            request=command_fields(request),
            timeout=self.timeout,
            keep=list(keep),
        )
        result = (await self._request(worker_idx, message, request.cmd)).result
        return result if relayed else await _computable(result)

    async def read_kept(
        self, worker_idx: int, kept: str, name: str, offset: int, length: int
    ) -> bytes:
        message = ReadKept(job_id=self.job_id, kept=kept, name=name, offset=offset, length=length)
        piece = (await self._request(worker_idx, message, "read_kept")).result
        if not isinstance(piece, bytes | bytearray | memoryview):
            info = ErrorInfo(
                code=ErrorCode.BAD_REQUEST,
                message=f"read_kept of {name!r} answered {type(piece).__name__}, not bytes",
            )
            raise WorkerCallError(self.records[worker_idx].id, info)
        return bytes(piece)

    async def drop_kept(self, worker_idx: int, kept: str) -> None:
        await self._request(worker_idx, DropKept(job_id=self.job_id, kept=kept), "drop_kept")

    async def routed(
        self,
        worker_idx: int,
        request: DaemonRequest,
        *,
        input_from: str | None = None,
        input_field: str = "x",
        output_to: tuple[int, str] | None = None,
        seq: int | None = None,
    ) -> Any:
        route = None
        if output_to is not None:
            route = PeerRoute(worker=self.records[output_to[0]].id, key=output_to[1])
        message = Call(
            job_id=self.job_id,
            request=command_fields(request),
            timeout=self.timeout,
            input_from=input_from,
            input_field=input_field,
            output_to=route,
            seq=seq,
        )
        if input_from is None:
            return await _computable((await self._request(worker_idx, message, request.cmd)).result)
        answer = asyncio.ensure_future(self._request(worker_idx, message, request.cmd))
        loss = self._first_loss()
        await asyncio.wait((answer, loss), return_when=asyncio.FIRST_COMPLETED)
        if answer.done() or not loss.done():
            return await _computable((await answer).result)
        answer.cancel()
        with contextlib.suppress(asyncio.CancelledError, WorkerCallError):
            await answer
        lost = loss.result()
        raise WorkerCallError(lost.id, _lost(lost, f"{request.cmd} waiting for {input_from}"))

    def _first_loss(self) -> asyncio.Task[WorkerRecord]:
        """A task that completes with the first of the job's current workers whose connection
        closes (made again once a lost one is replaced)."""
        loss = self._loss
        if (
            loss is None
            or loss.cancelled()
            or (loss.done() and (loss.result() not in self.records or loss.result().connected))
        ):
            loss = self._loss = asyncio.create_task(_first_closed(list(self.records)))
        return loss

    async def links(self, worker_idx: int, expects: Mapping[int, str]) -> dict[str, Any]:
        addresses = {self.records[i].id: self.records[i].peer_address for i in expects}
        prefixes = {self.records[i].id: prefix for i, prefix in expects.items()}
        own = self.records[worker_idx].id
        credentials = {
            peer: credential(link_key(self.peer_secret, peer), own) for peer in addresses
        }
        message = Links(
            job_id=self.job_id, peers=addresses, expects=prefixes, credentials=credentials
        )
        reply = await self._request(worker_idx, message, "links")
        return dict(reply.result)

    async def replace(self, worker_idx: int, timeout: float) -> WorkerIdentity:  # noqa: ASYNC109
        if self.recruit is None:
            raise NoReplacement("this job's workers are not replaced when lost")
        record = await self.recruit(timeout)
        if record is None:
            raise NoReplacement(f"no worker came within {timeout:g}s")
        self.replaced.append(self.records[worker_idx])
        self.records[worker_idx] = record
        self.workers[worker_idx] = record.identity
        return record.identity

    def swap(self, a: int, b: int) -> None:
        super().swap(a, b)
        self.records[a], self.records[b] = self.records[b], self.records[a]

    async def close(self) -> None:
        """Stop the job's daemon on every worker still connected (best effort, bounded)."""
        if self._loss is not None:
            self._loss.cancel()

        async def close_one(record: WorkerRecord) -> None:
            if record.channel is None:
                return
            # Gone or stuck: the job is over either way.
            with contextlib.suppress(RemoteError, ChannelClosed, TimeoutError):
                await record.channel.request(CloseJob(job_id=self.job_id), CLOSE_TIMEOUT)

        records = {id(r): r for r in self.records + self.replaced}  # a lost one may be back
        await asyncio.gather(*(close_one(r) for r in records.values()))

    async def _request(
        self,
        worker_idx: int,
        message: Any,
        cmd: str,
        timeout: float | None = None,  # noqa: ASYNC109
        *,
        pace: Pacer | None = None,
        sink: StreamSink | None = None,
    ) -> Any:
        """``message`` to the worker, answered within ``timeout`` (default: the call timeout);
        ``pace`` and ``sink`` as :meth:`call`'s."""
        timeout = self.timeout if timeout is None else timeout
        record = self.records[worker_idx]
        channel = record.channel
        if channel is None or channel.closed.is_set():
            raise WorkerCallError(record.id, _lost(record, cmd))
        started = time.perf_counter()
        try:
            reply = await channel.request(message, timeout + NETWORK_MARGIN, pace=pace, sink=sink)
        except RemoteError as exc:
            raise WorkerCallError(record.id, exc.info) from None
        except ChannelClosed:
            raise WorkerCallError(record.id, _lost(record, cmd)) from None
        except TimeoutError:
            info = ErrorInfo(
                code=ErrorCode.TIMEOUT,
                message=f"{cmd} for job {self.job_id} got no answer within {timeout}s",
                detail={"cmd": cmd},
            )
            raise WorkerCallError(record.id, info) from None
        self.observe(cmd, time.perf_counter() - started)
        return reply


async def _computable(result: Any) -> Any:
    """A worker's ``result`` with its tensors, which the connection reads as the bytes they came
    as (:class:`~protocol.arrays.RelayedTensor`), made torch tensors for a strategy to compute
    on: in a thread, as the first of them imports torch (a second or more)."""
    if not holds_relayed(result):
        return result
    return await asyncio.to_thread(materialize, result)


async def _first_closed(records: Sequence[WorkerRecord]) -> WorkerRecord:
    """The first of ``records`` whose connection closes (one without a connection at once)."""
    for record in records:
        if record.channel is None or record.channel.closed.is_set():
            return record
    waits = {
        asyncio.ensure_future(r.channel.closed.wait()): r for r in records if r.channel is not None
    }
    if not waits:  # no workers: none to lose
        await asyncio.get_running_loop().create_future()
    try:
        done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for wait in waits:
            wait.cancel()
    return waits[next(iter(done))]


def _lost(record: WorkerRecord, cmd: str) -> ErrorInfo:
    reason = record.reason or "its connection closed"
    return ErrorInfo(
        code=ErrorCode.WORKER_LOST,
        message=f"lost during {cmd}: {reason}",
        detail={"cmd": cmd, "reason": reason},
    )
