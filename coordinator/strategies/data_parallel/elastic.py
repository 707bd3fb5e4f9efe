"""Elastic recovery for DataParallel: a lost replica replaced and brought back to where the
others stand.

:class:`Replicas` runs one call on several replicas. Without ``elastic`` the first failure
cancels the rest and fails the job (fail fast). With it every call is let finish, so each
surviving replica is known to stand exactly where the last completed step left it (a step's
request applies the previous step's mean before its gradient pass, and a gradient pass changes no
weights). A replica whose worker was lost (``worker_lost``) or whose daemon died
(``daemon_crashed``) then gets a worker — a replacement waited for up to the timeout, or its own
worker with a fresh daemon — and is restored: the filters loaded, its rows staged, a survivor's
model state *and* optimizer state (momentum, Adam moments, step counts) copied onto it. Its call
is run again with ``fresh=True``; the others' results stand. With no survivor left there is
nothing to copy from and the job fails saying so: the coordinator keeps no snapshot of its own,
which would cost a full read of the model and optimizer at every step.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from coordinator.context import StrategyContext
from coordinator.errors import NoReplacement, StrategyFailed, WorkerCallError
from coordinator.strategies.base import Emit, JobInputs, ShardedStates, concurrently
from coordinator.strategies.kept_on_worker import KeptLimit, KeptOnWorker
from coordinator.strategies.steps import OwnData, set_up
from protocol.daemon import DistPiecesRequest, ScheduleRequest, StageRequest
from protocol.errors import ErrorCode
from protocol.files.shard_pieces import KEPT_AT, PIECES_FILE
from protocol.filter_buffers import FilterBuffer
from protocol.filters import split_rows
from protocol.rules.rows import take_rows

T = TypeVar("T")

RECOVERABLE = frozenset({ErrorCode.WORKER_LOST, ErrorCode.DAEMON_CRASHED})
"""Failures an elastic job recovers from: the replica's state is gone, not wrong."""

MAX_RECOVERIES = 3
"""Recoveries one step (or setup phase) may take before the job fails: a filter that crashes its
daemon on the same rows every time must not loop forever."""


@dataclass
class DataParallelPosition:
    """Where a DataParallel run stands: the phase, the global step, the rows each replica holds,
    the last step's mean gradient (applied with the next step), and whether the replicas hold
    state a replacement must copy. The run loop reads and advances it; nothing else holds it."""

    held: list[Any]  # row indices each replica was sent (or holds of its own), by replica
    own: OwnData | None = None  # the replicas train on their own datasets (WorkerData)
    phase: str = "loading"
    epoch: int = 0
    step: int | None = None  # the global step being run, from 1; None outside training
    mean: Any = None  # the previous step's gradient mean, not yet applied
    mean_ends_epoch: bool = False  # that step was its epoch's last
    buffers: Any = None  # replica 0's buffers after the last step (when they are synced)
    copy_state: bool = False  # replicas hold state (fitted, trained) a replacement must copy

    def at(self) -> dict[str, Any]:
        """The position as job events name it."""
        return {"phase": self.phase} | ({"step": self.step} if self.step is not None else {})

    @property
    def where(self) -> str:
        return f"step {self.step}" if self.step is not None else self.phase


class Lost(Exception):
    """Replicas lost in one round of calls (``errors``), and what the others returned."""

    def __init__(self, errors: dict[int, WorkerCallError], results: dict[int, Any]) -> None:
        super().__init__(", ".join(str(e) for e in errors.values()))
        self.errors = errors
        self.results = results


@dataclass
class Snapshot:
    """Where the replicas stand: every node's state and the torch nodes' optimizers."""

    source: str
    states: dict[str, Any]
    optimizers: dict[str, Any]


