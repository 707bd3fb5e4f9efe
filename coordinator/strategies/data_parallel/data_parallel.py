"""DataParallel: synchronous data-parallel SGD over N replicas (all-reduce of gradients).

Every global batch is exactly the batch ``graph.fit`` would take (:mod:`protocol.rules.batching`,
with the last TorchFilter's ``batch_size``, ``shuffle`` and ``seed``); it is split across the
replicas together with its labels (``numpy.array_split``: uneven splits allowed). Each replica
computes the gradient of its slice's mean loss; the coordinator averages the gradients weighted by
slice size — which is the gradient of the global batch's mean loss — and every replica applies that
same mean with its own persistent optimizer. With a mean-reduced loss and no randomness in the
model, the result equals single-process training on the same global batches (Goyal et al. 2017, §2:
"the same as a single-worker minibatch of size kn").

Data crosses the wire once per job: each replica is sent the rows it will ever see, staged in its
filter daemon, and per step only row indices go out and gradients come back. Plain filters before
the first TorchFilter are fitted on each replica's share of the first epoch, their states
averaged (weighted by rows) and set everywhere before training starts. At the end the model is
read whole from one replica and every replica's tensors compared by their SHA-256
(:meth:`~coordinator.context.StrategyContext.state_digests`): they must agree, and the
coordinator takes one model's bytes, not N.

Over ``WorkerData`` each replica stages its own dataset instead and each step takes every
replica's next ``batch_size`` rows of its own (:func:`protocol.rules.batching.replica_batches`, by
:class:`~coordinator.strategies.steps.OwnData`); the rest is the same. It cannot be elastic: a
replacement worker would hold other rows.

A replica whose worker is lost (its connection closed or went silent, ``worker_lost``) or whose
daemon died (``daemon_crashed``) fails the job at once, naming the worker — unless the job is
``elastic``: then the step in flight is abandoned, the replica replaced and restored from a
survivor (:mod:`~coordinator.strategies.data_parallel.elastic`), and the step resumed, so the result
is still the one ``graph.fit`` gives.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterable
from typing import Any, TypeVar

import numpy as np

from coordinator.context import StrategyContext
from coordinator.errors import StrategyFailed, StrategyOptionsError
from coordinator.strategies.base import Emit, JobInputs, Placement, ShardedStates, Strategy
from coordinator.strategies.data_parallel.checkpoints import ReplicaCheckpoints
from coordinator.strategies.data_parallel.elastic import DataParallelPosition, Replicas
from coordinator.strategies.data_parallel.phase import Choice, SetUp, TrainingPhase
from coordinator.strategies.data_parallel.star import GlobalBatchPlan, StarTraining, average
from coordinator.strategies.data_parallel.torch_collective import TorchTraining, choose
from coordinator.strategies.history import (
    VALIDATION,
    Evaluate,
    History,
    ended,
    row_weighted,
    validation_stage,
)
from coordinator.strategies.steps import (
    OwnData,
    TrainingSettings,
    global_batches,
    lr_schedule_request,
    plain_prefix,
)
from protocol.daemon import CompositeFitRequest, DistEvaluateRequest, EvaluateRequest
from protocol.errors import ErrorCode
from protocol.options.strategies import DataParallelOptions
from protocol.rules.equivalence import data_parallel_notes
from protocol.rules.replica_memory import replica_bytes
from protocol.rules.rows import rows_of
from protocol.rules.traffic import step_bytes

T = TypeVar("T")

STAGED = "train"
"""The name a replica's rows are staged under in its daemon."""


