"""DiLoCo (Douillard et al. 2023): DataParallel's replicas, placement and data, each replica
stepping alone between synchronisations and an outer step at each.

On the torch collective the coordinator's part is DataParallel's (it is the rendezvous and the
clock, and never touches a weight): the replicas are told the outer step with their plan
(:class:`~protocol.daemon.OuterStepSpec`) and run it themselves
(:mod:`engine.data_parallel.outer_step`).

Through the coordinator — workers that cannot reach each other, behind NAT — each replica trains
``alone`` (no group: :mod:`engine.data_parallel.modes.diloco_alone`) from one synchronisation to
the next, and at each the coordinator reads every replica's weights, averages them (x̄, the mean
of the replicas' local models) and takes the outer step on the global weights it keeps: Nesterov
SGD on the pseudo-gradient x − x̄ is
:class:`~coordinator.strategies.federated.server_optimizers.FedAvgM` with ``nesterov``
(x + η (Δ + β m), Δ = x̄ − x), the same maths the replicas run over a group.
It then sets every replica to the new global weights. Each replica keeps its inner optimizer.
With ``compression`` the weights do not travel: each replica sends its pseudo-gradient
θ_sync − θ_local encoded (:mod:`protocol.compressed_trees`; int8 with its own error feedback),
the coordinator averages them into Δ̄, takes the outer step on −Δ̄ alone (Nesterov's update
needs no weights: η (−Δ̄ + β m)) and sends that update encoded (int8 with its own error
feedback), which each replica adds to its weights of the last synchronisation
(:class:`engine.data_parallel.outer_step.SyncPoint`).

Either way the synchronisations fall after every ``sync_every`` steps counted over the run, as the
paper and torchft count H, and after the run's last (:func:`protocol.rules.batching.synchronises`);
and wherever the model is read — an epoch's validation, ``validate_every`` — or, with
``sync_at_epoch_end``, at every epoch's end (:meth:`DiLoCo.reads`), so validation and the result
see the global model, which every replica holds alike. An epoch's history row without validation
needs no synchronisation: it is the replicas' inner losses. Streaming DiLoCo's validation needs
none either: a replica evaluates the global model its fragments hold
(:meth:`engine.data_parallel.outer_step.OuterStep.global_weights`).

On the torch group a DiLoCo job that is ``elastic``, saves checkpoints or may restart keeps what
outlives a replica on the replicas (:mod:`.diloco_torch`): checkpoints are left on the workers
by the chunk that ends at a synchronisation and read while the next trains, and a lost replica
is dropped from its round's synchronisation, the group formed again without it and its place
taken after. An elastic model with buffers (which
DDP broadcasts at every inner step) trains through the coordinator instead. There, with
``elastic``, a replica whose
worker or daemon is lost during a round is *dropped* from that round's average (``worker_lost``,
then ``worker_dropped``) and the others go on at once, without waiting; at each synchronisation
that follows, a lost replica's place is taken by a worker that is idle then — its own worker
with a fresh daemon when only the daemon died — set to the new global model and a survivor's
inner optimizer state (``worker_joined``), the outer state staying with the coordinator (as
torchft's DiLoCo). A checkpoint (:class:`~.checkpoints.SyncCheckpoints`) is taken after a
synchronisation: the global model, every replica's inner optimizer state and the outer momentum.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from coordinator.context import StrategyContext
from coordinator.errors import (
    StrategyFailed,
    StrategyOptionsError,
    WorkerCallError,
)
from coordinator.strategies.base import JobInputs, Placement
from coordinator.strategies.data_parallel.checkpoints import SyncCheckpoints, sync_payload
from coordinator.strategies.data_parallel.data_parallel import DataParallel
from coordinator.strategies.data_parallel.diloco_torch import SyncsOnTorch
from coordinator.strategies.data_parallel.elastic import (
    RECOVERABLE,
    Lost,
    Replicas,
    Snapshot,
    every_replica_lost,
)
from coordinator.strategies.data_parallel.phase import Choice, TrainingPhase
from coordinator.strategies.data_parallel.star import average, received
from coordinator.strategies.data_parallel.torch_collective import chunk_progress, replica_plans
from coordinator.strategies.federated.server_optimizers import FedAvgM
from protocol.compressed_trees import TreeCompressor
from protocol.daemon import (
    DiLoCoAloneSpec,
    DistOuterUpdateRequest,
    DistPlanRequest,
    DistPseudoGradientsRequest,
    DistTrainRequest,
    ReplicaPlace,
)
from protocol.errors import ErrorCode
from protocol.options.server_optimizers import FedAvgMOptions
from protocol.options.strategies import DiLoCoOptions
from protocol.rules.batching import synchronises
from protocol.rules.fragments import fragment_pieces
from protocol.rules.traffic import sync_bytes

__all__ = ["CoordinatorSyncs", "DiLoCo"]

T = TypeVar("T")


class DiLoCo(DataParallel):
    """``workers`` replicas that synchronise every ``sync_every`` steps (module docstring)."""

    options_model = DiLoCoOptions
    options: DiLoCoOptions
    checkpoints_kind = SyncCheckpoints

    def _torch_training(self, phase: TrainingPhase) -> SyncsOnTorch:
        """The replicas step alone and take the outer step together, checkpointed and
        elastic on the group (:mod:`.diloco_torch`)."""
        outer = self.options.outer_step(self.reads(phase))
        return SyncsOnTorch(phase=phase, options=self.options, outer=outer)

    def reads(self, phase: TrainingPhase) -> list[int]:
        """The steps (from 1) after which the global model is read, so that the replicas
        synchronise there too: where the run validates, and every epoch's end with
        ``sync_at_epoch_end``. A Streaming DiLoCo run's validations read the global model as
        its fragments' last synchronisations left it, on a replica (every one holds it),
        without synchronising."""
        bounds = phase.training.boundaries(phase.setup.steps_per_epoch)
        validates = phase.evaluate is not None and not self.options.streaming()
        at_ends = self.options.sync_at_epoch_end
        return [
            s
            for s in range(1, bounds.total + 1)
            if (validates and bounds.reads_after(s)) or (at_ends and bounds.ends_epoch(s))
        ]

    def placement(self) -> Placement:
        placement = super().placement()
        if self.options.streaming():  # only on the torch collective
            return dataclasses.replace(placement, network=True)
        return placement

    def validate(self, job: JobInputs) -> None:
        """As DataParallel's, and a Streaming DiLoCo the model allows: no more fragments than
        trainable values, no buffers when exchanges overlap (module docstring)."""
        super().validate(job)
        o = self.options
        nodes = self._plan(job)[0]
        shapes = [shape for n in nodes for shape in job.nodes[n].parameter_shapes]
        values = sum(math.prod(shape) for shape in shapes)
        if o.fragments > 1 and shapes and values < o.fragments:
            raise StrategyOptionsError(
                f"fragments={o.fragments}: the model has {values} trainable values, and a "
                "fragment holds one at least"
            )
        if o.overlap and any(job.nodes[n].buffers for n in nodes):
            raise StrategyOptionsError(
                f"overlap={o.overlap}: the model has buffers, which DDP broadcasts before each "
                "forward while an exchange would be in flight; use overlap=0"
            )

    def _traffic(self, shapes: list[list[int]]) -> dict[str, Any]:
        """A synchronisation's pseudo-gradients, every ``sync_every`` steps: the largest
        fragment's, streaming (``sync_bytes`` is the peak a synchronisation moves)."""
        o = self.options
        compression = o.compression
        said: dict[str, Any] = {"sync_every": o.sync_every}
        numels = [math.prod(shape) for shape in shapes]
        if o.fragments > 1 and sum(numels) >= o.fragments:
            cut = fragment_pieces(numels, o.fragments)
            peak = max(sync_bytes([[b - a] for _, a, b in p], compression) for p in cut)
            said |= {"fragments": o.fragments, "model_sync_bytes": sync_bytes(shapes, compression)}
        else:
            peak = sync_bytes(shapes, compression)
        said["sync_bytes"] = peak
        return said | ({"overlap": o.overlap} if o.overlap else {})

    async def _choose(self, run: Replicas) -> Choice:
        """Through the coordinator when an elastic run's model has buffers (module
        docstring); a Streaming DiLoCo only on the torch collective."""
        buffers = [n for n in run.torch_nodes if run.job.nodes[n].buffers]
        if self.options.elastic and buffers:
            return Choice(
                "coordinator",
                f"elastic DiLoCo on a model with buffers ({buffers}), which DDP broadcasts at "
                "every inner step, synchronises through the coordinator",
            )
        choice = await super()._choose(run)
        streaming = self.options.streaming()
        if streaming and choice.collective != "torch":
            raise StrategyFailed(
                ErrorCode.COLLECTIVE_FAILED,
                f"Streaming DiLoCo ({streaming}) runs on the torch collective, and the "
                f"replicas' group cannot: {choice.reason}",
            )
        return choice

    async def _through_coordinator(self, phase: TrainingPhase) -> None:
        """3. DiLoCo through the coordinator (module docstring)."""
        assert isinstance(phase.saves, SyncCheckpoints)
        syncs = CoordinatorSyncs(
            phase=phase, options=self.options, saves=phase.saves, reads=self.reads(phase)
        )
        await syncs.train(phase.total, phase.start)


