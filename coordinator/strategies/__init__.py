"""Strategies: how a job's training is spread over workers.

A strategy is a class named after what it implements, built from its options model whole
(:mod:`protocol.options`, the one definition the SDK and the wire share): with

* ``from_options(options)`` — the client's JSON options, parsed into that model
  (:class:`StrategyOptionsError` names the bad option), then ``cls(model)``;
* ``placement()`` — how many workers it needs and which ones qualify;
* ``async run(ctx, job, emit)`` — the training against a
  :class:`~coordinator.context.StrategyContext`, its paper's phases named in comments, reading
  and advancing one position dataclass, and returning the trained states by node id (read back
  over the wire, never recalled).

The package, by module: ``base`` (inputs, placement, the strategy interface), ``rounds`` (the
round loop a federated strategy fills with hooks), ``steps`` (what several strategies do: the
plain-prefix check, global batches, setting a worker up), ``aggregate`` (weighted means),
``history`` (a run's rows per epoch, its validation data), ``process_group`` (torch.distributed
groups), ``local``; and a package per family: ``data_parallel/`` (synchronous SGD and DiLoCo:
the torch collective, the star through the coordinator, elastic replicas, checkpoints),
``federated/``
(FedAvg, FedProx, q-FedAvg and their plug-ins: cohort, folds, robust rules, server optimizers,
privacy, secure aggregation, evaluation), ``model_parallel/`` (pipelines: schedules as data and
their execution).

:data:`STRATEGIES` maps the wire name (``StrategySpec.name``) to the class.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from coordinator.strategies.base import (
    Emit,
    JobInputs,
    Placement,
    ShardedStates,
    Strategy,
    StrategyFailed,
    StrategyOptionsError,
)
from coordinator.strategies.data_parallel.data_parallel import DataParallel
from coordinator.strategies.data_parallel.diloco import DiLoCo
from coordinator.strategies.federated.fedavg import FedAvg
from coordinator.strategies.federated.fedprox import FedProx
from coordinator.strategies.federated.qfedavg import QFedAvg
from coordinator.strategies.local import Local
from coordinator.strategies.model_parallel.model_parallel import ModelParallel

STRATEGIES: dict[str, type[Strategy]] = {
    cls.name: cls for cls in (Local, DataParallel, DiLoCo, FedAvg, FedProx, QFedAvg, ModelParallel)
}


def strategy_from_spec(name: str, options: Mapping[str, Any]) -> Strategy:
    """The strategy a client asked for, validated.

    Raises:
        StrategyOptionsError: no strategy of that name, or an option it cannot take.
    """
    try:
        cls = STRATEGIES[name]
    except KeyError:
        raise StrategyOptionsError(
            f"unknown strategy {name!r}; this coordinator runs {sorted(STRATEGIES)}"
        ) from None
    return cls.from_options(options)


__all__ = [
    "STRATEGIES",
    "DataParallel",
    "DiLoCo",
    "Emit",
    "FedAvg",
    "FedProx",
    "JobInputs",
    "Local",
    "ModelParallel",
    "Placement",
    "QFedAvg",
    "ShardedStates",
    "Strategy",
    "StrategyFailed",
    "StrategyOptionsError",
    "strategy_from_spec",
]
