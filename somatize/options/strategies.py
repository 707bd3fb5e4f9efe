"""How a job is spread over workers: the strategies' configuration objects.

A strategy here is only configuration: each class is its options model
(:mod:`protocol.options.strategies`, :mod:`protocol.options.federated`: the one definition of its
options, their defaults, their checks and their documentation), built from Python arguments — a
bad one is a :class:`ValueError` naming it — and sent to the coordinator as a
:class:`~protocol.messages.StrategySpec` (:meth:`Strategy.spec`: a name and JSON options). The
strategies themselves run on the coordinator (:mod:`coordinator.strategies`), which parses the
options into the same models::

    client.submit(graph, x, y, strategy=sz.Local(tag="gpu"))

Every strategy takes ``device``: run only on workers training on it (``"cpu"``, ``"cuda"`` for
any CUDA device, ``"cuda:N"``, ``"mps"``; default ``None``: any worker). A job asking for a
device no worker has is refused when it is submitted, naming the devices there are::

    client.submit(graph, x, y, strategy=sz.DataParallel(2, device="cuda"))
"""

from __future__ import annotations

from typing import Any

from protocol.messages import StrategySpec
from protocol.options import federated, strategies
from protocol.options.base import StrategyOptions
from protocol.options.client_config import client_configs
from somatize.options.components import SdkOptions
from somatize.options.server_optimizers import (
    FedAdagrad,
    FedAdam,
    FedAvgM,
    FedYogi,
    ServerOptimizer,
)

__all__ = [
    "DataParallel",
    "DiLoCo",
    "FedAdagrad",
    "FedAdam",
    "FedAvg",
    "FedAvgM",
    "FedProx",
    "FedYogi",
    "Local",
    "ModelParallel",
    "Partition",
    "QFedAvg",
    "ServerOptimizer",
    "Strategy",
    "WorkerData",
]


class Strategy(SdkOptions, StrategyOptions):
    """Base of the strategies: a name the coordinator knows (``name``) and the options it takes
    (:meth:`options`)."""

    def spec(self) -> StrategySpec:
        """This strategy as it travels in a :class:`~protocol.messages.Submit`."""
        return StrategySpec(name=self.name, options=self.options())


class Local(Strategy, strategies.LocalOptions):
    __init__ = SdkOptions.__init__


class DataParallel(Strategy, strategies.DataParallelOptions):
    __init__ = SdkOptions.__init__


class DiLoCo(Strategy, strategies.DiLoCoOptions):
    __init__ = SdkOptions.__init__
    positional = (  # (its own options came in after workers; elastic after collective)
        "workers",
        "sync_every",
        "outer_lr",
        "outer_momentum",
        "nesterov",
        "inner_state",
        "tag",
        "device",
        "collective",
        "collective_timeout",
        "elastic",
        "elastic_timeout",
    )


class WorkerData(SdkOptions, strategies.WorkerDataOptions):
    __init__ = SdkOptions.__init__


# -- federated ----------------------------------------------------------------------------------


def _per_round(values: dict[str, Any]) -> dict[str, Any]:
    """``client_config``, a function of the round, as the model takes it: the list of what it
    returns for rounds 1 to ``rounds`` (the coordinator never runs a client's code)."""
    make, rounds = values.get("client_config"), values.get("rounds")
    if make is None or not isinstance(rounds, int) or isinstance(rounds, bool) or rounds < 1:
        return values  # (a bad rounds is refused by the model first)
    return values | {"client_config": client_configs(make, rounds)}


class FedAvg(Strategy, federated.FedAvgOptions):
    __init__ = SdkOptions.__init__

    @classmethod
    def _from_python(cls, values: dict[str, Any]) -> dict[str, Any]:
        return _per_round(values)


class FedProx(Strategy, federated.FedProxOptions):
    __init__ = SdkOptions.__init__

    @classmethod
    def _from_python(cls, values: dict[str, Any]) -> dict[str, Any]:
        return _per_round(values)


class QFedAvg(FedAvg, federated.QFedAvgOptions):
    __init__ = SdkOptions.__init__


# -- pipelines ----------------------------------------------------------------------------------


class Partition(SdkOptions, strategies.PartitionOptions):
    __init__ = SdkOptions.__init__

    def option(self) -> dict[str, Any]:
        """This stage as ModelParallel sends it."""
        return self.to_wire()


class ModelParallel(Strategy, strategies.ModelParallelOptions):
    __init__ = SdkOptions.__init__
