"""How a job is spread over workers: the strategies' configuration objects.

A strategy here is only configuration: it is checked when it is built (a bad argument is a
:class:`ValueError` naming it) and travels to the coordinator as a
:class:`~protocol.messages.StrategySpec` (a name and JSON options). The strategies themselves run
on the coordinator (:mod:`coordinator.strategies`)::

    client.submit(graph, x, y, strategy=sz.Local(tag="gpu"))
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

from protocol.messages import StrategySpec

__all__ = ["DataParallel", "Local", "Strategy", "WorkerData"]


class Strategy(ABC):
    """Base of the strategies: a name the coordinator knows and the options it takes."""

    #: The strategy's name on the wire.
    name: ClassVar[str]

    @abstractmethod
    def options(self) -> dict[str, Any]:
        """The options sent to the coordinator (JSON values; unset options left out)."""

    def spec(self) -> StrategySpec:
        """This strategy as it travels in a :class:`~protocol.messages.Submit`."""
        return StrategySpec(name=self.name, options=self.options())


def _check_selector(argument: str, value: object) -> None:
    if value is not None and (not isinstance(value, str) or not value.strip()):
        raise ValueError(f"{argument} must be a non-empty string or None, not {value!r}")


@dataclass(frozen=True)
class Local(Strategy):
    """The whole graph on one worker with all the data, trained as ``graph.fit`` would.

    Args:
        worker: run on the worker with this id (default: any idle worker).
        tag: run on a worker that has this tag (default: any idle worker).

    Raises:
        ValueError: ``worker`` or ``tag`` is not a non-empty string, or both are given.
    """

    worker: str | None = None
    tag: str | None = None

    name: ClassVar[str] = "local"

    def __post_init__(self) -> None:
        _check_selector("worker", self.worker)
        _check_selector("tag", self.tag)
        if self.worker is not None and self.tag is not None:
            raise ValueError(
                f"pin a Local job to a worker or to a tag, not both "
                f"(worker={self.worker!r}, tag={self.tag!r})"
            )

    def options(self) -> dict[str, Any]:
        return {k: v for k, v in (("worker", self.worker), ("tag", self.tag)) if v is not None}


@dataclass(frozen=True)
class DataParallel(Strategy):
    """Synchronous data-parallel SGD over ``workers`` replicas (gradient all-reduce).

    Each global batch — exactly the batch ``graph.fit`` takes, by the last TorchFilter's
    ``batch_size``, ``shuffle`` and ``seed`` — is split across the replicas with its labels; the
    coordinator averages their gradients weighted by slice size and every replica takes the same
    step with its own persistent optimizer. With a mean-reduced loss and no randomness in the
    model, the result equals ``graph.fit``. Plain filters before the first TorchFilter are fitted
    per shard and their states averaged by rows.

    Args:
        workers: how many replicas (workers) to train on.
        tag: only workers with this tag (default: any idle workers).
    """

    workers: int
    tag: str | None = None

    name: ClassVar[str] = "data_parallel"

    def __post_init__(self) -> None:
        if not isinstance(self.workers, int) or isinstance(self.workers, bool) or self.workers < 1:
            raise ValueError(f"workers must be a positive integer, not {self.workers!r}")
        _check_selector("tag", self.tag)

    def options(self) -> dict[str, Any]:
        options: dict[str, Any] = {"workers": self.workers}
        if self.tag is not None:
            options["tag"] = self.tag
        return options


@dataclass(frozen=True)
class WorkerData:
    """A job's input that stays on the workers: each trains on its own dataset called ``name``
    (``somatize-worker --data NAME=PATH``, an ``.npz`` with ``x`` and ``y``)::

        client.submit(graph, sz.WorkerData("clinic"), strategy=sz.FedAvg(rounds=10))
    """

    name: str

    def __post_init__(self) -> None:
        _check_selector("name", self.name)