class DataParallel(Strategy):
    """``workers`` replicas (optionally all tagged ``tag``) train one model in lockstep; with
    ``elastic``, a lost replica is replaced within ``elastic_timeout`` seconds and training
    resumes from the last completed step."""

    options_model = DataParallelOptions
    options: DataParallelOptions
    saves_checkpoints = True
    checkpoints_kind: type[ReplicaCheckpoints] = ReplicaCheckpoints

    def __init__(self, options: DataParallelOptions) -> None:
        super().__init__(options)
        self._prepared: SetUp | None = None

    @property
    def shards_checkpoints(self) -> bool:
        return self.options.sharding != "none"

    def placement(self) -> Placement:
        o = self.options
        torch = o.collective == "torch" or o.sharding != "none"  # never the coordinator path
        return Placement(workers=o.workers, tag=o.tag, device=o.device, network=torch)

    def validate(self, job: JobInputs) -> None:
        self._plan(job)

    async def prepare(self, ctx: StrategyContext, job: JobInputs, emit: Emit) -> dict[str, Any]:
        """Ship the filters and each replica's rows, and choose the collective; what the
        ``placed`` event says of it, with why the run will not equal ``graph.fit`` exactly
        (``notes``: :mod:`protocol.rules.equivalence`) when it will not."""
        self._prepared = await self._set_up(ctx, job, emit)
        notes = data_parallel_notes(job.nodes, self._plan(job)[0], self.options.sync_batchnorm)
        compression = self.options.compression
        said = self._prepared.choice.describe()
        said |= {"compression": compression} if compression is not None else {}
        shapes = [shape for n in self._plan(job)[0] for shape in job.nodes[n].parameter_shapes]
        said |= self._traffic(shapes) if shapes else {}  # (unless the client did not say them)
        return said | ({"notes": notes} if notes else {})

    def _traffic(self, shapes: list[list[int]]) -> dict[str, Any]:
        """What the ``placed`` event says of the bytes a replica exchanges, from the trainable
        parameters' ``shapes``: a step's gradients (:mod:`protocol.rules.traffic`); and, sharded,
        what each replica holds of them."""
        said: dict[str, Any] = {"step_bytes": step_bytes(shapes, self.options.compression)}
        if self.options.sharding != "none":
            said["sharding"] = self.options.sharding
            said["replica_bytes"] = replica_bytes(shapes, self.options.workers)
        return said

    def _rows_alone(self, job: JobInputs) -> bool:
        """Whether each replica is sent only its rows of the torch nodes' parameters: when
        they are sharded, unless the run resumes from a checkpoint of whole states (which each
        replica loads whole before it is sharded, as it did the filters)."""
        if self.options.sharding == "none":
            return False
        resume = job.checkpoints.resume if job.checkpoints is not None else None
        return resume is None or "shards" in resume.payload

    async def _set_up(self, ctx: StrategyContext, job: JobInputs, emit: Emit) -> SetUp:
        torch_nodes, _, training = self._plan(job)
        n = rows_of(job.x) or 0
        replicas = range(ctx.num_workers())
        if job.dataset is None:
            # Walked in threads, off the event loop: a shuffled plan is torch's generator's
            # permutations (their first import takes a second or more), and each walk takes
            # as long as the run has steps.
            steps = itertools.islice(global_batches(n, len(replicas), training), training.max_steps)
            held = await asyncio.to_thread(_held, steps, len(replicas))
            plan = global_batches(n, len(replicas), training)
        else:  # each replica's own rows: known once staged
            held = [np.arange(0) for _ in replicas]
        run = Replicas(
            ctx,
            job,
            emit,
            DataParallelPosition(held),
            torch_nodes,
            staged=STAGED,
            elastic=self.options.elastic,
            timeout=self.options.elastic_timeout,
            placement=self.placement().describe(),
            validation=validation_stage(job),
            sharded=self.options.sharding != "none",
            rows_alone=self._rows_alone(job),
        )
        await run.on_all(run.set_up, replicas)
        if job.dataset is not None:
            own = OwnData.of([run.staged_rows[i] for i in replicas], run.ids)
            run.position.own = own
            run.position.held = [np.arange(size) for size in own.sizes]
            plan = own.batches(training)
        first_epoch, steps_per_epoch = await asyncio.to_thread(_first_epoch, plan, len(replicas))
        run.schedule = schedule = lr_schedule_request(training, steps_per_epoch)

        async def tell(i: int, fresh: bool) -> None:
            if not fresh:  # a replacement was told when it was set up
                await ctx.call(i, schedule)

        await run.on_all(tell, replicas)
        choice = await self._choose(run)
        compression = self.options.compression
        factorised = compression is not None and not compression.travels_as_tree  # PowerSGD
        if factorised and choice.collective != "torch":
            raise StrategyFailed(
                ErrorCode.COLLECTIVE_FAILED,
                f"compression={compression!r} runs on the torch collective, and "
                f"{choice.reason} (through the coordinator: 'fp16', 'bf16' or 'int8')",
            )
        if self.options.sync_batchnorm and choice.collective != "torch":
            raise StrategyFailed(
                ErrorCode.COLLECTIVE_FAILED,
                f"sync_batchnorm=True needs the torch collective, and {choice.reason}",
            )
        if self.options.sharding != "none" and choice.collective != "torch":
            raise StrategyFailed(
                ErrorCode.COLLECTIVE_FAILED,
                f"sharding={self.options.sharding!r} shards the model with FSDP2 on the torch "
                f"collective, and {choice.reason}",
            )
        return SetUp(run, first_epoch, steps_per_epoch, choice)

    async def run(
        self, ctx: StrategyContext, job: JobInputs, emit: Emit
    ) -> dict[str, Any] | ShardedStates:
        torch_nodes, prefix, training = self._plan(job)
        n = rows_of(job.x) or 0
        replicas = range(ctx.num_workers())

        # 1. Ship the filters, then each replica's rows: the union of its slices over all steps;
        #    choose the collective (done by prepare() when the job manager ran it).
        await emit("progress", {"phase": "loading", "replicas": len(replicas)})
        setup, self._prepared = self._prepared or await self._set_up(ctx, job, emit), None
        run, first_epoch, steps_per_epoch = setup.run, setup.first_epoch, setup.steps_per_epoch
        position = run.position

        # 2. Plain filters before the torch part: fitted per shard, averaged by rows, set on all;
        #    or, resumed, every node's state and optimizer state from the job's checkpoint.
        saves = self.checkpoints_kind.of(
            run, self.options.checkpoint_every, steps_per_epoch, training.epochs
        )
        start = await saves.restore()
        if prefix and not start:
            position.phase = "fitting"
            await emit("progress", {"phase": "fitting", "nodes": prefix})
            await _fit_prefix(run, prefix, first_epoch)
        position.copy_state = True  # from here on every replica holds what a replacement copies

        bounds = training.boundaries(steps_per_epoch)
        total_steps = bounds.total
        history = History(emit)
        phase = TrainingPhase(
            setup=setup,
            training=training,
            rows=n,
            history=history,
            evaluate=_evaluator(run, job),
            total=total_steps,
            start=start,
            saves=saves,
        )
        saves.start()
        if setup.choice.collective == "torch":
            await self._on_torch(phase)
        else:
            await self._through_coordinator(phase)
        await saves.flush()
        await history.finish(ended(bounds.epochs_run, total_steps))
        if run.sharded:  # kept as the replicas hold it: the client joins the pieces
            return await run.pieces()
        return await _agreed_states(run, torch_nodes)

    async def _on_torch(self, phase: TrainingPhase) -> None:
        """3. Synchronous SGD on torch.distributed: the replicas train, the coordinator only
        keeps time (:mod:`.torch_collective`)."""
        await self._torch_training(phase).train(phase.total, phase.start, phase.saves)

    def _torch_training(self, phase: TrainingPhase) -> TorchTraining:
        """The training phase on the torch group: every step's gradients reduced (DDP), or
        FSDP2's shards."""
        return TorchTraining(phase=phase, options=self.options)

    async def _through_coordinator(self, phase: TrainingPhase) -> None:
        """3. Synchronous SGD (Goyal et al. 2017) through the coordinator: each slice's
        gradient, their weighted mean, one step everywhere; streamed, a step's mean going out
        with the next step's requests as it folds (:mod:`.star`)."""
        run = phase.run
        syncs = any(run.job.nodes[node].buffers for node in run.torch_nodes)
        star = StarTraining(
            phase=phase, staged=STAGED, syncs_buffers=syncs, compression=self.options.compression
        )
        await star.train(phase.total, phase.start, phase.saves)

    async def _choose(self, run: Replicas) -> Choice:
        """The collective the run trains on (:func:`.torch_collective.choose`)."""
        return await choose(run, self.options.collective, self.options.collective_timeout)

    def _plan(self, job: JobInputs) -> tuple[list[str], list[str], TrainingSettings]:
        """The torch nodes, the plain prefix and the training settings; or why not."""
        if job.dataset is not None and self.options.elastic:
            raise StrategyOptionsError(
                "data_parallel on WorkerData cannot be elastic: a replacement worker holds "
                "other rows than the replica it would replace"
            )
        torch_nodes, prefix = plain_prefix(job, self.name, "; use Local")
        missing = job.missing_labels(torch_nodes[-1], "data_parallel")
        if missing is not None:
            raise StrategyOptionsError(missing)
        return torch_nodes, prefix, TrainingSettings.of(job.nodes[torch_nodes[-1]])


