"""One run of a ModelParallel job's pipeline, from its start or from its newest checkpoint.

:class:`PipelineRun` loads every stage (a fresh daemon each), fits the plain filters in front
(or, from a checkpoint, sets their states back and only applies them), picks the transport,
sets every training stage back to the checkpoint, trains the remaining global batches — saving
checkpoints as they fall due — and reads the states back. A stage that fails over to a spare
(:mod:`~coordinator.strategies.model_parallel.model_parallel`) makes a new run: every stage is
loaded again, so no daemon keeps anything of the batches after the checkpoint, nor a half-done
schedule.

A global batch is ``accumulate`` batches of the last TorchFilter (so that many times the
micro-batches); every training stage is told the horizon of the run's learning-rate schedules
before a checkpoint's optimizer (and scheduler) states are set; with ``clip_grad_norm`` the
whole pipeline's gradient is clipped as one (each stage's part of the norm, one coefficient
for all). With validation data the model is evaluated at each epoch's end, stage by stage, and
the run's :class:`~coordinator.strategies.history.History` (kept in its checkpoints) gets a row
per epoch.

Over WebSockets every global batch is a round of the loop the federated strategies run
(:func:`~coordinator.strategies.rounds.run_rounds` over :class:`GlobalBatchSteps`); over
torch.distributed the stages run the schedule themselves
(:mod:`~coordinator.strategies.model_parallel.torch_transport`).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from coordinator.context import StrategyContext
from coordinator.errors import StrategyFailed, WorkerCallError
from coordinator.strategies.base import Emit, JobInputs, concurrently
from coordinator.strategies.history import VALIDATION, Evaluate, History, ended
from coordinator.strategies.model_parallel.checkpoints import StageCheckpoints
from coordinator.strategies.model_parallel.executor import (
    STAGED,
    GlobalBatch,
    PipelinePosition,
    ThroughStrategy,
    WorkerToWorker,
    expects,
    run_schedule,
)
from coordinator.strategies.model_parallel.phase import PipelinePhase
from coordinator.strategies.model_parallel.schedule import SCHEDULES
from coordinator.strategies.model_parallel.torch_transport import (
    LABELS,
    TorchPipeline,
    choose_transport,
)
from coordinator.strategies.process_group import Rendezvous
from coordinator.strategies.rounds import run_rounds
from coordinator.strategies.steps import TrainingSettings, global_batches, lr_schedule_request
from protocol.daemon import (
    BatchedFitRequest,
    CompositeFitRequest,
    CompositeForwardRequest,
    EvaluateRequest,
    StageNormRequest,
    StageRequest,
    StageStepRequest,
)
from protocol.errors import ErrorCode
from protocol.options.strategies import ModelParallelOptions
from protocol.rules.clipping import clip_coefficient
from protocol.rules.rows import rows_of

__all__ = ["Guard", "PipelineRun"]

T = TypeVar("T")


@dataclass(kw_only=True)
class PipelineRun:
    """One run of the pipeline (module docstring).

    Args:
        ctx: the job's workers, stage ``s`` on worker ``s``.
        job: the job's inputs.
        options: the strategy's (the schedule, micro-batches, transport asked for, collective
            timeout).
        stages: each stage's nodes.
        torch_nodes: the differentiable nodes.
        training: the last TorchFilter's settings.
        emit: the job's events.
        make_saves: the run's checkpoints, once it knows its training stages and batches per
            epoch (the same object across runs: it keeps the newest checkpoint).
        history: the job's rows per epoch (the same object across runs; a run set back to a
            checkpoint takes the rows it holds).
    """

    ctx: StrategyContext
    job: JobInputs
    options: ModelParallelOptions
    stages: list[list[str]]
    torch_nodes: list[str]
    training: TrainingSettings
    emit: Emit
    make_saves: Callable[[list[int], int], StageCheckpoints]
    history: History

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
        count = (rows_of(x) or 0) if own_rows is None else own_rows
        steps_per_epoch = self.training.steps_per_epoch(count)
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
        # accumulate=k: a global batch is k batches, so k times the micro-batches of one.
        micro_batches = self.options.micro_batches * self.training.accumulate
        schedule = SCHEDULES[self.options.schedule](len(pipeline), micro_batches)
        # The schedules' horizon, before a checkpoint's schedulers are set back.
        told = lr_schedule_request(self.training, steps_per_epoch)
        await guard(concurrently(*(ctx.call(s, told) for s in pipeline)))
        evaluate = _evaluator(ctx, guard, stages, pipeline, job) if job.validates else None
        timeout = self.options.collective_timeout
        meet = await guard(choose_transport(ctx, pipeline, self.options.transport, timeout))
        if own_rows is None:
            await guard(ctx.call(first, StageRequest(name=STAGED, x=x)), stage=first)
        else:
            await self._stage_own_labels(guard, pipeline[-1], own_rows)
        phase = PipelinePhase(
            ctx=ctx,
            guard=guard,
            stages=stages,
            pipeline=pipeline,
            schedule=schedule,
            micro_batches=micro_batches,
            training=self.training,
            rows=count,
            emit=self.emit,
            history=self.history,
            evaluate=evaluate,
        )
        if isinstance(meet, Rendezvous):
            # 3. Training on torch.distributed: the stages run the schedule themselves.
            await self.emit(
                "progress", {"phase": "linked", "transport": "torch", "reason": meet.reason}
            )
            if own_rows is None:
                sent = StageRequest(name=LABELS, x=job.y)
                await guard(ctx.call(pipeline[-1], sent), stage=pipeline[-1])
            pipe = TorchPipeline(phase=phase, data=STAGED, timeout=timeout)
            await pipe.train(meet, steps_per_epoch, saves)
        else:
            labels = None if own_rows is None else LABELS
            await self._over_websockets(phase, meet, labels, saves)
        await saves.flush()
        total = steps_per_epoch * self.training.epochs
        await self.history.finish(ended(self.training.epochs, total))
        return await _read_back(ctx, guard, stages)

    async def _stage_own_labels(self, guard: Guard, last: int, rows: int) -> None:
        """The last stage's worker stages its own dataset's ``y`` under :data:`LABELS`; it must
        hold as many ``rows`` as the first stage's (which the workers' announcements promised
        at submit, and a dataset a ``loader=`` makes can only tell now).

        Raises:
            StrategyFailed: ``BAD_REQUEST`` naming the worker, when the rows disagree.
        """
        request = self.job.own_data(LABELS).model_copy(update={"labels": True})
        staged = await guard(self.ctx.call(last, request), stage=last)
        if int(staged["rows"]) != rows:
            raise StrategyFailed(
                ErrorCode.BAD_REQUEST,
                f"the last stage's worker {self.ctx.workers[last].id!r} holds {staged['rows']} "
                f"labels and the first stage's {rows} rows: both must hold the dataset with "
                "the same rows",
                stage=last,
            )

    async def _train_alone(self, guard: Guard, stage: int, source: dict[str, Any]) -> None:
        """3. The one stage that trains runs the whole training loop (``batched_fit``) on
        ``source``: the output of the stages before it, or its own rows; with validation data
        (sent through the stages before it, staged there) evaluated at each epoch's end."""
        ctx, job = self.ctx, self.job
        validation = None
        if job.validates:
            x_val = job.x_val
            for s in range(stage):
                forward = CompositeForwardRequest(node_ids=self.stages[s], x=x_val)
                x_val = await guard(ctx.call(s, forward), stage=s)
            staged = StageRequest(name=VALIDATION, x=x_val, y=job.y_val)
            await guard(ctx.call(stage, staged), stage=stage)
            validation = VALIDATION
        await self.emit("progress", {"phase": "training", "stage": stage})
        request = BatchedFitRequest(
            node_ids=self.stages[stage],
            validation=validation,
            return_output=False,
            return_states=False,
            **source,
        )
        fit = await guard(ctx.call(stage, request), stage=stage)
        losses = fit.get("epoch_losses") or []
        self.history.load_state_dict(None)  # the whole run is this one call's
        for row in fit.get("history") or []:
            await self.history.record(row)
        trained = {"phase": "trained", "loss": fit.get("loss"), "epochs": len(losses)}
        if self.history.rows:
            await self.history.finish(trained | {"epoch_losses": losses})
        else:
            await self.emit("progress", trained | {"epoch_losses": losses})

    async def _over_websockets(
        self, phase: PipelinePhase, reason: str, labels: str | None, saves: StageCheckpoints
    ) -> None:
        """3. Training (GPipe / 1F1B), every action a call from here: each global batch's
        micro-batches through the schedule, gradients accumulated, one step on every stage
        (the gradient of them all clipped as one); from the newest checkpoint's batch on. The
        first stage holds its rows staged; the last takes the job's ``y``, or the labels it
        staged under ``labels``."""
        ctx, pipeline, guard = phase.ctx, phase.pipeline, phase.guard
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
        start = await saves.restore(guard)
        saves.start()
        # (in a thread: a shuffled plan imports torch for its generator, a second or more)
        plan = global_batches(phase.rows, phase.micro_batches, phase.training)
        batches = await asyncio.to_thread(list, plan)
        steps = GlobalBatchSteps(
            phase=phase, batches=batches, y=self.job.y, labels=labels, linked=linked, saves=saves
        )
        # Each global batch a round of the loop (coordinator.strategies.rounds): its
        # micro-batches through the schedule, one step on every stage, its row, a checkpoint.
        await run_rounds(steps, _Trained(start), len(batches))


