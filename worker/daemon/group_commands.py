"""The filter daemon's commands for a daemon in a torch.distributed group: a data-parallel
replica (``dist_*``) or a pipeline stage (``pipe_*``) that runs its own training loop, the
coordinator keeping time. :class:`worker.daemon.main.Daemon` holds one :class:`GroupCommands`
over its engine and takes its :attr:`~GroupCommands.handlers` into its own table."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from engine.data_parallel.plan import ReplicaPlan
from engine.engine import Engine
from protocol.asyncio.memory import map_tensor_blocks
from protocol.daemon import (
    DistEvaluateRequest,
    DistJoinRequest,
    DistLeaveRequest,
    DistLoadShardsRequest,
    DistOuterStateRequest,
    DistOuterUpdateRequest,
    DistPiecesRequest,
    DistPlanRequest,
    DistProbeRequest,
    DistPseudoGradientsRequest,
    DistShardFileRequest,
    DistStoreRequest,
    DistTrainRequest,
    PipePlanRequest,
    PipeTrainRequest,
    ShardedSpec,
)
from protocol.files.shard_pieces import PIECES_FILE
from protocol.rules.batching import global_batches

__all__ = ["GroupCommands"]


class GroupCommands:
    """``dist_store``, ``dist_probe``, ``dist_join``, ``dist_plan``, ``dist_train``,
    ``dist_evaluate``, ``dist_pieces``, ``dist_shard_file``, ``dist_load_shards``,
    ``dist_pseudo_gradients``, ``dist_outer_update``, ``dist_outer_state``, ``pipe_plan``,
    ``pipe_train`` and ``dist_leave``, each onto one method of ``engine``'s group membership,
    replica or linked stage."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.handlers: dict[str, Callable[[Any], Any]] = {
            "dist_store": self.on_dist_store,
            "dist_probe": self.on_dist_probe,
            "dist_join": self.on_dist_join,
            "dist_plan": self.on_dist_plan,
            "dist_train": self.on_dist_train,
            "dist_evaluate": self.on_dist_evaluate,
            "dist_pieces": self.on_dist_pieces,
            "dist_shard_file": self.on_dist_shard_file,
            "dist_load_shards": self.on_dist_load_shards,
            "dist_pseudo_gradients": self.on_dist_pseudo_gradients,
            "dist_outer_update": self.on_dist_outer_update,
            "dist_outer_state": self.on_dist_outer_state,
            "pipe_plan": self.on_pipe_plan,
            "pipe_train": self.on_pipe_train,
            "dist_leave": self.on_dist_leave,
        }
        """The group commands by name, for the daemon's handler table."""

    def on_dist_store(self, req: DistStoreRequest) -> dict[str, Any]:
        return {"port": self.engine.group.open_store(req.secret, req.address, req.timeout)}

    def on_dist_probe(self, req: DistProbeRequest) -> dict[str, Any]:
        return self.engine.group.probe(req.host, req.port, req.timeout)

    def on_dist_join(self, req: DistJoinRequest) -> dict[str, Any]:
        return self.engine.group.join(
            req.host,
            req.port,
            req.secret,
            req.prefix,
            backend=req.backend,
            rank=req.rank,
            world=req.world,
            timeout=req.timeout,
        )

    def on_dist_plan(self, req: DistPlanRequest) -> dict[str, Any] | None:
        given = req.mode.given_place()  # its place among the replicas, not in the group
        rank, world = (given.rank, given.world) if given else self.engine.group.place()
        plan = ReplicaPlan.of(req, rank=rank, world=world)
        if isinstance(req.mode, ShardedSpec):
            # Under glibc's malloc its gathered units and their gradients would fragment the heap;
            # under tcmalloc (worker.daemon.allocator) glibc's thresholds govern nothing.
            map_tensor_blocks()
        return self.engine.replica.set_plan(plan)

    def on_dist_train(self, req: DistTrainRequest) -> dict[str, Any]:
        return self.engine.replica.train(req.start, req.stop, snapshot=req.snapshot)

    def on_dist_evaluate(self, req: DistEvaluateRequest) -> dict[str, Any]:
        return self.engine.replica.evaluate(req.node_ids, *self.engine.rows.of(req, lazy=True))

    def on_dist_pieces(self, req: DistPiecesRequest) -> dict[str, Any]:
        return {"files": {PIECES_FILE: self.engine.replica.pieces()}}  # kept as its frame

    def on_dist_shard_file(self, req: DistShardFileRequest) -> None:
        self.engine.replica.shard_file(req.name, req.data, req.offset)

    def on_dist_load_shards(self, req: DistLoadShardsRequest) -> None:
        self.engine.replica.load_shards(req.rest)

    def on_dist_pseudo_gradients(self, req: DistPseudoGradientsRequest) -> dict[str, Any]:
        return self.engine.replica.pseudo_gradients(req.compression)

    def on_dist_outer_update(self, req: DistOuterUpdateRequest) -> None:
        self.engine.replica.outer_update(req.update)

    def on_dist_outer_state(self, req: DistOuterStateRequest) -> dict[str, Any] | None:
        if req.momentum is None:
            return {"momentum": self.engine.replica.outer_momentum()}
        self.engine.replica.set_outer_momentum(req.momentum)
        return None

    def on_pipe_plan(self, req: PipePlanRequest) -> None:
        plan = global_batches(
            req.rows, req.micro_batches, req.epochs, req.batch_size, req.shuffle, req.seed
        )
        batches = [micro for _, _, micro in plan]
        self.engine.linked_stage.set_plan(
            req.node_ids, req.actions, batches, req.data, req.labels, req.clip_grad_norm
        )

    def on_pipe_train(self, req: PipeTrainRequest) -> dict[str, Any]:
        return self.engine.linked_stage.train(req.start, req.stop, snapshot=req.snapshot)

    def on_dist_leave(self, req: DistLeaveRequest) -> None:
        self.engine.group.leave()
