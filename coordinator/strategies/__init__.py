"""Strategies: how a job's training is spread over workers.

A strategy is a small class named after what it implements, with:

* ``from_options(options)`` — the client's options, checked by the models both sides share
  (:mod:`protocol.options.strategies`; :class:`StrategyOptionsError` names the bad option);
* ``placement()`` — how many workers it needs and which ones qualify;
* ``async run(ctx, job, emit)`` — the training loop against a
  :class:`~coordinator.context.StrategyContext`, its paper's phases named in comments, reading
  and advancing one position dataclass, and returning the trained states by node id (read back
  over the wire, never recalled).

The package, by module: ``base`` (inputs, placement, the strategy interface), ``steps`` (what
several strategies do: the plain-prefix check, global batches, setting a worker up),
``aggregate`` (weighted means), ``local``, ``data_parallel`` with ``elastic`` (replacing a
lost replica), ``fedavg``, ``fedprox`` and ``qfedavg`` with ``federated`` (the run's
position and workers), ``round_fold`` (a round's aggregate), ``robust`` (Byzantine-robust
rules), ``flat`` (a state as one vector), ``fed_eval`` (evaluating the global model, federated
or not) and ``server_opt`` (server optimizers), ``model_parallel`` with ``schedule`` (pipeline
schedules as data) and ``pipeline`` (running one over the context); ``history`` (a run's rows
per epoch, its validation data).

:data:`STRATEGIES` maps the wire name (``StrategySpec.name``) to the class.
"""

from __future__ import annotations

from coordinator.strategies.base import (
    Emit,
    JobInputs,
    Placement,
    Strategy,
    StrategyFailed,
    StrategyOptionsError,
    strategy_from_spec,
)
from coordinator.strategies.data_parallel.data_parallel import DataParallel
from coordinator.strategies.federated.fedavg import FedAvg
from coordinator.strategies.federated.fedprox import FedProx
from coordinator.strategies.federated.qfedavg import QFedAvg
from coordinator.strategies.local import Local
from coordinator.strategies.model_parallel.model_parallel import ModelParallel

STRATEGIES: dict[str, type[Strategy]] = {
    cls.name: cls for cls in (Local, DataParallel, FedAvg, FedProx, QFedAvg, ModelParallel)
}

__all__ = [
    "STRATEGIES",
    "DataParallel",
    "Emit",
    "FedAvg",
    "FedProx",
    "JobInputs",
    "Local",
    "ModelParallel",
    "Placement",
    "QFedAvg",
    "Strategy",
    "StrategyFailed",
    "StrategyOptionsError",
    "strategy_from_spec",
]
