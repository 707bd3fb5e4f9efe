"""Server optimizers for FedAvg and FedProx (Reddi et al. 2021, "Adaptive Federated
Optimization"): what the coordinator does with a round's average
(``coordinator.strategies.federated.server_optimizers`` runs them)::

    sz.FedAvg(rounds=20, server=sz.FedAdam(lr=0.01))

Each is checked when it is built, by the options model the coordinator checks it with
(:func:`protocol.options.strategies.server_options`).
"""

from __future__ import annotations

from abc import ABC
from dataclasses import dataclass, fields
from typing import Any, ClassVar

from protocol.options import strategies as so

__all__ = ["FedAdagrad", "FedAdam", "FedAvgM", "FedYogi", "ServerOptimizer"]


class ServerOptimizer(ABC):
    """What the coordinator does with a round's average (Reddi et al. 2021, "Adaptive Federated
    Optimization"): with x_t the global model and x̄ the round's row-weighted average of the
    client models, it steps on the pseudo-gradient Δ_t = x̄ − x_t. Without one (the default)
    the average is the next global model, x_{t+1} = x̄, as in FedAvg."""

    #: The optimizer's name on the wire.
    name: ClassVar[str]

    def __post_init__(self) -> None:
        self.options()

    def options(self) -> dict[str, Any]:
        """``{"name": ..., hyperparameter: value, ...}``, as the strategy sends it."""
        checked = so.server_options(self.name, _arguments(self), so.Dialect.SDK)
        return {"name": self.name, **checked.hyperparameters()}


@dataclass(frozen=True)
class FedAvgM(ServerOptimizer):
    """Server momentum (Hsu et al. 2019): m_t = β m_{t−1} + Δ_t; x_{t+1} = x_t + η m_t.

    Args:
        lr: η, the server learning rate (> 0).
        momentum: β, in [0, 1).
    """

    lr: float = 1.0
    momentum: float = 0.9

    name: ClassVar[str] = "fedavgm"


@dataclass(frozen=True)
class FedAdagrad(ServerOptimizer):
    """Adagrad on the server (Reddi et al. 2021, Algorithm 2): m_t = β1 m_{t−1} + (1 − β1) Δ_t;
    v_t = v_{t−1} + Δ_t²; x_{t+1} = x_t + η m_t / (√v_t + τ); v_{−1} = τ². Its steps only
    shrink as Δ_t² adds up: for sparse or rare features, or a bounded number of rounds.

    Args:
        lr: η, the server learning rate (> 0).
        beta1: β1, in [0, 1).
        tau: τ, the adaptivity (> 0).
    """

    lr: float = 0.01
    beta1: float = 0.9
    tau: float = 1e-3

    name: ClassVar[str] = "fedadagrad"


@dataclass(frozen=True)
class _Adaptive(ServerOptimizer):
    lr: float = 0.01
    beta1: float = 0.9
    beta2: float = 0.99
    tau: float = 1e-3


@dataclass(frozen=True)
class FedAdam(_Adaptive):
    """Adam on the server (Reddi et al. 2021, Algorithm 2): m_t = β1 m_{t−1} + (1 − β1) Δ_t;
    v_t = β2 v_{t−1} + (1 − β2) Δ_t²; x_{t+1} = x_t + η m_t / (√v_t + τ); v_{−1} = τ².

    Args:
        lr: η, the server learning rate (> 0).
        beta1: β1, in [0, 1).
        beta2: β2, in [0, 1).
        tau: τ, the adaptivity (> 0).
    """

    name: ClassVar[str] = "fedadam"


@dataclass(frozen=True)
class FedYogi(_Adaptive):
    """Yogi on the server (Reddi et al. 2021, Algorithm 2): as :class:`FedAdam` but
    v_t = v_{t−1} − (1 − β2) Δ_t² sign(v_{t−1} − Δ_t²).

    Args:
        lr: η, the server learning rate (> 0).
        beta1: β1, in [0, 1).
        beta2: β2, in [0, 1).
        tau: τ, the adaptivity (> 0).
    """

    name: ClassVar[str] = "fedyogi"


def _arguments(instance: object) -> dict[str, Any]:
    """A dataclass's arguments by name."""
    return {f.name: getattr(instance, f.name) for f in fields(instance)}  # type: ignore[arg-type]
