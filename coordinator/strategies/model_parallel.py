"""ModelParallel: the graph split in stages on different workers, trained as a pipeline.

Partitions tile the graph — every node in exactly one, each a contiguous run in graph order, in
graph order — and each is pinned to a worker by id or tag. Every global batch (the batch
``graph.fit`` would take) is cut into M micro-batches that flow forward stage to stage; the last
stage computes the loss; the gradient of the loss with respect to each stage's input flows back;
each stage accumulates its parameter gradients over the micro-batches and steps its optimizer once
per global batch (GPipe, Huang et al. 2019). The order of the actions on each stage is a
:class:`~coordinator.strategies.schedule.Schedule` (GPipe, or 1F1B), data checked before any work
starts; :func:`run_schedule` executes it, each action waiting only for the actions it depends on,
so micro-batches overlap across stages.

Plain filters may only come before the first TorchFilter: they are fitted in a first pass over
the data and then held fixed (stages made only of them are applied once, up front).

Over live workers, activations and their gradients go worker to worker: each stage's agent dials
its neighbours' peer address (``somatize-worker --peer-listen``) and the receiving agent waits for
the tensor in its mailbox (:class:`WorkerToWorker`); a worker with no peer address gets them
relayed by the coordinator, which forwards the frames without decoding the tensors. Contexts with
no peer links (in-memory workers) pass them through the strategy (:class:`ThroughStrategy`).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Self

import numpy as np

from coordinator.context import StrategyContext, Target
from coordinator.errors import WorkerCallError
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
from coordinator.strategies.data_parallel import Training, schedule
from coordinator.strategies.schedule import Action, Schedule, gpipe, one_f_one_b
from protocol.strategy_options import ModelParallelOptions

SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b}


@dataclass(frozen=True)
class Partition:
    """The nodes of one stage and where it runs."""

    node_ids: tuple[str, ...]
    target: Target


def check_partitions(node_ids: Sequence[str], partitions: Sequence[Partition]) -> None:
    """Refuse partitions that do not tile the graph, naming the node and partitions involved."""
    if not partitions:
        raise StrategyOptionsError("model_parallel needs at least one partition")
    owner: dict[str, int] = {}
    for p, partition in enumerate(partitions):
        if not partition.node_ids:
            raise StrategyOptionsError(f"partition {p} is empty")
        for node in partition.node_ids:
            if node not in node_ids:
                raise StrategyOptionsError(
                    f"partition {p} names {node!r}, which is not in the graph (nodes: "
                    f"{list(node_ids)})"
                )
            if node in owner:
                raise StrategyOptionsError(
                    f"node {node!r} is in partitions {owner[node]} and {p}: a node belongs to "
                    "exactly one"
                )
            owner[node] = p
    orphans = [n for n in node_ids if n not in owner]
    if orphans:
        raise StrategyOptionsError(f"nodes {orphans} are in no partition: partitions must tile")
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
        self, partitions: Sequence[Partition], micro_batches: int = 1, order: str = "gpipe"
    ) -> None:
        self.partitions = list(partitions)
        self.micro_batches = micro_batches
        self.order = order

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> Self:
        checked = parse_options(ModelParallelOptions, options)
        partitions = [
            Partition(p.node_ids, Target(id=p.worker, tag=p.tag)) for p in checked.partitions
        ]
        return cls(partitions, checked.micro_batches, checked.schedule)

    def placement(self) -> Placement:
        return Placement(
            workers=len(self.partitions), slots=tuple(p.target for p in self.partitions)
        )

    def validate(self, job: JobInputs) -> None:
        self._plan(job)

    def _plan(self, job: JobInputs) -> tuple[list[str], Training]:
        """The differentiable nodes and the training settings; or why the job cannot run."""
        check_partitions(job.node_ids, self.partitions)
        torch_nodes = job.differentiable()
        if not torch_nodes:
            raise StrategyOptionsError("model_parallel trains TorchFilters and this graph has none")
        first = job.node_ids.index(torch_nodes[0])
        late = [n for n in job.node_ids[first:] if n not in torch_nodes]
        if late:
            raise StrategyOptionsError(
                f"model_parallel fits plain filters only before the first TorchFilter; {late} "
                f"come after {torch_nodes[0]!r}"
            )
        if job.y is None or job.dataset is not None:
            raise StrategyOptionsError("model_parallel trains on data the client sends, with y")
        return torch_nodes, Training.of(job.nodes[torch_nodes[-1]])

    async def run(self, ctx: StrategyContext, job: JobInputs, emit: Emit) -> dict[str, Any]:
        torch_nodes, training = self._plan(job)
        stages = [list(p.node_ids) for p in self.partitions]
        ids = [w.id for w in ctx.workers]

        # 1. Each stage's worker loads only its own nodes.
        await emit("progress", {"phase": "loading", "stages": len(stages)})
        await self._guard(
            ids,
            stages,
            concurrently(
                *(ctx.load(s, {n: job.filters[n] for n in nodes}) for s, nodes in enumerate(stages))
            ),
        )

        # 2. Plain filters (before the first TorchFilter): fitted in one pass over the data, then
        #    held. Stages made only of them are applied here, once: the pipeline starts after.
        x = job.x
        first_stage = next(s for s, nodes in enumerate(stages) if set(nodes) & set(torch_nodes))
        for s, nodes in enumerate(stages[: first_stage + 1]):
            plain = [n for n in nodes if n not in torch_nodes]
            if plain:
                fit = await self._guard(
                    ids,
                    stages,
                    ctx.call(s, {"cmd": "composite_fit", "node_ids": plain, "x": x}),
                    stage=s,
                )
                if s < first_stage:
                    x = fit["output"]
        pipeline = list(range(first_stage, len(stages)))
        plan: Schedule = SCHEDULES[self.order](len(pipeline), self.micro_batches)
        linked = ctx.supports_peer_links and len(pipeline) > 1
        if linked:
            # Neighbours dial each other; without a peer address the coordinator relays.
            neighbours = [[p for p in (s - 1, s + 1) if p in pipeline] for s in pipeline]
            routes = await self._guard(
                ids,
                stages,
                concurrently(
                    *(ctx.links(s, near) for s, near in zip(pipeline, neighbours, strict=True))
                ),
            )
            direct = sorted({w for r in routes for w in r.get("direct", [])})
            relayed = sorted({w for r in routes for w in r.get("relay", [])})
            await emit("progress", {"phase": "linked", "direct": direct, "relay": relayed})
        await self._guard(
            ids,
            stages,
            ctx.call(first_stage, {"cmd": "stage", "name": "train", "x": x}),
            stage=first_stage,
        )

        # 3. Training: every global batch through the schedule, then one step on every stage.
        n = int(x.shape[0])
        batches = schedule(n, self.micro_batches, training)
        sequence = {s: itertools.count() for s in pipeline}  # Call.seq of each stage's worker
        for steps, (epoch, _, micro) in enumerate(batches, start=1):
            micro = [m for m in micro if len(m)]
            batch = GlobalBatch(pipeline, stages, micro, job.y, steps)
            exchange: ThroughStrategy | WorkerToWorker = (
                WorkerToWorker(ctx, batch, sequence) if linked else ThroughStrategy(ctx, batch)
            )
            losses = await self._guard(ids, stages, run_schedule(plan, batch, exchange))
            await self._guard(
                ids,
                stages,
                concurrently(
                    *(ctx.call(s, {"cmd": "stage_step", "node_ids": stages[s]}) for s in pipeline)
                ),
            )
            rows = [len(m) for m in micro]
            loss = sum(r * v for r, v in zip(rows, losses, strict=True)) / sum(rows)
            await emit(
                "progress",
                {
                    "phase": "training",
                    "epoch": epoch + 1,
                    "epochs": training.epochs,
                    "step": steps,
                    "loss": loss,
                },
            )

        # 4. The states of every stage, read back over the wire.
        parts = await self._guard(
            ids,
            stages,
            concurrently(*(ctx.read_back_state(s, nodes) for s, nodes in enumerate(stages))),
        )
        return {node: state for part in parts for node, state in part.items()}

    @staticmethod
    async def _guard(
        ids: list[str], stages: list[list[str]], work: Any, stage: int | None = None
    ) -> Any:
        """Await ``work``; a worker's failure becomes the job's, naming the stage and worker."""
        try:
            return await work
        except WorkerCallError as exc:
            s = ids.index(exc.worker_id) if stage is None and exc.worker_id in ids else stage
            where = f"stage {s} {stages[s]}" if s is not None else "a stage"
            info = exc.to_info()
            raise StrategyFailed(
                info.code,
                f"{where} on worker {exc.worker_id!r}: {exc.info.message}",
                **{**info.detail, "stage": s},
            ) from exc


@dataclass(frozen=True)
class GlobalBatch:
    """One global batch of a pipeline: its micro-batches' rows and the labels."""

    pipeline: list[int]  # the stages that train, in order
    stages: list[list[str]]  # node ids of every stage
    micro: list[np.ndarray[Any, Any]]  # row indices of each micro-batch
    y: Any
    index: int  # which global batch (keys of the tensors in flight)

    @property
    def rows(self) -> int:
        return sum(len(m) for m in self.micro)

    def forward_request(self, k: int, m: int) -> dict[str, Any]:
        """``stage_forward`` of micro-batch ``m`` on pipeline stage ``k``, less its input."""
        request: dict[str, Any] = {
            "cmd": "stage_forward",
            "node_ids": self.stages[self.pipeline[k]],
            "micro": m,
        }
        if k == 0:
            request |= {"data": "train", "rows": self.micro[m].tolist(), "first": True}
        if k == len(self.pipeline) - 1:
            rows = self.micro[m]
            request |= {"y": self.y[rows], "scale": len(rows) / self.rows, "last": True}
        return request


