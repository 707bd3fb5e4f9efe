"""DataParallel: synchronous data-parallel SGD over N replicas (all-reduce of gradients).

Every global batch is exactly the batch ``graph.fit`` would take (:mod:`protocol.batching`, with
the last TorchFilter's ``batch_size``, ``shuffle`` and ``seed``); it is split across the replicas
together with its labels (``numpy.array_split``: uneven splits allowed). Each replica computes the
gradient of its slice's mean loss; the coordinator averages the gradients weighted by slice size —
which is the gradient of the global batch's mean loss — and every replica applies that same mean
with its own persistent optimizer. With a mean-reduced loss and no randomness in the model, the
result equals single-process training on the same global batches (Goyal et al. 2017, §2: "the
same as a single-worker minibatch of size kn").

Data crosses the wire once per job: each replica is sent the rows it will ever see, staged in its
filter daemon, and per step only row indices go out and gradients come back. Plain filters before
the first TorchFilter are fitted on each replica's share of the first epoch, their states
averaged (weighted by rows) and set everywhere before training starts.

A replica whose worker is lost (its connection closed or went silent, ``worker_lost``) or whose
daemon died (``daemon_crashed``) fails the job at once, naming the worker — unless the job is
``elastic``. Then the step in flight is abandoned: the other replicas' calls are let finish, so
each of them is known to stand exactly where the last completed step left it (a step's request
applies the previous step's mean before its gradient pass, and a gradient pass changes no
weights). The job waits up to ``elastic_timeout`` seconds for a replacement worker (a crashed
daemon keeps its worker and gets a fresh daemon), loads the filters on it, stages its rows, copies
a survivor's model state *and* optimizer state (momentum, Adam moments, step counts) onto it, and
resumes the step that failed by computing only the lost replica's slice again. The result is the
one an undisturbed run gives, which is the one ``graph.fit`` gives. With no survivor left there
is nothing to copy from and the job fails saying so: the coordinator keeps no snapshot of its
own, which would cost a full read of the model and optimizer at every step.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Self, TypeVar

import numpy as np

from coordinator.context import StrategyContext
from coordinator.errors import NoReplacement, WorkerCallError
from coordinator.strategies.aggregate import AggregationError, weighted_mean
from coordinator.strategies.base import (
    Emit,
    JobInputs,
    Placement,
    Strategy,
    StrategyFailed,
    StrategyOptionsError,
    concurrently,
    parse_options,
)
from protocol.batching import batches, generator
from protocol.errors import ErrorCode
from protocol.messages import NodeInfo
from protocol.strategy_options import DEFAULT_ELASTIC_TIMEOUT, DataParallelOptions

T = TypeVar("T")

STAGED = "train"
"""The name a replica's rows are staged under in its daemon."""

RECOVERABLE = frozenset({ErrorCode.WORKER_LOST, ErrorCode.DAEMON_CRASHED})
"""Failures an elastic job recovers from: the replica's state is gone, not wrong."""

MAX_RECOVERIES = 3
"""Recoveries one step (or setup phase) may take before the job fails: a filter that crashes its
daemon on the same rows every time must not loop forever."""


@dataclass(frozen=True)
class Training:
    """The training settings of a run (those of its last TorchFilter)."""

    epochs: int
    batch_size: int | None
    shuffle: bool
    seed: int

    @classmethod
    def of(cls, info: NodeInfo) -> Training:
        return cls(
            epochs=info.epochs if info.epochs is not None else 1,
            batch_size=info.batch_size,
            shuffle=bool(info.shuffle),
            seed=info.seed or 0,
        )


def schedule(rows: int, replicas: int, training: Training) -> Iterator[tuple[int, int, list[Any]]]:
    """``(epoch, step, slices)`` of every step: the global batch's row indices split in
    ``replicas`` slices (some may be empty when a batch has fewer rows than replicas)."""
    order = generator(training.seed) if training.shuffle else None
    size = training.batch_size or rows
    for epoch in range(training.epochs):
        for step, index in enumerate(batches(rows, size, order)):
            rows_ = np.arange(rows)[index] if isinstance(index, slice) else index.numpy()
            yield epoch, step, np.array_split(rows_, replicas)


