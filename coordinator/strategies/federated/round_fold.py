"""How a federated round's client models become its aggregate x̄, the model the server
optimizer then steps towards (:func:`~coordinator.strategies.federated.server_optimizers.step_on`).

A fold takes each client's trained states as they arrive (:meth:`RoundFold.add`) and gives the
aggregate once the round is in (:meth:`RoundFold.result`):

* :class:`RowWeightedMean` — FedAvg's row-weighted mean (McMahan et al. 2017), folded in as the
  states arrive: the coordinator holds a few client states, not the round's.
* :class:`RobustFold` — a Byzantine-robust rule (:mod:`~coordinator.strategies.federated.robust`) on
  the TorchFilters' float leaves, which needs every client's vector at once (n × d float64 held);
  everything else (plain filters' states, integer leaves) is the row-weighted mean, checked as
  the mean checks it.
* :class:`QFold` — q-FedAvg's fair update (Li et al. 2020), from each client's model and its
  loss at w_t.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from coordinator.strategies.aggregate import Accumulator, AggregationError, Tree
from coordinator.strategies.federated.flat import Flat, Vector
from coordinator.strategies.federated.robust import RobustRule


class RoundFold(ABC):
    """A round's aggregation, fed one client at a time."""

    @abstractmethod
    def add(self, label: str, fit: Mapping[str, Any], states: Tree) -> None:
        """Take client ``label``'s trained ``states``; ``fit`` is its training's reply
        (``rows``, ``loss``, and ``start_loss`` where asked for).

        Raises:
            AggregationError: its states cannot be aggregated with the others'; nothing taken.
        """

    @abstractmethod
    def result(self) -> tuple[Tree, dict[str, Any]]:
        """x̄, and what the round's event adds about how it was made."""


class RowWeightedMean(RoundFold):
    """Σ (n_k / n) w_k, folded in as the clients arrive."""

    def __init__(self) -> None:
        self.mean = Accumulator()

    def add(self, label: str, fit: Mapping[str, Any], states: Tree) -> None:
        self.mean.add(label, fit["rows"], states)

    def result(self) -> tuple[Tree, dict[str, Any]]:
        return self.mean.result(), {}


class RobustFold(RoundFold):
    """``rule`` on the float leaves of ``nodes`` (the TorchFilters), the row-weighted mean for
    the rest."""

    def __init__(self, rule: RobustRule[Any], nodes: Sequence[str]) -> None:
        self.rule = rule
        self.nodes = list(nodes)
        self.mean = Accumulator()
        self.labels: list[str] = []
        self.vectors: list[Vector] = []
        self.flat: Flat | None = None

    def add(self, label: str, fit: Mapping[str, Any], states: Tree) -> None:
        model = {n: states[n] for n in self.nodes if n in states}
        flat = self.flat or Flat(model)
        vector = flat.vector(model)  # before the mean takes it: a refusal leaves both as they were
        self.mean.add(label, fit["rows"], states)
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


START_LOSS_FLOOR = 1e-10
"""F_k(w_t) is taken as at least this, so that F^(q−1) stays finite for a client whose loss
is 0 (Flower adds the same 1e-10)."""


class QFold(RoundFold):
    """q-FedAvg's server update (Li et al. 2020, "Fair Resource Allocation in Federated
    Learning", Algorithm 3), on the float leaves of ``nodes`` (the TorchFilters)::

        Δw_k = L (w_t − w̄_k)
        Δ_k  = F_k^q(w_t) Δw_k
        h_k  = q F_k^(q−1)(w_t) ‖Δw_k‖² + L F_k^q(w_t)
        w_{t+1} = w_t − Σ_k Δ_k / Σ_k h_k

    with w̄_k client k's trained model, F_k(w_t) its loss at w_t before training (``start_loss``
    in its reply) and L the Lipschitz constant of the gradient (the paper takes 1/η). Clients of
    higher loss weigh more as q grows; q = 0 is the unweighted mean of the clients' models. The
    rest (plain filters' states) is the row-weighted mean.
    """

    def __init__(self, start: Tree, nodes: Sequence[str], q: float, lipschitz: float) -> None:
        self.start = start
        self.nodes = list(nodes)
        self.q = q
        self.lipschitz = lipschitz
        self.mean = Accumulator()
        self.flat: Flat | None = None
        self.w_t: Vector | None = None
        self.deltas: Vector | None = None
        self.h = 0.0

    def add(self, label: str, fit: Mapping[str, Any], states: Tree) -> None:
        loss = fit.get("start_loss")
        if not isinstance(loss, int | float) or not np.isfinite(loss) or loss < 0:
            raise AggregationError(
                f"contributor {label!r} gave no usable loss at w_t ({loss!r}); q-FedAvg needs it"
            )
        model = {n: states[n] for n in self.nodes}
        flat = self.flat or Flat(model)
        w_t = (
            self.w_t
            if self.w_t is not None
            else flat.vector({n: self.start[n] for n in self.nodes})
        )
        step = self.lipschitz * (w_t - flat.vector(model))  # Δw_k
        self.mean.add(label, fit["rows"], states)
        self.flat, self.w_t = flat, w_t
        f = max(float(loss), START_LOSS_FLOOR)
        weighted = f**self.q * step  # Δ_k
        self.deltas = weighted if self.deltas is None else self.deltas + weighted
        self.h += self.q * f ** (self.q - 1) * float(step @ step) + self.lipschitz * f**self.q

    def result(self) -> tuple[Tree, dict[str, Any]]:
        mean = self.mean.result()
        if self.flat is None or self.w_t is None or self.deltas is None:
            return mean, {}
        model = self.flat.tree(self.w_t - self.deltas / self.h, {n: mean[n] for n in self.nodes})
        return {**mean, **model}, {}
