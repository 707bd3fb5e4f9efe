"""What every strategy shares: its inputs, its placement needs, its event callback."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Self

from coordinator.context import StrategyContext, WorkerIdentity
from coordinator.errors import CoordinatorError

Emit = Callable[[str, dict[str, Any]], Awaitable[None]]
"""``await emit(event, data)``: record a job event (``"progress"`` with step, loss...)."""


class StrategyOptionsError(CoordinatorError):
    """A strategy that does not exist, or an option it does not take or cannot accept."""


@dataclass(frozen=True)
class JobInputs:
    """What a job trains: the graph (node ids, pickled filters) and its data."""

    node_ids: list[str]
    filters: dict[str, bytes]
    x: Any
    y: Any


@dataclass(frozen=True)
class Placement:
    """How many workers a strategy needs, and which qualify (by id and tags)."""

    workers: int
    worker_id: str | None = None
    tag: str | None = None

    def accepts(self, worker: WorkerIdentity) -> bool:
        if self.worker_id is not None and worker.id != self.worker_id:
            return False
        return self.tag is None or self.tag in worker.tags

    def describe(self) -> str:
        what = f"{self.workers} worker{'s' if self.workers != 1 else ''}"
        if self.worker_id is not None:
            what += f" with id {self.worker_id!r}"
        if self.tag is not None:
            what += f" tagged {self.tag!r}"
        return what


class Strategy(ABC):
    """A training strategy; subclasses set :attr:`name` and implement the three hooks."""

    name: ClassVar[str]

    @classmethod
    @abstractmethod
    def from_options(cls, options: Mapping[str, Any]) -> Self:
        """Build from the client's options, refusing unknown or invalid ones."""

    @abstractmethod
    def placement(self) -> Placement:
        """The workers this strategy needs."""

    @abstractmethod
    async def run(self, ctx: StrategyContext, job: JobInputs, emit: Emit) -> dict[str, Any]:
        """Train and return the final states by node id."""


def check_options(name: str, options: Mapping[str, Any], allowed: set[str]) -> None:
    """Refuse options a strategy does not take, naming them and what it does take."""
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise StrategyOptionsError(
            f"strategy {name!r} takes no option {unknown}; it takes {sorted(allowed)}"
        )


def strategy_from_spec(name: str, options: Mapping[str, Any]) -> Strategy:
    """The strategy a client asked for, validated."""
    from coordinator.strategies import STRATEGIES

    try:
        cls = STRATEGIES[name]
    except KeyError:
        raise StrategyOptionsError(
            f"unknown strategy {name!r}; this coordinator runs {sorted(STRATEGIES)}"
        ) from None
    return cls.from_options(options)
