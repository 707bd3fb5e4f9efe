"""ModelParallel: the graph split in stages on different workers, trained as a pipeline.

Partitions tile the graph — every node in exactly one, each a contiguous run in graph order, in
graph order — and each is pinned to a worker by id or tag. Every global batch (the batch
``graph.fit`` would take) is cut into M micro-batches that flow forward stage to stage; the last
stage computes the loss; the gradient of the loss with respect to each stage's input flows back;
each stage accumulates its parameter gradients over the micro-batches and steps its optimizer once
per global batch (GPipe, Huang et al. 2019). The order of the actions on each stage is a
:class:`~coordinator.strategies.model_parallel.schedule.Schedule` (GPipe, or 1F1B), data checked
before any work starts; :mod:`~coordinator.strategies.model_parallel.executor` executes it.

Plain filters may only come before the first TorchFilter: they are fitted in a first pass over
the data and then held fixed (stages made only of them are applied once, up front).

Over live workers whose daemons can reach each other, the stages run the schedule themselves and
pass activations and gradients over torch.distributed (``transport="torch"`` or ``"auto"``:
:mod:`~coordinator.strategies.model_parallel.torch_transport`). Otherwise (``"websocket"``) every
action is a call from here and the tensors go worker to worker: each stage's agent dials its
neighbours' peer address (``somatize-worker --peer-listen``), or the coordinator relays them for a
worker with no peer address. Contexts with no peer links (in-memory workers) pass them through the
strategy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from coordinator.context import StrategyContext, Target
from coordinator.errors import StrategyFailed, StrategyOptionsError
from coordinator.strategies.base import Emit, JobInputs, Placement, Strategy
from coordinator.strategies.data_parallel.elastic import MAX_RECOVERIES, RECOVERABLE
from coordinator.strategies.history import History
from coordinator.strategies.model_parallel.checkpoints import StageCheckpoints
from coordinator.strategies.model_parallel.run import PipelineRun
from coordinator.strategies.steps import TrainingSettings, plain_prefix
from protocol.errors import ErrorCode
from protocol.options.devices import device_fits
from protocol.options.strategies import ModelParallelOptions
from protocol.text.wording import listed


@dataclass(frozen=True)
class StagePlacement:
    """A stage of the pipeline as it is placed: its nodes (a partition's) and the worker it
    asks for (id or tag, and device: the partition's, else the pipeline's)."""

    node_ids: tuple[str, ...]
    target: Target


def check_partitions(node_ids: Sequence[str], partitions: Sequence[StagePlacement]) -> None:
    """Refuse partitions that do not tile the graph, naming the node and partitions involved.

    Linear in the nodes, so that a graph of tens of thousands is checked at once."""
    if not partitions:
        raise StrategyOptionsError("model_parallel needs at least one partition")
    in_graph = set(node_ids)
    owner: dict[str, int] = {}
    for p, partition in enumerate(partitions):
        if not partition.node_ids:
            raise StrategyOptionsError(f"partition {p} is empty")
        for node in partition.node_ids:
            if node not in in_graph:
                raise StrategyOptionsError(
                    f"partition {p} names {node!r}, which is not in the graph (nodes: "
                    f"{listed(node_ids)})"
                )
            if node in owner:
                raise StrategyOptionsError(
                    f"node {node!r} is in partitions {owner[node]} and {p}: a node belongs to "
                    "exactly one"
                )
            owner[node] = p
    orphans = [n for n in node_ids if n not in owner]
    if orphans:
        raise StrategyOptionsError(
            f"nodes {listed(orphans)} are in no partition: partitions must tile"
        )
    order = [owner[n] for n in node_ids]
    if order != sorted(order):
        first = next(i for i in range(1, len(order)) if order[i] < order[i - 1])
        raise StrategyOptionsError(
            f"partitions must be contiguous runs in graph order: node {node_ids[first]!r} "
            f"(partition {order[first]}) comes after {node_ids[first - 1]!r} (partition "
            f"{order[first - 1]})"
        )


class ModelParallel(Strategy):
    """A pipeline over ``partitions`` with ``micro_batches`` micro-batches per global batch;
    ``spares`` more workers (tagged ``spare_tag``, or any) held to take a lost stage's place."""

    options_model = ModelParallelOptions
    options: ModelParallelOptions
    saves_checkpoints = True

    def __init__(self, options: ModelParallelOptions) -> None:
        super().__init__(options)
        self.partitions = [
            StagePlacement(p.node_ids, Target(id=p.worker, tag=p.tag, device=options.device_of(i)))
            for i, p in enumerate(options.partitions)
        ]
        """The stages, placed: each partition's nodes and the worker it asks for."""

    def placement(self) -> Placement:
        spare = Target(tag=self.options.spare_tag, device=self.options.device)
        slots = (*(p.target for p in self.partitions), *([spare] * self.options.spares))
        network = self.options.transport == "torch"  # its stages' daemons dial each other
        return Placement(workers=len(slots), slots=slots, network=network)

    def dataset_slots(self, slots: int) -> tuple[int, ...]:
        """On ``WorkerData`` the first stage reads ``x`` and the last ``y``; the others read
        nothing of it."""
        return (0, slots - 1)

    def validate(self, job: JobInputs) -> None:
        self._plan(job)

    def _plan(self, job: JobInputs) -> tuple[list[str], TrainingSettings]:
        """The differentiable nodes and the training settings; or why the job cannot run."""
        check_partitions(job.node_ids, self.partitions)
        torch_nodes, _ = plain_prefix(job, self.name, "")
        missing = job.missing_labels(torch_nodes[-1], "model_parallel")
        if missing is not None:
            raise StrategyOptionsError(missing)
        if torch_nodes[-1] not in job.labelled():
            raise StrategyOptionsError(
                f"model_parallel takes the loss of its last stage against labels y, and node "
                f"{torch_nodes[-1]!r} computes its own (loss='model' or step=): train it with "
                "Local, DataParallel or FedAvg"
            )
        if job.dataset is not None:
            own_data_checks(self.partitions, torch_nodes)
        if job.val_split is not None:
            raise StrategyOptionsError(
                "model_parallel evaluates validation data sent with the job (x_val, y_val), "
                "not the workers' own split: its stages hold different parts of the model"
            )
        return torch_nodes, TrainingSettings.of(job.nodes[torch_nodes[-1]])

    async def run(self, ctx: StrategyContext, job: JobInputs, emit: Emit) -> dict[str, Any]:
        torch_nodes, training = self._plan(job)
        stages = [list(p.node_ids) for p in self.partitions]
        spares = list(range(len(stages), ctx.num_workers()))
        saves: list[StageCheckpoints] = []  # one for the whole job: it keeps the newest
        history = History(emit)  # one for the whole job too, kept in its checkpoints

        def make_saves(pipeline: list[int], steps_per_epoch: int) -> StageCheckpoints:
            if not saves:
                saves.append(
                    StageCheckpoints.of(
                        ctx,
                        stages=stages,
                        pipeline=pipeline,
                        torch_nodes=torch_nodes,
                        checkpoints=job.checkpoints,
                        every=self.options.checkpoint_every,
                        steps_per_epoch=steps_per_epoch,
                        epochs=training.epochs,
                        emit=emit,
                        history=history,
                    )
                )
            return saves[0]

        attempt = PipelineRun(
            ctx=ctx,
            job=job,
            options=self.options,
            stages=stages,
            torch_nodes=torch_nodes,
            training=training,
            emit=emit,
            make_saves=make_saves,
            history=history,
        )
        crashes = 0
        while True:
            try:
                return await attempt()
            except StrategyFailed as failed:
                stage = failed.info.detail.get("stage")
                if stage is None or failed.info.code not in RECOVERABLE:
                    raise
                if failed.info.code is ErrorCode.DAEMON_CRASHED and crashes < MAX_RECOVERIES:
                    crashes += 1  # its own worker, a fresh daemon: the run starts again
                    await emit("worker_lost", _lost(stage, ctx.workers[stage].id, failed))
                    continue
                await self._fail_over(ctx, stage, spares, failed, emit)

    async def _fail_over(
        self,
        ctx: StrategyContext,
        stage: int,
        spares: list[int],
        failed: StrategyFailed,
        emit: Emit,
    ) -> None:
        """Put a spare that can run ``stage``'s partition in place of its lost worker; or
        re-raise ``failed`` when none is left."""
        lost = ctx.workers[stage].id
        await emit("worker_lost", _lost(stage, lost, failed))
        target = self.partitions[stage].target
        fits = [
            k
            for k in spares
            if device_fits(target.device, ctx.workers[k].device)
            and (target.dataset is None or target.dataset in ctx.workers[k].datasets)
        ]
        if not fits:
            left = "no spare is left" if not spares else f"no spare fits it ({target})"
            raise StrategyFailed(
                failed.info.code, f"{failed.info.message}; {left}", **failed.info.detail
            )
        spares.remove(fits[0])
        ctx.swap(stage, fits[0])
        await emit(
            "worker_replaced", {"stage": stage, "lost": lost, "worker": ctx.workers[stage].id}
        )


def _lost(stage: int, worker: str, failed: StrategyFailed) -> dict[str, Any]:
    return {
        "stage": stage,
        "worker": worker,
        "code": str(failed.info.code),
        "message": failed.info.message,
    }


def own_data_checks(partitions: Sequence[StagePlacement], torch_nodes: Sequence[str]) -> None:
    """What ModelParallel on ``WorkerData`` needs: a first partition that trains (the output of
    plain filters alone would travel through the coordinator).

    Raises:
        StrategyOptionsError: saying so.
    """
    if not set(partitions[0].node_ids) & set(torch_nodes):
        raise StrategyOptionsError(
            "model_parallel on WorkerData: partition 0 holds only plain filters, whose output "
            "would travel through the coordinator; put them in the first TorchFilter's partition"
        )


__all__ = ["ModelParallel", "StagePlacement", "check_partitions", "own_data_checks"]
