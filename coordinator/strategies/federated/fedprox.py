"""FedProx: FedAvg whose clients keep near the global model.

Li et al. 2020, "Federated Optimization in Heterogeneous Networks", Algorithm 2: the rounds of
FedAvg (:mod:`~coordinator.strategies.federated.fedavg`), each client minimising
h_k(w; w_t) = F_k(w) + μ/2 ‖w − w_t‖² instead of F_k — the proximal term added to every local
batch's loss (``batched_fit`` with ``prox_mu``), which keeps local models near w_t on
heterogeneous data.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Self

from coordinator.strategies.base import parse_options
from coordinator.strategies.federated.fedavg import FedAvg, arguments
from protocol.options.strategies import FedProxOptions


class FedProx(FedAvg):
    """FedAvg whose clients add μ/2 ‖w − w_t‖² to their loss (Li et al. 2020).

    Args:
        mu: μ > 0 (with μ = 0 this would be FedAvg: ask for FedAvg instead).
        **kwargs: as :class:`FedAvg`.
    """

    name = "fedprox"

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> Self:
        checked = parse_options(FedProxOptions, options)
        return cls(**arguments(checked), prox_mu=checked.mu)
