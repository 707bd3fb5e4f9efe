"""What the training phase of a ModelParallel run works with, whichever transport runs it: the
stages and their workers, the stages that train, the schedule and its micro-batches per global
batch, the rows, settings, history and evaluation (:class:`PipelinePhase`).

:class:`~coordinator.strategies.model_parallel.run.PipelineRun` makes it once the plain
filters in front are fitted; the stages then train over torch.distributed
(:class:`~coordinator.strategies.model_parallel.torch_transport.TorchPipeline`) or with every
action a call from the coordinator
(:class:`~coordinator.strategies.model_parallel.run.GlobalBatchSteps`), each taking it whole.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from coordinator.context import StrategyContext
from coordinator.strategies.base import Emit
from coordinator.strategies.history import Evaluate, History
from coordinator.strategies.model_parallel.schedule import Schedule
from coordinator.strategies.steps import StepBoundaries, TrainingSettings

__all__ = ["PipelinePhase"]


@dataclass(frozen=True, kw_only=True)
class PipelinePhase:
    """The training phase of a pipeline (module docstring).

    Args:
        ctx: the job's workers, stage ``s`` on worker ``s``.
        guard: awaits a stage's work, a worker's failure becoming the job's, naming its stage.
        stages: every stage's nodes.
        pipeline: the stages that train, by worker index, in order.
        schedule: the order of each training stage's actions (GPipe or 1F1B).
        micro_batches: per global batch (``accumulate`` times the options' own).
        training: the last TorchFilter's settings.
        rows: the rows the first stage holds.
        emit: the job's events.
        history: the job's rows per epoch.
        evaluate: the model's figures on the validation data, now (``None``: none sent).
    """

    ctx: StrategyContext
    guard: Callable[..., Awaitable[Any]]
    stages: list[list[str]]
    pipeline: list[int]
    schedule: Schedule
    micro_batches: int
    training: TrainingSettings
    rows: int
    emit: Emit
    history: History
    evaluate: Evaluate | None

    @property
    def steps_per_epoch(self) -> int:
        """Global batches an epoch."""
        return self.training.steps_per_epoch(self.rows)

    @property
    def bounds(self) -> StepBoundaries:
        """Where the run's epochs close and the model is validated."""
        return self.training.boundaries(self.steps_per_epoch)