class DataParallel(Strategy):
    """``workers`` replicas (optionally all tagged ``tag``) train one model in lockstep; with
    ``elastic``, a lost replica is replaced within ``elastic_timeout`` seconds and training
    resumes from the last completed step."""

    name = "data_parallel"

    def __init__(
        self,
        workers: int,
        tag: str | None = None,
        elastic: bool = False,
        elastic_timeout: float = DEFAULT_ELASTIC_TIMEOUT,
    ) -> None:
        self.workers = workers
        self.tag = tag
        self.elastic = elastic
        self.elastic_timeout = elastic_timeout

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> Self:
        checked = parse_options(DataParallelOptions, options)
        return cls(checked.workers, checked.tag, checked.elastic, checked.elastic_timeout)

    def placement(self) -> Placement:
        return Placement(workers=self.workers, tag=self.tag)

    def validate(self, job: JobInputs) -> None:
        self._plan(job)

    async def run(self, ctx: StrategyContext, job: JobInputs, emit: Emit) -> dict[str, Any]:
        torch_nodes, prefix, training = self._plan(job)
        n = int(job.x.shape[0]) if hasattr(job.x, "shape") else len(job.x)
        replicas = range(ctx.num_workers())

        # 1. Ship the filters, then each replica's rows: the union of its slices over all steps.
        await emit("progress", {"phase": "loading", "replicas": len(replicas)})
        needed: list[set[int]] = [set() for _ in replicas]
        first_epoch: list[list[int]] = [[] for _ in replicas]
        steps_per_epoch = 0
        for epoch, step, slices in schedule(n, len(replicas), training):
            steps_per_epoch = max(steps_per_epoch, step + 1)
            for i, part in enumerate(slices):
                needed[i].update(part.tolist())
                if epoch == 0:
                    first_epoch[i].extend(part.tolist())
        held = [np.array(sorted(rows), dtype=np.int64) for rows in needed]
        run = _Replicas(self, ctx, job, emit, held, torch_nodes)
        await run.on_all(run.set_up, replicas)

        # 2. Plain filters before the torch part: fitted per shard, averaged by rows, set on all.
        if prefix:
            run.phase = "fitting"
            await emit("progress", {"phase": "fitting", "nodes": prefix})
            shards = [np.searchsorted(held[i], sorted(first_epoch[i])).tolist() for i in replicas]
            fitting = [i for i in replicas if shards[i]]

            async def fit(i: int, fresh: bool) -> Any:
                return await self._call(ctx, i, "composite_fit", prefix, shards[i])

            fits = await run.on_all(fit, fitting)
            contributions = [(run.ids[i], len(shards[i]), fits[i]["states"]) for i in fitting]
            averaged = _average(contributions)

            async def set_averaged(i: int, fresh: bool) -> None:
                await ctx.set_state(i, averaged)

            await run.on_all(set_averaged, replicas)
        run.copy_state = True  # from here on every replica holds what a replacement must copy

        # 3. Synchronous SGD: each slice's gradient, their weighted mean, one step everywhere.
        #    A step's mean travels with the next step's request (one round trip a step); the
        #    last mean, and any a replica with no rows in a step would miss, go on their own.
        #    A replica restored onto a replacement (``fresh``) copied a survivor that had
        #    already applied the mean: it only computes its slice.
        total_steps = steps_per_epoch * training.epochs
        mean: Any = None
        plan = schedule(n, len(replicas), training)
        for done, (epoch, _, slices) in enumerate(plan, start=1):
            run.phase, run.step = "training", done
            local = {i: np.searchsorted(held[i], slices[i]) for i in replicas if len(slices[i])}

            targets = [i for i in replicas if i in local or mean is not None]
            results = await run.on_all(self._step(ctx, job, local, mean), targets)
            active = sorted(local)
            weights = [len(slices[i]) for i in active]
            grads = [
                (run.ids[i], w, results[i]["gradients"])
                for i, w in zip(active, weights, strict=True)
            ]
            # Summed in float32: a gradient mean needs no float64, and it is ~7x faster.
            mean = _average(grads, precise=False)
            losses = [w * float(results[i]["loss"]) for i, w in zip(active, weights, strict=True)]
            progress = {"phase": "training", "epoch": epoch + 1, "epochs": training.epochs}
            progress |= {"step": done, "steps": total_steps, "loss": sum(losses) / sum(weights)}
            await emit("progress", progress)
        if mean is not None:
            run.phase, run.step = "finishing", None

            async def finish(i: int, fresh: bool) -> None:
                if not fresh:
                    await ctx.apply_gradients(i, mean)

            await run.on_all(finish, replicas)

        # 4. The final states, read back over the wire from every replica: they must agree.
        states = await run.read_back()
        _check_replicas_agree([run.ids[i] for i in states], list(states.values()), torch_nodes)
        return next(iter(states.values()))

    def _plan(self, job: JobInputs) -> tuple[list[str], list[str], Training]:
        """The torch nodes, the plain prefix and the training settings; or why not."""
        if job.dataset is not None:
            raise StrategyOptionsError(
                "data_parallel splits the data the client sends; for data that stays on the "
                "workers (WorkerData) use FedAvg"
            )
        torch_nodes = job.differentiable()
        if not torch_nodes:
            raise StrategyOptionsError(
                "data_parallel trains TorchFilters and this graph has none; use Local"
            )
        first = job.node_ids.index(torch_nodes[0])
        late = [n for n in job.node_ids[first:] if n not in torch_nodes]
        if late:
            raise StrategyOptionsError(
                f"data_parallel fits plain filters only before the first TorchFilter; {late} "
                f"come after {torch_nodes[0]!r}"
            )
        if job.y is None:
            raise StrategyOptionsError("data_parallel trains with labels: y is missing")
        return torch_nodes, job.node_ids[:first], Training.of(job.nodes[torch_nodes[-1]])

    def _step(
        self, ctx: StrategyContext, job: JobInputs, local: Mapping[int, Any], mean: Any
    ) -> Callable[[int, bool], Awaitable[Any]]:
        """A replica's part of a step: apply the previous step's ``mean`` (unless the replica is
        ``fresh``: it copied a survivor that had applied it), then the gradient of its ``local``
        rows, if it has any this step."""

        async def call(i: int, fresh: bool) -> Any:
            apply = None if fresh else mean
            if i in local:
                return await self._call(ctx, i, "gradients", job.node_ids, local[i], apply)
            if apply is not None:
                await ctx.apply_gradients(i, apply)
            return None

        return call

    @staticmethod
    async def _call(
        ctx: StrategyContext, i: int, cmd: str, nodes: list[str], rows: Any, apply: Any = None
    ) -> Any:
        """A command on replica ``i``'s staged rows (positions in what it holds)."""
        request = {"cmd": cmd, "node_ids": nodes, "data": STAGED, "rows": np.asarray(rows).tolist()}
        if apply is not None:
            request["apply"] = apply
        return await ctx.call(i, request)


