"""The agent's job requests: ``open_job``, ``call``, ``links``, ``deliver``, ``close_job``, ...

A job is one daemon (from :class:`~worker.supervision.pool.DaemonPool`) and the tasks working on it.
A ``call`` forwards one daemon command; with ``input_from`` it first waits for that mailbox key,
with ``output_to`` its result goes, encoded, to that worker's mailbox — over a direct peer link
(:class:`~worker.peer.PeerLinks`), or as a ``deliver`` the coordinator relays. Sequenced calls
(``Call.seq``) take their turn through the job's :class:`~worker.peer.CallOrder`. Files a call
asks to keep (``Call.keep``) stay on this worker's disk (:class:`~worker.kept_files.KeptFiles`)
for ``read_kept`` until ``drop_kept`` or the job's close.

A refused request raises :class:`~protocol.errors.RequestRefused`, which the channel sends as
the error reply; a daemon's own error keeps its code, message and detail, plus ``worker_id``
and ``job_id``. A job's mailbox entries go with the job.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from protocol.asyncio.channel import Channel
from protocol.codec import decode, encode_frame
from protocol.daemon import LoadRequest
from protocol.errors import ChannelClosed, ErrorCode, ErrorInfo, RemoteError, RequestRefused
from protocol.files.kept_files import files_at
from protocol.messages import (
    Ack,
    Call,
    CloseJob,
    Deliver,
    DropKept,
    Links,
    OpenJob,
    PeerHello,
    Probe,
    ReadKept,
    Result,
)
from protocol.security.peer_credentials import matches
from worker.config import AgentConfig
from worker.errors import DaemonError, DeliveredTwice, MailboxDropped, MailboxFull, OutOfOrder
from worker.kept_files import KeptFiles
from worker.lifecycle import Lifecycle
from worker.peer import CallOrder, Mailbox, PeerLinks
from worker.supervision.pool import DaemonPool
from worker.supervision.supervisor import DaemonSupervisor
from worker.tasks import cancelling, owned_task

__all__ = ["JobHandlers"]

log = logging.getLogger(__name__)

RELAY_TIMEOUT = 75.0
"""Seconds a relayed delivery may take: the coordinator's own bound for the receiver (60 s),
and the way there and back."""


@dataclass(eq=False)
class _Job:
    """One open job: its daemon and the tasks working on it (owned here, not by a handler)."""

    job_id: str
    supervisor: DaemonSupervisor
    opening: asyncio.Task[None] | None = None
    calls: set[asyncio.Task[Any]] = field(default_factory=set)
    order: CallOrder = field(default_factory=CallOrder)  # its sequenced calls (Call.seq)
    peer_secret: str | None = None  # what its peers present on a peer link (OpenJob)
    expects: dict[str, str] = field(default_factory=dict)  # peer id → key prefix (Links)


class JobHandlers:
    """The open jobs of one agent and the requests that work on them.

    Args:
        config: the agent's settings (call and close timeouts, default threads).
        pool: where the jobs' daemons come from.
        links: the direct links to other workers, for ``links`` and ``output_to``.
        lifecycle: whether a job may open now.
        worker_id: this worker's id, for error messages (it may change at a welcome).
        coordinator: the coordinator's channel while connected, to relay deliveries.
        kept: where the files calls ask to keep go (``Call.keep``).
    """

    def __init__(
        self,
        config: AgentConfig,
        pool: DaemonPool,
        links: PeerLinks,
        lifecycle: Lifecycle,
        *,
        worker_id: Callable[[], str | None],
        coordinator: Callable[[], Channel | None],
        kept: KeptFiles,
    ) -> None:
        self._config = config
        self._pool = pool
        self._links = links
        self._lifecycle = lifecycle
        self._worker_id = worker_id
        self._coordinator = coordinator
        self._kept = kept
        self.jobs: dict[str, _Job] = {}
        self.mailbox = Mailbox()

    # -- open and close -----------------------------------------------------------------------

    async def open_job(self, message: OpenJob) -> Ack:
        """Start a daemon for the job (replacing one of the same id) and load its filters."""
        self._refuse_unless_accepting(message.job_id)
        while (previous := self.jobs.pop(message.job_id, None)) is not None:
            log.info("job %s: opened again; closing its previous daemon", message.job_id)
            await self._close_job(previous)
        self._refuse_unless_accepting(message.job_id)  # stop() may have come meanwhile
        supervisor, started = await self._pool.for_job(message.threads)
        job = _Job(message.job_id, supervisor, peer_secret=message.peer_secret)
        job.opening = owned_task(self._open(job, message.filters, start=not started))
        self.jobs[job.job_id] = job
        try:
            # Shielded: the job owns the opening (see _close_job), this handler only waits.
            await asyncio.shield(job.opening)
        except asyncio.CancelledError as exc:
            if not job.opening.cancelled() or cancelling():
                raise
            raise RequestRefused(
                self._job_info(job, ErrorCode.CANCELLED, "closed while opening")
            ) from exc
        except DaemonError as exc:
            if self.jobs.get(job.job_id) is job:
                del self.jobs[job.job_id]
            await self._pool.close(supervisor)
            raise self._job_error(job, "open_job", exc) from exc
        log.info(
            "job %s: opened (daemon pid %s, %d filters, %d threads)",
            job.job_id,
            supervisor.pid,
            len(message.filters),
            supervisor.threads,
        )
        return Ack()

    async def _open(self, job: _Job, filters: dict[str, Any], start: bool) -> None:
        if start:
            await job.supervisor.start()
        await job.supervisor.request(LoadRequest(id=0, cmd="load", filters=filters))

    async def close_job(self, message: CloseJob) -> Ack:
        """Close the job's daemon (cancelling a running call); an unknown job is already closed."""
        job = self.jobs.pop(message.job_id, None)
        if job is not None:
            await self._close_job(job)
            log.info("job %s: closed", job.job_id)
        return Ack()

    async def close_all(self) -> None:
        """Close every open job (the connection is going)."""
        jobs = list(self.jobs.values())
        self.jobs.clear()
        if jobs:
            await asyncio.gather(*(self._close_job(job) for job in jobs))
            log.info("closed %d job(s): %s", len(jobs), ", ".join(job.job_id for job in jobs))

    async def _close_job(self, job: _Job) -> None:
        self.mailbox.drop(job.job_id)
        await asyncio.to_thread(self._kept.drop, job.job_id)
        await self._links.drop_job(job.job_id)
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
        await self._pool.close(job.supervisor)

    def current_job(self) -> str | None:
        """The job to name in heartbeats: the newest with a call running, else the newest open."""
        jobs = list(reversed(self.jobs.values()))
        busy = [job for job in jobs if job.calls]
        return (busy or jobs)[0].job_id if jobs else None

    # -- calls --------------------------------------------------------------------------------

    async def call(self, message: Call) -> Result:
        """Forward one daemon command of the job and return its result (sequenced calls wait
        for their turn, see :class:`~worker.peer.CallOrder`)."""
        job = self.jobs.get(message.job_id)
        if job is not None and job.opening is not None and not job.opening.done():
            # Normally the coordinator waits for open_job's ack; if not, wait for the daemon
            # rather than fail with "not running". asyncio.wait never cancels the opening.
            await asyncio.wait({job.opening})
            job = self.jobs.get(message.job_id)
        if job is None:
            raise RequestRefused(self._unknown_job(message.job_id))
        cmd = str(message.request.get("cmd"))
        timeout = self._config.call_timeout if message.timeout is None else message.timeout
        if message.seq is None:
            result = await self._run_call(job, message, cmd, timeout)
        else:
            try:
                async with job.order.turn(message.seq, cmd, timeout):
                    result = await self._run_call(job, message, cmd, timeout)
            except OutOfOrder as exc:
                raise RequestRefused(
                    self._job_info(job, ErrorCode.CANCELLED, str(exc), cmd=cmd)
                ) from exc
        if message.output_to is not None:
            return await self._deliver_output(
                job, message.output_to.worker, message.output_to.key, result
            )
        if message.keep is not None:
            result = await self._keep(job, cmd, result, message.keep)
        return Result(result=result)

    async def _keep(self, job: _Job, cmd: str, result: Any, keys: list[str]) -> Any:
        """``result`` with the files at ``keys`` written here and their names and sizes in
        their place (``Call.keep``)."""
        try:
            parent, files = files_at(result, keys)
        except ValueError as exc:
            raise RequestRefused(
                self._job_info(job, ErrorCode.BAD_REQUEST, f"{cmd}'s reply kept: {exc}")
            ) from exc
        parent[keys[-1]] = said = await asyncio.to_thread(self._kept.keep, job.job_id, files)
        if self.jobs.get(job.job_id) is not job:  # closed meanwhile: its files go with it
            await asyncio.to_thread(self._kept.drop, job.job_id, said["kept"])
        return result

    async def read_kept(self, message: ReadKept) -> Result:
        """A piece of a file a call of the job kept here."""
        if message.job_id not in self.jobs:
            raise RequestRefused(self._unknown_job(message.job_id))
        piece = await asyncio.to_thread(
            self._kept.read,
            message.job_id,
            message.kept,
            message.name,
            message.offset,
            message.length,
        )
        return Result(result=piece)

    async def drop_kept(self, message: DropKept) -> Ack:
        """Remove the files a call of the job kept here under ``message.kept``."""
        await asyncio.to_thread(self._kept.drop, message.job_id, message.kept)
        return Ack()

    async def _run_call(self, job: _Job, message: Call, cmd: str, timeout: float) -> Any:  # noqa: ASYNC109
        """Take the call's input from the mailbox if it names one, then run it on the daemon."""
        request = message.request
        if message.input_from is not None:
            payload = await self._take_input(job, message.input_from, timeout, cmd)
            # A bytearray: the tensors decode zero-copy over it and stay writable.
            request = {**request, message.input_field: decode(bytearray(payload), relay=True)}
        task = owned_task(job.supervisor.request_dict(request, timeout))
        job.calls.add(task)
        task.add_done_callback(job.calls.discard)
        try:
            # Shielded: close_job cancels the task itself (which kills the daemon), and a
            # cancelled handler (the connection went) leaves it to the teardown.
            return await asyncio.shield(task)
        except asyncio.CancelledError as exc:
            if not task.cancelled() or cancelling():
                raise
            raise RequestRefused(
                self._job_info(job, ErrorCode.CANCELLED, f"closed while running {cmd}", cmd=cmd)
            ) from exc
        except DaemonError as exc:
            raise self._job_error(job, cmd, exc) from exc

    async def _take_input(self, job: _Job, key: str, timeout: float, cmd: str) -> bytes:  # noqa: ASYNC109
        try:
            return await self.mailbox.take(job.job_id, key, timeout)
        except TimeoutError as exc:
            raise RequestRefused(
                self._job_info(
                    job, ErrorCode.TIMEOUT, f"waiting {timeout}s for input {key!r}", cmd=cmd
                )
            ) from exc
        except MailboxDropped as exc:
            raise RequestRefused(
                self._job_info(job, ErrorCode.CANCELLED, f"closed while waiting for {key!r}")
            ) from exc

    async def _deliver_output(self, job: _Job, to: str, key: str, result: Any) -> Result:
        """Send a call's result to worker ``to``'s mailbox: directly, else through the
        coordinator (which relays it). The call fails at once when it cannot be delivered."""
        payload = encode_frame(result)
        deliver = Deliver(job_id=job.job_id, to=to, key=key, payload=payload)
        try:
            if not await self._links.send(to, deliver):
                channel = self._coordinator()
                if channel is None:
                    raise ChannelClosed("not connected to the coordinator")
                await channel.request(deliver, RELAY_TIMEOUT)
        except RemoteError as exc:
            info = exc.info
            raise RequestRefused(
                self._job_info(job, info.code, f"refused {key!r} by {to}: {info.message}")
            ) from None
        except (ChannelClosed, TimeoutError) as exc:
            raise RequestRefused(
                self._job_info(job, ErrorCode.WORKER_LOST, f"unable to deliver {key!r}: {exc}")
            ) from None
        return Result(result={"delivered": len(payload)})

    # -- pipeline links and deliveries --------------------------------------------------------

    async def links(self, message: Links) -> Result:
        """Open direct links to the job's peers that have an address; say which work. What
        each peer may deliver here is ``message.expects``."""
        job = self.jobs.get(message.job_id)
        if job is None:
            raise RequestRefused(self._unknown_job(message.job_id))
        job.expects = dict(message.expects)
        direct: list[str] = []
        relay: list[str] = []
        for worker_id, address in message.peers.items():
            presented = message.credentials.get(worker_id)
            if (
                address is not None
                and presented is not None
                and await self._links.connect(job.job_id, presented, worker_id, address)
            ):
                direct.append(worker_id)
            else:
                relay.append(worker_id)
        log.info("job %s: direct links %s, relayed %s", message.job_id, direct, relay)
        return Result(result={"direct": direct, "relay": relay})

    def admit_peer(self, hello: PeerHello) -> None:
        """Whether a peer link may open: ``hello`` names a job open here and presents the
        credential of the worker it claims to be (:mod:`protocol.security.peer_credentials`,
        compared in constant time; a job unknown here is refused the same way).

        Raises:
            RequestRefused: ``unauthorized``, naming only the job the hello named.
        """
        job = self.jobs.get(hello.job_id)
        if not matches(None if job is None else job.peer_secret, hello.worker_id, hello.secret):
            raise RequestRefused.of(
                ErrorCode.UNAUTHORIZED,
                f"worker {self._worker_id()}: peer link from {hello.worker_id!r} refused: no "
                f"open job {hello.job_id!r} here for which it holds that credential",
            )

    async def deliver(self, message: Deliver) -> Ack:
        """A tensor relayed by the coordinator (which set its ``sender``): into the mailbox."""
        return self.put(message)

    def put(self, message: Deliver) -> Ack:
        """Into the mailbox, if it is for this worker, its job is open here and expects that key
        from its sender (a delivery for another job would sit there forever).

        Raises:
            RequestRefused: the job is not open here, the key is not one the sender delivers,
                it was delivered already, or the mailbox is full.
        """
        job = self.jobs.get(message.job_id)
        if job is None:
            raise RequestRefused(self._unknown_job(message.job_id))
        me = self._worker_id()
        prefix = job.expects.get(message.sender or "")
        if message.to != me or prefix is None or not message.key.startswith(prefix):
            raise RequestRefused.of(
                ErrorCode.BAD_REQUEST,
                f"job {job.job_id!r} on worker {me} takes no {message.key!r} for worker "
                f"{message.to!r} from {message.sender!r}",
                job_id=job.job_id,
                key=message.key,
            )
        try:
            self.mailbox.put(message.job_id, message.key, message.payload)
        except MailboxFull as exc:
            raise RequestRefused(ErrorInfo(code=ErrorCode.BUSY, message=str(exc))) from exc
        except DeliveredTwice as exc:
            raise RequestRefused(ErrorInfo(code=ErrorCode.BAD_REQUEST, message=str(exc))) from exc
        return Ack()

    # -- the spare daemon ---------------------------------------------------------------------

    async def probe(self, message: Probe) -> Result:
        """Ping the spare daemon: the no-op round trip through coordinator, agent and daemon."""
        try:
            supervisor = await self._pool.ping_spare()
        except DaemonError as exc:
            raise RequestRefused(exc.info()) from exc
        if supervisor is None:
            raise RequestRefused.of(
                ErrorCode.BAD_REQUEST,
                f"worker {self._worker_id()} keeps no spare daemon to probe",
            )
        return Result(result={"worker_id": self._worker_id(), "daemon_pid": supervisor.pid})

    # -- errors -------------------------------------------------------------------------------

    def _refuse_unless_accepting(self, job_id: str) -> None:
        if not self._lifecycle.accepting:
            worker_id = self._worker_id()
            raise RequestRefused.of(
                ErrorCode.SHUTTING_DOWN,
                f"worker {worker_id} is shutting down: job {job_id!r} refused",
                worker_id=worker_id,
                job_id=job_id,
            )

    def _unknown_job(self, job_id: str) -> ErrorInfo:
        """The refusal of a request for a job not open here: it names no other job."""
        worker_id = self._worker_id()
        return ErrorInfo(
            code=ErrorCode.UNKNOWN_JOB,
            message=f"worker {worker_id} has no open job {job_id!r}",
            detail={"worker_id": worker_id, "job_id": job_id},
        )

    def _job_info(self, job: _Job, code: ErrorCode, what: str, **detail: Any) -> ErrorInfo:
        log.warning("job %s: %s", job.job_id, what)
        worker_id = self._worker_id()
        return ErrorInfo(
            code=code,
            message=f"job {job.job_id!r} on worker {worker_id} was {what}",
            detail={**detail, "worker_id": worker_id, "job_id": job.job_id},
        )

    def _job_error(self, job: _Job, cmd: str, exc: DaemonError) -> RequestRefused:
        """A daemon error as the reply: its own code, message and detail, plus where."""
        info = exc.info()
        first_line = info.message.splitlines()[0] if info.message else ""
        log.warning("job %s: %s failed: %s: %s", job.job_id, cmd, info.code, first_line)
        detail = {**info.detail, "worker_id": self._worker_id(), "job_id": job.job_id}
        return RequestRefused(info.model_copy(update={"detail": detail}))
