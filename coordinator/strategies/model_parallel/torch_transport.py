"""ModelParallel's torch transport: the stages run the schedule themselves, passing activations
and their gradients to each other over torch.distributed point-to-point.

:func:`choose_transport` decides: ``websocket`` when asked for or when the stages cannot form a
group (:mod:`~coordinator.strategies.process_group`: in-process workers, an address not known,
a stage that cannot reach the rendezvous on the first); else ``torch``. The tensors cross on the
CPU, so the group is gloo's even on CUDA workers.

:class:`TorchPipeline` then trains. The stages join the group (a stage's rank is its place in
the pipeline), the last stage is sent the labels once, and each stage takes its plan: the
micro-batches of every global batch — cut as the WebSocket path cuts them — and its own
actions of the schedule (:mod:`~coordinator.strategies.model_parallel.schedule`, GPipe or 1F1B).
Then every stage is told to train a chunk of global batches at a time
(:mod:`engine.pipeline.linked_stage`): one call per stage per chunk, one progress event per chunk
with each batch's loss, the chunks growing and the next sent while one trains
(:mod:`coordinator.strategies.chunks`) except where an epoch's evaluation reads the model between
them. A checkpoint does not stop it: the chunk that ends where one falls due carries every stage's
states and optimizer states in its replies (``snapshot``), saved while the next chunk trains. A
stage lost mid-chunk breaks the group, its neighbours' receives fail at once, and the job fails
naming the lost stage and worker — never a hang.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Awaitable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from coordinator.context import StrategyContext
from coordinator.errors import StrategyFailed
from coordinator.strategies.chunks import Chunk, cancelled, next_chunk
from coordinator.strategies.history import History
from coordinator.strategies.model_parallel.checkpoints import StageCheckpoints
from coordinator.strategies.model_parallel.phase import PipelinePhase
from coordinator.strategies.process_group import (
    PROBE_TIMEOUT,
    Broken,
    Rendezvous,
    join,
    rendezvous,
    settle,
)
from protocol.daemon import PipePlanRequest, PipeTrainRequest
from protocol.errors import ErrorCode

__all__ = ["LABELS", "TorchPipeline", "choose_transport"]

T = TypeVar("T")

LABELS = "labels"
"""The name the last stage's labels are staged under."""


async def choose_transport(
    ctx: StrategyContext, pipeline: list[int], wanted: str, limit: float
) -> Rendezvous | str:
    """Where the stages' group meets, or why the run goes over WebSockets.

    Raises:
        StrategyFailed: ``COLLECTIVE_FAILED`` when ``torch`` was asked for and cannot be had.
    """
    if wanted == "websocket":
        return "transport='websocket' was asked for"
    probe = min(PROBE_TIMEOUT, limit)
    meet = await rendezvous(ctx, pipeline, probe, limit, nccl=False, member="stage")
    if isinstance(meet, str) and wanted == "torch":
        raise StrategyFailed(ErrorCode.COLLECTIVE_FAILED, f"transport='torch': {meet}")
    return meet


