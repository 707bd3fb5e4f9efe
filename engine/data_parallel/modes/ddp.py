"""DataParallel on the torch group: the replica's run wrapped in ``DistributedDataParallel``.

DDP checks the replicas' parameters agree and broadcasts replica 0's when it wraps the run,
then all-reduces the gradients in buckets during each step's backward — its last accumulated
slice's, ``no_sync`` before it — and broadcasts replica 0's buffers before each forward; after
the run's last step they are broadcast once more (:func:`broadcast_buffers`), since the last
forward left each replica its own. With ``compression`` the gradients travel through one of
torch's communication hooks (:mod:`engine.data_parallel.compression`); with
``sync_batchnorm`` BatchNorm layers normalise with the global batch's statistics.

DiLoCo over the group (:mod:`engine.data_parallel.modes.diloco_group`) wraps its run the same
way (:func:`in_ddp`), and all-reduces nothing in its backward.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from engine.data_parallel.chain import Chain, synced_batchnorm
from engine.data_parallel.compression import bucketing, compress
from engine.data_parallel.modes.mode import ReplicaMode, ReplicaParts, whole_snapshot
from engine.data_parallel.plan import ReplicaPlan
from engine.group_member import GroupMember, looks_collective
from engine.nodes import Node
from protocol.daemon import DdpSpec, SnapshotWay
from protocol.options.compression import Compression

__all__ = ["DdpMode", "broadcast_buffers", "in_ddp"]


class DdpMode(ReplicaMode):
    """A replica of ``plan`` whose steps all-reduce their gradients (module docstring)."""

    plan: ReplicaPlan
    wrapped: DistributedDataParallel

    def __init__(
        self, spec: DdpSpec, plan: ReplicaPlan, run: list[Node], parts: ReplicaParts
    ) -> None:
        parts.group.place()
        self.plan, self.parts = plan, parts
        self.wrapped = in_ddp(
            Chain(run, parts.nodes.device),
            plan,
            parts.group,
            sync_batchnorm=spec.sync_batchnorm,
            hook=plan.compression,
        )

    def after_last_step(self, done: int) -> None:
        broadcast_buffers(self.wrapped, self.parts.group, done)

    def snapshot(
        self, prefix: list[Node], run: list[Node], done: int, way: SnapshotWay
    ) -> dict[str, Any]:
        return whole_snapshot(self.parts, self.plan, run, way)


def in_ddp(
    chain: Chain,
    plan: ReplicaPlan,
    group: GroupMember,
    *,
    sync_batchnorm: bool,
    hook: Compression | None,
    init_sync: bool = True,
) -> DistributedDataParallel:
    """``chain`` wrapped in DDP over the group (its BatchNorm layers synchronised with
    ``sync_batchnorm``; the communication hook of the compression ``hook``; without
    ``init_sync`` replica 0's parameters are not broadcast: a regrouped DiLoCo replica's local
    weights are its own).

    Raises:
        EngineError: ``COLLECTIVE_FAILED`` when the group broke.
    """
    device = chain.device
    try:
        if sync_batchnorm:
            synced_batchnorm(chain)
        ids = [device.index] if device.type == "cuda" else None
        buckets = bucketing(plan.compression)
        ddp = DistributedDataParallel(chain, device_ids=ids, init_sync=init_sync, **buckets)
        if hook is not None:
            compress(ddp, hook, plan.seed)
    except RuntimeError as exc:
        if looks_collective(exc):
            raise group.broken("wrapping the model in DDP", exc) from exc
        raise
    return ddp


def broadcast_buffers(ddp: DistributedDataParallel, group: GroupMember, steps_done: int) -> None:
    """Replica 0's buffers to every replica once more after the last step: DDP broadcasts
    them before each forward, so the last one left each replica its own.

    Raises:
        EngineError: ``COLLECTIVE_FAILED`` when the group broke, with ``steps_done``.
    """
    try:
        for buffer in ddp.module.buffers():
            dist.broadcast(buffer, 0)
    except RuntimeError as exc:
        if looks_collective(exc):
            raise group.broken("broadcasting the buffers", exc, steps_done) from exc
        raise
