"""ModelParallel's checkpoints: after a global batch, when every stage has stepped, each stage's
node states and optimizer states, and the batch.

A pipeline's stages hold disjoint parts of the model, so a checkpoint is every training stage's
``get_state`` and ``get_optimizer_state`` (momentum, Adam moments, step counts) read once all of
them have stepped on global batch ``s``, plus ``s``. The data order is a function of the seed and
the epoch (:mod:`protocol.rules.batching`) and the micro-batches a function of the global batch, so
that is all the position a run needs: set back on every stage, it trains batches ``s + 1 ...``
exactly as the undisturbed run would have. The optimizer states hold the learning-rate
schedulers' (:mod:`engine.stepping`), and the payload the run's history as it stood (its rows
so far and the open epoch's sums), so that a run set back goes on with both where they were.

The newest checkpoint also stays in memory for the run itself: a stage that fails over to a
spare (:mod:`~coordinator.strategies.model_parallel.model_parallel`) takes every stage back to it
without reading the store. A run whose job keeps no checkpoints (``checkpoint_every=0``) goes back
to the start instead.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from coordinator.context import StrategyContext
from coordinator.storage.checkpoints import CheckpointPolicy, JobCheckpoints, RunCheckpoints
from coordinator.strategies.base import Emit, concurrently
from coordinator.strategies.history import History

__all__ = ["StageCheckpoints"]

Guard = Callable[..., Awaitable[Any]]
"""Awaits a stage's work, a worker's failure becoming the job's, naming the stage."""


@dataclass
class StageCheckpoints(RunCheckpoints):
    """A ModelParallel run's checkpoints (module docstring).

    Args:
        ctx: the stages' workers, stage ``s`` on worker ``s``.
        stages: each stage's nodes.
        pipeline: the stages that train, in order.
        torch_nodes: the differentiable nodes (those with optimizers).
        epochs: of the run, for the position's epoch.
        emit: the job's events.
        history: the run's rows per epoch, saved with each checkpoint and set back with it.
    """

    ctx: StrategyContext
    stages: list[list[str]]
    pipeline: list[int]
    torch_nodes: Sequence[str]
    epochs: int
    emit: Emit
    history: History | None = None

    def __post_init__(self) -> None:
        saves = self.checkpoints
        self.newest: tuple[dict[str, Any], dict[str, Any], dict[str, Any]] | None = (
            None
            if saves is None or saves.resume is None
            else (saves.resume.position, saves.resume.payload, saves.resumed())
        )
        """(position, payload, what ``resumed`` says) of the checkpoint a restore goes back to."""

    @classmethod
    def of(
        cls,
        ctx: StrategyContext,
        *,
        stages: list[list[str]],
        pipeline: list[int],
        torch_nodes: Sequence[str],
        checkpoints: JobCheckpoints | None,
        every: int | None,
        steps_per_epoch: int,
        epochs: int,
        emit: Emit,
        history: History | None = None,
    ) -> StageCheckpoints:
        policy = CheckpointPolicy.of(every, steps_per_epoch, checkpoints)
        return cls(
            checkpoints=checkpoints,
            policy=policy,
            ctx=ctx,
            stages=stages,
            pipeline=pipeline,
            torch_nodes=torch_nodes,
            epochs=epochs,
            emit=emit,
            history=history,
        )

    @property
    def states(self) -> dict[str, Any] | None:
        """Every node's state in the checkpoint a restore goes back to (``None``: the start)."""
        return None if self.newest is None else dict(self.newest[1]["states"])

    async def restore(self, guard: Guard) -> int:
        """Set every training stage to the newest checkpoint and say so (``resumed``), the
        history to its rows; the global batches it had done (``0``: none, nothing set, the
        history empty)."""
        if self.newest is None:
            if self.history is not None:
                self.history.load_state_dict(None)
            return 0
        position, payload, said = self.newest
        if self.history is not None:
            self.history.load_state_dict(payload.get("history"))
        states, optimizers = payload["states"], payload["optimizers"]

        async def put(s: int) -> None:
            own = {n: states[n] for n in self.stages[s] if n in states}
            await guard(self.ctx.set_state(s, own), stage=s)
            trained = {n: optimizers[n] for n in self.stages[s] if n in optimizers}
            if trained:
                await guard(self.ctx.set_optimizer_state(s, trained), stage=s)

        await concurrently(*(put(s) for s in self.pipeline))
        await self.emit("resumed", said)
        return int(position["step"])

    async def after(self, done: int, total: int, guard: Guard) -> None:
        """Save a checkpoint after global batch ``done`` if one is due (every stage stepped),
        each stage's states read now."""
        if not self.due(done, total):
            return
        await self.save(done, total, {}, guard)

    async def save(self, done: int, total: int, snapshots: Mapping[int, Any], guard: Guard) -> None:
        """Save the checkpoint after global batch ``done``, if one is still due then (one due
        by time is not, once another was saved since): the stages' states and optimizer
        states as ``snapshots`` has them (by stage: what a chunk's replies carried, taken as it
        ended), every other stage's read now."""
        if self.checkpoints is None or not self.policy.due(done, total):
            return

        async def read(s: int) -> tuple[dict[str, Any], dict[str, Any]]:
            if s in snapshots:
                return snapshots[s]["states"], snapshots[s]["optimizers"]
            return await self._read(s, guard)

        reads = await concurrently(*(read(s) for s in range(len(self.stages))))
        states = {n: state for part, _ in reads for n, state in part.items()}
        optimizers = {n: state for _, part in reads for n, state in part.items()}
        per_epoch = max(1, self.policy.per_epoch)
        position = {"step": done, "epoch": min(self.epochs, (done - 1) // per_epoch + 1)}
        payload: dict[str, Any] = {"states": states, "optimizers": optimizers}
        if self.history is not None:
            payload["history"] = self.history.state_dict()
        await self.checkpoints.save(position, payload)
        self.newest = (position, payload, position)
        self.policy.saved()

    async def _read(self, s: int, guard: Guard) -> tuple[dict[str, Any], dict[str, Any]]:
        """Stage ``s``'s states and optimizers, as saved (never computed on: relayed)."""
        states = await guard(self.ctx.get_state(s, self.stages[s], relayed=True), stage=s)
        trained = [n for n in self.stages[s] if n in self.torch_nodes]
        optimizers = (
            await guard(self.ctx.get_optimizer_state(s, trained, relayed=True), stage=s)
            if trained
            else {}
        )
        return states, optimizers
