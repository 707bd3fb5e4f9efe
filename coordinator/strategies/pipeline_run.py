"""One run of a ModelParallel job's pipeline, from its start or from its newest checkpoint.

:class:`PipelineRun` loads every stage (a fresh daemon each), fits the plain filters in front
(or, from a checkpoint, sets their states back and only applies them), picks the transport,
sets every training stage back to the checkpoint, trains the remaining global batches — saving
checkpoints as they fall due — and reads the states back. A stage that fails over to a spare
(:mod:`~coordinator.strategies.model_parallel`) makes a new run: every stage is loaded again, so
no daemon keeps anything of the batches after the checkpoint, nor a half-done schedule.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from coordinator.context import StrategyContext
from coordinator.errors import StrategyFailed, WorkerCallError
from coordinator.strategies.base import Emit, JobInputs, concurrently
from coordinator.strategies.mp_checkpoints import StageCheckpoints
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
from coordinator.strategies.schedule import Schedule
from coordinator.strategies.steps import Training, global_batches
from protocol.daemon import (
    BatchedFitRequest,
    CompositeFitRequest,
    CompositeForwardRequest,
    StageRequest,
    StageStepRequest,
)
from protocol.errors import ErrorCode

__all__ = ["Guard", "PipelineRun"]

T = TypeVar("T")


@dataclass
class PipelineRun:
    """One run of the pipeline (module docstring).

    Args:
        ctx: the job's workers, stage ``s`` on worker ``s``.
        job: the job's inputs.
        stages: each stage's nodes.
        torch_nodes: the differentiable nodes.
        training: the last TorchFilter's settings.
        schedule: builds the schedule for a number of training stages and micro-batches.
        micro_batches: per global batch.
        transport: asked for (``auto``, ``torch``, ``websocket``).
        timeout: the collective timeout.
        emit: the job's events.
        make_saves: the run's checkpoints, once it knows its training stages and batches per
            epoch (the same object across runs: it keeps the newest checkpoint).
    """

    ctx: StrategyContext
    job: JobInputs
    stages: list[list[str]]
    torch_nodes: list[str]
    training: Training
    schedule: Callable[[int, int], Schedule]
    micro_batches: int
    transport: str
    timeout: float
    emit: Emit
    make_saves: Callable[[list[int], int], StageCheckpoints]

    async def __call__(self) -> dict[str, Any]:
        ctx, job, stages, torch_nodes = self.ctx, self.job, self.stages, self.torch_nodes
        guard = Guard([w.id for w in ctx.workers], stages)

        # 1. Each stage's worker loads only its own nodes (a fresh daemon).
        await self.emit("progress", {"phase": "loading", "stages": len(stages)})
        loads = (ctx.load(s, {n: job.filters[n] for n in nodes}) for s, nodes in enumerate(stages))
        await guard(concurrently(*loads))

        # 2. Plain filters (before the first TorchFilter): fitted in one pass over the data, then
        #    held — or, from a checkpoint, set back as they were. Stages made only of them are
        #    applied here, once: the pipeline starts after. On WorkerData the first stage holds
        #    the rows (its own) and fits them there.
        x = job.x
        first = next(s for s, nodes in enumerate(stages) if set(nodes) & set(torch_nodes))
        own_rows = None
        if job.dataset is not None:
            staged = await guard(ctx.call(first, job.own_data(STAGED)), stage=first)
            own_rows = int(staged["rows"])
        pipeline = list(range(first, len(stages)))
        count = int(x.shape[0]) if own_rows is None else own_rows
        steps_per_epoch = -(-count // (self.training.batch_size or count)) if count else 0
        saves = self.make_saves(pipeline, steps_per_epoch)
        restored = saves.states
        alone = len(pipeline) == 1  # the one stage that trains: it fits its own plain filters
        for s, nodes in enumerate(stages[: first + (0 if alone else 1)]):
            plain = [n for n in nodes if n not in torch_nodes]
            if not plain:
                continue
            if restored is not None:  # set back; the training stages' nodes are, below
                if s < first:
                    await guard(ctx.set_state(s, {n: restored[n] for n in plain}), stage=s)
                    forward = CompositeForwardRequest(node_ids=plain, x=x)
                    x = await guard(ctx.call(s, forward), stage=s)
                continue
            data = {"data": STAGED} if own_rows is not None else {"x": x}
            fit = await guard(ctx.call(s, CompositeFitRequest(node_ids=plain, **data)), stage=s)
            if s < first:
                x = fit["output"]
        if alone:
            # First stage and last: no activation to pass on. It trains its nodes on what the
            # stages before it output, as graph.fit trains them on that: the whole training
            # loop in one call, as Local's (no checkpoints in between).
            source = {"data": STAGED} if own_rows is not None else {"x": x, "y": job.y}
            await self._train_alone(guard, first, source)
            return await _read_back(ctx, guard, stages)
        plan = self.schedule(len(pipeline), self.micro_batches)
        meet = await guard(choose_transport(ctx, pipeline, self.transport, self.timeout))
        if own_rows is not None and not isinstance(meet, Rendezvous):
            raise StrategyFailed(
                ErrorCode.COLLECTIVE_FAILED,
                f"model_parallel on WorkerData trains on the torch transport, and {meet}",
            )
        if isinstance(meet, Rendezvous):
            # 3. Training on torch.distributed: the stages run the schedule themselves.
            await self.emit(
                "progress", {"phase": "linked", "transport": "torch", "reason": meet.reason}
            )
            if own_rows is None:
                await guard(ctx.call(first, StageRequest(name=STAGED, x=x)), stage=first)
                labels = StageRequest(name=LABELS, x=job.y)
            else:  # the last stage's own y, staged as its rows
                labels = job.own_data(LABELS).model_copy(update={"labels": True})
            pipe = TorchPipeline(
                ctx,
                guard,
                pipeline,
                stages,
                plan,
                self.training,
                count,
                self.micro_batches,
                STAGED,
                self.timeout,
                self.emit,
            )
            await pipe.train(meet, labels, steps_per_epoch, saves)
        else:
            await self._over_websockets(guard, pipeline, plan, meet, x, saves)
        await saves.finish()
        return await _read_back(ctx, guard, stages)

    async def _train_alone(self, guard: Guard, stage: int, source: dict[str, Any]) -> None:
        """3. The one stage that trains runs the whole training loop (``batched_fit``) on
        ``source``: the output of the stages before it, or its own rows."""
        await self.emit("progress", {"phase": "training", "stage": stage})
        request = BatchedFitRequest(
            node_ids=self.stages[stage], return_output=False, return_states=False, **source
        )
        fit = await guard(self.ctx.call(stage, request), stage=stage)
        losses = fit.get("epoch_losses") or []
        trained = {"phase": "trained", "loss": fit.get("loss"), "epochs": len(losses)}
        await self.emit("progress", trained | {"epoch_losses": losses})

    async def _over_websockets(
        self,
        guard: Guard,
        pipeline: list[int],
        plan: Schedule,
        reason: str,
        x: Any,
        saves: StageCheckpoints,
    ) -> None:
        """3. Training (GPipe / 1F1B), every action a call from here: each global batch's
        micro-batches through the schedule, gradients accumulated, one optimizer step on every
        stage; from the newest checkpoint's batch on."""
        ctx, stages, training = self.ctx, self.stages, self.training
        linked = ctx.supports_peer_links and len(pipeline) > 1
        if linked:
            # Neighbours dial each other; without a peer address the coordinator relays. A
            # stage takes activations from the one before it and gradients from the one after.
            links = (ctx.links(s, expects(pipeline, k)) for k, s in enumerate(pipeline))
            routes = await guard(concurrently(*links))
            direct = sorted({w for r in routes for w in r.get("direct", [])})
            relayed = sorted({w for r in routes for w in r.get("relay", [])})
            linked_by = {"transport": "websocket", "reason": reason}
            await self.emit(
                "progress", {"phase": "linked", "direct": direct, "relay": relayed} | linked_by
            )
        await guard(ctx.call(pipeline[0], StageRequest(name=STAGED, x=x)), stage=pipeline[0])
        start = await saves.restore(guard)
        saves.start()
        at = PipelinePosition()
        batches = list(global_batches(int(x.shape[0]), self.micro_batches, training))
        total = len(batches)
        for epoch, _, micro in batches:
            at.epoch, at.step = epoch, at.step + 1
            if at.step <= start:
                continue  # trained before the checkpoint this run goes on from
            micro = [m for m in micro if len(m)]
            batch = GlobalBatch(pipeline, stages, micro, self.job.y, at.step)
            exchange: ThroughStrategy | WorkerToWorker = (
                WorkerToWorker(ctx, batch, at) if linked else ThroughStrategy(ctx, batch)
            )
            losses = await guard(run_schedule(plan, batch, exchange))
            steps = (ctx.call(s, StageStepRequest(node_ids=stages[s])) for s in pipeline)
            await guard(concurrently(*steps))
            rows = [len(m) for m in micro]
            loss = sum(r * v for r, v in zip(rows, losses, strict=True)) / sum(rows)
            progress = {"phase": "training", "epoch": epoch + 1, "epochs": training.epochs}
            progress |= {"step": at.step, "steps": total, "rows": sum(rows)}
            await self.emit("progress", progress | {"loss": loss})
            await saves.after(at.step, total, guard)


async def _read_back(ctx: StrategyContext, guard: Guard, stages: list[list[str]]) -> dict[str, Any]:
    """4. The states of every stage, read back over the wire."""
    reads = (ctx.read_back_state(s, nodes) for s, nodes in enumerate(stages))
    parts = await guard(concurrently(*reads))
    return {node: state for part in parts for node, state in part.items()}


@dataclass(frozen=True)
class Guard:
    """Awaits a stage's work; a worker's failure becomes the job's, naming the stage and
    worker (``stage`` in its detail)."""

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