class _Lost(Exception):
    """Replicas lost in one round of calls (``errors``), and what the others returned."""

    def __init__(self, errors: dict[int, WorkerCallError], results: dict[int, Any]) -> None:
        super().__init__(", ".join(str(e) for e in errors.values()))
        self.errors = errors
        self.results = results


@dataclass
class _Snapshot:
    """Where the replicas stand: every node's state and the torch nodes' optimizers."""

    source: str
    states: dict[str, Any]
    optimizers: dict[str, Any]


@dataclass
class _Replicas:
    """The replicas of one run, what each holds, and — elastic — how a lost one comes back.

    ``on_all`` runs a call on several replicas; without ``elastic`` the first failure cancels
    the rest and fails the job (fail fast). With it every call is let finish, a replica lost on
    the way is replaced and restored (:meth:`recover`) and its call run again with
    ``fresh=True``; the others' results stand.
    """

    strategy: DataParallel
    ctx: StrategyContext
    job: JobInputs
    emit: Emit
    held: list[Any]
    torch_nodes: list[str]
    phase: str = "loading"
    step: int | None = None
    copy_state: bool = False  # replicas hold state (fitted, trained) a replacement must copy
    recoveries: Counter[str] = field(default_factory=Counter)

    @property
    def ids(self) -> list[str]:
        """The workers' ids now, by replica (a replacement takes its replica's index)."""
        return [w.id for w in self.ctx.workers]

    @property
    def where(self) -> str:
        return f"step {self.step}" if self.step is not None else self.phase

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
            except _Lost as lost:
                results |= lost.results
                await self.recover(lost.errors)
                pending, fresh = sorted(lost.errors), True
        return results

    async def each(self, calls: Mapping[int, Awaitable[T]]) -> dict[int, T]:
        """Await one call per replica, concurrently.

        Raises:
            WorkerCallError: a call failed (without ``elastic``: any, at once; with it: one
                that losing the worker does not explain, once every call has ended).
            _Lost: with ``elastic``, replicas whose worker or daemon was lost.
        """
        if not self.strategy.elastic:
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
            raise _Lost(lost, results)
        return results

    async def recover(self, errors: dict[int, WorkerCallError]) -> None:
        """Bring lost replicas back to where the others stand, on replacement workers."""
        pending = dict(errors)  # replicas to restore, and why each was lost
        unmanned = dict(errors)  # those of them still without a worker
        await self._report(errors)
        while True:
            self.recoveries[self.where] += 1
            if self.recoveries[self.where] > MAX_RECOVERIES:
                last = next(iter(pending.values()))
                raise StrategyFailed(
                    last.code,
                    f"{self.where}: replicas were lost {MAX_RECOVERIES} times over; the last: "
                    f"{last}",
                    **last.to_info().detail,
                )
            survivors = [i for i in range(len(self.held)) if i not in pending]
            await concurrently(*(self._replace(i, error) for i, error in unmanned.items()))
            unmanned = {}
            try:
                snapshot = await self._snapshot(survivors, pending)
                await self.each({i: self.restore(i, snapshot) for i in pending})
                return
            except _Lost as more:  # a survivor or a replacement went too
                await self._report(more.errors)
                pending = {i: e for i, e in pending.items() if i not in more.results}
                pending |= more.errors
                unmanned = dict(more.errors)

    async def restore(self, i: int, snapshot: _Snapshot | None) -> None:
        """Load the filters on replica ``i``'s worker, stage its rows and copy ``snapshot``."""
        await self.ctx.load(i, self.job.filters)
        rows = self.held[i]
        stage = {"cmd": "stage", "name": STAGED, "x": self.job.x[rows], "y": self.job.y[rows]}
        await self.ctx.call(i, stage)
        if snapshot is not None:
            await self.ctx.set_state(i, snapshot.states)
            await self.ctx.set_optimizer_state(i, snapshot.optimizers)
            await self.emit(
                "worker_restored",
                {"replica": i, "worker": self.ids[i], "from": snapshot.source, **self._at()},
            )

    async def read_back(self) -> dict[int, dict[str, Any]]:
        """Every replica's final state; with ``elastic`` a lost one is left out."""
        self.phase, self.step = "reading", None
        replicas = range(len(self.held))
        reads = {i: self.ctx.read_back_state(i, self.job.node_ids) for i in replicas}
        try:
            return await self.each(reads)
        except _Lost as lost:
            await self._report(lost.errors)
            if not lost.results:
                raise _every_replica_lost(lost.errors, "reading the final states") from None
            return lost.results

    async def _replace(self, i: int, error: WorkerCallError) -> None:
        """A worker for lost replica ``i``: the same one when only its daemon died (loading the
        job again starts a fresh one), else a replacement, waited for."""
        old = self.ids[i]
        timeout = self.strategy.elastic_timeout
        started = asyncio.get_running_loop().time()
        if error.code is not ErrorCode.DAEMON_CRASHED:
            try:
                await self.ctx.replace(i, timeout)
            except NoReplacement as exc:
                placement = self.strategy.placement().describe()
                raise StrategyFailed(
                    ErrorCode.NOT_ENOUGH_WORKERS,
                    f"replica {i} lost its worker {old!r} at {self.where} ({error.info.message});"
                    f" waited {timeout:g}s for a replacement ({placement}) and none came",
                    worker_id=old,
                    replica=i,
                    waited=timeout,
                    reason=str(exc),
                    **self._at(),
                ) from exc
        waited = asyncio.get_running_loop().time() - started
        await self.emit(
            "worker_replaced",
            {"replica": i, "lost": old, "worker": self.ids[i], "waited": round(waited, 3)}
            | self._at(),
        )

    async def _snapshot(
        self, survivors: list[int], lost: Mapping[int, WorkerCallError]
    ) -> _Snapshot | None:
        """A survivor's model and optimizer state (``None`` before there is any to copy)."""
        if not self.copy_state:
            return None  # loading or fitting: a replica is its filters and rows, nothing more
        if not survivors:
            raise _every_replica_lost(lost, self.where)
        source = survivors[0]

        async def read() -> _Snapshot:
            states = await self.ctx.get_state(source, self.job.node_ids)
            optimizers = await self.ctx.get_optimizer_state(source, self.torch_nodes)
            return _Snapshot(self.ids[source], states, optimizers)

        return (await self.each({source: read()}))[source]

    async def _report(self, errors: Mapping[int, WorkerCallError]) -> None:
        for i, error in errors.items():
            await self.emit(
                "worker_lost",
                {
                    "replica": i,
                    "worker": error.worker_id,
                    "code": str(error.code),
                    "message": error.info.message,
                }
                | self._at(),
            )

    def _at(self) -> dict[str, Any]:
        return {"phase": self.phase} | ({"step": self.step} if self.step is not None else {})


