"""ModelParallel: the graph split in stages on different workers, trained as a pipeline.

Partitions tile the graph — every node in exactly one, each a contiguous run in graph order, in
graph order — and each is pinned to a worker by id or tag. Every global batch (the batch
``graph.fit`` would take) is cut into M micro-batches that flow forward stage to stage; the last
stage computes the loss; the gradient of the loss with respect to each stage's input flows back;
each stage accumulates its parameter gradients over the micro-batches and steps its optimizer once
per global batch (GPipe, Huang et al. 2019). The order of the actions on each stage is a
:class:`~coordinator.strategies.schedule.Schedule` (GPipe, or 1F1B), data checked before any work
starts; :mod:`~coordinator.strategies.pipeline` executes it.

Plain filters may only come before the first TorchFilter: they are fitted in a first pass over
the data and then held fixed (stages made only of them are applied once, up front).

Over live workers whose daemons can reach each other, the stages run the schedule themselves and
pass activations and gradients over torch.distributed (``transport="torch"`` or ``"auto"``:
:mod:`~coordinator.strategies.pipeline_torch`). Otherwise (``"websocket"``) every action is a
call from here and the tensors go worker to worker: each stage's agent dials its neighbours'
peer address (``somatize-worker --peer-listen``), or the coordinator relays them for a worker
with no peer address. Contexts with no peer links (in-memory workers) pass them through the
strategy.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Self, TypeVar

from coordinator.context import StrategyContext, Target
from coordinator.errors import StrategyFailed, StrategyOptionsError, WorkerCallError
from coordinator.strategies.base import (
    Emit,
    JobInputs,
    Placement,
    Strategy,
    concurrently,
    parse_options,
)
from coordinator.strategies.history import Evaluate, History, ended
from coordinator.strategies.pipeline import (
    STAGED,
    GlobalBatch,
    PipelinePosition,
    ThroughStrategy,
    WorkerToWorker,
    expects,
    run_schedule,
)
from coordinator.strategies.pipeline_torch import LABELS, TorchPipeline, choose_transport
from coordinator.strategies.process_group import Rendezvous
from coordinator.strategies.schedule import Schedule, gpipe, one_f_one_b
from coordinator.strategies.steps import Training, global_batches, plain_prefix, schedule_request
from protocol.clipping import clip_coefficient
from protocol.daemon import (
    CompositeFitRequest,
    CompositeForwardRequest,
    EvaluateRequest,
    ScheduleRequest,
    StageNormRequest,
    StageRequest,
    StageStepRequest,
)
from protocol.errors import ErrorCode
from protocol.strategy_options import DEFAULT_COLLECTIVE_TIMEOUT, ModelParallelOptions
from protocol.wording import listed

T = TypeVar("T")

SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b}


@dataclass(frozen=True)
class Partition:
    """The nodes of one stage and where it runs."""

    node_ids: tuple[str, ...]
    target: Target


def check_partitions(node_ids: Sequence[str], partitions: Sequence[Partition]) -> None:
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
    """A pipeline over ``partitions`` with ``micro_batches`` micro-batches per global batch."""

    name = "model_parallel"

    def __init__(
        self,
        partitions: Sequence[Partition],
        micro_batches: int = 1,
        order: str = "gpipe",
        transport: str = "auto",
        collective_timeout: float = DEFAULT_COLLECTIVE_TIMEOUT,
    ) -> None:
        self.partitions = list(partitions)
        self.micro_batches = micro_batches
        self.order = order
        self.transport = transport
        self.collective_timeout = collective_timeout

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> Self:
        checked = parse_options(ModelParallelOptions, options)
        partitions = [
            Partition(p.node_ids, Target(id=p.worker, tag=p.tag, device=checked.device_of(i)))
            for i, p in enumerate(checked.partitions)
        ]
        return cls(
            partitions,
            checked.micro_batches,
            checked.schedule,
            checked.transport,
            checked.collective_timeout,
        )

    def placement(self) -> Placement:
        return Placement(
            workers=len(self.partitions), slots=tuple(p.target for p in self.partitions)
        )

    def dataset_slots(self, slots: int) -> tuple[int, ...]:
        """On ``WorkerData`` the first stage reads ``x`` and the last ``y``; the others read
        nothing of it."""
        return (0, slots - 1)

    def validate(self, job: JobInputs) -> None:
        self._plan(job)

    def _plan(self, job: JobInputs) -> tuple[list[str], Training]:
        """The differentiable nodes and the training settings; or why the job cannot run."""
        check_partitions(job.node_ids, self.partitions)
        torch_nodes, _ = plain_prefix(job, self.name, "")
        if job.dataset is None and job.y is None:
            raise StrategyOptionsError("model_parallel trains with labels: y is missing")
        if job.dataset is not None:
            own_data_checks(self.partitions, torch_nodes, self.transport)
        if job.val_split is not None:
            raise StrategyOptionsError(
                "model_parallel evaluates validation data sent with the job (x_val, y_val), "
                "not the workers' own split: its stages hold different parts of the model"
            )
        return torch_nodes, Training.of(job.nodes[torch_nodes[-1]])

    async def run(self, ctx: StrategyContext, job: JobInputs, emit: Emit) -> dict[str, Any]:
        torch_nodes, training = self._plan(job)
        stages = [list(p.node_ids) for p in self.partitions]
        guard = _Guard([w.id for w in ctx.workers], stages)

        # 1. Each stage's worker loads only its own nodes.
        await emit("progress", {"phase": "loading", "stages": len(stages)})
        await guard(
            concurrently(
                *(ctx.load(s, {n: job.filters[n] for n in nodes}) for s, nodes in enumerate(stages))
            )
        )

        # 2. Plain filters (before the first TorchFilter): fitted in one pass over the data, then
        #    held. Stages made only of them are applied here, once: the pipeline starts after.
        #    On WorkerData the first stage holds the rows (its own) and fits them there.
        x = job.x
        first_stage = next(s for s, nodes in enumerate(stages) if set(nodes) & set(torch_nodes))
        own_rows = None
        if job.dataset is not None:
            staged = await guard(ctx.call(first_stage, job.own_data(STAGED)), stage=first_stage)
            own_rows = int(staged["rows"])
        for s, nodes in enumerate(stages[: first_stage + 1]):
            plain = [n for n in nodes if n not in torch_nodes]
            if plain:
                data = {"data": STAGED} if own_rows is not None else {"x": x}
                fit = await guard(ctx.call(s, CompositeFitRequest(node_ids=plain, **data)), stage=s)
                if s < first_stage:
                    x = fit["output"]
        pipeline = list(range(first_stage, len(stages)))
        if len(pipeline) < 2:
            # Its one stage_forward would take the rows by name and the labels inline, which a
            # daemon refuses: the job fails as it would there, before any training.
            raise StrategyFailed(
                ErrorCode.BAD_REQUEST,
                f"stage {first_stage} {stages[first_stage]}: a pipeline needs at least two "
                "stages that train; for one, use Local or DataParallel",
                stage=first_stage,
            )
        history = History(emit)
        evaluate = _evaluator(ctx, guard, stages, pipeline, job) if job.validates else None
        # accumulate=k: a step is k batches, so k times the micro-batches of one.
        micro_batches = self.micro_batches * training.accumulate
        plan: Schedule = SCHEDULES[self.order](len(pipeline), micro_batches)
        meet = await guard(choose_transport(ctx, pipeline, self.transport, self.collective_timeout))
        if own_rows is not None and not isinstance(meet, Rendezvous):
            raise StrategyFailed(
                ErrorCode.COLLECTIVE_FAILED,
                f"model_parallel on WorkerData trains on the torch transport, and {meet}",
            )
        if isinstance(meet, Rendezvous):
            # 3. Training on torch.distributed: the stages run the schedule themselves.
            await emit("progress", {"phase": "linked", "transport": "torch", "reason": meet.reason})
            if own_rows is None:
                staged = StageRequest(name=STAGED, x=x)
                await guard(ctx.call(first_stage, staged), stage=first_stage)
            count = int(x.shape[0]) if own_rows is None else own_rows
            steps_per_epoch = training.steps_per_epoch(count)
            await _tell_schedule(ctx, guard, pipeline, schedule_request(training, steps_per_epoch))
            if own_rows is None:
                labels = StageRequest(name=LABELS, x=job.y)
            else:  # the last stage's own y, staged as its rows
                labels = job.own_data(LABELS).model_copy(update={"labels": True})
            await TorchPipeline(
                ctx,
                guard,
                pipeline,
                stages,
                plan,
                training,
                count,
                micro_batches,
                STAGED,
                self.collective_timeout,
                emit,
                history,
                evaluate,
            ).train(meet, labels, steps_per_epoch)
            total = steps_per_epoch * training.epochs
            await history.finish(ended(training.epochs, total))
            return await _read_back(ctx, guard, stages)
        linked = ctx.supports_peer_links and len(pipeline) > 1
        if linked:
            # Neighbours dial each other; without a peer address the coordinator relays. A
            # stage takes activations from the one before it and gradients from the one after.
            routes = await guard(
                concurrently(*(ctx.links(s, expects(pipeline, k)) for k, s in enumerate(pipeline)))
            )
            direct = sorted({w for r in routes for w in r.get("direct", [])})
            relayed = sorted({w for r in routes for w in r.get("relay", [])})
            linked_by = {"transport": "websocket", "reason": meet}
            await emit(
                "progress", {"phase": "linked", "direct": direct, "relay": relayed} | linked_by
            )
        stage_input = StageRequest(name=STAGED, x=x)
        await guard(ctx.call(first_stage, stage_input), stage=first_stage)
        per_epoch = training.steps_per_epoch(int(x.shape[0]))
        await _tell_schedule(ctx, guard, pipeline, schedule_request(training, per_epoch))

        # 3. Training (GPipe / 1F1B): every global batch's micro-batches through the schedule,
        #    gradients accumulated, then one step on every stage (the gradient of them all
        #    clipped as one).
        at = PipelinePosition()
        for epoch, _, micro in global_batches(int(x.shape[0]), micro_batches, training):
            at.epoch, at.step = epoch, at.step + 1
            micro = [m for m in micro if len(m)]
            batch = GlobalBatch(pipeline, stages, micro, job.y, at.step)
            exchange: ThroughStrategy | WorkerToWorker = (
                WorkerToWorker(ctx, batch, at) if linked else ThroughStrategy(ctx, batch)
            )
            answers = await guard(run_schedule(plan, batch, exchange))
            coefficient = await _clipping(ctx, guard, pipeline, stages, training.clip_grad_norm)
            ends = at.step % per_epoch == 0
            steps = (
                ctx.call(
                    s,
                    StageStepRequest(node_ids=stages[s], epoch_end=ends, coefficient=coefficient),
                )
                for s in pipeline
            )
            await guard(concurrently(*steps))
            rows = [len(m) for m in micro]
            losses = [float(a["loss"]) for a in answers]
            loss = sum(r * v for r, v in zip(rows, losses, strict=True)) / sum(rows)
            progress = {"phase": "training", "epoch": epoch + 1, "epochs": training.epochs}
            progress |= {"lr": answers[0]["lr"]} if "lr" in answers[0] else {}
            await emit("progress", progress | {"step": at.step, "loss": loss})
            history.add(loss, sum(rows), answers[0].get("lr"))
            if ends:
                await history.close(epoch + 1, await evaluate() if evaluate is not None else None)
        total = per_epoch * training.epochs
        await history.finish(ended(training.epochs, total))

        return await _read_back(ctx, guard, stages)


def own_data_checks(
    partitions: Sequence[Partition], torch_nodes: Sequence[str], transport: str
) -> None:
    """What ModelParallel on ``WorkerData`` needs: the torch transport (over WebSocket links
    the labels travel from the coordinator), and a first partition that trains (the output of
    plain filters alone would travel back through the coordinator).

    Raises:
        StrategyOptionsError: saying which.
    """
    if transport == "websocket":
        raise StrategyOptionsError(
            "model_parallel on WorkerData trains on the torch transport (transport='auto' or "
            "'torch'): over WebSocket links the labels travel from the coordinator"
        )
    if not set(partitions[0].node_ids) & set(torch_nodes):
        raise StrategyOptionsError(
            "model_parallel on WorkerData: partition 0 holds only plain filters, whose output "
            "would travel through the coordinator; put them in the first TorchFilter's partition"
        )


def _evaluator(
    ctx: StrategyContext,
    guard: _Guard,
    stages: list[list[str]],
    pipeline: list[int],
    job: JobInputs,
) -> Evaluate:
    """The pipeline's evaluation of the validation rows sent with the job: forward stage by
    stage through the coordinator (plain stages in front too), the last stage's loss and
    metrics."""

    async def evaluate() -> dict[str, Any]:
        x = job.x_val
        for s in range(pipeline[-1]):
            x = await guard(ctx.call(s, CompositeForwardRequest(node_ids=stages[s], x=x)), s)
        last = EvaluateRequest(node_ids=stages[pipeline[-1]], x=x, y=job.y_val)
        scores: dict[str, Any] = await guard(ctx.call(pipeline[-1], last), pipeline[-1])
        return scores

    return evaluate


async def _tell_schedule(
    ctx: StrategyContext, guard: _Guard, pipeline: list[int], request: ScheduleRequest
) -> None:
    """Every stage that trains learns the horizon of the run's schedules."""
    await guard(concurrently(*(ctx.call(s, request) for s in pipeline)))


