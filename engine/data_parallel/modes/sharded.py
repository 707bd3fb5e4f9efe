"""DataParallel with FSDP2 on the torch group: each replica holds a shard of every parameter,
gradient and optimizer moment (:mod:`engine.data_parallel.sharding`), and the step loop is
DDP's, the gradients reduce-scattered on each step's last accumulated slice.

No replica ever holds the whole model: a checkpoint saves every replica's shards with
torch.distributed.checkpoint, as files the chunk's reply carries, and a resumed run loads them
back, each replica the files it is sent
(:class:`~engine.data_parallel.incoming_shards.ShardFiles`, then
:meth:`ShardedMode.load_shards`); the coordinator reads each replica's shards of the model
where they lie for the result (:meth:`ShardedMode.pieces`), and every replica evaluates its
part of the validation rows through its shards (:meth:`ShardedMode.evaluate`). Once its group
is left the replica's nodes stay sharded over it (:class:`ShardsLeft`): their pieces can still
be read, and they train no new plan until their filters are loaded again.
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from engine.batches import num_rows
from engine.data_parallel.chain import Chain
from engine.data_parallel.modes.mode import (
    ONE_ROW,
    ReplicaMode,
    ReplicaParts,
    Unplanned,
    node_ids,
)
from engine.data_parallel.plan import ReplicaPlan
from engine.data_parallel.sharding import Sharded, ShardedRun, unit_classes
from engine.errors import EngineError
from engine.evaluation import Evaluation
from engine.group_member import GroupMember, looks_collective
from engine.nodes import Node
from protocol.daemon import ShardedSpec, SnapshotWay
from protocol.errors import ErrorCode

__all__ = ["ShardedMode", "ShardsLeft"]


class ShardsLeft(ReplicaMode):
    """A replica's nodes sharded over ``group`` (``sharded``): their pieces read where they
    lie, a checkpoint's shards loaded into them, and no new plan over them."""

    def __init__(self, sharded: ShardedRun, group: GroupMember) -> None:
        self.sharded, self.group = sharded, group

    def left_group(self) -> ReplicaMode:
        return self

    def before_plan(self, run: list[Node]) -> ReplicaMode:
        """Nodes still sharded over a group that is gone cannot train (their filters loaded
        again can); other nodes may.

        Raises:
            EngineError: ``BAD_REQUEST``: ``run``'s nodes are the ones sharded before.
        """
        if {id(n) for n in run} & {id(n) for n in self.sharded.run}:
            raise EngineError(
                ErrorCode.BAD_REQUEST,
                "this replica's model is sharded over a group that is gone: its filters must "
                "be loaded again",
            )
        return Unplanned()

    def pieces(self) -> dict[str, Any]:
        """This replica's shards of its model, where they lie, and which they are
        (:meth:`ShardedRun.pieces`): no collective, no optimizer state."""
        return self.sharded.pieces()

    def load_shards(
        self, files: tempfile.TemporaryDirectory[str] | None, rest: dict[str, Any]
    ) -> None:
        """Load the sharded checkpoint whose ``files`` :class:`ShardFiles` kept into this
        replica's shards (a collective: every replica at once; :meth:`ShardedRun.load_shards`),
        then drop the files. ``rest``: what every replica holds alike, as it was saved.

        Raises:
            EngineError: ``BAD_REQUEST`` without the files; ``STATE_MISMATCH`` for a
                checkpoint of other tensors; ``COLLECTIVE_FAILED``.
        """
        if files is None:
            return super().load_shards(files, rest)
        with files:
            try:
                self.sharded.load_shards(files.name, rest)
            except (RuntimeError, CheckpointException) as exc:
                if isinstance(exc, RuntimeError) and not looks_collective(exc):
                    raise
                raise self.group.broken("loading the checkpoint's shards", exc) from exc


class ShardedMode(ReplicaMode):
    """A replica of ``plan`` whose run is sharded by FSDP2 over its group (module docstring):
    its optimizers made over the shards."""

    plan: ReplicaPlan
    wrapped: Sharded

    def __init__(
        self, spec: ShardedSpec, plan: ReplicaPlan, run: list[Node], parts: ReplicaParts
    ) -> None:
        parts.group.place()
        self.plan, self.parts = plan, parts
        units = None if spec.shard_units is None else unit_classes(spec.shard_units)
        full = spec.sharding == "full"
        try:
            sharded = ShardedRun(Chain(run, parts.nodes.device), run, parts.optimizers, full, units)
        except RuntimeError as exc:
            if looks_collective(exc):
                raise parts.group.broken("wrapping the model in DDP", exc) from exc
            raise
        self.sharded, self.shards = sharded, ShardsLeft(sharded, parts.group)
        self.wrapped = sharded.wrapped

    def held(self) -> dict[str, int]:
        """What this replica holds of the model (:meth:`ShardedRun.held`)."""
        return self.sharded.held()

    def before_plan(self, run: list[Node]) -> ReplicaMode:
        return self.shards.before_plan(run)

    def left_group(self) -> ReplicaMode:
        return self.shards

    def pieces(self) -> dict[str, Any]:
        return self.shards.pieces()

    def load_shards(
        self, files: tempfile.TemporaryDirectory[str] | None, rest: dict[str, Any]
    ) -> None:
        self.shards.load_shards(files, rest)

    def snapshot(
        self, prefix: list[Node], run: list[Node], done: int, way: SnapshotWay
    ) -> dict[str, Any]:
        """Its shards saved with torch.distributed.checkpoint (:meth:`ShardedRun.save_shards`:
        every replica at once) as the files it wrote (``shards``: name → bytes; replica 0's
        include the ``.metadata``), what every replica holds alike (``rest``) and its plain
        filters' states (``plain``)."""
        with tempfile.TemporaryDirectory(prefix="somatize-shards-") as folder:
            try:
                rest = self.sharded.save_shards(folder)
            except (RuntimeError, CheckpointException) as exc:
                if isinstance(exc, RuntimeError) and not looks_collective(exc):
                    raise
                where = "saving the checkpoint's shards"
                raise self.parts.group.broken(where, exc, steps_done=done) from exc
            files = {p.name: p.read_bytes() for p in sorted(Path(folder).iterdir())}
        return {
            "shards": files,
            "rest": rest,
            "plain": self.parts.nodes.get_state(node_ids(prefix)),
        }

    def evaluate(self, node_ids: Sequence[str], x: Any, y: Any) -> dict[str, Any]:
        """The model evaluated on this replica's part of the validation rows (``x``, ``y``)
        through its shards, every replica of the group at once and forwarding as many batches
        (:mod:`engine.evaluation`); with no rows of its own it forwards one training row for
        the others' sake. Its figures, ``rows``: 0 with none.

        Raises:
            EngineError: ``COLLECTIVE_FAILED`` when the group breaks.
        """
        counted = num_rows(x) > 0
        if not counted:
            x, y = self.parts.rows.held(self.plan.data, ONE_ROW)
        self.wrapped.module.eval()
        try:
            scores = Evaluation(self.parts.nodes).evaluate(
                node_ids, x, y, self.wrapped, self._most_batches
            )
        except RuntimeError as exc:
            if looks_collective(exc):
                raise self.parts.group.broken("evaluating the sharded model", exc) from exc
            raise
        return scores if counted else scores | {"rows": 0}

    def _most_batches(self, batches: int) -> int:
        """The most batches any replica of the group evaluates (a collective)."""
        most = torch.tensor([batches], dtype=torch.int64, device=self.parts.nodes.device)
        dist.all_reduce(most, op=dist.ReduceOp.MAX)
        return int(most.item())
