"""The pipeline executor: one global batch through a schedule, over a strategy context.

A :class:`~coordinator.strategies.model_parallel.schedule.Schedule` says which action (``F``
forward, ``B`` backward, of which micro-batch) each stage runs in which order — GPipe (Huang et al.
2019: all forwards, then all backwards) or 1F1B (Narayanan et al. 2019, PipeDream-Flush: one
forward, one backward, in the steady state). :func:`run_schedule` runs it, each stage's actions in
order and each action waiting only for what it depends on, so micro-batches overlap across stages.

An exchange moves the activations and their gradients between stages: through the coordinator
(:class:`ThroughStrategy`, contexts with no peer links) or straight from worker to worker
(:class:`WorkerToWorker`, the agents' peer links, relayed by the coordinator for a worker with
no peer address).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from coordinator.context import StrategyContext
from coordinator.strategies.base import concurrently
from coordinator.strategies.model_parallel.schedule import Action, Schedule
from protocol.daemon import StageBackwardRequest, StageForwardRequest
from protocol.rules.rows import take_rows

STAGED = "train"
"""The name the first stage's input rows are staged under in its daemon."""
ACTIVATIONS = "act/"
"""The mailbox keys of activations, ``act/<global batch>/<micro-batch>``: from a stage to the
next."""
GRADIENTS = "grad/"
"""The mailbox keys of activation gradients, ``grad/<global batch>/<micro-batch>``: from a
stage to the one before."""


def expects(pipeline: list[int], k: int) -> dict[int, str]:
    """What stage ``k`` of ``pipeline`` (worker indices) takes from its neighbours: worker
    index → the prefix of the keys it delivers (for :meth:`StrategyContext.links`)."""
    taken = {}
    if k > 0:
        taken[pipeline[k - 1]] = ACTIVATIONS
    if k < len(pipeline) - 1:
        taken[pipeline[k + 1]] = GRADIENTS
    return taken


@dataclass
class PipelinePosition:
    """Where a ModelParallel run stands: the epoch, the global batches done, and the next
    ``Call.seq`` of each stage's worker. The run loop reads and advances it."""

    epoch: int = 0
    step: int = 0  # global batches done
    seq: dict[int, int] = field(default_factory=dict)  # stage index → its next Call.seq

    def next_seq(self, stage: int) -> int:
        seq = self.seq.get(stage, 0)
        self.seq[stage] = seq + 1
        return seq


@dataclass(frozen=True)
class GlobalBatch:
    """One global batch of a pipeline: its micro-batches' rows and the labels."""

    pipeline: list[int]  # the stages that train, in order
    stages: list[list[str]]  # node ids of every stage
    micro: list[np.ndarray[Any, Any]]  # row indices of each micro-batch
    y: Any  # the labels sent with the job; None when the last stage holds its own
    index: int  # which global batch (keys of the tensors in flight)
    labels: str | None = None  # what the last stage's own labels are staged under

    @property
    def rows(self) -> int:
        return sum(len(m) for m in self.micro)

    def forward_request(self, k: int, m: int, x: Any = None) -> StageForwardRequest:
        """``stage_forward`` of micro-batch ``m`` on pipeline stage ``k`` (its input ``x``, or
        none when it comes from the previous stage's worker or from the staged rows)."""
        fields: dict[str, Any] = {"node_ids": self.stages[self.pipeline[k]], "micro": m}
        if x is not None:
            fields["x"] = x
        if k == 0:
            fields |= {"data": STAGED, "rows": self.micro[m].tolist(), "first": True}
        if k == len(self.pipeline) - 1:
            rows = self.micro[m]
            fields |= {"scale": len(rows) / self.rows, "last": True}
            if self.labels is None:
                fields["y"] = take_rows(self.y, rows)
            else:
                fields |= {"labels": self.labels, "label_rows": rows.tolist()}
        return StageForwardRequest(**fields)


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
        x = await self.acts[(k - 1, m)] if k > 0 else None
        result = await self.ctx.call(self.batch.pipeline[k], self.batch.forward_request(k, m, x))
        self.acts[(k, m)].set_result(result)
        return result

    async def backward(self, k: int, m: int, seq: int | None = None) -> None:
        last = k == len(self.batch.pipeline) - 1
        grad = None if last else await self.grads[(k + 1, m)]
        request = StageBackwardRequest(micro=m, grad_output=grad)
        self.grads[(k, m)].set_result(await self.ctx.call(self.batch.pipeline[k], request))


class WorkerToWorker:
    """An activation goes from stage k straight into stage k+1's mailbox (``act/<batch>/<m>``)
    and its gradient back into stage k's (``grad/<batch>/<m>``), over the peer link or relayed;
    the receiving agent waits for it. The coordinator sees only the last stage's losses.

    The calls are sequenced (``Call.seq``, numbered per stage worker by ``position``): each
    stage gets its actions up to :data:`WINDOW` ahead and runs them back to back in schedule
    order, with no round trip to the coordinator between two micro-batches.
    """

    sequenced = True

    def __init__(
        self, ctx: StrategyContext, batch: GlobalBatch, position: PipelinePosition
    ) -> None:
        self.ctx, self.batch, self.position = ctx, batch, position

    def next_seq(self, k: int) -> int | None:
        return self.position.next_seq(self.batch.pipeline[k])

    async def forward(self, k: int, m: int, seq: int | None = None) -> Any:
        pipeline, key = self.batch.pipeline, f"{ACTIVATIONS}{self.batch.index}/{m}"
        source = None if k == 0 else key
        target = None if k == len(pipeline) - 1 else (pipeline[k + 1], key)
        request = self.batch.forward_request(k, m)
        return await self.ctx.routed(
            pipeline[k], request, input_from=source, output_to=target, seq=seq
        )

    async def backward(self, k: int, m: int, seq: int | None = None) -> None:
        pipeline, key = self.batch.pipeline, f"{GRADIENTS}{self.batch.index}/{m}"
        source = None if k == len(pipeline) - 1 else key
        target = None if k == 0 else (pipeline[k - 1], key)
        request = StageBackwardRequest(micro=m)
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
) -> list[Any]:
    """One global batch through ``plan``: each stage runs its actions in order, each waiting
    only for what it needs, so micro-batches overlap across stages. Returns what the last
    stage's forward of each micro-batch answered (its unscaled ``loss``, ``rows``, ``lr``)."""
    count, last = len(batch.micro), len(batch.pipeline) - 1
    losses: list[Any] = [None] * count

    async def act(k: int, action: Action, seq: int | None) -> None:
        if action.kind == "B":
            await exchange.backward(k, action.micro, seq)
            return
        result = await exchange.forward(k, action.micro, seq)
        if k == last:
            losses[action.micro] = result

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
    "STAGED",
    "GlobalBatch",
    "PipelinePosition",
    "ThroughStrategy",
    "WorkerToWorker",
    "run_schedule",
]