async def _clipping(
    ctx: StrategyContext,
    guard: _Guard,
    pipeline: list[int],
    stages: list[list[str]],
    clip: float | None,
) -> float | None:
    """The factor every stage multiplies its gradients by so that the pipeline's whole
    gradient is clipped to ``clip`` (``torch.nn.utils.clip_grad_norm_``'s, from every stage's
    part of the norm); ``None`` without clipping."""
    if clip is None:
        return None
    parts = (ctx.call(s, StageNormRequest(node_ids=stages[s])) for s in pipeline)
    squares = await guard(concurrently(*parts))
    return clip_coefficient(math.sqrt(sum(float(p) for p in squares)), clip)


async def _read_back(
    ctx: StrategyContext, guard: _Guard, stages: list[list[str]]
) -> dict[str, Any]:
    """4. The states of every stage, read back over the wire."""
    reads = (ctx.read_back_state(s, nodes) for s, nodes in enumerate(stages))
    parts = await guard(concurrently(*reads))
    return {node: state for part in parts for node, state in part.items()}


@dataclass(frozen=True)
class _Guard:
    """Awaits a stage's work; a worker's failure becomes the job's, naming the stage and
    worker."""

    ids: list[str]
    stages: list[list[str]]

    async def __call__(self, work: Awaitable[T], stage: int | None = None) -> T:
        try:
            return await work
        except WorkerCallError as exc:
            ids, stages = self.ids, self.stages
            s = ids.index(exc.worker_id) if stage is None and exc.worker_id in ids else stage
            where = f"stage {s} {stages[s]}" if s is not None else "a stage"
            info = exc.to_info()
            raise StrategyFailed(
                info.code,
                f"{where} on worker {exc.worker_id!r}: {exc.info.message}",
                **{**info.detail, "stage": s},
            ) from exc


__all__ = ["ModelParallel", "Partition", "check_partitions", "own_data_checks"]
