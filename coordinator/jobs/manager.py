"""Jobs: queued, placed on workers, run by their strategy, recorded in the store.

A submitted job waits in a FIFO queue until enough idle workers match its strategy's
:class:`~coordinator.strategies.Placement`; a job that cannot be placed yet does not hold up later
jobs that can. Running, it owns its workers until it ends, whatever way it ends: its daemons are
closed and its workers freed in one ``finally``. A running job that lost a worker and can go on
(elastic DataParallel) *recruits* a replacement: the next idle worker that matches its placement
is reserved for it before any queued job is placed, and is freed with the job's others.

A run that a fault of the cluster ended (a worker lost, a daemon crashed:
:mod:`coordinator.jobs.restarts`) goes back to the head of the queue when its strategy allows
``max_restarts``, and resumes from its last checkpoint on the workers that take it.

Every change of a job is an event in the store (``queued``, ``placed``, ``progress``,
``restarting``, ``succeeded``, ``failed``, ``cancelled``) and is pushed to the clients watching
it (:mod:`coordinator.jobs.events`). A job is
``succeeded`` only once its strategy returned the states read back from the workers and they are
stored with the state change, in one transaction.

A placed job runs on the strategy context its :data:`ContextFactory` makes from a
:class:`PlacedJob` (its workers, timeouts, the recruit callback): the live workers over their
connections (:func:`transport_context`) in the server, in-memory ones in the unit tests.

The store is SQLite: every call into it runs in a thread, never on the event loop. The write
that records how a job ended is tried again while the store fails (a full disk may get room, a
database locked by a backup be let go: :data:`STORE_RETRIES`); if it never goes through, the
job's watchers are told anyway, its record reads as it ended, and the end is written as soon as
the store takes it (:mod:`coordinator.jobs.owed_ends`; a coordinator stopped before then marks
it failed at its next start, ``coordinator_restarted``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import itertools
import logging
import sqlite3
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from coordinator.context import (
    DEFAULT_CALL_TIMEOUT,
    StrategyContext,
    WorkerCallError,
)
from coordinator.errors import StoreError
from coordinator.jobs.events import JobEvents
from coordinator.jobs.files import JobFiles
from coordinator.jobs.owed_ends import OwedEnds
from coordinator.jobs.pruning import Pruning
from coordinator.jobs.restarts import no_workers_for_restart, restarting_event, should_restart
from coordinator.jobs.result_pieces import answer, kept
from coordinator.jobs.submission import (
    check_workers,
    job_inputs,
    no_workers_after_wait,
    placement_of,
    summary_of,
    vetted,
)
from coordinator.scheduling.plan import DEFAULT_SHARE_WAIT, Queued, Running, Seat, Wait, plan
from coordinator.scheduling.shares import DEFAULT_HALF_LIFE, ClientPolicy, UsageLedger
from coordinator.storage.kept_files import PIECE_BYTES
from coordinator.storage.store import (
    EventRecord,
    JobRecord,
    JobState,
    JobStore,
    UnknownJob,
    error_record,
)
from coordinator.strategies import (
    JobInputs,
    Placement,
    ShardedStates,
    Strategy,
    StrategyFailed,
    strategy_from_spec,
)
from coordinator.workers.registry import Registry, WorkerRecord, WorkerState
from coordinator.workers.transport import TransportContext
from protocol.codec import decode, encode_frame
from protocol.errors import ErrorCode, ErrorInfo, FrameError, RequestRefused
from protocol.messages import MAX_READ_BYTES, StrategySpec, Submit

__all__ = [
    "ADMIN_POLICY",
    "DEFAULT_OWNER",
    "DEFAULT_PREEMPT_GRACE",
    "STORE_RETRIES",
    "ContextFactory",
    "JobManager",
    "PlacedJob",
    "Sharing",
    "record_dict",
    "transport_context",
]

log = logging.getLogger(__name__)

DEFAULT_OWNER = "client"
"""The owner of a job submitted without a client name: the ``client`` admin, whom everyone is
without client tokens (:data:`coordinator.server.clients.EVERYONE`)."""

STORE_RETRIES = (0.5, 1.0, 2.0, 4.0)
"""Seconds between the tries of a terminal write when the store fails."""

DEFAULT_PREEMPT_GRACE = 60.0
"""Seconds a preempted job has to save a checkpoint at its next safe point before its run is
stopped anyway (it then resumes from the checkpoint before)."""

PASS_EVERY = 5.0
"""Seconds between two placement passes when nothing else calls one: a job's wait for its
share (``share_wait``) and the estimates in the queue move with the clock."""

FINISHING = 1.0
"""Seconds a preempted run is given to end on its own once its checkpoint is written: the
checkpoint of its last step is followed by its end, not by a requeue."""

ADMIN_POLICY = ClientPolicy(max_priority=None)
"""What a client the coordinator knows nothing more of is owed: an equal share, no quota, no
priority ceiling (everyone, where there are no client tokens, is the ``client`` admin)."""


def record_dict(record: JobRecord) -> dict[str, Any]:
    """A job record as it travels to clients."""
    out = dataclasses.asdict(record)
    out["state"] = str(record.state)
    return out


@dataclass(frozen=True)
class Sharing:
    """How the manager shares the workers between clients.

    Args:
        policies: each client's share, quota and priority ceiling (by client name).
        preempt_grace: seconds a preempted job has to checkpoint before it is stopped.
        share_wait: seconds a job waits before it preempts for its client's fair share.
        half_life: seconds after which a client's past use of workers counts half.
        fifo: place jobs first come, first placed, as before fair shares (``--scheduler
            fifo``): no priority, share, reservation, preemption or quota.
    """

    policies: Callable[[str], ClientPolicy] = lambda client: ADMIN_POLICY
    preempt_grace: float = DEFAULT_PREEMPT_GRACE
    share_wait: float = DEFAULT_SHARE_WAIT
    half_life: float = DEFAULT_HALF_LIFE
    fifo: bool = False


@dataclass(frozen=True)
class PlacedJob:
    """What a job's strategy context is made from, once the job has its workers.

    Attributes:
        job_id: the job.
        workers: the registry records of its workers, in strategy index order.
        timeout: seconds one command may take on a worker.
        threads: torch threads of each job daemon (``None``: each worker's ``shares``).
        observe: called with ``(command, seconds)`` for every successful worker command.
        recruit: waits up to the given seconds for a worker to replace a lost one and reserves
            it for the job (:meth:`JobManager.recruit`); ``None`` if none came.
        shares: a worker's torch threads when ``threads`` is ``None``: its share of a machine
            other workers run on too (:meth:`Registry.thread_share`), or ``None`` (the agent's
            own default).
    """

    job_id: str
    workers: list[WorkerRecord]
    timeout: float
    threads: int | None
    observe: Callable[[str, float], None]
    recruit: Callable[[float], Awaitable[WorkerRecord | None]]
    shares: Callable[[WorkerRecord], int | None] = lambda record: None


ContextFactory = Callable[[PlacedJob], AbstractAsyncContextManager[StrategyContext]]
"""Makes a placed job's strategy context; leaving it closes the job on its workers."""


@asynccontextmanager
async def transport_context(job: PlacedJob) -> AsyncIterator[StrategyContext]:
    """The job's live workers over their connections (:class:`TransportContext`)."""
    ctx = TransportContext(
        job.job_id,
        job.workers,
        job.timeout,
        threads=job.threads,
        observe=job.observe,
        recruit=job.recruit,
        shares=job.shares,
    )
    try:
        yield ctx
    finally:
        await ctx.close()


@dataclass
class _Job:
    id: str
    strategy: Strategy
    inputs: JobInputs
    owner: str = DEFAULT_OWNER  # the client that submitted it
    done: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None
    workers: list[WorkerRecord] = field(default_factory=list)
    stop_reason: ErrorInfo | None = None  # why the task was cancelled (client or shutdown)
    spec: StrategySpec | None = None  # what the strategy was made from: remade for a restart
    restarts: int = 0  # times it went back to its last checkpoint after a fault
    restart_for: ErrorInfo | None = None  # the fault its run just ended with, to restart past
    # Fails it if no workers take it in time (a restart's restart_timeout, wait_for_workers).
    wait_expiry: asyncio.Task[None] | None = None
    resume_from: str | None = None  # the job whose newest checkpoint it starts from
    priority: int = 0
    preemptible: bool = True  # the client allows it (it is preempted only if it resumes too)
    time_limit: float | None = None  # seconds each run may take
    slots: int = 1  # of each of its workers
    order: int = 0  # submission order, kept when it is queued again
    queued_at: float = field(default_factory=time.monotonic)
    started_at: float = 0.0
    deadline: asyncio.TimerHandle | None = None  # its time limit, while it runs
    leaving: asyncio.Task[None] | None = None  # it is being preempted
    leave_by: float = 0.0  # when its run stops at the latest, once it is being preempted
    preempted: ErrorInfo | None = None  # why its run was stopped to make room


@dataclass
class _Recruit:
    """A running job waiting for a worker to replace one it lost."""

    job: _Job
    placement: Placement
    found: asyncio.Future[WorkerRecord]


class JobManager:
    """The queue, the running jobs and their event streams.

    Args:
        store: the job store (SQLite).
        registry: the workers.
        call_timeout: seconds one command of a job may take on a worker.
        job_threads: torch threads of each job daemon (``None``: the agent's default).
        observe: called with ``(command, seconds)`` for every successful worker command.
        context_factory: makes the strategy context of each job placed on its workers (the
            live workers over their connections unless told otherwise).
        max_queued_jobs: jobs one client may have queued or running at once (``None``: any).
        files: where each live job's submit message and checkpoints are kept, so that a
            restarted coordinator resumes it, and whose memory map of that message the job's
            inputs are (``None``: nowhere; it would not, and its inputs stay in memory).
        sharing: how the workers are shared between clients (:class:`Sharing`).
    """

    def __init__(
        self,
        store: JobStore,
        registry: Registry,
        *,
        call_timeout: float = DEFAULT_CALL_TIMEOUT,
        job_threads: int | None = None,
        observe: Callable[[str, float], None] = lambda cmd, seconds: None,
        context_factory: ContextFactory = transport_context,
        max_queued_jobs: int | None = None,
        files: JobFiles | None = None,
        sharing: Sharing = Sharing(),
    ) -> None:
        self.store = store
        self.files = files
        self.max_queued_jobs = max_queued_jobs
        self.registry = registry
        self.call_timeout = call_timeout
        self.job_threads = job_threads
        self.observe = observe
        self.context_factory = context_factory
        self._jobs: dict[str, _Job] = {}
        self._queue: list[str] = []
        self._recruits: list[_Recruit] = []  # served before the queue
        self.policies = sharing.policies
        self.preempt_grace = sharing.preempt_grace
        self.share_wait = sharing.share_wait
        self.fifo = sharing.fifo
        self.usage = UsageLedger(sharing.half_life)
        """Each client's decayed use of worker-time (fair share)."""
        self.waits: dict[str, Wait] = {}
        """Where each queued job stands, and why it waits, as the last pass found."""
        self._reserved_for: str | None = None  # the job free workers are held for
        self._orders = itertools.count()
        self.events = JobEvents(store)
        self.pruning = Pruning(store, files)  # ended jobs removed (somatize prune, retention)
        self.owed_ends = OwedEnds()
        """Ends the store refused, written when it can (:meth:`OwedEnds.pay_forever`)."""
        self._wake = asyncio.Event()
        self.accepting = True

    # -- scheduling ---------------------------------------------------------------------------

    def kick(self) -> None:
        """Something changed that may let a queued job start."""
        self._wake.set()

    async def place_forever(self) -> None:
        """Place queued jobs whenever workers or jobs change, and every :data:`PASS_EVERY`
        seconds."""
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(PASS_EVERY):
                    await self._wake.wait()
            self._wake.clear()
            self._place()

    def _place(self) -> None:
        # Running jobs waiting for a replacement first: they hold workers and made progress.
        for recruit in list(self._recruits):
            if recruit.found.done():  # gave up waiting
                self._recruits.remove(recruit)
                continue
            worker = next(
                (w for w in self.registry.idle() if recruit.placement.accepts(w.identity)), None
            )
            if worker is None:
                continue
            self._reserve(recruit.job, [worker])
            self._recruits.remove(recruit)
            recruit.found.set_result(worker)
        now = time.monotonic()
        running = [j for j in self._jobs.values() if j.task is not None]
        self._accrue(now)
        seats = [
            Seat(w.identity, w.slots, w.free_slots)
            for w in self.registry
            if w.connected and w.state in (WorkerState.IDLE, WorkerState.BUSY)
        ]
        decided = plan(
            [self._queued(self._jobs[job_id], now) for job_id in self._queue],
            [self._running(job) for job in running],
            seats,
            self.policies,
            self.usage.clients(),
            now,
            reserved_for=self._reserved_for,
            share_wait=self.share_wait,
            fifo=self.fifo,
        )
        self._reserved_for = decided.reserved_for
        self.waits = decided.waits
        for job_id, worker_ids in decided.starts:
            job = self._jobs[job_id]
            workers = [self.registry.get(w) for w in worker_ids]
            self._reserve(job, [w for w in workers if w is not None])
            self._queue.remove(job_id)
            if job.wait_expiry is not None:
                job.wait_expiry.cancel()
                job.wait_expiry = None
            job.started_at = now
            job.task = asyncio.create_task(self._run(job), name=f"job {job_id}")
            if job.time_limit is not None:
                job.deadline = asyncio.get_running_loop().call_later(
                    job.time_limit, self._time_up, job
                )
        for victim, making_room_for in decided.preempt:
            self._preempt(self._jobs[victim], making_room_for)

    def _held(self) -> dict[str, float]:
        """The workers each client's running jobs hold (a slot of four: ¼)."""
        held: dict[str, float] = {}
        for job in self._jobs.values():
            if job.task is not None:
                load = sum(job.slots / max(1, w.slots) for w in job.workers)
                held[job.owner] = held.get(job.owner, 0.0) + load
        return held

    def _accrue(self, now: float) -> None:
        """Charge each client's ledger what its jobs held since the last charge."""
        self.usage.accrue(self._held(), now)

    def _queued(self, job: _Job, now: float) -> Queued:
        return Queued(
            job.id,
            job.owner,
            placement_of(job.strategy, job.inputs),
            priority=job.priority,
            order=job.order,
            slots=job.slots,
            time_limit=job.time_limit,
            preemptible=job.preemptible,
            waited=now - job.queued_at,
        )

    def _running(self, job: _Job) -> Running:
        ends = None if job.time_limit is None else job.started_at + job.time_limit
        if job.leaving is not None:
            ends = job.leave_by
        return Running(
            job.id,
            job.owner,
            tuple(w.id for w in job.workers),
            priority=job.priority,
            slots=job.slots,
            started=job.started_at,
            ends=ends,
            preemptible=self._resumable(job),
            leaving=job.leaving is not None,
        )

    def _resumable(self, job: _Job) -> bool:
        """Whether ``job`` may be preempted: its client allows it, and it resumes from its
        checkpoints where it stopped."""
        return (
            job.preemptible
            and self.files is not None
            and job.strategy.saves_checkpoints
            and job.strategy.checkpoint_every != 0
        )

    def _reserve(self, job: _Job, workers: list[WorkerRecord]) -> None:
        # By id (a list's ``in`` compares records field by field: seconds for 10,000 workers);
        # a lost worker may come back as its own replacement: it is in the job's workers once.
        held = {w.id for w in job.workers}
        for worker in workers:
            worker.take(job.id, job.slots)
            if worker.id not in held:
                held.add(worker.id)
                job.workers.append(worker)

    # -- preemption and time limits -------------------------------------------------------------

    def _preempt(self, job: _Job, making_room_for: str) -> None:
        """Have the running ``job`` leave for ``making_room_for``: a checkpoint at its next
        safe point (within :attr:`preempt_grace`), then its run stops and it is queued again,
        to resume from that checkpoint."""
        if job.leaving is not None or job.task is None:
            return
        job.leave_by = time.monotonic() + self.preempt_grace
        job.leaving = asyncio.create_task(
            self._leave(job, making_room_for), name=f"job {job.id} leaves"
        )

    async def _leave(self, job: _Job, making_room_for: str) -> None:
        task = job.task
        grace = self.preempt_grace
        await self._emit(job.id, "preempting", {"for": making_room_for, "grace": grace})
        saves = job.inputs.checkpoints
        if saves is not None:
            try:
                async with asyncio.timeout(grace):
                    await asyncio.shield(saves.ask())
            except TimeoutError:
                log.info("job %s: no checkpoint within %gs of its preemption", job.id, grace)
        if task is not None and not task.done():  # its last checkpoint: the run ends itself
            await asyncio.wait({task}, timeout=FINISHING)
        if task is None or task.done() or job.stop_reason is not None:
            return
        why = f"preempted to make room for job {making_room_for}"
        job.preempted = ErrorInfo(
            code=ErrorCode.PREEMPTED, message=why, detail={"for": making_room_for}
        )
        task.cancel()

    def _time_up(self, job: _Job) -> None:
        """``job`` ran past its ``time_limit``: its run stops and it fails."""
        job.deadline = None
        if job.task is None or job.task.done() or job.stop_reason is not None:
            return
        job.stop_reason = ErrorInfo(
            code=ErrorCode.TIME_LIMIT,
            message=f"the job ran past its time_limit of {job.time_limit:g}s",
            detail={"time_limit": job.time_limit},
        )
        job.task.cancel()

    async def recruit(self, job_id: str, timeout: float) -> WorkerRecord | None:  # noqa: ASYNC109
        """Wait up to ``timeout`` seconds for an idle worker that matches the running job's
        placement and reserve it for the job (ahead of queued jobs); ``None`` if none came.

        The worker joins the job's workers, so it is freed with them when the job ends."""
        job = self._jobs[job_id]
        recruit = _Recruit(
            job,
            placement_of(job.strategy, job.inputs),
            asyncio.get_running_loop().create_future(),
        )
        self._recruits.append(recruit)
        self._place()  # one may be idle already
        try:
            async with asyncio.timeout(timeout):
                return await asyncio.shield(recruit.found)
        except TimeoutError:
            # It may have been found in the very iteration the time ran out: take it.
            found = recruit.found
            return found.result() if found.done() and not found.cancelled() else None
        finally:
            if not recruit.found.done():
                recruit.found.cancel()
            if recruit in self._recruits:
                self._recruits.remove(recruit)

    # -- client requests ----------------------------------------------------------------------

    async def submit(self, msg: Submit, owner: str = DEFAULT_OWNER) -> str:
        """Validate and queue a job of client ``owner``; returns its id.

        The checks are linear in the graph's size and run off the event loop: a submit of a
        huge graph delays no heartbeat and no other client. A client that has
        :attr:`max_queued_jobs` jobs queued or running already is refused ``busy``."""
        if not self.accepting:
            raise RequestRefused.of(ErrorCode.SHUTTING_DOWN, "the coordinator is shutting down")
        live = sum(1 for job in self._jobs.values() if job.owner == owner)
        if self.max_queued_jobs is not None and live >= self.max_queued_jobs:
            raise RequestRefused.of(
                ErrorCode.BUSY,
                f"client {owner} has {live} jobs queued or running (the limit is "
                f"{self.max_queued_jobs}): submit again once one has ended",
                limit=self.max_queued_jobs,
            )
        strategy, inputs, placement = await asyncio.to_thread(vetted, msg)
        waits = msg.wait_for_workers
        check_workers(placement, inputs, list(self.registry), waits is not None)
        self._check_scheduling(msg, placement, owner, waits is not None)
        if msg.resume_from is not None:
            if self.files is None:
                raise RequestRefused.of(
                    ErrorCode.BAD_REQUEST, "resume_from: this coordinator keeps no checkpoints"
                )
            source = await self._record(msg.resume_from)
            await asyncio.to_thread(self.files.continuable, source, strategy)
        summary = summary_of(msg, placement, owner)
        record = await asyncio.to_thread(self.store.create, strategy.name, summary)
        if self.files is not None:  # the inputs read back over the file: msg is dropped
            inputs = job_inputs(await asyncio.to_thread(self.files.keep, record.id, msg, owner))
        job = self._job(record.id, strategy, inputs, owner, msg)
        await self._enqueue(
            job, placement.describe(), {"name": msg.name} if msg.name else {}, waits
        )
        return record.id

    def _job(
        self, job_id: str, strategy: Strategy, inputs: JobInputs, owner: str, msg: Submit
    ) -> _Job:
        return _Job(
            job_id,
            strategy,
            inputs,
            owner,
            spec=msg.strategy,
            resume_from=msg.resume_from,
            priority=msg.priority,
            preemptible=msg.preemptible,
            time_limit=msg.time_limit,
            slots=msg.slots,
            order=next(self._orders),
        )

    def _check_scheduling(self, msg: Submit, placement: Placement, owner: str, waits: bool) -> None:
        """Refuse what the client may not ask (a priority over its ceiling), or what could
        never start (more slots than any worker gives, more workers than its quota allows a
        job that may not borrow).

        Raises:
            RequestRefused: ``BAD_REQUEST`` or ``NO_WORKERS`` saying which.
        """
        policy = self.policies(owner)
        ceiling = policy.max_priority
        if ceiling is not None and msg.priority > ceiling:
            raise RequestRefused.of(
                ErrorCode.BAD_REQUEST,
                f"priority {msg.priority} is over client {owner}'s ceiling of {ceiling} "
                "(max_priority in the coordinator's clients file)",
                priority=msg.priority,
                max_priority=ceiling,
            )
        quota = policy.max_workers
        if not msg.preemptible and quota is not None and placement.workers > quota:
            raise RequestRefused.of(
                ErrorCode.BAD_REQUEST,
                f"the job needs {placement.workers} workers and may not be preempted, but "
                f"client {owner} may hold {quota} (max_workers): submit it preemptible to "
                "borrow past the quota",
                max_workers=quota,
            )
        if msg.slots > 1 and not waits:
            most = max((w.slots for w in self.registry), default=0)
            if most < msg.slots:
                raise RequestRefused.of(
                    ErrorCode.NO_WORKERS,
                    f"the job asks for {msg.slots} slots of each worker, and no registered "
                    f"worker gives more than {most} (somatize-worker --slots)",
                    slots=msg.slots,
                )

    async def requeue(self, record: JobRecord) -> None:
        """Queue again a job a previous coordinator left live (the store made it ``queued``),
        from what it was submitted with; one that cannot be read back fails, saying why."""
        files = self.files
        if files is None:
            raise RuntimeError("requeue needs the job files the store resumed jobs from")
        try:
            msg, owner = await asyncio.to_thread(files.load, record.id)
            strategy, inputs, placement = await asyncio.to_thread(vetted, msg)
        except Exception as exc:
            log.warning("job %s cannot be resumed: %s", record.id, exc)
            info = ErrorInfo(
                code=ErrorCode.COORDINATOR_RESTARTED,
                message=f"the coordinator restarted and could not resume the job: {exc}",
            )
            await self._record_end(record.id, info)
            return
        after = {"requeued": "the coordinator restarted"}
        job = self._job(record.id, strategy, inputs, owner, msg)
        await self._enqueue(job, placement.describe(), after, msg.wait_for_workers)

    async def _enqueue(
        self, job: _Job, placement: str, data: dict[str, Any], waits: float | None
    ) -> None:
        """Queue ``job``; one that ``waits`` for workers fails after that many seconds."""
        self._jobs[job.id] = job
        self._queue.append(job.id)
        waiting = {} if waits is None else {"wait_for_workers": waits}
        await self._emit(job.id, "queued", {"placement": placement} | data | waiting)
        if waits is not None:
            job.wait_expiry = self._expire(
                job, waits, functools.partial(self._no_workers_after_wait, job, waits)
            )
        self.kick()

    def _no_workers_after_wait(self, job: _Job, seconds: float) -> ErrorInfo:
        known = [w.identity for w in self.registry]
        return no_workers_after_wait(placement_of(job.strategy, job.inputs), known, seconds)

    def watch(self, job_id: str, after_seq: int = 0) -> AsyncIterator[EventRecord]:
        """The job's events after ``after_seq``, live until its terminal event."""
        return self.events.watch(job_id, after_seq, live=job_id in self._jobs)

    async def result(
        self,
        job_id: str,
        wait: float = 0.0,
        replica: int | None = None,
        offset: int | None = None,
        length: int = MAX_READ_BYTES,
    ) -> dict[str, Any]:
        """The states of a succeeded job, waiting up to ``wait`` seconds for it to end: by
        node (``states``), or a sharded run's as its replicas hold them (``pieces``: how many
        replicas and the bytes of each one's file; with ``replica``, that one's pieces, or
        with ``offset`` too, ``length`` bytes of its file from there; the client joins them:
        :func:`~coordinator.jobs.result_pieces.answer`)."""
        job = self._jobs.get(job_id)
        if job is not None and wait > 0:
            try:
                async with asyncio.timeout(wait):
                    await job.done.wait()
            except TimeoutError:
                pass
        record = await self._record(job_id)
        if record.state is JobState.SUCCEEDED:
            said = {"job_id": job_id, "record": record_dict(record)}
            kind = await asyncio.to_thread(self.store.result_kind, job_id)
            if kind == "states" and replica is not None:
                raise RequestRefused.of(
                    ErrorCode.BAD_REQUEST,
                    f"job {job_id} ran unsharded: its result is whole, not a replica's pieces",
                    job_id=job_id,
                )
            blob = await asyncio.to_thread(self.store.result, job_id)
            # (sent on as it is: its tensors relayed, never made torch's here)
            stored = await asyncio.to_thread(decode, bytearray(blob), relay=True)
            if kind == "states":
                return said | {"states": stored}
            files = None if self.files is None else self.files.results
            try:
                return said | await asyncio.to_thread(
                    answer, stored, replica, files, job_id, offset, length
                )
            except IndexError as exc:
                raise RequestRefused.of(
                    ErrorCode.BAD_REQUEST, f"job {job_id}: {exc}", job_id=job_id
                ) from exc
            except (OSError, FrameError) as exc:
                raise RequestRefused.of(
                    ErrorCode.INTERNAL,
                    f"job {job_id} succeeded, but its sharded result cannot be read: {exc}",
                    job_id=job_id,
                ) from exc
        if record.state.terminal:
            error = record.error or {"code": "internal", "message": "no error recorded"}
            raise RequestRefused.of(
                _code(error.get("code")),
                f"job {job_id} {record.state}: {error.get('message')}",
                **{**error.get("detail", {}), "job_id": job_id, "state": str(record.state)},
            )
        raise RequestRefused.of(
            ErrorCode.NOT_FINISHED,
            f"job {job_id} is still {record.state}",
            job_id=job_id,
            state=str(record.state),
        )

    async def cancel(self, job_id: str) -> None:
        """Cancel a queued or running job; it ends ``cancelled``."""
        job = self._jobs.get(job_id)
        if job is None or job.done.is_set():  # (ended, its run maybe still winding down)
            record = await self._record(job_id)
            raise RequestRefused.of(
                ErrorCode.BAD_REQUEST,
                f"job {job_id} already ended ({record.state}): nothing to cancel",
                job_id=job_id,
            )
        info = ErrorInfo(code=ErrorCode.CANCELLED, message="cancelled by the client")
        await self._stop(job, info)

    async def record(self, job_id: str) -> dict[str, Any]:
        return self._with_wait(record_dict(await self._record(job_id)))

    async def owner(self, job_id: str) -> str | None:
        """The client that submitted ``job_id`` (``None``: from before owners were kept).

        Raises:
            RequestRefused: ``unknown_job``.
        """
        job = self._jobs.get(job_id)
        if job is not None:
            return job.owner
        owner = (await self._record(job_id)).summary.get("owner")
        return owner if isinstance(owner, str) else None

    async def records(self, limit: int = 50) -> list[dict[str, Any]]:
        records = await asyncio.to_thread(self.store.list, None, limit)
        return [self._with_wait(record_dict(self.owed_ends.as_recorded(r))) for r in records]

    async def queue(self) -> list[dict[str, Any]]:
        """Every job queued or running, in the order they go (running first, then the queued
        by their place), each record with its ``wait`` while queued."""
        ids = [j.id for j in self._jobs.values() if j.task is not None]
        ids += sorted(
            self._queue, key=lambda i: self.waits[i].position if i in self.waits else 1 << 30
        )
        records = [await self._record(job_id) for job_id in ids]
        return [self._with_wait(record_dict(r)) for r in records]

    def shares(self) -> dict[str, dict[str, float]]:
        """Each client with jobs live or use on record: its ``share``, the workers it
        ``holds`` now, those it held lately (``recent``) and its ``fair`` part of the connected
        workers among the clients with jobs live."""
        held = self._held()
        live = {job.owner for job in self._jobs.values()}
        recent = self.usage.clients()
        weights = {c: self.policies(c).share for c in live}
        workers = sum(1 for w in self.registry if w.connected)
        total = sum(weights.values()) or 1.0
        return {
            client: {
                "share": self.policies(client).share,
                "holds": round(held.get(client, 0.0), 3),
                "recent": round(recent.get(client, 0.0), 3),
                "fair": round(workers * weights[client] / total, 3) if client in live else 0.0,
            }
            for client in sorted(live | set(recent))
        }

    def _with_wait(self, record: dict[str, Any]) -> dict[str, Any]:
        """``record`` with where its job stands in the queue and why it waits (``wait``:
        ``position``, ``reason``, ``detail``, ``starts_in`` seconds when it can be told), or
        with ``preempting`` while a running job is leaving for another."""
        job = self._jobs.get(record["id"])
        if job is None:
            return record
        if job.leaving is not None and job.task is not None:
            return record | {"preempting": True}
        wait = self.waits.get(job.id)
        if job.task is not None or wait is None:
            return record
        starts_in = None if wait.start is None else max(0.0, wait.start - time.monotonic())
        said = {
            "position": wait.position,
            "reason": str(wait.reason),
            "detail": wait.detail,
            "starts_in": None if starts_in is None else round(starts_in, 1),
        }
        return record | {"wait": said}

    async def counts(self) -> dict[JobState, int]:
        return await asyncio.to_thread(self.store.counts)

    # -- shutdown -----------------------------------------------------------------------------

    async def shutdown(self, grace: float) -> None:
        """Stop taking jobs; give running ones ``grace`` seconds, then fail what is left."""
        self.accepting = False
        running = [j.done.wait() for j in self._jobs.values() if j.task is not None]
        if running:
            try:
                async with asyncio.timeout(grace):
                    await asyncio.gather(*running)
            except TimeoutError:
                pass
        info = ErrorInfo(
            code=ErrorCode.SHUTTING_DOWN, message="the coordinator shut down before the job ended"
        )
        await asyncio.gather(*(self._stop(j, info) for j in list(self._jobs.values())))

    # -- internals ----------------------------------------------------------------------------

    async def _stop(self, job: _Job, info: ErrorInfo) -> None:
        if job.task is None:  # still queued
            if job.wait_expiry is not None:  # (None when it is the expiry that stops it)
                job.wait_expiry.cancel()
            self._queue.remove(job.id)
            self._jobs.pop(job.id, None)
            await self._end(job, info)
            return
        job.stop_reason = info
        job.task.cancel()
        await job.done.wait()

    async def _run(self, job: _Job) -> None:
        async def recruit(timeout: float) -> WorkerRecord | None:  # noqa: ASYNC109
            return await self.recruit(job.id, timeout)

        def share(record: WorkerRecord) -> int | None:
            """Its machine's threads, or its slots' part of them on a worker of several."""
            threads = self.registry.thread_share(record)
            if record.slots <= 1:
                return threads
            cpus = threads if threads is not None else record.capabilities.cpus
            return max(1, cpus * min(job.slots, record.slots) // record.slots)

        placed = PlacedJob(
            job.id,
            job.workers,
            self.call_timeout,
            self.job_threads,
            self.observe,
            recruit,
            share,
        )
        try:
            async with self.context_factory(placed) as ctx:
                await self._train(job, ctx)
        finally:
            if job.deadline is not None:
                job.deadline.cancel()
                job.deadline = None
            self._accrue(time.monotonic())  # its last stretch, while it still holds them
            for worker in job.workers:
                worker.give_back(job.id)
            if job.restart_for is None:
                self._jobs.pop(job.id, None)
                job.done.set()
                self.kick()
        if job.restart_for is not None:  # the kick comes once it is queued: it goes first
            await self._restart(job, job.restart_for)

    async def _restart(self, job: _Job, info: ErrorInfo) -> None:
        """Queue again a job whose run the fault ``info`` ended (its workers are free now), or
        end it if that cannot be stored or it is stopped meanwhile."""
        preempted = info.code is ErrorCode.PREEMPTED
        try:
            failure = await _failure_after_retries(job.id, self.store.requeue, job.id)
            if failure is None and preempted:
                await self._emit(job.id, "preempted", {"reason": info.message} | info.detail)
            elif failure is None:
                await self._emit(
                    job.id, "restarting", restarting_event(info, job.strategy, job.restarts)
                )
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()
            failure = "stopped while restarting"
            info = job.stop_reason or info
        if failure is not None:
            await self._end(job, info)
            self._jobs.pop(job.id, None)
            return
        self._queue_restart(job, info)
        self.kick()

    def _queue_restart(self, job: _Job, info: ErrorInfo) -> None:
        """Put the job back at the head of the queue, its strategy made again (nothing of the
        failed run is carried over but its checkpoints); it fails with ``info`` if no workers
        take it within its ``restart_timeout``."""
        job.restart_for = None
        job.task = None
        job.workers = []
        job.leaving = None
        job.preempted = None
        job.queued_at = time.monotonic()
        if job.spec is not None:
            job.strategy = strategy_from_spec(job.spec.name, job.spec.options)
        self._queue.insert(0, job.id)
        if info.code is ErrorCode.PREEMPTED:
            return  # it waits its turn again, for as long as that takes
        self._reserved_for = job.id  # a fault's restart goes first: free workers are its
        why = functools.partial(no_workers_for_restart, info, job.strategy, job.restarts)
        job.wait_expiry = self._expire(job, job.strategy.restart_timeout, why)

    def _expire(
        self, job: _Job, seconds: float, why: Callable[[], ErrorInfo]
    ) -> asyncio.Task[None]:
        """A task that fails the queued ``job`` with ``why()`` unless workers take it within
        ``seconds`` (placing it cancels the task)."""

        async def expire() -> None:
            await asyncio.sleep(seconds)
            if job.task is None and job.id in self._queue:
                job.wait_expiry = None
                await self._stop(job, why())

        return asyncio.create_task(expire(), name=f"job {job.id} waits for workers")

    async def _train(self, job: _Job, ctx: StrategyContext) -> None:
        """Run the job's strategy on ``ctx`` and record how it ended, whatever way it ends."""
        ids = [w.id for w in job.workers]
        try:
            await asyncio.to_thread(self.store.start, job.id, ids)
            devices = [w.capabilities.device for w in job.workers]

            # (not a closure over job: the job's inputs keep it, and job → inputs → emit → job
            # would be a cycle that only the rare full collection frees — with the job's data)
            emit = functools.partial(self._emit, job.id)

            if self.files is not None:
                saves = await self.files.checkpoints_for(
                    job.id, job.strategy, emit, job.resume_from
                )
                job.inputs = dataclasses.replace(job.inputs, checkpoints=saves)
            how = await job.strategy.prepare(ctx, job.inputs, emit)
            await self._emit(job.id, "placed", {"workers": ids, "devices": devices} | how)
            states = await job.strategy.run(ctx, job.inputs, emit)
            kind, frame = await self._result_frame(job.id, states)
            failure = await _failure_after_retries(job.id, self.store.succeed, job.id, frame, kind)
            if failure is not None:
                why = f"the job trained, but its result could not be stored: {failure}"
                raise StrategyFailed(ErrorCode.INTERNAL, why)
            nodes = states.node_ids if isinstance(states, ShardedStates) else states
            await self._emit(job.id, "succeeded", {"nodes": sorted(nodes)})
            await self._forget(job.id, succeeded=True, keep=job.strategy.keep_on_success)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()  # handled here: the job ends, the task returns normally
            if job.stop_reason is None and job.preempted is not None and self.accepting:
                if job.inputs.checkpoints is not None:
                    await job.inputs.checkpoints.flush()
                job.restart_for = job.preempted  # queued again once its workers are freed
                return
            await self._end(job, job.stop_reason or _internal("the job's task was cancelled"))
        except WorkerCallError as exc:
            log.info("job %s failed: %s", job.id, exc)
            await self._end_or_restart(job, exc.to_info())
        except StrategyFailed as exc:
            log.info("job %s failed: %s", job.id, exc)
            await self._end_or_restart(job, exc.info)
        except Exception as exc:
            log.exception("job %s failed on the coordinator", job.id)
            await self._end(job, _internal(f"{type(exc).__name__}: {exc}"))

    async def _result_frame(
        self, job_id: str, states: dict[str, Any] | ShardedStates
    ) -> tuple[str, bytes | bytearray]:
        """The kind and frame of the result row for a run's final ``states``; a sharded run's
        pieces read and written to their files first, one replica at a time
        (:mod:`coordinator.jobs.result_pieces`), or kept in the frame where there are no files.

        Raises:
            StrategyFailed: ``INTERNAL``: the pieces could not be written; ``STATE_MISMATCH``:
                they are not of one model.
        """
        if not isinstance(states, ShardedStates):
            return "states", await asyncio.to_thread(encode_frame, states)
        try:
            files = None if self.files is None else self.files.results
            piece = PIECE_BYTES if self.files is None else self.files.piece_bytes
            said = await kept(states, files, job_id, piece)
        except OSError as exc:
            why = f"the job trained, but its sharded result could not be written: {exc}"
            raise StrategyFailed(ErrorCode.INTERNAL, why) from exc
        return "pieces", await asyncio.to_thread(encode_frame, said)

    async def _end_or_restart(self, job: _Job, info: ErrorInfo) -> None:
        """A fault ended the job's run: it fails, or (``max_restarts``) it is queued again to
        resume from its last checkpoint once its workers are freed (:meth:`_run`)."""
        if not self.accepting or not should_restart(info, job.strategy, job.restarts):
            await self._end(job, info)
            return
        if job.inputs.checkpoints is not None:
            await job.inputs.checkpoints.flush()  # a write under way ends first
        job.restarts += 1
        job.restart_for = info  # queued again once its run's workers are freed: _run
        log.info("job %s restarts (%d of %d)", job.id, job.restarts, job.strategy.max_restarts)

    async def _end(self, job: _Job, info: ErrorInfo) -> None:
        """Record a job's unsuccessful end (failed, or cancelled by the client)."""
        if job.inputs.checkpoints is not None:
            await job.inputs.checkpoints.flush()  # a write under way ends first
        await self._record_end(job.id, info)
        job.done.set()

    async def _record_end(self, job_id: str, info: ErrorInfo) -> None:
        data = {"code": str(info.code), "message": info.message, "detail": info.detail}
        if info.code is ErrorCode.CANCELLED:
            state, event = JobState.CANCELLED, "cancelled"
            write = functools.partial(self.store.cancel, job_id, info.message)
        else:
            state, event = JobState.FAILED, "failed"
            write = functools.partial(
                self.store.fail, job_id, str(info.code), info.message, info.detail
            )
        if await _failure_after_retries(job_id, write) is not None:
            error = error_record(str(info.code), info.message, info.detail)
            self.owed_ends.owe(job_id, state, error, time.time(), write)
        await self._emit(job_id, event, data)
        await self._forget(job_id, succeeded=False)

    async def _forget(self, job_id: str, succeeded: bool, keep: str = "newest") -> None:
        """A job ended: what was kept to resume it goes (its checkpoints stay unless it
        succeeded; then as ``keep`` says: ``keep_on_success``)."""
        if self.files is not None:
            await asyncio.to_thread(self.files.ended, job_id, succeeded, keep)

    async def _emit(self, job_id: str, event: str, data: dict[str, Any]) -> None:
        await self.events.emit(job_id, event, data)

    async def _record(self, job_id: str) -> JobRecord:
        """The job's record, as it reads once an end the store refused is written."""
        try:
            return self.owed_ends.as_recorded(await asyncio.to_thread(self.store.get, job_id))
        except UnknownJob as exc:
            raise RequestRefused.of(
                ErrorCode.UNKNOWN_JOB, f"no job {job_id!r}", job_id=job_id
            ) from exc


def _internal(message: str) -> ErrorInfo:
    return ErrorInfo(code=ErrorCode.INTERNAL, message=message)


def _code(code: Any) -> ErrorCode:
    try:
        return ErrorCode(code)
    except ValueError:
        return ErrorCode.INTERNAL


async def _failure_after_retries(job_id: str, write: Callable[..., Any], *args: Any) -> str | None:
    """Do ``write(*args)`` in a thread, tried again after each of :data:`STORE_RETRIES` while
    the store fails. Returns the failure that outlasted the tries (``None``: it is written)."""
    failure = ""
    for delay in (*STORE_RETRIES, None):
        try:
            await asyncio.to_thread(write, *args)
            return None
        except (sqlite3.Error, StoreError) as exc:
            failure = f"{type(exc).__name__}: {exc}"
        if delay is None:
            break
        log.warning("job %s: the store failed (%s); again in %gs", job_id, failure, delay)
        await asyncio.sleep(delay)
    log.error("job %s: its end could not be stored: %s", job_id, failure)
    return failure
