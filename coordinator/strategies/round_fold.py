"""How a federated round's client models become its aggregate x̄, the model the server
optimizer then steps towards (:func:`~coordinator.strategies.server_opt.step_on`).

A fold takes each client's trained states as they arrive (:meth:`RoundFold.add`) and gives the
aggregate once the round is in (:meth:`RoundFold.result`):

* :class:`MeanFold` — FedAvg's row-weighted mean (McMahan et al. 2017), folded in as the states
  arrive: the coordinator holds a few client states, not the round's.
* :class:`RobustFold` — a Byzantine-robust rule (:mod:`~coordinator.strategies.robust`) on the
  TorchFilters' float leaves, which needs every client's vector at once (n × d float64 held);
  everything else (plain filters' states, integer leaves) is the row-weighted mean, checked as
  the mean checks it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import numpy as np

from coordinator.strategies.aggregate import Accumulator, Tree
from coordinator.strategies.flat import Flat, Vector
from coordinator.strategies.robust import RobustRule


class RoundFold(ABC):
    """A round's aggregation, fed one client at a time."""

    @abstractmethod
    def add(self, label: str, rows: int, states: Tree) -> None:
        """Take client ``label``'s trained ``states`` (from ``rows`` examples).

        Raises:
            AggregationError: its states cannot be aggregated with the others'; nothing taken.
        """

    @abstractmethod
    def result(self) -> tuple[Tree, dict[str, Any]]:
        """x̄, and what the round's event adds about how it was made."""


class MeanFold(RoundFold):
    """Σ (n_k / n) w_k, folded in as the clients arrive."""

    def __init__(self) -> None:
        self.mean = Accumulator()

    def add(self, label: str, rows: int, states: Tree) -> None:
        self.mean.add(label, rows, states)

    def result(self) -> tuple[Tree, dict[str, Any]]:
        return self.mean.result(), {}


class RobustFold(RoundFold):
    """``rule`` on the float leaves of ``nodes`` (the TorchFilters), the row-weighted mean for
    the rest."""

    def __init__(self, rule: RobustRule, nodes: Sequence[str]) -> None:
        self.rule = rule
        self.nodes = list(nodes)
        self.mean = Accumulator()
        self.labels: list[str] = []
        self.vectors: list[Vector] = []
        self.flat: Flat | None = None

    def add(self, label: str, rows: int, states: Tree) -> None:
        model = {n: states[n] for n in self.nodes if n in states}
        flat = self.flat or Flat(model)
        vector = flat.vector(model)  # before the mean takes it: a refusal leaves both as they were
        self.mean.add(label, rows, states)
        self.flat = flat
        self.labels.append(label)
        self.vectors.append(vector)

    def result(self) -> tuple[Tree, dict[str, Any]]:
        mean = self.mean.result()
        if self.flat is None:
            return mean, {}
        # In label order, not arrival order: ties break the same way in every run.
        order = sorted(range(len(self.labels)), key=self.labels.__getitem__)
        combined, kept = self.rule.combine(np.stack([self.vectors[i] for i in order]))
        model = self.flat.tree(combined, {n: mean[n] for n in self.nodes})
        extra = {} if kept is None else {"kept": [self.labels[order[i]] for i in kept]}
        return {**mean, **model}, extra