class ThroughStrategy:
    """Activations and gradients come back to the coordinator and go on from here (contexts
    whose workers cannot reach each other, like in-memory ones). Each stage sends its next action
    when the last one has answered."""

    sequenced = False

    def __init__(self, ctx: StrategyContext, batch: GlobalBatch) -> None:
        self.ctx, self.batch = ctx, batch
        loop = asyncio.get_running_loop()
        keys = [(k, m) for k in range(len(batch.pipeline)) for m in range(len(batch.micro))]
        self.acts: dict[tuple[int, int], asyncio.Future[Any]] = {
            key: loop.create_future() for key in keys
        }
        self.grads: dict[tuple[int, int], asyncio.Future[Any]] = {
            key: loop.create_future() for key in keys
        }

    def next_seq(self, k: int) -> int | None:
        return None

    async def forward(self, k: int, m: int, seq: int | None = None) -> Any:
        request = self.batch.forward_request(k, m)
        if k > 0:
            request["x"] = await self.acts[(k - 1, m)]
        result = await self.ctx.call(self.batch.pipeline[k], request)
        self.acts[(k, m)].set_result(result)
        return result

    async def backward(self, k: int, m: int, seq: int | None = None) -> None:
        last = k == len(self.batch.pipeline) - 1
        grad = None if last else await self.grads[(k + 1, m)]
        request = {"cmd": "stage_backward", "micro": m, "grad_output": grad}
        self.grads[(k, m)].set_result(await self.ctx.call(self.batch.pipeline[k], request))