@dataclass(kw_only=True)
class TorchPipeline:
    """The training phase of a ModelParallel run on a torch group (module docstring): the
    ``phase`` whole, what the first stage's rows are staged under (``data``) and the
    collective ``timeout``."""

    phase: PipelinePhase
    data: str
    timeout: float

    def __post_init__(self) -> None:
        phase = self.phase
        self.ctx, self.guard, self.pipeline = phase.ctx, phase.guard, phase.pipeline
        self.stages, self.schedule, self.micro_batches = (
            phase.stages,
            phase.schedule,
            phase.micro_batches,
        )
        self.training, self.rows, self.emit = phase.training, phase.rows, phase.emit
        self.history: History | None = phase.history  # the rows of the run's epochs
        self.evaluate = phase.evaluate  # the model's figures on the validation data, now

    async def train(self, meet: Rendezvous, steps_per_epoch: int, saves: StageCheckpoints) -> None:
        """Every global batch of the run through the pipeline — from the newest checkpoint's on,
        every stage set back to it first —, with progress per chunk, a chunk ending where a
        checkpoint falls due (``saves``) and the checkpoint saved then. The first stage holds
        its rows under ``data``, the last its labels under :data:`LABELS`."""
        ctx, last = self.ctx, self.pipeline[-1]
        prefix = f"{secrets.token_hex(4)}/pipeline/"
        await self.guard(join(ctx, self.pipeline, meet, prefix, self.timeout))
        plans = {s: ctx.call(s, self._plan(k, s)) for k, s in enumerate(self.pipeline)}
        await self.guard(self._settle(plans, 0))
        step = await saves.restore(self.guard)
        saves.start()
        total = steps_per_epoch * self.training.epochs
        loop = asyncio.get_running_loop()
        chunk = 1
        ahead: Chunk | None = None  # the next chunk, queued on every stage behind this one
        landed = loop.time()  # when the last chunk's results were in
        try:
            while step < total:
                if ahead is None:
                    stop = self._stop(step, chunk, total, steps_per_epoch, saves)
                    ahead = self._send(step, stop, saves.due(stop, total))
                now, ahead = ahead, None
                if now.stop < total and not self._evaluated_at(now.stop, steps_per_epoch):
                    after = self._stop(now.stop, chunk, total, steps_per_epoch, saves)
                    ahead = self._send(now.stop, after, saves.due(after, total))
                results = await self.guard(now.calls)
                began, landed = max(now.sent, landed), loop.time()
                await self._progress(step, now.stop, results[last], steps_per_epoch)
                chunk = next_chunk(chunk, now.stop - step, landed - began)
                step = now.stop
                if now.snapshot:  # taken as the chunk ended, while the next one trains
                    snapshot = {s: results[s]["snapshot"] for s in self.pipeline}
                    await saves.save(step, total, snapshot, self.guard)
        finally:
            await cancelled(ahead)

    def _stop(
        self, step: int, chunk: int, total: int, steps_per_epoch: int, saves: StageCheckpoints
    ) -> int:
        """Where a chunk of ``chunk`` batches after ``step`` ends: at ``total``, at a
        checkpoint due, where the model is evaluated (an epoch's end, ``validate_every``)."""
        stop = min(total, step + chunk, saves.stop_at(step, total))
        if self.evaluate is not None:
            stop = min(stop, self.training.boundaries(steps_per_epoch).next_read(step))
        return stop

    def _evaluated_at(self, stop: int, steps_per_epoch: int) -> bool:
        """Whether the model is evaluated after global batch ``stop``."""
        bounds = self.training.boundaries(steps_per_epoch)
        return self.evaluate is not None and bounds.reads_after(stop)

    def _send(self, step: int, stop: int, snapshot: bool) -> Chunk:
        """Global batches ``[step, stop)`` sent to every stage (each daemon takes requests one
        at a time, so a chunk sent early waits behind the one before); with ``snapshot`` (a
        checkpoint due after it) each stage sends what the checkpoint saves of it with its
        reply."""
        request = PipeTrainRequest(start=step, stop=stop, snapshot=snapshot)
        # (their snapshots go into a checkpoint as they came: relayed)
        calls = {s: self.ctx.call(s, request, relayed=True) for s in self.pipeline}
        settled = asyncio.ensure_future(self._settle(calls, stop))
        return Chunk(stop, settled, asyncio.get_running_loop().time(), snapshot)

    def _plan(self, k: int, stage: int) -> PipePlanRequest:
        first, last = k == 0, k == len(self.pipeline) - 1
        return PipePlanRequest(
            node_ids=self.stages[stage],
            micro_batches=self.micro_batches,
            clip_grad_norm=self.training.clip_grad_norm,
            actions=[(a.kind, a.micro) for a in self.schedule.actions[k]],
            data=self.data if first else None,
            labels=LABELS if last else None,
            rows=self.rows,
            **self.training.batch_plan(),
        )

    async def _settle(self, calls: Mapping[int, Awaitable[Any]], stop: int) -> dict[int, Any]:
        """The calls' results; a failure is blamed on the stage that explains it."""
        try:
            return await settle(calls, [w.id for w in self.ctx.workers], self.timeout, stop)
        except Broken as broken:
            raise broken.blame() from None

    async def _progress(
        self, start: int, stop: int, last: Mapping[str, Any], steps_per_epoch: int
    ) -> None:
        """One progress event for a chunk ending at global batch ``stop``: each batch's mean
        loss (its micro-batches' losses weighted by rows)."""
        losses = [
            sum(r * v for r, v in zip(rows, values, strict=True)) / max(sum(rows), 1)
            for values, rows in zip(last["losses"], last["rows"], strict=True)
        ]
        await self.emit(
            "progress",
            {
                "phase": "training",
                "epoch": min(self.training.epochs, (stop - 1) // steps_per_epoch + 1),
                "epochs": self.training.epochs,
                "step": stop,
                "steps": steps_per_epoch * self.training.epochs,
                "loss": losses[-1],
                "losses": losses,
                "chunk": len(losses),
                "rows": sum(sum(rows) for rows in last["rows"]),
                "batch_rows": [sum(rows) for rows in last["rows"]],
            }
            | ({"lr": last["lrs"][-1], "lrs": last["lrs"]} if last.get("lrs") else {}),
        )
        if self.history is not None:
            rows = [sum(r) for r in last["rows"]]
            lrs = last.get("lrs") or []
            bounds = self.training.boundaries(steps_per_epoch)
            await self.history.steps(start, losses, rows, lrs, bounds, evaluate=self.evaluate)
