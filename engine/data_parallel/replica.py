"""A data-parallel replica that trains by itself, its gradients all-reduced by torch.distributed.

The torch collective of ``DataParallel``
(:mod:`coordinator.strategies.data_parallel.torch_collective`): the coordinator is only the
rendezvous and the clock. The replicas join one process group (:mod:`engine.group_member`),
take the plan they all walk (:meth:`Replica.set_plan`: :mod:`engine.data_parallel.plan`) and
then train the steps they are told (:meth:`Replica.train`, the loop a replica runs): per global
step its own slice of the batch ``graph.fit`` takes
(:func:`protocol.rules.batching.global_batches`), forward, loss, backward — during which
``DistributedDataParallel`` all-reduces the gradients in buckets — and one step of its
persistent optimizer.

Uneven slices stay exact: DDP averages over the ``world`` replicas, so each replica scales its
slice's mean loss by ``rows · world / batch`` first, and the average is the gradient of the
global batch's mean loss. A replica with no rows in a step still takes part (every all-reduce
needs every rank): it runs one held row through the model with its loss times zero.

The plan's mode, chosen once, says what happens around the steps
(:mod:`engine.data_parallel.modes`): DDP's all-reduce; DiLoCo's inner steps and outer step over
the group; DiLoCo through the coordinator, with no group; FSDP2's shards. The loop calls the
mode's one face (:class:`~engine.data_parallel.modes.mode.ReplicaMode`) and never asks which it
is. A broken group raises ``COLLECTIVE_FAILED`` carrying the steps this replica has completed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from engine.batches import on_disk, part_of
from engine.data.read_ahead import read_ahead
from engine.data_parallel.chain import prefix_and_run
from engine.data_parallel.incoming_shards import ShardFiles
from engine.data_parallel.modes.choose import mode_for
from engine.data_parallel.modes.mode import ONE_ROW, ReplicaMode, ReplicaParts, Unplanned, Wrapped
from engine.data_parallel.plan import ReplicaPlan
from engine.errors import EngineError
from engine.group_member import GroupMember, looks_collective
from engine.held_rows import HeldRows
from engine.nodes import Node, Nodes, run_training
from engine.optimizers import Optimizers
from engine.stepping import backward
from protocol.daemon import SnapshotWay
from protocol.errors import ErrorCode
from protocol.options.compression import Compression
from protocol.rules.batching import replica_seed
from protocol.rules.row_means import RowMeans

__all__ = ["Replica"]


class Replica:
    """``nodes`` as one replica of a torch.distributed data-parallel group: the plan it walks
    and the loop it runs (:meth:`train`), its rows from ``rows``, its steps taken with
    ``optimizers``, over ``group``."""

    def __init__(
        self, nodes: Nodes, optimizers: Optimizers, rows: HeldRows, group: GroupMember
    ) -> None:
        self.nodes = nodes
        self.optimizers = optimizers
        self.rows = rows
        self.group = group
        self._parts = ReplicaParts(nodes, optimizers, rows, group)
        self._mode: ReplicaMode = Unplanned()
        self._incoming = ShardFiles()  # a sharded checkpoint's files, until loaded
        group.on_leave(self._forget)  # the plan and its wrapper were for that group

    def set_plan(self, plan: ReplicaPlan) -> dict[str, int] | None:
        """Take the plan every replica walks, in its mode (which, over a group, wraps the
        differentiable run: DDP checks the replicas' parameters agree and broadcasts replica
        0's; sharded, FSDP2 shards it); what the mode says of it (a sharded replica's share).

        Raises:
            EngineError: ``BAD_REQUEST`` before a join, or for a plan whose nodes are not plain
                filters then one differentiable run; ``COLLECTIVE_FAILED`` when the group broke.
        """
        _, run = prefix_and_run(self.nodes, plan.node_ids)
        self._mode = carried = self._mode.before_plan(run)
        self.rows.held(plan.data, lazy=True)  # staged (not read: a dataset on disk stays there)
        try:
            mode = mode_for(plan, run, self._parts, carried)
        except BaseException:
            self._mode = carried.left_group()  # (no wrapper to train with)
            raise
        carried.close()
        self._mode = mode
        return mode.held()

    def train(self, start: int, stop: int, snapshot: SnapshotWay | None = None) -> dict[str, Any]:
        """Global steps ``[start, stop)`` of the plan (module docstring); this replica's loss,
        rows, learning rate and (from a step function) metrics per step. With ``snapshot``,
        also what a checkpoint saves of it now (:meth:`ReplicaMode.snapshot`), in the reply or
        as a file for its worker to keep (:class:`~protocol.daemon.DistTrainRequest`'s).

        Raises:
            EngineError: ``BAD_REQUEST`` before a plan or for steps outside it;
                ``COLLECTIVE_FAILED`` when the group breaks, with ``steps_done``.
        """
        mode, plan, wrapped = self._planned(stop)
        prefix, run = prefix_and_run(self.nodes, plan.node_ids)
        optimizers = [self.optimizers.optimizer(node) for node in run]
        scaler = self.optimizers.scaler(run[-1])
        accumulate = run_training(run).accumulate
        losses: list[float] = []
        rows: list[int] = []
        lrs: list[float] = []
        metrics: list[dict[str, float]] = []

        def read(step: int) -> tuple[Any, Any]:  # on a step without rows of its own: one row
            local = plan.steps[step][0]
            return self.rows.held(plan.data, local if len(local) else ONE_ROW)

        said: dict[str, Any] = {"losses": losses, "rows": rows, "lrs": lrs}
        mode.before_steps(start, optimizers, said)  # (DiLoCo's: a synchronisation owed)
        from_disk = on_disk(self.rows.held(plan.data, lazy=True)[0])
        steps = range(start, stop)
        for step, (x, y) in zip(steps, read_ahead(read, steps, 1 if from_disk else 0), strict=True):
            batch = self._inputs(prefix, run, x, y)
            for opt in optimizers:
                opt.zero_grad(set_to_none=True)
            try:
                loss, lr, figures = self._step(
                    (mode, wrapped), run, step, batch, accumulate=accumulate, scaler=scaler
                )
            except RuntimeError as exc:
                if looks_collective(exc):
                    raise self.group.broken(f"step {step + 1}", exc, steps_done=step) from exc
                raise
            losses.append(loss)
            rows.append(len(plan.steps[step][0]))
            lrs.append(lr)
            metrics.append(figures)
            mode.after_step(step, optimizers, said)  # (DiLoCo's: a synchronisation)
        if stop == len(plan.steps):
            mode.after_last_step(stop)
        if from_disk and stop < len(plan.steps):  # the next chunk's first rows, read meanwhile
            self.rows.read_next(plan.data, plan.steps[stop][0])
        if snapshot is not None:
            said["snapshot"] = mode.snapshot(prefix, run, stop, snapshot)
        return said | ({"metrics": metrics} if any(metrics) else {})

    def _planned(self, stop: int) -> tuple[ReplicaMode, ReplicaPlan, Wrapped]:
        """The mode, its plan and the run as it trains, when the plan goes as far as ``stop``."""
        mode = self._mode
        plan, wrapped = mode.plan, mode.wrapped
        if plan is None or wrapped is None:
            raise EngineError(ErrorCode.BAD_REQUEST, "dist_train before dist_plan")
        if stop > len(plan.steps):
            raise EngineError(
                ErrorCode.BAD_REQUEST, f"the plan has {len(plan.steps)} steps, not {stop}"
            )
        return mode, plan, wrapped

    def _inputs(
        self, prefix: list[Node], run: list[Node], x: Any, y: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A step's rows through the plain filters before the run (the states they hold), as
        the run's inputs and targets on the device."""
        for node in prefix:
            x = self.nodes.apply(node, x, self.nodes.state_of(node))
        xt = self.nodes.on_device(run[0].filter.prepare_input(x))
        yt = self.nodes.on_device(run[-1].filter.prepare_target(y))
        return xt, yt

    def _step(
        self,
        trains: tuple[ReplicaMode, Wrapped],
        run: list[Node],
        step: int,
        batch: tuple[Any, Any],
        *,
        accumulate: int,
        scaler: torch.amp.GradScaler | None,
    ) -> tuple[float, float, dict[str, float]]:
        """Global step ``step``: forward and backward of this replica's rows of it (``batch``:
        its inputs and targets) in the mode it ``trains`` in, then one optimizer step; the
        replica's mean loss, the learning rate the step took and the replica's mean of each
        metric."""
        mode, wrapped = trains
        plan = mode.plan
        assert plan is not None
        local, size = plan.steps[step]
        wrapped.module.train()
        torch.manual_seed(replica_seed(plan.seed, plan.rank, step + 1))
        cut = min(accumulate, plan.least[step]) if plan.least[step] else 1
        loss, metrics = self._accumulated(
            trains, run, batch, (len(local), size, plan.world), parts=cut, scaler=scaler
        )
        ends = self.optimizers.ends_epoch(step + 1)
        return loss, self.optimizers.step_run(run, scaler, epoch_end=ends), metrics

    def _accumulated(
        self,
        trains: tuple[ReplicaMode, Wrapped],
        run: list[Node],
        batch: tuple[Any, Any],
        rows_of: tuple[int, int, int],
        *,
        parts: int,
        scaler: torch.amp.GradScaler | None,
    ) -> tuple[float, dict[str, float]]:
        """Forward and backward of this replica's ``mine`` rows of a ``size``-row global step
        over ``world`` replicas (``rows_of``), in ``parts`` slices (``accumulate``; every
        replica as many, none empty), each in the scope its mode gives it (the gradients
        reduced on the last one, or on none: :meth:`ReplicaMode.backward_scope`): the gradients
        left are the global batch's mean loss's. The replica's mean loss (0 with no rows) and
        its mean of each metric a step function returned."""
        mode, wrapped = trains
        (xt, yt), (mine, size, world) = batch, rows_of
        if not mine:  # one row read to join the all-reduce, its loss counted for nothing
            with mode.backward_scope(last=True):
                loss = self.nodes.batch_loss(run, xt, yt, wrapped).loss
                backward(loss * 0.0, scaler)
            return 0.0, {}
        slices = np.array_split(np.arange(mine), parts)
        total, metrics = 0.0, RowMeans()
        for j, part in enumerate(slices):
            index = torch.from_numpy(part).to(self.nodes.device)
            with mode.backward_scope(last=j == len(slices) - 1):
                computed = self.nodes.batch_loss(
                    run, part_of(xt, index), part_of(yt, index), wrapped
                )
                backward(computed.loss * (len(part) * world / size), scaler)
            total += float(computed.loss.detach()) * len(part)
            metrics.add(computed.metrics, len(part))
        return total / mine, metrics.means()

    # -- the requests that are one mode's (the mode answers, or refuses) -------------------------

    def evaluate(self, node_ids: Sequence[str], x: Any, y: Any) -> dict[str, Any]:
        """A sharded replica's model evaluated on its part of the validation rows
        (:meth:`~engine.data_parallel.modes.sharded.ShardedMode.evaluate`)."""
        return self._mode.evaluate(node_ids, x, y)

    def pieces(self) -> dict[str, Any]:
        """A sharded replica's shards of its model, where they lie
        (:meth:`~engine.data_parallel.modes.sharded.ShardsLeft.pieces`)."""
        return self._mode.pieces()

    def shard_file(self, name: str, data: bytes, offset: int = 0) -> None:
        """Keep a piece of one file of a sharded checkpoint until :meth:`load_shards` reads it
        (:meth:`~engine.data_parallel.incoming_shards.ShardFiles.add`)."""
        self._incoming.add(name, data, offset)

    def load_shards(self, rest: dict[str, Any]) -> None:
        """Load the sharded checkpoint whose files :meth:`shard_file` kept into this replica's
        shards, then drop the files
        (:meth:`~engine.data_parallel.modes.sharded.ShardsLeft.load_shards`)."""
        self._mode.load_shards(self._incoming.take(), rest)

    def pseudo_gradients(self, compression: Compression) -> dict[str, Any]:
        """A replica alone at a synchronisation: its pseudo-gradients as ``compression`` has
        them travel (:mod:`~engine.data_parallel.modes.diloco_alone`)."""
        return self._mode.pseudo_gradients(compression)

    def outer_update(self, update: dict[str, Any]) -> None:
        """A replica alone takes the coordinator's outer ``update`` (compressed)."""
        self._mode.outer_update(update)

    def outer_momentum(self) -> dict[str, dict[str, torch.Tensor]]:
        """DiLoCo's outer momentum on a replica of a torch group
        (:mod:`~engine.data_parallel.modes.diloco_group`)."""
        return self._mode.outer_momentum()

    def set_outer_momentum(self, momentum: dict[str, dict[str, Any]]) -> None:
        """Set DiLoCo's outer momentum on a replica of a torch group."""
        self._mode.set_outer_momentum(momentum)

    def global_weights(self) -> contextlib.AbstractContextManager[None]:
        """A DiLoCo replica's weights set to the global model while the block runs; nothing
        for another replica."""
        return self._mode.global_weights()

    def _forget(self) -> None:
        """The group is left: what the mode keeps of it stays (DiLoCo's outer step, a sharded
        model's shards), and a checkpoint's files never loaded go."""
        self._incoming.drop()
        self._mode = self._mode.left_group()
