"""The filter execution engine: fit, forward and train a chain of filters in one process.

This is the code that runs user filters, wherever they run: ``graph.fit`` in the user's process
builds an :class:`Engine` over copies of the graph's filters, and the filter daemon
(:mod:`worker.daemon.main`) holds one :class:`Engine` per job and maps each command onto one
method of one of its parts. There is no second copy of the training loop anywhere.

An engine is one set of loaded nodes (:mod:`engine.nodes`) and the parts that work on them,
each a class of its own that is handed the collaborators it uses:

* :attr:`Engine.nodes` — the loaded filters, their states, forward passes on the device;
* :attr:`Engine.optimizers` — their persistent optimizers, schedulers and one step of a run
  (:mod:`engine.optimizers`);
* :attr:`Engine.rows` — rows held under a name for later commands (:mod:`engine.held_rows`);
* :attr:`Engine.evaluation` — validation loss and metrics (:mod:`engine.evaluation`);
* :attr:`Engine.fitting` — fit, forward, and ``batched_fit``, which trains a chain with the one
  training loop (:mod:`engine.fitting`, :mod:`engine.training`);
* :attr:`Engine.gradients` — reading and applying gradients (:mod:`engine.gradients`);
* :attr:`Engine.star_replica` — a data-parallel replica's step when the coordinator averages
  the gradients (:mod:`engine.data_parallel.star_replica`);
* :attr:`Engine.stage` — the nodes as one stage of a pipeline, driven by calls
  (:mod:`engine.pipeline.stage`);
* :attr:`Engine.group` — membership of a torch.distributed group (:mod:`engine.group_member`),
  which two parts train over: :attr:`Engine.replica`, one replica of a data-parallel group
  (:mod:`engine.data_parallel.replica`), and :attr:`Engine.linked_stage`, a pipeline stage running
  its own schedule (:mod:`engine.pipeline.linked_stage`).

An engine trains on one device (``Engine(device="cuda:0")``; default the CPU): modules move there
when loaded and stay, batches move there once each, and everything the engine hands out is on the
CPU (:mod:`engine.transfer`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from engine.batches import num_rows
from engine.data_parallel.replica import Replica
from engine.data_parallel.star_replica import StarReplica
from engine.evaluation import Evaluation
from engine.fitting import FitResult, FitSettings, Fitting
from engine.gradients import Gradients
from engine.group_member import GroupMember
from engine.held_rows import HeldRows
from engine.nodes import DifferentiableFilter, Nodes, is_differentiable
from engine.optimizers import Optimizers
from engine.pipeline.linked_stage import LinkedStage
from engine.pipeline.stage import PipelineStage
from engine.transfer import engine_device

__all__ = [
    "DifferentiableFilter",
    "Engine",
    "FitResult",
    "FitSettings",
    "is_differentiable",
    "num_rows",
]


class Engine:
    """Filters by node id (in graph order), and the parts that fit, train, step and serve them.

    Args:
        device: where the modules train (``"cpu"``, ``"cuda:N"``, ``"mps"``...).

    Raises:
        EngineError: ``BAD_REQUEST`` for a device torch cannot read.
    """

    def __init__(self, device: str | torch.device = "cpu") -> None:
        self.device = engine_device(device)
        self.nodes = Nodes(self.device)
        self.optimizers = Optimizers(self.nodes)
        self.rows = HeldRows()
        self.evaluation = Evaluation(self.nodes)
        self.fitting = Fitting(self.nodes, self.optimizers, self.evaluation)
        self.gradients = Gradients(self.nodes, self.optimizers)
        self.stage = PipelineStage(self.nodes, self.optimizers)
        self.group = GroupMember(self.device)
        self.replica = Replica(self.nodes, self.optimizers, self.rows, self.group)
        self.star_replica = StarReplica(
            self.nodes, self.optimizers, self.rows, self.fitting, self.gradients
        )
        self.linked_stage = LinkedStage(
            self.nodes, self.optimizers, self.rows, self.stage, self.group
        )

    def load(self, filters: Mapping[str, Any]) -> None:
        """Replace whatever was loaded by ``filters`` (node id -> filter, in graph order): their
        modules move to the device, and what was kept of the filters replaced — states,
        optimizers, the pipeline stage's micro-batches in flight — goes with them."""
        self.nodes.load(filters)
        self.stage.forget_in_flight()
