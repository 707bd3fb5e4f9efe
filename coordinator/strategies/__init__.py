"""Strategies: how a job's training is spread over workers.

A strategy is a small class named after what it implements, with:

* ``from_options(options)`` — validate what the client sent (:class:`StrategyOptionsError` names
  the bad option), refusing rather than guessing;
* ``placement()`` — how many workers it needs and which ones qualify;
* ``async run(ctx, job, emit)`` — the training loop against a
  :class:`~coordinator.context.StrategyContext`, with phase comments, returning the trained
  states by node id (read back over the wire, never recalled).

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
from coordinator.strategies.data_parallel import DataParallel
from coordinator.strategies.fedavg import FedAvg, FedProx
from coordinator.strategies.local import Local
from coordinator.strategies.model_parallel import ModelParallel

STRATEGIES: dict[str, type[Strategy]] = {
    cls.name: cls for cls in (Local, DataParallel, FedAvg, FedProx, ModelParallel)
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
    "Strategy",
    "StrategyFailed",
    "StrategyOptionsError",
    "strategy_from_spec",
]