def _every_replica_lost(errors: Mapping[int, WorkerCallError], where: str) -> StrategyFailed:
    workers = {e.worker_id: e.info.message for e in errors.values()}
    return StrategyFailed(
        ErrorCode.WORKER_LOST,
        f"every replica was lost at {where}, leaving no survivor to copy the model and "
        f"optimizer state from: {workers}",
        lost=workers,
    )


def _average(contributions: Sequence[tuple[str, float, Any]], precise: bool = True) -> Any:
    try:
        return weighted_mean(contributions, precise=precise)
    except AggregationError as exc:
        raise StrategyFailed(ErrorCode.AGGREGATION_MISMATCH, str(exc)) from exc


def _check_replicas_agree(ids: list[str], states: list[dict[str, Any]], nodes: list[str]) -> None:
    """Every replica applied the same steps to the same start: their weights must be equal."""
    for node in nodes:
        for key, value in states[0][node].items():
            reference = np.asarray(value)
            for worker, other in zip(ids[1:], states[1:], strict=True):
                if not np.array_equal(np.asarray(other[node][key]), reference):
                    raise StrategyFailed(
                        ErrorCode.INTERNAL,
                        f"replicas diverged: node {node!r}, key {key!r} differs between "
                        f"{ids[0]!r} and {worker!r}",
                    )