@dataclass
class Replicas:
    """The replicas of one run and — ``elastic`` — how a lost one comes back (module docstring).

    ``staged`` names the rows in each daemon; ``placement`` describes the workers that qualify.
    """

    ctx: StrategyContext
    job: JobInputs
    emit: Emit
    position: DataParallelPosition
    torch_nodes: list[str]
    staged: str
    elastic: bool
    timeout: float
    placement: str
    recoveries: Counter[str] = field(default_factory=Counter)
    staged_rows: dict[int, int] = field(default_factory=dict)  # by replica, as staging said
    schedule: ScheduleRequest | None = None  # the schedules' horizon, once it is known
    validation: StageRequest | None = None  # stages the job's validation data, if it has any
    absent: set[int] = field(default_factory=set)  # replicas dropped (DiLoCo), until one joins
    sharded: bool = False  # FSDP2 shards the torch nodes: read from every replica's pieces
    rows_alone: bool = False  # each replica sent only its rows of the torch nodes' parameters

    @property
    def ids(self) -> list[str]:
        """The workers' ids now, by replica (a replacement takes its replica's index)."""
        return [w.id for w in self.ctx.workers]

    def present(self) -> list[int]:
        """The replicas taking part now: all but those dropped (DiLoCo's elastic rounds)."""
        return [i for i in range(len(self.position.held)) if i not in self.absent]

    async def set_up(self, i: int, fresh: bool) -> None:
        """Load the filters on replica ``i`` and stage its rows (already done when ``fresh``)."""
        if not fresh:
            await self.restore(i, None)

    async def on_all(
        self, call: Callable[[int, bool], Awaitable[T]], replicas: Sequence[int]
    ) -> dict[int, T]:
        """``call(i, fresh)`` on each of ``replicas``; their results by replica."""
        results: dict[int, T] = {}
        pending, fresh = list(replicas), False
        while pending:
            try:
                results |= await self.each({i: call(i, fresh) for i in pending})
                break
            except Lost as lost:
                results |= lost.results
                await self.recover(lost.errors)
                pending, fresh = sorted(lost.errors), True
        return results

    async def each(self, calls: Mapping[int, Awaitable[T]]) -> dict[int, T]:
        """Await one call per replica, concurrently.

        Raises:
            WorkerCallError: a call failed (without ``elastic``: any, at once; with it: one
                that losing the worker does not explain, once every call has ended).
            Lost: with ``elastic``, replicas whose worker or daemon was lost.
        """
        if not self.elastic:
            return dict(zip(calls, await concurrently(*calls.values()), strict=True))
        outcomes = await asyncio.gather(*calls.values(), return_exceptions=True)
        results: dict[int, T] = {}
        lost: dict[int, WorkerCallError] = {}
        for i, outcome in zip(calls, outcomes, strict=True):
            if isinstance(outcome, WorkerCallError) and outcome.code in RECOVERABLE:
                lost[i] = outcome
            elif isinstance(outcome, BaseException):
                raise outcome
            else:
                results[i] = outcome
        if lost:
            raise Lost(lost, results)
        return results

    async def recover(
        self, errors: dict[int, WorkerCallError], source: int | None = None
    ) -> Snapshot | None:
        """Bring lost replicas back to where the others stand, on replacement workers; copied
        from survivor ``source`` when it still stands (default: the first survivor). Returns
        what was copied (``None`` before there is any state to copy)."""
        pending = dict(errors)  # replicas to restore, and why each was lost
        unmanned = dict(errors)  # those of them still without a worker
        await self.report(errors)
        where = self.position.where
        while True:
            self.recoveries[where] += 1
            if self.recoveries[where] > MAX_RECOVERIES:
                last = next(iter(pending.values()))
                raise StrategyFailed(
                    last.code,
                    f"{where}: replicas were lost {MAX_RECOVERIES} times over; the last: {last}",
                    **last.to_info().detail,
                )
            survivors = [i for i in range(len(self.position.held)) if i not in pending]
            survivors.sort(key=lambda i: i != source)
            await concurrently(*(self._replace(i, error) for i, error in unmanned.items()))
            unmanned = {}
            try:
                snapshot = await self._snapshot(survivors, pending)
                await self.each({i: self.restore(i, snapshot) for i in pending})
                return snapshot
            except Lost as more:  # a survivor or a replacement went too
                await self.report(more.errors)
                pending = {i: e for i, e in pending.items() if i not in more.results}
                pending |= more.errors
                unmanned = dict(more.errors)

    async def _filters(self, i: int) -> Mapping[str, FilterBuffer]:
        """The job's filters as replica ``i`` loads them: with ``rows_alone``, each torch
        node's parameters cut to the rows FSDP2 gives that replica (``split_rows``: the
        weights never arrive whole on a sharded replica; cut off the event loop, each cut
        views of the job's filters, not a copy of them), the rest whole."""
        if not self.rows_alone:
            return self.job.filters
        replicas, torch_nodes = self.ctx.num_workers(), set(self.torch_nodes)

        def cut() -> dict[str, FilterBuffer]:
            return {
                node: split_rows(data, i, replicas) if node in torch_nodes else data
                for node, data in self.job.filters.items()
            }

        return await asyncio.to_thread(cut)

    async def restore(self, i: int, snapshot: Snapshot | None) -> None:
        """Load the filters on replica ``i``'s worker, stage its rows and copy ``snapshot``."""
        if self.job.dataset is not None:  # the worker's own rows
            data = self.job.own_data(self.staged)
        else:
            rows = self.position.held[i]
            x, y = take_rows(self.job.x, rows), take_rows(self.job.y, rows)
            data = StageRequest(name=self.staged, x=x, y=y)
        staged = await set_up(self.ctx, i, await self._filters(i), data)
        self.staged_rows[i] = int(staged["rows"])
        if self.validation is not None:
            await self.ctx.call(i, self.validation)
        if self.schedule is not None:  # before an optimizer (and its scheduler) is loaded
            await self.ctx.call(i, self.schedule)
        if snapshot is not None:
            await self.ctx.set_state(i, snapshot.states)
            await self.ctx.set_optimizer_state(i, snapshot.optimizers)
            await self.emit(
                "worker_restored",
                {"replica": i, "worker": self.ids[i], "from": snapshot.source} | self.position.at(),
            )

    async def read_back(
        self, compared: Sequence[str]
    ) -> tuple[dict[str, Any], dict[int, dict[str, Any]]]:
        """The final state, read whole from one present replica, and every present replica's
        digests of ``compared``'s tensors by replica (:meth:`StrategyContext.state_digests`):
        the replicas are compared without each sending the model (N models' bytes through
        the coordinator, and in its memory at once, where one is read). With ``elastic`` a
        lost replica is left out (another survivor read whole if it was the one).

        Raises:
            StrategyFailed: ``WORKER_LOST``: every replica was lost.
        """
        self.position.phase, self.position.step = "reading", None
        reads = {i: self.ctx.state_digests(i, compared) for i in self.present()}
        digests, lost = await self._surviving(reads)
        for i in sorted(digests):
            read = {i: self.ctx.read_back_state(i, self.job.node_ids, relayed=True)}
            whole, lost_now = await self._surviving(read)
            if i in whole:
                return whole[i], digests
            lost |= lost_now
        raise every_replica_lost(lost, "reading the final states")

    async def _surviving(
        self, calls: Mapping[int, Awaitable[T]]
    ) -> tuple[dict[int, T], dict[int, WorkerCallError]]:
        """:meth:`each`'s results, and the replicas lost meanwhile (with ``elastic``; each
        reported), left out of them."""
        try:
            return await self.each(calls), {}
        except Lost as lost:
            await self.report(lost.errors)
            return lost.results, dict(lost.errors)

    async def idle_worker(self, i: int, error: WorkerCallError) -> bool:
        """A worker for dropped replica ``i`` (DiLoCo's elastic rounds), without waiting: its
        own when only its daemon died (loading the job again starts a fresh one), else one
        idle now; ``False`` when none is."""
        if error.code is ErrorCode.DAEMON_CRASHED:
            return True
        try:
            await self.ctx.replace(i, 0.0)
        except NoReplacement:
            return False
        return True

    async def _replace(self, i: int, error: WorkerCallError) -> None:
        """A worker for lost replica ``i``: the same one when only its daemon died (loading the
        job again starts a fresh one), else a replacement, waited for."""
        old = self.ids[i]
        started = asyncio.get_running_loop().time()
        if error.code is not ErrorCode.DAEMON_CRASHED:
            try:
                await self.ctx.replace(i, self.timeout)
            except NoReplacement as exc:
                raise StrategyFailed(
                    ErrorCode.NOT_ENOUGH_WORKERS,
                    f"replica {i} lost its worker {old!r} at {self.position.where} "
                    f"({error.info.message}); waited {self.timeout:g}s for a replacement "
                    f"({self.placement}) and none came",
                    worker_id=old,
                    replica=i,
                    waited=self.timeout,
                    reason=str(exc),
                    **self.position.at(),
                ) from exc
        waited = asyncio.get_running_loop().time() - started
        await self.emit(
            "worker_replaced",
            {"replica": i, "lost": old, "worker": self.ids[i], "waited": round(waited, 3)}
            | self.position.at(),
        )

    async def _snapshot(
        self, survivors: list[int], lost: Mapping[int, WorkerCallError]
    ) -> Snapshot | None:
        """A survivor's model and optimizer state (``None`` before there is any to copy)."""
        if not self.position.copy_state:
            return None  # loading or fitting: a replica is its filters and rows, nothing more
        if not survivors:
            raise every_replica_lost(lost, self.position.where)
        source = survivors[0]

        return (await self.each({source: self.snapshot(source)}))[source]

    async def snapshot(self, source: int) -> Snapshot:
        """Replica ``source``'s model and optimizer state (a sharded run's replicas hold
        theirs as shards: their checkpoints come with their chunks' replies)."""
        assert not self.sharded, "a sharded run is never elastic: no replacement copies it"
        # (passed on only: into a checkpoint, to replicas that take it)
        states = await self.ctx.get_state(source, self.job.node_ids, relayed=True)
        optimizers = await self.ctx.get_optimizer_state(source, self.torch_nodes, relayed=True)
        return Snapshot(self.ids[source], states, optimizers)

    async def pieces(self) -> ShardedStates:
        """A sharded run's final states as its replicas hold them: each replica's pieces of
        the model, one file its worker keeps for the job to read a piece at a time (no
        collective), one replica after another (:mod:`protocol.files.shard_pieces`: the client
        joins them); the plain filters before the torch nodes read from replica 0, which
        holds them as every replica does."""
        self.position.phase, self.position.step = "reading", None
        plain = [node for node in self.job.node_ids if node not in self.torch_nodes]
        states = await self.ctx.get_state(0, plain) if plain else {}

        async def keep(replica: int) -> KeptOnWorker:
            said = await self.ctx.call_keeping(replica, DistPiecesRequest(), KEPT_AT)
            files = said.get("files") if isinstance(said, dict) else None
            kept = KeptOnWorker.of(self.ctx, replica, files, "pieces")
            limit = KeptLimit.of(self.job.trained_shapes(), 1)
            try:
                limit.check([kept], f"replica {replica}'s pieces of the model")
            except StrategyFailed:
                await kept.release()
                raise
            if set(kept.files) != {PIECES_FILE}:
                await kept.release()
                raise StrategyFailed(
                    ErrorCode.STATE_MISMATCH,
                    f"replica {replica} kept {sorted(kept.files)}, not its {PIECES_FILE!r}",
                )
            return kept

        return ShardedStates(self.ctx.num_workers(), keep, states, list(self.job.node_ids))

    async def report(self, errors: Mapping[int, WorkerCallError]) -> None:
        """A ``worker_lost`` event for each replica of ``errors``, where the run stands."""
        for i, error in errors.items():
            await self.emit(
                "worker_lost",
                {
                    "replica": i,
                    "worker": error.worker_id,
                    "code": str(error.code),
                    "message": error.info.message,
                }
                | self.position.at(),
            )


def every_replica_lost(errors: Mapping[int, WorkerCallError], where: str) -> StrategyFailed:
    workers = {e.worker_id: e.info.message for e in errors.values()}
    return StrategyFailed(
        ErrorCode.WORKER_LOST,
        f"every replica was lost at {where}, leaving no survivor to copy the model and "
        f"optimizer state from: {workers}",
        lost=workers,
    )
