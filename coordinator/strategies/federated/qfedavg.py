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

from typing import Any, ClassVar

from coordinator.strategies.federated.fedavg import FedAvg
from coordinator.strategies.federated.round_fold import QFold, RoundFold
from protocol.options.federated import QFedAvgOptions


class QFedAvg(FedAvg):
    """FedAvg with q-FedAvg's server update (Li et al. 2020); its options are
    :class:`~protocol.options.federated.QFedAvgOptions`, FedAvg's and ``q``, ``lipschitz``."""

    options_model = QFedAvgOptions
    options: QFedAvgOptions
    asks_start_loss: ClassVar[bool] = True

    def round_fold(self, torch_nodes: list[str], start: dict[str, Any]) -> RoundFold:
        return QFold(start, torch_nodes, self.options.q, self.options.lipschitz)