@dataclass
class _Trained:
    """The global batches a run over WebSockets has trained (from the checkpoint it went on
    from), and where its stages' calls stand."""

    round: int
    position: PipelinePosition = field(default_factory=PipelinePosition)


@dataclass
class _Batch:
    """Global batch ``t`` (of ``epoch``) in flight, and what it gave."""

    t: int
    epoch: int
    batch: GlobalBatch
    ends: bool  # the last of its epoch
    answers: list[Any] = field(default_factory=list)
    scores: dict[str, Any] | None = None


@dataclass(kw_only=True)
class GlobalBatchSteps:
    """A pipeline's global batches as rounds of the loop (:func:`run_rounds`), every action a
    call from the coordinator: configure (the micro-batches), train (the schedule), aggregate
    (the gradient clipped as one, one step on every stage), evaluate (at an epoch's end),
    record (its progress, the history's row), checkpoint."""

    phase: PipelinePhase
    batches: list[tuple[int, int, list[Any]]]  # (epoch, step, micro-batches' rows) of each
    y: Any  # the job's labels (None: the last stage's own, staged under ``labels``)
    labels: str | None
    linked: bool  # the workers pass tensors to each other; else through the coordinator
    saves: StageCheckpoints

    def __post_init__(self) -> None:
        phase = self.phase
        self.ctx, self.guard, self.pipeline = phase.ctx, phase.guard, phase.pipeline
        self.stages, self.plan, self.per_epoch = phase.stages, phase.schedule, phase.steps_per_epoch
        self.training, self.evaluate = phase.training, phase.evaluate
        self.emit, self.history = phase.emit, phase.history

    async def configure_round(self, run: _Trained, t: int) -> _Batch:
        epoch, _, micro = self.batches[t - 1]
        micro = [m for m in micro if len(m)]
        batch = GlobalBatch(self.pipeline, self.stages, micro, self.y, t, self.labels)
        return _Batch(t, epoch, batch, t % self.per_epoch == 0)

    async def train_round(self, run: _Trained, work: _Batch) -> None:
        exchange: ThroughStrategy | WorkerToWorker = (
            WorkerToWorker(self.ctx, work.batch, run.position)
            if self.linked
            else ThroughStrategy(self.ctx, work.batch)
        )
        work.answers = await self.guard(run_schedule(self.plan, work.batch, exchange))

    async def aggregate_round(self, run: _Trained, work: _Batch) -> None:
        ctx, stages = self.ctx, self.stages
        clip = self.training.clip_grad_norm
        coefficient = await _clipping(ctx, self.guard, self.pipeline, stages, clip)
        steps = (
            ctx.call(
                s,
                StageStepRequest(node_ids=stages[s], epoch_end=work.ends, coefficient=coefficient),
            )
            for s in self.pipeline
        )
        await self.guard(concurrently(*steps))

    async def evaluate_round(self, run: _Trained, work: _Batch) -> None:
        if work.ends and self.evaluate is not None:
            work.scores = await self.evaluate()

    async def record_round(self, run: _Trained, work: _Batch) -> None:
        rows = [len(m) for m in work.batch.micro]
        losses = [float(a["loss"]) for a in work.answers]
        loss = sum(r * v for r, v in zip(rows, losses, strict=True)) / sum(rows)
        lr = work.answers[0].get("lr")
        progress = {"phase": "training", "epoch": work.epoch + 1, "epochs": self.training.epochs}
        progress |= {"step": work.t, "steps": len(self.batches), "rows": sum(rows)}
        progress |= {"lr": lr} if lr is not None else {}
        await self.emit("progress", progress | {"loss": loss})
        self.history.add(loss, sum(rows), lr)
        if work.ends:
            await self.history.close(work.epoch + 1, work.scores)

    async def checkpoint_round(self, run: _Trained, work: _Batch) -> None:
        await self.saves.after(work.t, len(self.batches), self.guard)


def _evaluator(
    ctx: StrategyContext, guard: Guard, stages: list[list[str]], pipeline: list[int], job: JobInputs
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


async def _clipping(
    ctx: StrategyContext,
    guard: Callable[..., Awaitable[Any]],
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


async def _read_back(ctx: StrategyContext, guard: Guard, stages: list[list[str]]) -> dict[str, Any]:
    """4. The states of every stage, read back over the wire (into the job's result only)."""
    reads = (ctx.read_back_state(s, nodes, relayed=True) for s, nodes in enumerate(stages))
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
