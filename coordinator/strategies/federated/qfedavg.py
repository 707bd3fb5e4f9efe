"""q-FedAvg: FedAvg whose server update favours the clients it fits worst.

Li, Sanjabi, Beirami and Smith 2020, "Fair Resource Allocation in Federated Learning": the
objective min_w Σ_k p_k/(q+1) F_k^{q+1}(w) spreads accuracy more evenly across clients as q
grows (q = 0 is FedAvg's objective). Its Algorithm 3 (q-FedAvg) keeps FedAvg's rounds
(:mod:`~coordinator.strategies.federated.fedavg`: selection, local epochs of SGD from w_t) and
changes what the server does with the trained models: see
:class:`~coordinator.strategies.federated.round_fold.QFold`. Each client reports its loss at w_t
(``batched_fit`` with ``start_loss``) along with its model. It is its own server update, so it
takes no server optimizer and no robust aggregator (refused at submit).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Self

from coordinator.strategies.base import parse_options
from coordinator.strategies.federated.fedavg import FedAvg, arguments
from coordinator.strategies.federated.round_fold import QFold, RoundFold
from protocol.options.strategies import QFedAvgOptions


class QFedAvg(FedAvg):
    """FedAvg with q-FedAvg's server update (Li et al. 2020).

    Args:
        q: q >= 0, how much more the worse-fitted clients weigh (0: the unweighted mean).
        lipschitz: L > 0, the Lipschitz constant of the loss's gradient (the paper: 1/η,
            η the clients' learning rate).
        **kwargs: as :class:`FedAvg`.
    """

    name = "qfedavg"
    asks_start_loss: ClassVar[bool] = True

    def __init__(self, q: float, lipschitz: float, **kwargs: Any) -> None:
        self.q = q
        self.lipschitz = lipschitz
        super().__init__(**kwargs)

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> Self:
        checked = parse_options(QFedAvgOptions, options)
        return cls(checked.q, checked.lipschitz, **arguments(checked))

    def _fold(self, torch_nodes: list[str], start: Mapping[str, Any]) -> RoundFold:
        return QFold(start, torch_nodes, self.q, self.lipschitz)
