"""FedProx: FedAvg whose clients keep near the global model.

Li et al. 2020, "Federated Optimization in Heterogeneous Networks", Algorithm 2: the rounds of
FedAvg (:mod:`~coordinator.strategies.federated.fedavg`), each client minimising
h_k(w; w_t) = F_k(w) + μ/2 ‖w − w_t‖² instead of F_k — the proximal term added to every local
batch's loss (``batched_fit`` with ``prox_mu``), which keeps local models near w_t on
heterogeneous data.
"""

from __future__ import annotations

from coordinator.strategies.federated.fedavg import FedAvg
from protocol.options.federated import FedProxOptions


class FedProx(FedAvg):
    """FedAvg whose clients add μ/2 ‖w − w_t‖² to their loss (Li et al. 2020); its options are
    :class:`~protocol.options.federated.FedProxOptions`, FedAvg's and ``mu``."""

    options_model = FedProxOptions
    options: FedProxOptions

    def proximal_mu(self) -> float:
        return self.options.mu
