"""How a federated round's trained client models reach its aggregate — a plug-in of the round
loop (:mod:`coordinator.strategies.rounds`): :class:`InTheClear` pulls each client's states and
folds them into the round's :class:`~coordinator.strategies.federated.round_fold.RoundFold`;
secure aggregation (:class:`~coordinator.strategies.federated.secure_aggregation.SecureSum`) has
each client mask its model and takes their sum alone.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from coordinator.context import StrategyContext
from coordinator.errors import StrategyFailed
from coordinator.strategies.aggregate import AggregationError, Tree, format_path, non_finite
from coordinator.strategies.federated.cohort import Cohort, DroppedWorker
from coordinator.strategies.federated.round_fold import RoundFold
from protocol.errors import ErrorCode

__all__ = ["FETCHES", "Collection", "InTheClear"]

FETCHES = 16
"""Trained states pulled from the workers at once: the coordinator holds at most this many
client states (arriving or being folded into the mean), however many workers train."""


class Collection(ABC):
    """How one round's client models are collected and combined."""

    async def before_training(
        self, ctx: StrategyContext, cohort: Cohort, selected: Sequence[int]
    ) -> list[DroppedWorker]:
        """What the selected clients do before they train; who dropped out doing it."""
        return []

    def trains(self, label: str) -> bool:
        """Whether client ``label`` trains this round (one that dropped out before does not)."""
        return True

    @abstractmethod
    async def collect(
        self, ctx: StrategyContext, i: int, label: str, fit: Mapping[str, Any], nodes: list[str]
    ) -> None:
        """Take client ``label``'s trained model (of ``nodes``, on worker ``i``) whose
        training replied ``fit``.

        Raises:
            WorkerCallError: the worker failed to give it (the client drops out).
            StrategyFailed: it cannot be combined with the others' (the round fails).
        """

    @abstractmethod
    async def aggregate(
        self, ctx: StrategyContext, cohort: Cohort, selected: Sequence[int]
    ) -> tuple[Tree, dict[str, Any]]:
        """x̄, and what the round's event says of how it was made."""


@dataclass
class InTheClear(Collection):
    """Round ``t``'s trained states pulled from the workers (at most :data:`FETCHES` at once:
    m clients finishing together would push m states into memory) and folded into ``fold`` as
    they arrive."""

    fold: RoundFold
    t: int
    fetch: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(FETCHES))

    async def collect(
        self, ctx: StrategyContext, i: int, label: str, fit: Mapping[str, Any], nodes: list[str]
    ) -> None:
        async with self.fetch:
            states = await ctx.get_state(i, nodes)
            try:
                where = non_finite(states)  # a NaN would make the global model NaN
                if where is not None:
                    raise AggregationError(
                        f"worker {label!r} sent states that are not finite (NaN or infinity) "
                        f"at {format_path(where)}: refused rather than averaged into the model"
                    )
                self.fold.add(label, fit, states)
            except AggregationError as exc:
                raise StrategyFailed(
                    ErrorCode.AGGREGATION_MISMATCH, f"round {self.t}: {exc}"
                ) from exc

    async def aggregate(
        self, ctx: StrategyContext, cohort: Cohort, selected: Sequence[int]
    ) -> tuple[Tree, dict[str, Any]]:
        return self.fold.result()
