"""DiLoCo through the coordinator, for workers that cannot reach each other: a replica with no
group and no DDP, its place among the replicas given with its plan.

It trains its slices between synchronisations, all-reducing nothing; at each the coordinator
reads the replicas' weights, averages them and takes the outer step
(:mod:`coordinator.strategies.data_parallel.diloco`), and the replica drops its inner
optimizers' state there when the outer step says ``reset``. With ``compression`` the weights do
not travel: the replica keeps the weights of its last synchronisation
(:class:`engine.data_parallel.outer_step.SyncPoint`), sends its pseudo-gradients from them
compressed, and adds the coordinator's compressed outer update onto them.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from typing import Any

import torch

from engine.data_parallel.chain import Chain
from engine.data_parallel.modes.mode import ReplicaMode, ReplicaParts, whole_snapshot
from engine.data_parallel.outer_step import SyncPoint
from engine.data_parallel.plan import ReplicaPlan
from engine.nodes import Node, trainable
from protocol.daemon import DiLoCoAloneSpec, SnapshotWay
from protocol.options.compression import Compression

__all__ = ["DiLoCoAloneMode"]


class DiLoCoAloneMode(ReplicaMode):
    """A replica of ``plan`` with no group, the coordinator taking the outer step (module
    docstring)."""

    plan: ReplicaPlan
    wrapped: _Unwrapped

    def __init__(
        self, spec: DiLoCoAloneSpec, plan: ReplicaPlan, run: list[Node], parts: ReplicaParts
    ) -> None:
        self.spec, self.plan, self.parts = spec, plan, parts
        self.wrapped = _Unwrapped(Chain(run, parts.nodes.device))
        self.sync_point: SyncPoint | None = None  # (the coordinator reads the weights themselves)
        if plan.compression is not None:  # the pseudo-gradients travel compressed
            self.sync_point = SyncPoint({node.node_id: trainable(node) for node in run})

    def backward_scope(self, last: bool) -> contextlib.AbstractContextManager[None]:
        """Nothing to reduce: there is no group."""
        return contextlib.nullcontext()

    def after_step(
        self, step: int, inner: list[torch.optim.Optimizer], said: dict[str, Any]
    ) -> None:
        """At a synchronisation (the coordinator's outer step): the ``inner`` optimizers'
        state dropped when the outer step says ``reset``."""
        if self.plan.syncs[step] and self.spec.outer.inner_state == "reset":
            for optimizer in inner:
                optimizer.state = defaultdict(dict)

    def snapshot(
        self, prefix: list[Node], run: list[Node], done: int, way: SnapshotWay
    ) -> dict[str, Any]:
        return whole_snapshot(self.parts, self.plan, run, way)

    def pseudo_gradients(self, compression: Compression) -> dict[str, Any]:
        """At a synchronisation: the pseudo-gradients as ``compression`` has them travel
        (:class:`~engine.data_parallel.outer_step.SyncPoint`).

        Raises:
            EngineError: ``BAD_REQUEST`` without compression in the plan.
        """
        if self.sync_point is None:
            return super().pseudo_gradients(compression)
        return self.sync_point.pseudo_gradients(compression)

    def outer_update(self, update: dict[str, Any]) -> None:
        """The coordinator's outer ``update`` (compressed) taken.

        Raises:
            EngineError: ``BAD_REQUEST`` without compression in the plan or for an update that
                cannot be decoded; ``GRADIENT_MISMATCH`` for one of another model.
        """
        if self.sync_point is None:
            return super().outer_update(update)
        return self.sync_point.update(update)


class _Unwrapped:
    """The chain as a replica that all-reduces nothing: DDP's face, no DDP."""

    def __init__(self, chain: Chain) -> None:
        self.module = chain

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()
