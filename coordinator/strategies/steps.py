"""Steps more than one strategy takes: reading a graph's plan, cutting global batches, setting a
worker up with the job's filters and data.

Each is written once here and named after what it does, so that a strategy's ``run()`` reads as
its paper's phases.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from coordinator.context import StrategyContext
from coordinator.errors import StrategyOptionsError
from coordinator.strategies.base import JobInputs
from protocol.daemon import ScheduleRequest, StageRequest
from protocol.filter_buffers import FilterBuffer
from protocol.messages import NodeInfo
from protocol.options.training import TrainingOptions
from protocol.rules import batching
from protocol.text.wording import listed


class TrainingSettings(TrainingOptions):
    """The training options of a run (its last TorchFilter's, :class:`TrainingOptions`), and
    how the coordinator cuts the run into global batches by them.

    A global batch is the rows of one optimizer step (:attr:`~TrainingOptions.step_rows`: the
    filter's ``batch_size`` times its ``accumulate``); a replica or a stage computes its part
    of such a step in ``accumulate`` slices. ``max_steps`` stops the run after that many
    optimizer steps, mid-epoch if need be (the epoch it stops in ends there);
    ``validate_every`` evaluates the model every that many steps besides each epoch's end
    (``graph.fit``'s meanings).
    """

    @classmethod
    def of(cls, info: NodeInfo) -> TrainingSettings:
        """The settings of a run whose last TorchFilter ``info`` describes."""
        return cls(**dict(info.training or TrainingOptions()))

    def steps_per_epoch(self, rows: int) -> int:
        """Optimizer steps in an epoch over ``rows`` rows."""
        return -(-rows // (self.step_rows or rows)) if rows else 0

    def batch_plan(self) -> dict[str, Any]:
        """How every member of a run cuts its global batches: the fields of a plan request
        (:class:`protocol.daemon.DistPlanRequest`, :class:`~protocol.daemon.PipePlanRequest`)
        but the rows."""
        return {
            "epochs": self.epochs,
            "batch_size": self.step_rows,
            "shuffle": self.shuffle,
            "seed": self.seed,
            "max_steps": self.max_steps,
        }

    def boundaries(self, steps_per_epoch: int) -> StepBoundaries:
        """Where a run of epochs of ``steps_per_epoch`` steps closes epochs and validates."""
        total = steps_per_epoch * self.epochs
        if self.max_steps is not None:
            total = min(total, self.max_steps)
        return StepBoundaries(steps_per_epoch, self.epochs, total, self.validate_every)


@dataclass(frozen=True)
class StepBoundaries:
    """Where a run's optimizer steps (counted from 1) close its epochs and where the model is
    evaluated between them, as ``graph.fit``'s training loop does: an epoch closes at its last
    step, or at the run's last (``total``, which ``max_steps`` may put mid-epoch); with
    ``validate_every``, the model is evaluated after every that many steps too, except where an
    epoch closes (its row has the figures)."""

    per_epoch: int
    epochs: int  # asked for
    total: int
    validate_every: int | None = None

    def ends_epoch(self, done: int) -> bool:
        """Whether step ``done`` closes its epoch."""
        return done == self.total or (self.per_epoch > 0 and done % self.per_epoch == 0)

    def validates_after(self, done: int) -> bool:
        """Whether the model is evaluated after step ``done`` for ``validate_every``."""
        every = self.validate_every
        return every is not None and done % every == 0 and not self.ends_epoch(done)

    def reads_after(self, done: int) -> bool:
        """Whether the model is read after step ``done`` (an epoch closes or a validation):
        with validation data, nothing may run ahead of it."""
        return self.ends_epoch(done) or self.validates_after(done)

    def next_read(self, step: int) -> int:
        """The first step after ``step`` that the model is read after (:meth:`reads_after`)."""
        stop = self.total
        if self.per_epoch:
            stop = min(stop, (step // self.per_epoch + 1) * self.per_epoch)
        if self.validate_every:
            stop = min(stop, (step // self.validate_every + 1) * self.validate_every)
        return stop

    def epoch(self, done: int) -> int:
        """The epoch (from 1) step ``done`` belongs to."""
        return -(-done // self.per_epoch) if self.per_epoch else 1

    @property
    def epochs_run(self) -> int:
        """The epochs the run trains in (the last cut short by ``max_steps``)."""
        return self.epoch(self.total) if self.total else self.epochs


def global_batches(
    rows: int, parts: int, training: TrainingSettings
) -> Iterator[tuple[int, int, list[Any]]]:
    """``(epoch, step, slices)`` of every step of ``training`` over ``rows`` rows in ``parts``
    slices (:func:`protocol.rules.batching.global_batches`)."""
    return batching.global_batches(
        rows, parts, training.epochs, training.step_rows, training.shuffle, training.seed
    )


@dataclass(frozen=True)
class OwnData:
    """Replicas that train on their own datasets (``WorkerData``): each one's rows and its
    place among the replicas sorted by worker id (the order
    :func:`protocol.rules.batching.replica_batches` takes them in), both by replica."""

    sizes: list[int]
    places: list[int]

    @classmethod
    def of(cls, sizes: list[int], ids: list[str]) -> OwnData:
        ranked = sorted(range(len(ids)), key=ids.__getitem__)
        places = [0] * len(ids)
        for place, i in enumerate(ranked):
            places[i] = place
        return cls(sizes, places)

    @property
    def in_order(self) -> list[int]:
        """The sizes in worker-id order."""
        ordered = [0] * len(self.sizes)
        for i, place in enumerate(self.places):
            ordered[place] = self.sizes[i]
        return ordered

    def batches(self, training: TrainingSettings) -> Iterator[tuple[int, int, list[Any]]]:
        """``(epoch, step, slices)`` of every step, the slices by replica (rows of its own)."""
        for epoch, step, slices in batching.replica_batches(
            self.in_order, training.epochs, training.step_rows, training.shuffle, training.seed
        ):
            yield epoch, step, [slices[place] for place in self.places]


def plain_prefix(job: JobInputs, strategy: str, none: str) -> tuple[list[str], list[str]]:
    """The TorchFilters of ``job`` and the plain filters before them.

    Strategies that step the TorchFilters together fit plain filters once, up front; one after
    the first TorchFilter would need fitting on data that only exists mid-training.

    Raises:
        StrategyOptionsError: the graph has no TorchFilter (``none`` says what to use), or a
            plain filter comes after the first one.
    """
    torch_nodes = job.differentiable()
    if not torch_nodes:
        raise StrategyOptionsError(f"{strategy} trains TorchFilters and this graph has none{none}")
    first = job.node_ids.index(torch_nodes[0])
    trains = set(torch_nodes)
    late = [n for n in job.node_ids[first:] if n not in trains]
    if late:
        raise StrategyOptionsError(
            f"{strategy} fits plain filters only before the first TorchFilter; {listed(late)} "
            f"come after {torch_nodes[0]!r}"
        )
    return torch_nodes, job.node_ids[:first]


def lr_schedule_request(training: TrainingSettings, steps_per_epoch: int) -> ScheduleRequest:
    """What tells a daemon the horizon of the run's learning-rate schedules."""
    return ScheduleRequest(
        steps_per_epoch=steps_per_epoch,
        epochs=training.epochs,
        max_steps=training.max_steps,
    )


async def set_up(
    ctx: StrategyContext, i: int, filters: Mapping[str, FilterBuffer], data: StageRequest
) -> dict[str, Any]:
    """Load ``filters`` on worker ``i`` (a fresh daemon), then stage its ``data`` there;
    returns what staging answered (``{"rows": n}``)."""
    await ctx.load(i, filters)
    staged: dict[str, Any] = await ctx.call(i, data)
    return staged
