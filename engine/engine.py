"""The filter execution engine: fit, forward and train a chain of filters in one process.

This is the code that runs user filters, wherever they run: ``graph.fit`` in the user's process
builds an :class:`Engine` over copies of the graph's filters, and the filter daemon
(:mod:`worker.daemon.main`) holds one :class:`Engine` per job and maps each command onto one method.
There is no second copy of the training loop anywhere.

The engine is one set of loaded nodes (:mod:`engine.nodes`) seen by these parts, each owning
one concern:

* :mod:`engine.training` — rows held under a name, fit, forward and the nodes' states;
* :mod:`engine.gradients` — the persistent optimizers' state, reading and applying gradients;
* :mod:`engine.stage` — the loaded nodes as one stage of a pipeline (ModelParallel),
  and :mod:`engine.linked_stage` — such a stage running its part of the schedule itself,
  talking to its neighbours over a torch.distributed group (ModelParallel's torch transport);
* :mod:`engine.replica` — the loaded nodes as one replica of a torch.distributed
  data-parallel group (DataParallel's torch collective); both groups are
  :mod:`engine.group_member`'s.

An engine trains on one device (``Engine(device="cuda:0")``; default the CPU): modules move there
when loaded and stay, batches move there once each, and everything the engine hands out is on the
CPU (:mod:`engine.transfer`).
"""

from __future__ import annotations

import torch

from engine.gradients import Gradients
from engine.linked_stage import PipelineLink
from engine.nodes import DifferentiableFilter, is_differentiable, num_rows
from engine.replica import Collective
from engine.training import FitResult
from engine.transfer import engine_device

__all__ = ["DifferentiableFilter", "Engine", "FitResult", "is_differentiable", "num_rows"]


class Engine(Collective, PipelineLink, Gradients):
    """Filters by node id (in graph order), their states and their persistent optimizers.

    Args:
        device: where the modules train (``"cpu"``, ``"cuda:N"``, ``"mps"``...).

    Raises:
        EngineError: ``BAD_REQUEST`` for a device torch cannot read.
    """

    def __init__(self, device: str | torch.device = "cpu") -> None:
        super().__init__()
        self.device = engine_device(device)