async def _agreed_states(run: Replicas, torch_nodes: list[str]) -> dict[str, Any]:
    """4. The final states, read back over the wire from one replica, every replica's torch
    nodes' tensors compared by their digests: they must agree."""
    states, digests = await run.read_back(torch_nodes)
    _check_replicas_agree([run.ids[i] for i in digests], list(digests.values()), torch_nodes)
    return states


def _evaluator(run: Replicas, job: JobInputs) -> Evaluate | None:
    """How the model is evaluated at an epoch's end (``None``: no validation data): on the
    first replica present, which holds the rows sent; or, on the workers' own split, every
    replica present on its own, the figures weighted by rows. A sharded run's replicas
    evaluate together, through their shards, each its part of the rows sent (or its own
    split)."""
    if not job.validates:
        return None
    if run.sharded:
        return _sharded_evaluator(run, job)
    request = EvaluateRequest(node_ids=job.node_ids, data=VALIDATION)

    async def one(i: int, fresh: bool) -> dict[str, Any]:
        scores: dict[str, Any] = await run.ctx.call(i, request)
        return scores

    async def evaluate() -> dict[str, Any]:
        present = run.present()  # (DiLoCo's elastic rounds drop replicas: those left hold it)
        which = present if job.val_split is not None else present[:1]
        return row_weighted(list((await run.on_all(one, which)).values()))

    return evaluate


