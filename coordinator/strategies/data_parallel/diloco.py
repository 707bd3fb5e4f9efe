"""DiLoCo (Douillard et al. 2023): DataParallel's replicas, placement, data and torch group, each
replica stepping alone between synchronisations and an outer step at each.

The coordinator's part is DataParallel's on the torch collective (it is the rendezvous and the
clock, and never touches a weight): the replicas are told the outer step with their plan
(:class:`~protocol.daemon.OuterStepSpec`) and run it themselves (:mod:`engine.outer_step`).
The synchronisations fall after every ``sync_every`` steps of an epoch and at its end, so the
epoch's validation, its history row and the result see the global model, which every replica
holds alike.
"""

from __future__ import annotations

from typing import Any

from coordinator.strategies.data_parallel.data_parallel import DataParallel
from protocol.daemon import OuterStepSpec
from protocol.options.strategies import DiLoCoOptions
from protocol.rules.traffic import sync_bytes

__all__ = ["DiLoCo"]


class DiLoCo(DataParallel):
    """``workers`` replicas that synchronise every ``sync_every`` steps (module docstring)."""

    options_model = DiLoCoOptions
    options: DiLoCoOptions
    saves_checkpoints = False

    def _outer_step(self) -> OuterStepSpec:
        return self.options.outer_step()

    def _traffic(self, shapes: list[list[list[int]]]) -> dict[str, Any]:
        """A synchronisation's pseudo-gradients, every ``sync_every`` steps."""
        flat = [shape for node in shapes for shape in node]
        if not flat:
            return {}
        return {"sync_bytes": sync_bytes(flat), "sync_every": self.options.sync_every}
