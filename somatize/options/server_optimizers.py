"""Server optimizers for FedAvg and FedProx (Reddi et al. 2021, "Adaptive Federated
Optimization"): what the coordinator does with a round's average
(``coordinator.strategies.federated.server_optimizers`` runs them)::

    sz.FedAvg(rounds=20, server=sz.FedAdam(lr=0.01))

Each class is its options model (:mod:`protocol.options.server_optimizers`: the hyperparameters,
their defaults, their checks and their documentation), taking its arguments positionally too.
"""

from __future__ import annotations

from protocol.options import server_optimizers as options
from somatize.options.components import Component, SdkOptions

__all__ = ["FedAdagrad", "FedAdam", "FedAvgM", "FedYogi", "ServerOptimizer"]


class ServerOptimizer(Component, options.ServerOptimizerOptions):
    pass


class FedAvgM(ServerOptimizer, options.FedAvgMOptions):
    __init__ = SdkOptions.__init__


class FedAdagrad(ServerOptimizer, options.FedAdagradOptions):
    __init__ = SdkOptions.__init__


class FedAdam(ServerOptimizer, options.FedAdamOptions):
    __init__ = SdkOptions.__init__


class FedYogi(ServerOptimizer, options.FedYogiOptions):
    __init__ = SdkOptions.__init__