@dataclass(kw_only=True)
class CoordinatorSyncs:
    """DiLoCo's training phase with the coordinator taking the outer steps (module
    docstring): the ``phase`` whole, the run's ``options``, its checkpoints (``saves``) and
    ``reads``, the steps after which the global model is read (a sync falls there)."""

    phase: TrainingPhase
    options: DiLoCoOptions
    saves: SyncCheckpoints
    reads: list[int]
    lost: dict[int, WorkerCallError] = field(default_factory=dict)  # dropped, and why

    def __post_init__(self) -> None:
        phase = self.phase
        self.run, self.training, self.rows = phase.run, phase.training, phase.rows
        self.steps_per_epoch = phase.setup.steps_per_epoch
        self.history, self.evaluate = phase.history, phase.evaluate

    async def train(self, total: int, start: int) -> None:
        """Global steps ``[start, total)``: each round's inner steps on every replica present,
        then the synchronisation (and the lost replicas' places taken); one progress event a
        round."""
        run, ctx = self.run, self.run.ctx
        plan = self._plans()
        await run.on_all(lambda i, fresh: ctx.call(i, plan(i)), run.present())
        nodes = run.torch_nodes
        o = self.options
        updates = None if o.compression is None else TreeCompressor(o.compression)
        global_state: dict[str, Any] = {}  # (with compression, on the replicas only)
        if updates is None:
            global_state = next(iter((await self._on_present(_get(ctx, nodes))).values()))
        outer = FedAvgM(
            FedAvgMOptions(lr=o.outer_lr, momentum=o.outer_momentum, nesterov=o.nesterov)
        )
        if self.saves.outer is not None:  # resumed: the outer momentum as it was saved
            outer.load_state_dict(self.saves.outer)
        step = start
        for stop in self._rounds(total):
            if stop <= step:
                continue
            run.position.phase, run.position.step = "training", step + 1
            results = await self._on_present(_train(ctx, step, stop))
            if updates is None:
                states = await self._on_present(_get(ctx, nodes))
                results = {i: r for i, r in results.items() if i in states}
                mean = average([(run.ids[i], 1.0, states[i]) for i in sorted(states)])
                global_state = outer.step(global_state, mean)
                await self._on_present(_set(ctx, global_state))
            else:
                results = await self._compressed_sync(results, outer, updates)
            if self.lost:
                await self._join(plan)
            if self.saves.due(stop, total):
                if updates is not None:  # every replica holds the global model alike
                    global_state = await ctx.get_state(run.present()[0], nodes)
                await self._checkpoint(stop, global_state, outer.state_dict())
            await chunk_progress(
                run.emit,
                self.training,
                self.steps_per_epoch,
                (step, stop),
                results,
                history=self.history,
                evaluate=self.evaluate,
            )
            step = stop
        run.position.step = None

    async def _compressed_sync(
        self, results: dict[int, Any], outer: FedAvgM, updates: TreeCompressor
    ) -> dict[int, Any]:
        """A synchronisation with compression (module docstring): the replicas' pseudo-gradients
        averaged, the outer update sent encoded and taken; the rounds' ``results`` of the
        replicas still present."""
        run, ctx, compression = self.run, self.run.ctx, updates.compression
        ask = DistPseudoGradientsRequest(compression=compression)
        sent = await self._on_present(lambda i: ctx.call(i, ask))
        model = run.job.trained_shapes()
        deltas = [
            (run.ids[i], 1.0, received(run.ids[i], "pseudo-gradients", sent[i], model))
            for i in sorted(sent)
        ]
        mean = average(deltas, what="pseudo-gradients")  # Δ̄ = θ − x̄
        zeros = {n: {k: v.new_zeros(v.shape) for k, v in ps.items()} for n, ps in mean.items()}
        towards = {n: {k: -v for k, v in ps.items()} for n, ps in mean.items()}  # x̄ − θ
        update = DistOuterUpdateRequest(update=updates.encode(outer.step(zeros, towards)))
        await self._on_present(lambda i: ctx.call(i, update))
        return {i: r for i, r in results.items() if i in sent}

    async def _checkpoint(self, done: int, global_state: dict[str, Any], outer: Any) -> None:
        """Save the run after the synchronisation that ends step ``done``: the global model
        with the plain filters' states (fitted once, the same everywhere), every replica's
        inner optimizer state and the ``outer`` optimizer's."""
        run, ctx = self.run, self.run.ctx
        prefix = [n for n in run.job.node_ids if n not in run.torch_nodes]
        optimizers = await self._on_present(_get_optimizers(ctx, run.torch_nodes))
        fitted = await ctx.get_state(run.present()[0], prefix) if prefix else {}
        await self.saves.after_sync(done, sync_payload(fitted | global_state, optimizers, outer))

    async def _on_present(self, call: Callable[[int], Awaitable[T]]) -> dict[int, T]:
        """``call(i)`` on every replica present; their results by replica. With ``elastic`` a
        replica whose worker or daemon is lost is dropped and the others' results stand.

        Raises:
            StrategyFailed: every replica present was lost (``worker_lost``).
        """
        run = self.run
        try:
            return await run.each({i: call(i) for i in run.present()})
        except Lost as lost:
            await run.report(lost.errors)
            for i, error in lost.errors.items():
                run.absent.add(i)
                self.lost[i] = error
            if not lost.results:
                raise every_replica_lost(lost.errors, run.position.where) from None
            for i, error in lost.errors.items():
                await run.emit(
                    "worker_dropped",
                    {"replica": i, "worker": error.worker_id, "replicas": len(run.present())}
                    | run.position.at(),
                )
            return lost.results

    async def _join(self, plan: Callable[[int], DistPlanRequest]) -> None:
        """At a synchronisation, each lost replica's place taken by a worker idle now (its own,
        with a fresh daemon, when only the daemon died), set to a survivor's states — the
        global model, just set — and inner optimizer state; a place nobody takes stays empty
        until the next."""
        run, ctx = self.run, self.run.ctx
        source = run.present()[0]
        snapshot: Snapshot | None = None
        for i, error in sorted(self.lost.items()):
            old = run.ids[i]
            if not await run.idle_worker(i, error):
                continue
            try:
                if snapshot is None:  # (the plain filters' states with the global model)
                    snapshot = await run.snapshot(source)
                await run.restore(i, snapshot)
                await ctx.call(i, plan(i))
            except WorkerCallError as exc:
                if exc.code not in RECOVERABLE or exc.worker_id == run.ids[source]:
                    raise
                self.lost[i] = exc  # the joiner went too: the place stays empty
                continue
            del self.lost[i]
            run.absent.discard(i)
            await run.emit(
                "worker_joined",
                {"replica": i, "lost": old, "worker": run.ids[i], "from": run.ids[source]}
                | run.position.at(),
            )

    def _plans(self) -> Callable[[int], DistPlanRequest]:
        """Each replica's plan: its rows, its place among the replicas, no group."""
        world = self.run.ctx.num_workers()
        outer = self.options.outer_step(self.reads)

        def alone(i: int) -> DiLoCoAloneSpec:
            return DiLoCoAloneSpec(outer=outer, place=ReplicaPlace(rank=i, world=world))

        shared = DistPlanRequest(
            node_ids=self.run.job.node_ids,
            data=self.run.staged,
            held=[],
            rows=0,
            **self.training.batch_plan(),
            mode=alone(0),
            compression=self.options.compression,
        )
        plan = replica_plans(self.run, shared, self.rows)
        return lambda i: plan(i).model_copy(update={"mode": alone(i)})

    def _rounds(self, total: int) -> list[int]:
        """The steps after which the replicas synchronise, as ``stop`` bounds."""
        ends = synchronises(total, self.options.sync_every, self.reads)
        return [g + 1 for g in range(total) if ends[g]]


def _train(ctx: StrategyContext, start: int, stop: int) -> Callable[[int], Awaitable[Any]]:
    """A replica's inner steps ``[start, stop)``."""
    request = DistTrainRequest(start=start, stop=stop)
    return lambda i: ctx.call(i, request)


def _get(ctx: StrategyContext, nodes: list[str]) -> Callable[[int], Awaitable[dict[str, Any]]]:
    """A replica's weights of ``nodes``."""
    return lambda i: ctx.get_state(i, nodes)


def _get_optimizers(
    ctx: StrategyContext, nodes: list[str]
) -> Callable[[int], Awaitable[dict[str, Any]]]:
    """A replica's inner optimizer states of ``nodes``."""
    return lambda i: ctx.get_optimizer_state(i, nodes)


def _set(ctx: StrategyContext, states: dict[str, Any]) -> Callable[[int], Awaitable[None]]:
    """A replica set to the global weights ``states``."""
    return lambda i: ctx.set_state(i, states)
