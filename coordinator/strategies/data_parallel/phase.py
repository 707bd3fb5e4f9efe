"""What a DataParallel run's training phase works with, whichever loop runs it: the replicas set
up and the collective chosen (:class:`SetUp`, :class:`Choice`), and the settings, rows, history,
evaluation, steps and checkpoints of the phase (:class:`TrainingPhase`).

The strategy (:mod:`~coordinator.strategies.data_parallel.data_parallel`) makes them; each loop
takes the phase whole with its options: on the torch group
(:class:`~coordinator.strategies.data_parallel.torch_collective.TorchTraining`, DiLoCo's
:class:`~coordinator.strategies.data_parallel.diloco_torch.SyncsOnTorch`) or through the
coordinator (:class:`~coordinator.strategies.data_parallel.star.StarTraining`, DiLoCo's
:class:`~coordinator.strategies.data_parallel.diloco.CoordinatorSyncs`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from coordinator.strategies.data_parallel.checkpoints import ReplicaCheckpoints
from coordinator.strategies.data_parallel.elastic import Replicas
from coordinator.strategies.history import Evaluate, History
from coordinator.strategies.process_group import Rendezvous
from coordinator.strategies.steps import StepBoundaries, TrainingSettings

__all__ = ["Choice", "SetUp", "TrainingPhase"]


@dataclass(frozen=True)
class Choice:
    """How a run reduces its gradients, and why; for ``torch``, where the group meets."""

    collective: str  # "torch" | "coordinator"
    reason: str
    backend: str | None = None
    meet: Rendezvous | None = None  # where its group meets (``torch``)

    def describe(self) -> dict[str, Any]:
        """What the ``placed`` event says of it."""
        said: dict[str, Any] = {"collective": self.collective, "collective_reason": self.reason}
        return said | ({"backend": self.backend} if self.backend else {})


@dataclass(frozen=True)
class SetUp:
    """A run whose replicas hold the filters and their rows, and the collective chosen."""

    run: Replicas
    first_epoch: list[list[int]]
    steps_per_epoch: int
    choice: Choice


@dataclass(frozen=True, kw_only=True)
class TrainingPhase:
    """What step 3 of a run, the training, works with: the replicas set up, the settings, the
    rows sent, the history and evaluation, the steps ``[start, total)`` and the checkpoints."""

    setup: SetUp
    training: TrainingSettings
    rows: int
    history: History
    evaluate: Evaluate | None
    total: int
    start: int
    saves: ReplicaCheckpoints

    @property
    def run(self) -> Replicas:
        return self.setup.run

    @property
    def bounds(self) -> StepBoundaries:
        """Where the run's epochs close and the model is validated."""
        return self.training.boundaries(self.setup.steps_per_epoch)