class WorkerToWorker:
    """An activation goes from stage k straight into stage k+1's mailbox (``act/<batch>/<m>``)
    and its gradient back into stage k's (``grad/<batch>/<m>``), over the peer link or relayed;
    the receiving agent waits for it. The coordinator sees only the last stage's losses.

    The calls are sequenced (``Call.seq``, numbered per stage worker by ``sequence``): each stage
    gets its actions up to :data:`WINDOW` ahead and runs them back to back in schedule order, with
    no round trip to the coordinator between two micro-batches.
    """

    sequenced = True

    def __init__(
        self, ctx: StrategyContext, batch: GlobalBatch, sequence: Mapping[int, Iterator[int]]
    ) -> None:
        self.ctx, self.batch, self.sequence = ctx, batch, sequence

    def next_seq(self, k: int) -> int | None:
        return next(self.sequence[self.batch.pipeline[k]])

    async def forward(self, k: int, m: int, seq: int | None = None) -> Any:
        pipeline, key = self.batch.pipeline, f"act/{self.batch.index}/{m}"
        source = None if k == 0 else key
        target = None if k == len(pipeline) - 1 else (pipeline[k + 1], key)
        request = self.batch.forward_request(k, m)
        return await self.ctx.routed(
            pipeline[k], request, input_from=source, output_to=target, seq=seq
        )

    async def backward(self, k: int, m: int, seq: int | None = None) -> None:
        pipeline, key = self.batch.pipeline, f"grad/{self.batch.index}/{m}"
        source = None if k == len(pipeline) - 1 else key
        target = None if k == 0 else (pipeline[k - 1], key)
        request = {"cmd": "stage_backward", "micro": m}
        await self.ctx.routed(
            pipeline[k],
            request,
            input_from=source,
            input_field="grad_output",
            output_to=target,
            seq=seq,
        )


WINDOW = 8
"""Sequenced actions a stage may have outstanding on its worker at once."""


async def run_schedule(
    plan: Schedule, batch: GlobalBatch, exchange: ThroughStrategy | WorkerToWorker
) -> list[float]:
    """One global batch through ``plan``: each stage runs its actions in order, each waiting
    only for what it needs, so micro-batches overlap across stages. Returns the unscaled loss of
    each micro-batch (from the last stage)."""
    count, last = len(batch.micro), len(batch.pipeline) - 1
    losses: list[float] = [0.0] * count

    async def act(k: int, action: Action, seq: int | None) -> None:
        if action.kind == "B":
            await exchange.backward(k, action.micro, seq)
            return
        result = await exchange.forward(k, action.micro, seq)
        if k == last:
            losses[action.micro] = float(result["loss"])

    async def stage(k: int) -> None:
        actions = [a for a in plan.actions[k] if a.micro < count]  # a short last batch
        if not exchange.sequenced:
            for action in actions:
                await act(k, action, None)
            return
        window = asyncio.Semaphore(WINDOW)

        async def windowed(action: Action, seq: int | None) -> None:
            try:
                await act(k, action, seq)
            finally:
                window.release()

        issued: list[asyncio.Future[None]] = []
        try:
            for action in actions:  # numbered in schedule order, sent up to WINDOW ahead
                await window.acquire()
                issued.append(asyncio.ensure_future(windowed(action, exchange.next_seq(k))))
            await asyncio.gather(*issued)
        except BaseException:
            for task in issued:
                task.cancel()
            await asyncio.gather(*issued, return_exceptions=True)
            raise

    await concurrently(*(stage(k) for k in range(len(batch.pipeline))))
    return losses


__all__ = [
    "GlobalBatch",
    "ModelParallel",
    "Partition",
    "ThroughStrategy",
    "WorkerToWorker",
    "check_partitions",
    "run_schedule",
]
