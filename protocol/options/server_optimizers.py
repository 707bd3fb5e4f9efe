"""The server optimizers FedAvg and FedProx take (Reddi et al. 2021, "Adaptive Federated
Optimization"): their hyperparameters, defined once for the SDK (``sz.FedAdam(lr=0.01)``), the
wire (``{"name": "fedadam", "lr": 0.01, ...}``) and the coordinator, which runs them
(``coordinator.strategies.federated.server_optimizers``)::

    sz.FedAvg(rounds=20, server=sz.FedAdam(lr=0.01))
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from protocol.options.base import AboveZero, Boolean, Caller, Decay, NamedOptions, named

__all__ = [
    "FORMS",
    "SERVER_OPTIMIZERS",
    "AdaptiveOptions",
    "FedAdagradOptions",
    "FedAdamOptions",
    "FedAvgMOptions",
    "FedYogiOptions",
    "PlainAveragingOptions",
    "ServerOptimizerOptions",
    "ServerOptions",
    "server_options",
]


class ServerOptimizerOptions(NamedOptions):
    """What the coordinator does with a round's average (Reddi et al. 2021, "Adaptive Federated
    Optimization"): with x_t the global model and x̄ the round's row-weighted average of the
    client models, it steps on the pseudo-gradient Δ_t = x̄ − x_t. Without one (the default)
    the average is the next global model, x_{t+1} = x̄, as in FedAvg."""

    def hyperparameters(self) -> dict[str, Any]:
        """The hyperparameters by name."""
        return self.parameters()


class PlainAveragingOptions(ServerOptimizerOptions):
    """No server optimizer: the round's average is the next global model."""

    name = "fedavg"
    sdk_name = "FedAvg"


class FedAvgMOptions(ServerOptimizerOptions):
    """Server momentum (Hsu et al. 2019): m_t = β m_{t−1} + Δ_t; x_{t+1} = x_t + η m_t; with
    ``nesterov``, x_{t+1} = x_t + η (Δ_t + β m_t), Nesterov's momentum — DiLoCo's outer step
    (Douillard et al. 2023), ``torch.optim.SGD(nesterov=True)`` with −Δ_t as the gradient.

    Args:
        lr: η, the server learning rate (> 0).
        momentum: β, in [0, 1).
        nesterov: Nesterov's momentum instead of heavy-ball (default ``False``).
    """

    name = "fedavgm"
    sdk_name = "FedAvgM"

    lr: AboveZero = 1.0
    momentum: Decay = 0.9
    nesterov: Boolean = False


class _MomentOptions(ServerOptimizerOptions):
    """What the adaptive server optimizers share (Reddi et al. 2021, Algorithm 2): ``lr`` > 0,
    ``beta1`` in [0, 1), and where they take them ``beta2`` in [0, 1) and ``tau`` > 0."""

    lr: AboveZero = 0.01
    beta1: Decay = 0.9


class FedAdagradOptions(_MomentOptions):
    """Adagrad on the server (Reddi et al. 2021, Algorithm 2): m_t = β1 m_{t−1} + (1 − β1) Δ_t;
    v_t = v_{t−1} + Δ_t²; x_{t+1} = x_t + η m_t / (√v_t + τ); v_{−1} = τ². Its steps only
    shrink as Δ_t² adds up: for sparse or rare features, or a bounded number of rounds.

    Args:
        lr: η, the server learning rate (> 0).
        beta1: β1, in [0, 1).
        tau: τ, the adaptivity (> 0).
    """

    name = "fedadagrad"
    sdk_name = "FedAdagrad"

    tau: AboveZero = 1e-3


class AdaptiveOptions(_MomentOptions):
    """Adam-like server optimizers (Reddi et al. 2021, Algorithm 2), which take a second-moment
    decay β2 as well.

    Args:
        lr: η, the server learning rate (> 0).
        beta1: β1, in [0, 1).
        beta2: β2, in [0, 1).
        tau: τ, the adaptivity (> 0).
    """

    beta2: Decay = 0.99
    tau: AboveZero = 1e-3


class FedAdamOptions(AdaptiveOptions):
    """Adam on the server (Reddi et al. 2021, Algorithm 2): m_t = β1 m_{t−1} + (1 − β1) Δ_t;
    v_t = β2 v_{t−1} + (1 − β2) Δ_t²; x_{t+1} = x_t + η m_t / (√v_t + τ); v_{−1} = τ².

    Args:
        lr: η, the server learning rate (> 0).
        beta1: β1, in [0, 1).
        beta2: β2, in [0, 1).
        tau: τ, the adaptivity (> 0).
    """

    name = "fedadam"
    sdk_name = "FedAdam"


class FedYogiOptions(AdaptiveOptions):
    """Yogi on the server (Reddi et al. 2021, Algorithm 2): as FedAdam but
    v_t = v_{t−1} − (1 − β2) Δ_t² sign(v_{t−1} − Δ_t²).

    Args:
        lr: η, the server learning rate (> 0).
        beta1: β1, in [0, 1).
        beta2: β2, in [0, 1).
        tau: τ, the adaptivity (> 0).
    """

    name = "fedyogi"
    sdk_name = "FedYogi"


ServerOptions = (
    PlainAveragingOptions | FedAvgMOptions | FedAdagradOptions | FedAdamOptions | FedYogiOptions
)

SERVER_OPTIMIZERS: dict[str, type[ServerOptimizerOptions]] = {
    cls.name: cls
    for cls in (
        PlainAveragingOptions,
        FedAvgMOptions,
        FedAdagradOptions,
        FedAdamOptions,
        FedYogiOptions,
    )
}
"""The server optimizers' options by the name a client gives."""

FORMS = "FedAvgM(...), FedAdagrad(...), FedAdam(...), FedYogi(...)"
"""The SDK's server optimizers, as a refusal lists them."""


def server_options(
    name: str, hyperparameters: Mapping[str, Any], caller: Caller = Caller.WIRE
) -> ServerOptimizerOptions:
    """The server optimizer ``name`` with ``hyperparameters``, checked.

    Raises:
        ValueError: an unknown name, an option it does not take, or a value out of range.
    """
    return named(SERVER_OPTIMIZERS, "server optimizer", name, hyperparameters, caller)