def _sharded_evaluator(run: Replicas, job: JobInputs) -> Evaluate:
    """Every replica of a sharded run evaluates at once (each forward is a collective),
    replica ``i`` the ``i``-th of as many even parts of the rows sent, or its own split; their
    figures weighted by rows."""
    replicas = list(range(run.ctx.num_workers()))
    parts: list[list[int] | None] = [None for _ in replicas]
    if job.val_split is None:
        rows = np.arange(rows_of(job.x_val) or 0)
        parts = [part.tolist() for part in np.array_split(rows, len(replicas))]

    async def one(i: int, fresh: bool) -> dict[str, Any]:
        request = DistEvaluateRequest(node_ids=job.node_ids, data=VALIDATION, rows=parts[i])
        scores: dict[str, Any] = await run.ctx.call(i, request)
        return scores

    async def evaluate() -> dict[str, Any]:
        return row_weighted(list((await run.on_all(one, replicas)).values()))

    return evaluate


async def _fit_prefix(run: Replicas, prefix: list[str], first_epoch: list[list[int]]) -> None:
    """Fit the plain filters on each replica's share of the first epoch, then set their
    row-weighted mean on every replica."""
    held, replicas = run.position.held, range(len(run.position.held))
    shards = [np.searchsorted(held[i], sorted(first_epoch[i])).tolist() for i in replicas]
    fitting = [i for i in replicas if shards[i]]

    async def fit(i: int, fresh: bool) -> Any:
        request = CompositeFitRequest(node_ids=prefix, data=STAGED, rows=shards[i])
        return await run.ctx.call(i, request)

    fits = await run.on_all(fit, fitting)
    averaged = average([(run.ids[i], len(shards[i]), fits[i]["states"]) for i in fitting])

    async def set_averaged(i: int, fresh: bool) -> None:
        await run.ctx.set_state(i, averaged)

    await run.on_all(set_averaged, replicas)


def _held(plan: Iterable[tuple[int, int, list[Any]]], replicas: int) -> list[Any]:
    """The rows each replica will ever see (in the steps of ``plan``), sorted: what it is sent
    of the client's data."""
    needed: list[set[int]] = [set() for _ in range(replicas)]
    for _, _, slices in plan:
        for i, part in enumerate(slices):
            needed[i].update(part.tolist())
    return [np.array(sorted(rows), dtype=np.int64) for rows in needed]


def _first_epoch(plan: GlobalBatchPlan, replicas: int) -> tuple[list[list[int]], int]:
    """The rows each replica sees in the first epoch (what plain filters in front fit on), and
    the steps of an epoch; the plan is read no further than that epoch."""
    first_epoch: list[list[int]] = [[] for _ in range(replicas)]
    steps_per_epoch = 0
    for epoch, step, slices in plan:
        if epoch > 0:
            break
        steps_per_epoch = step + 1
        for i, part in enumerate(slices):
            first_epoch[i].extend(part.tolist())
    return first_epoch, steps_per_epoch


def _check_replicas_agree(ids: list[str], digests: list[dict[str, Any]], nodes: list[str]) -> None:
    """Every replica applied the same steps to the same start: their weights must be equal,
    tensor by tensor (``digests``: each replica's, :meth:`StrategyContext.state_digests`)."""
    for node in nodes:
        for key, reference in digests[0][node].items():
            for worker, other in zip(ids[1:], digests[1:], strict=True):
                if other[node].get(key) != reference:
                    raise StrategyFailed(
                        ErrorCode.INTERNAL,
                        f"replicas diverged: node {node!r}, key {key!r} differs between "
                        f"{ids[0]!r} and {worker!r}",
                    )
