"""The round loop: a strategy whose training is rounds owns no loop of its own, only hooks
(Flower's shape: ``Strategy.configure_fit``, ``aggregate_fit``, ``evaluate``... and the server's
loop over them, ``flwr.server.Server.fit``).

:meth:`RoundStrategy.run` is the loop, the same for every such strategy (:func:`run_rounds` its
middle, which any :class:`RoundHooks` may run: a pipeline's global batches over WebSockets do)::

    run ← start()                           the workers set up; the first model, or a checkpoint's
    while rounds are left:
        work ← configure_round(run, t)      who trains, and how their models will be combined
        train_round(run, work)              the clients' work, in parallel; who dropped out
        aggregate_round(run, work)          the next global model
        evaluate_round(run, work)           its figures
        record_round(run, work)             the round's row of the history: its event
        checkpoint_round(run, work)         a checkpoint, when one is due
    finish(run)                             the last checkpoint written; the run's last event
    return final_states(run)                the trained model, read back over the wire

``run`` is the strategy's own record of the run (it counts the rounds done, :class:`RoundRun`),
``work`` its record of one round. :class:`RoundCheckpoints` is the checkpointing the hooks share.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from coordinator.context import StrategyContext
from coordinator.storage.checkpoints import CheckpointPolicy, RunCheckpoints
from coordinator.strategies.base import Emit, JobInputs, Strategy

__all__ = ["RoundCheckpoints", "RoundHooks", "RoundRun", "RoundStrategy", "run_rounds"]


class RoundRun(Protocol):
    """What the loop reads and advances of a run: the rounds done."""

    round: int


R = TypeVar("R", bound=RoundRun)
W = TypeVar("W")
R_contra = TypeVar("R_contra", bound=RoundRun, contravariant=True)


class RoundHooks(Protocol[R_contra, W]):
    """What a round is made of (module docstring); ``W`` a round's own record."""

    async def configure_round(self, run: R_contra, t: int) -> W: ...
    async def train_round(self, run: R_contra, work: W) -> None: ...
    async def aggregate_round(self, run: R_contra, work: W) -> None: ...
    async def evaluate_round(self, run: R_contra, work: W) -> None: ...
    async def record_round(self, run: R_contra, work: W) -> None: ...
    async def checkpoint_round(self, run: R_contra, work: W) -> None: ...


async def run_rounds(hooks: RoundHooks[R, W], run: R, rounds: int) -> None:
    """Rounds ``run.round + 1`` to ``rounds`` through ``hooks``: the loop."""
    while run.round < rounds:
        work = await hooks.configure_round(run, run.round + 1)
        await hooks.train_round(run, work)
        await hooks.aggregate_round(run, work)
        run.round += 1
        await hooks.evaluate_round(run, work)
        await hooks.record_round(run, work)
        await hooks.checkpoint_round(run, work)


class RoundStrategy(Strategy, Generic[R, W]):
    """A strategy whose :meth:`run` is the round loop (module docstring) over its hooks."""

    @property
    @abstractmethod
    def rounds(self) -> int:
        """How many rounds a run trains."""

    async def run(self, ctx: StrategyContext, job: JobInputs, emit: Emit) -> dict[str, Any]:
        run = await self.start(ctx, job, emit)
        await run_rounds(self, run, self.rounds)
        await self.finish(run)
        return await self.final_states(run)

    @abstractmethod
    async def start(self, ctx: StrategyContext, job: JobInputs, emit: Emit) -> R:
        """Set the workers up and take the first global model (or a checkpoint's, and the
        round it was saved after)."""

    @abstractmethod
    async def configure_round(self, run: R, t: int) -> W:
        """Round ``t``: who trains, with what, and how their models will be combined."""

    @abstractmethod
    async def train_round(self, run: R, work: W) -> None:
        """The selected clients' training, in parallel, each collected as it arrives; refuse
        the round when too few answered."""

    @abstractmethod
    async def aggregate_round(self, run: R, work: W) -> None:
        """The next global model, from the round's collected models."""

    async def evaluate_round(self, run: R, work: W) -> None:
        """The new global model's figures, when the job has validation data."""

    @abstractmethod
    async def record_round(self, run: R, work: W) -> None:
        """The round's row of the history, and its event."""

    async def checkpoint_round(self, run: R, work: W) -> None:
        """Save a checkpoint after the round, when one is due."""

    async def finish(self, run: R) -> None:
        """After the last round: the last checkpoint written, the run's last event."""

    @abstractmethod
    async def final_states(self, run: R) -> dict[str, Any]:
        """The trained states by node id, read back over the wire."""


@dataclass
class RoundCheckpoints(RunCheckpoints):
    """A round strategy's checkpoints: one after every ``every`` rounds (``None``: each round;
    ``0``: never), holding what :meth:`save` is given and the round; nothing when the job keeps
    none (``checkpoints`` ``None``)."""

    rounds: int

    @classmethod
    def of(cls, job: JobInputs, every: int | None, rounds: int) -> RoundCheckpoints:
        policy = CheckpointPolicy.of(every, 1, job.checkpoints)
        return cls(checkpoints=job.checkpoints, policy=policy, rounds=rounds)

    @property
    def resume(self) -> tuple[int, Mapping[str, Any]] | None:
        """The round the job's checkpoint was saved after and what it holds; ``None`` when the
        run starts from the beginning."""
        resume = self.checkpoints.resume if self.checkpoints is not None else None
        if resume is None:
            return None
        return int(resume.position["round"]), resume.payload

    def resumed(self) -> dict[str, Any]:
        """What the ``resumed`` event says."""
        assert self.checkpoints is not None
        return self.checkpoints.resumed()

    async def save(self, t: int, payload: dict[str, Any]) -> None:
        """Save ``payload`` as the checkpoint after round ``t`` (when :meth:`due`)."""
        assert self.checkpoints is not None
        await self.checkpoints.save({"round": t}, payload)
        self.policy.saved()
