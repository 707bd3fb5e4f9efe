"""Byzantine-robust aggregation for FedAvg and FedProx: what replaces a round's weighted mean
when a few clients may send anything (``coordinator.strategies.federated.robust``)::

    sz.FedAvg(rounds=20, min_workers=7, aggregator=sz.Krum(byzantine=1, keep=3))

Each rule weighs the clients equally (as its paper does) and is applied to the TorchFilters'
weights; a server optimizer, if any, then steps on its result in place of the mean. A rule
that a round of ``min_workers`` clients cannot hold is refused when the strategy is built.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from protocol.options import aggregators as ao
from somatize.components import Component

__all__ = ["Aggregator", "Bulyan", "FedMedian", "Krum", "TrimmedMean"]


@dataclass(frozen=True)
class Aggregator(Component):
    """Base of the robust rules."""

    registry = ao.AGGREGATORS
    kind = "aggregator"


@dataclass(frozen=True)
class FedMedian(Aggregator):
    """The coordinate-wise median of the clients' models (Yin et al. 2018): robust to any
    minority of bad clients, at some cost in accuracy on honest, varied data."""

    name: ClassVar[str] = "fedmedian"


@dataclass(frozen=True)
class TrimmedMean(Aggregator):
    """The coordinate-wise β-trimmed mean (Yin et al. 2018): each coordinate's ⌊β n⌋ largest
    and ⌊β n⌋ smallest values dropped, the rest averaged.

    Args:
        beta: β, in [0, 0.5).
    """

    beta: float

    name: ClassVar[str] = "trimmed_mean"


@dataclass(frozen=True)
class Krum(Aggregator):
    """Krum (Blanchard et al. 2017): the client model closest to its n − f − 2 nearest
    neighbours; with ``keep`` = m > 1, Multi-Krum, the mean of the m best. Needs n > 2f + 2.

    Args:
        byzantine: f, how many bad clients to withstand (>= 0).
        keep: m, how many models are averaged (1: Krum).
    """

    byzantine: int
    keep: int = 1

    name: ClassVar[str] = "krum"


@dataclass(frozen=True)
class Bulyan(Aggregator):
    """Bulyan (El Mhamdi et al. 2018): θ = n − 2f models chosen by Krum one after the other,
    then, coordinate by coordinate, the mean of the θ − 2f values closest to their median.
    Needs n >= 4f + 3.

    Args:
        byzantine: f, how many bad clients to withstand (>= 0).
    """

    byzantine: int

    name: ClassVar[str] = "bulyan"
