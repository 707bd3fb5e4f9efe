"""Byzantine-robust aggregation rules: a round's n client models, each a point of R^d
(:class:`~coordinator.strategies.federated.flat.Flat`), made into one that a few bad clients cannot
drag far.

* :class:`FedMedian` — the coordinate-wise median (Yin et al. 2018, "Byzantine-Robust
  Distributed Learning: Towards Optimal Statistical Rates", Definition 1: "g = med{x^i}, where
  for each k-th coordinate, g_k = med{x^i_k}").
* :class:`TrimmedMean` — the coordinate-wise β-trimmed mean (Yin et al. 2018, Definition 2:
  "for each k-th coordinate, g_k = 1/((1−2β)m) Σ_{x∈U_k} x, where U_k is a subset of
  {x^1_k, ..., x^m_k} obtained by removing the largest and smallest β fraction of its
  elements"); here ⌊β n⌋ values are removed at each end.
* :class:`Krum` — Blanchard et al. 2017, "Machine Learning with Adversaries: Byzantine
  Tolerant Gradient Descent": "For any i ≠ j, we denote by i → j the fact that V_j belongs to
  the n − f − 2 closest vectors to V_i. Then, we define for each worker i, the score
  s(i) = Σ_{i→j} ‖V_i − V_j‖², where the sum runs over the n − f − 2 closest vectors to V_i.
  Finally, KR(V_1, ..., V_n) = V_{i*} where i* refers to the worker minimizing the score";
  Multi-Krum ("m ∈ {1, ..., n}", ``keep``) averages the m vectors of least score. It needs
  n > 2f + 2.
* :class:`Bulyan` — El Mhamdi et al. 2018, "The Hidden Vulnerability of Distributed Learning
  in Byzantium", with Krum as its rule A: "recursively use A to select θ = n − 2f gradients:
  [each time] A chooses, among the remaining gradients, the closest one to A's output, removes
  it and adds it to the selection set S"; then "each i-th coordinate of G is equal to the
  average of the β = θ − 2f closest i-th coordinates to the median i-th coordinate of the θ
  selected gradients". It needs n ≥ 4f + 3. As the set shrinks, Krum's n − f − 2 neighbours
  fall below one at the last picks; there they count as one, as Flower does.

The rules weigh clients equally, as their papers do (they are written for gradients of
same-sized batches), not by example count. They are translation-equivariant, so aggregating
the models w_k equals w_t plus aggregating the updates w_k − w_t: the server optimizer
(:mod:`~coordinator.strategies.federated.server_optimizers`) then steps on the robust aggregate in
place of the mean, as Reddi et al.'s Algorithm 2 steps on its "Δ_t" and Blanchard et al.'s SGD on
Krum's choice. Ties (equal scores, equal distances) go to the lowest client position.

Each rule takes its options model (:mod:`protocol.options.aggregators`: the parameters and their
checks, defined once) and implements the maths; :func:`for_options` builds the one a model asks
for.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any, ClassVar, Generic, TypeAlias, TypeVar

import numpy as np

from protocol.options.aggregators import (
    BulyanOptions,
    FedMedianOptions,
    KrumOptions,
    RobustRuleOptions,
    TrimmedMeanOptions,
    aggregator_options,
)

Matrix: TypeAlias = np.ndarray[Any, np.dtype[np.float64]]
Vector: TypeAlias = np.ndarray[Any, np.dtype[np.float64]]
R = TypeVar("R", bound=RobustRuleOptions)


class RobustRule(ABC, Generic[R]):
    """n client vectors (the rows of a matrix) to one; see the module docstring."""

    options_model: ClassVar[type[RobustRuleOptions]]
    name: ClassVar[str]

    def __init__(self, options: R) -> None:
        self.options = options

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "options_model" in cls.__dict__:
            cls.name = cls.options_model.name

    @abstractmethod
    def combine(self, stack: Matrix) -> tuple[Vector, list[int] | None]:
        """The aggregate of the rows of ``stack`` (n × d), and which rows a selecting rule
        kept (``None`` for the coordinate-wise ones)."""

    def least_clients(self) -> int:
        """The fewest clients a round needs for this rule to hold."""
        return self.options.least_clients()


class FedMedian(RobustRule[FedMedianOptions]):
    """The coordinate-wise median (Yin et al. 2018); the mean of the two middle values when n
    is even."""

    options_model = FedMedianOptions

    def __init__(self, options: FedMedianOptions | None = None) -> None:
        super().__init__(options if options is not None else FedMedianOptions())

    def combine(self, stack: Matrix) -> tuple[Vector, list[int] | None]:
        return np.median(stack, axis=0), None


class TrimmedMean(RobustRule[TrimmedMeanOptions]):
    """The coordinate-wise mean of what is left once the ⌊β n⌋ largest and ⌊β n⌋ smallest
    values are removed (Yin et al. 2018; β ``beta``)."""

    options_model = TrimmedMeanOptions

    def combine(self, stack: Matrix) -> tuple[Vector, list[int] | None]:
        n = len(stack)
        cut = math.floor(self.options.beta * n)
        ordered = np.sort(stack, axis=0)
        return ordered[cut : n - cut].mean(axis=0), None


class Krum(RobustRule[KrumOptions]):
    """Krum, or Multi-Krum with ``keep`` m > 1: the m vectors of least score averaged
    (Blanchard et al. 2017; f ``byzantine``)."""

    options_model = KrumOptions

    def combine(self, stack: Matrix) -> tuple[Vector, list[int] | None]:
        scores = krum_scores(stack, self.options.byzantine)
        kept = sorted(np.argsort(scores, kind="stable")[: self.options.keep].tolist())
        return stack[kept].mean(axis=0), kept


class Bulyan(RobustRule[BulyanOptions]):
    """Bulyan over Krum (El Mhamdi et al. 2018; f ``byzantine``)."""

    options_model = BulyanOptions

    def combine(self, stack: Matrix) -> tuple[Vector, list[int] | None]:
        f, n = self.options.byzantine, len(stack)
        theta = n - 2 * f
        remaining, selected = list(range(n)), list[int]()
        while len(selected) < theta:
            scores = krum_scores(stack[remaining], f)
            pick = remaining[int(np.argmin(scores))]  # argmin: the first of equal scores
            selected.append(pick)
            remaining.remove(pick)
        chosen = stack[selected]
        beta = theta - 2 * f
        median = np.median(chosen, axis=0)
        nearest = np.argsort(np.abs(chosen - median), axis=0, kind="stable")[:beta]
        return np.take_along_axis(chosen, nearest, axis=0).mean(axis=0), sorted(selected)


def krum_scores(stack: Matrix, byzantine: int) -> Vector:
    """s(i) = Σ_{i→j} ‖V_i − V_j‖² over the n − f − 2 vectors closest to V_i (at least one),
    for each row V_i of ``stack``."""
    n = len(stack)
    closest = max(1, n - byzantine - 2)
    distances = np.empty((n, n), dtype=np.float64)
    for i in range(n):
        distances[i] = np.square(stack - stack[i]).sum(axis=1)
    np.fill_diagonal(distances, np.inf)  # i → j only for j ≠ i
    nearest = np.sort(distances, axis=1)[:, :closest]
    return np.asarray(nearest.sum(axis=1), dtype=np.float64)


RULES: dict[str, type[RobustRule[Any]]] = {
    cls.name: cls for cls in (FedMedian, TrimmedMean, Krum, Bulyan)
}
"""The robust rules by the name a client gives."""


def for_options(options: RobustRuleOptions) -> RobustRule[Any]:
    """The rule ``options`` asks for."""
    return RULES[options.name](options)


def from_options(spec: Mapping[str, Any]) -> RobustRule[Any]:
    """The rule ``{"name": ..., parameter: value}`` asks for, checked.

    Raises:
        ValueError: an unknown name, a parameter it does not take, or a value out of range.
    """
    return for_options(aggregator_options(spec))
