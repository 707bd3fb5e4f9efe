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
from protocol.messages import NodeInfo
from protocol.rules import batching
from protocol.wording import listed


@dataclass(frozen=True)
class TrainingSettings:
    """The training settings of a run (those of its last TorchFilter).

    ``batch_size`` is the rows of one optimizer step: the filter's ``batch_size`` times its
    ``accumulate`` (the batches of an epoch are one permutation cut in order, so ``accumulate``
    consecutive batches are exactly one batch that many times larger). A replica or a stage
    then computes its part of such a step in ``accumulate`` slices.
    """

    epochs: int
    batch_size: int | None
    shuffle: bool
    seed: int
    accumulate: int = 1
    clip_grad_norm: float | None = None

    @classmethod
    def of(cls, info: NodeInfo) -> TrainingSettings:
        accumulate = info.accumulate or 1
        return cls(
            epochs=info.epochs if info.epochs is not None else 1,
            batch_size=info.batch_size * accumulate if info.batch_size else None,
            shuffle=bool(info.shuffle),
            seed=info.seed or 0,
            accumulate=accumulate,
            clip_grad_norm=info.clip_grad_norm,
        )

    def steps_per_epoch(self, rows: int) -> int:
        """Optimizer steps in an epoch over ``rows`` rows."""
        return -(-rows // (self.batch_size or rows)) if rows else 0


def global_batches(
    rows: int, parts: int, training: TrainingSettings
) -> Iterator[tuple[int, int, list[Any]]]:
    """``(epoch, step, slices)`` of every step of ``training`` over ``rows`` rows in ``parts``
    slices (:func:`protocol.rules.batching.global_batches`)."""
    return batching.global_batches(
        rows, parts, training.epochs, training.batch_size, training.shuffle, training.seed
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
            self.in_order, training.epochs, training.batch_size, training.shuffle, training.seed
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
    return ScheduleRequest(steps_per_epoch=steps_per_epoch, epochs=training.epochs)


async def set_up(
    ctx: StrategyContext, i: int, filters: Mapping[str, bytes], data: StageRequest
) -> dict[str, Any]:
    """Load ``filters`` on worker ``i`` (a fresh daemon), then stage its ``data`` there;
    returns what staging answered (``{"rows": n}``)."""
    await ctx.load(i, filters)
    staged: dict[str, Any] = await ctx.call(i, data)
    return staged
