"""A data-parallel replica that trains by itself, its gradients all-reduced by torch.distributed.

The torch collective of ``DataParallel``
(:mod:`coordinator.strategies.data_parallel.torch_collective`): the coordinator is only the
rendezvous and the clock. The replicas join one process group (:mod:`engine.group_member`),
take the plan they all walk (:meth:`Replica.set_plan`) and then train the steps they are told
(:meth:`Replica.train`, the loop a replica runs): per global step its own slice of the batch
``graph.fit`` takes (:func:`protocol.rules.batching.global_batches`), forward, loss, backward —
during which ``DistributedDataParallel`` all-reduces the gradients in buckets — and one step of
its persistent optimizer.

Uneven slices stay exact: DDP averages over the ``world`` replicas, so each replica scales its
slice's mean loss by ``rows · world / batch`` first, and the average is the gradient of the
global batch's mean loss. A replica with no rows in a step still takes part (every all-reduce
needs every rank): it runs one held row through the model with its loss times zero.

A plan with an ``outer`` step is DiLoCo's (:mod:`engine.data_parallel.outer_step`): the same loop
with no all-reduce in the backward (DDP's ``no_sync``), each replica stepping on its own slice's
gradient, and after the steps that end a round the replicas' pseudo-gradients averaged and one
outer step taken on the global weights.

A plan with ``sharding`` shards the run with FSDP2 instead of wrapping it in DDP
(:mod:`engine.data_parallel.sharding`): the same loop, each replica holding a shard of every
parameter, gradient and optimizer moment. A checkpoint saves every replica's shards with
torch.distributed.checkpoint, as files the chunk's reply carries, and a resumed run loads them
back, each replica the rows it holds (:meth:`Replica.load_shards`); the coordinator reads each
replica's shards of the model where they lie for the result (:meth:`Replica.pieces`), and
every replica evaluates its part of the validation rows through its shards
(:meth:`Replica.evaluate`): no replica ever holds the whole model.

A plan ``alone`` is a replica of DiLoCo through the coordinator, for workers that cannot reach
each other: no group, no DDP, its rank and the world given with the plan; it trains its slices
between synchronisations and the coordinator averages the replicas' weights and takes the outer
step (:mod:`coordinator.strategies.data_parallel.diloco`).

A broken group raises ``COLLECTIVE_FAILED`` carrying the steps this replica has completed.
DiLoCo's group that breaks in a synchronisation leaves the replica as it stood before it — its
local weights, global weights, outer momentum and int8 residuals — owing that synchronisation
(``sync_pending`` in the error, with the losses of the chunk's steps so far): an elastic run
forms the group again with the replicas left (a plan that ``regroup``s keeps all of it, and
DDP broadcasts nothing) and the replica makes the synchronisation first when next told to
train on.
"""

from __future__ import annotations

import contextlib
import itertools
import tempfile
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.nn.parallel import DistributedDataParallel

from engine.batches import call_module, num_rows, on_disk, part_of
from engine.data.read_ahead import read_ahead
from engine.data_parallel.compression import bucketing, compress
from engine.data_parallel.outer_step import OuterStep, SyncPoint
from engine.data_parallel.sharding import Sharded, ShardedRun, unit_classes
from engine.errors import EngineError
from engine.evaluation import Evaluation
from engine.group_member import GroupMember, looks_collective
from engine.held_rows import HeldRows
from engine.nodes import Node, Nodes, run_training, trainable
from engine.optimizers import Optimizers
from engine.step_functions import step_of
from engine.stepping import backward
from engine.transfer import autocast
from protocol.codec import encode_frame
from protocol.daemon import (
    DdpSpec,
    DiLoCoAloneSpec,
    DiLoCoGroupSpec,
    DistPlanRequest,
    OuterStepSpec,
    ReplicaModeSpec,
    ShardedSpec,
    SnapshotWay,
)
from protocol.errors import ErrorCode
from protocol.files.shard_files import SNAPSHOT_FILE, is_plain_file_name
from protocol.options.compression import Compression
from protocol.rules.batching import global_batches, replica_batches, replica_seed
from protocol.rules.fragments import fragment_syncs
from protocol.rules.row_means import RowMeans

__all__ = ["Replica", "ReplicaPlan"]

ONE_ROW = np.zeros(1, dtype=np.int64)
"""The held row a replica runs through, loss times zero, on a step it has no rows of."""


@dataclass(frozen=True, kw_only=True)
class ReplicaPlan:
    """What a replica walks: per global step the positions of its slice in the rows staged
    under ``data``, and the global batch's size; and per step the fewest rows a replica has
    (``least``: every replica runs as many forwards a step, each of which broadcasts buffers,
    so a step is cut in at most that many ``accumulate`` slices); how it trains (``mode``)."""

    data: str
    node_ids: list[str]
    steps: list[tuple[np.ndarray[Any, Any], int]]
    least: list[int] = field(default_factory=list)
    seed: int = 0  # with the rank and the step, torch's generator's (dropout masks)
    rank: int = 0  # this replica's place, and the replicas there are
    world: int = 1
    mode: ReplicaModeSpec
    # the gradients (DiLoCo's: pseudo-gradients) as they travel
    compression: Compression | None = None
    # per step, with DiLoCo's outer step: the fragments that synchronise after it (``(0,)``: the
    # model)
    syncs: list[tuple[int, ...]] = field(default_factory=list)

    @classmethod
    def of(cls, request: DistPlanRequest, *, rank: int, world: int) -> ReplicaPlan:
        """The plan ``request`` says, for the replica at ``rank`` of ``world``.

        Raises:
            EngineError: ``BAD_REQUEST`` for a slice with rows that were not staged here.
        """
        r = request
        batches = (r.epochs, r.batch_size, r.shuffle, r.seed)
        if r.sizes is not None:  # each replica on its own dataset
            own = list(itertools.islice(replica_batches(r.sizes, *batches), r.max_steps))
            steps = [(s[r.position], sum(len(p) for p in s)) for _, _, s in own]
            least = [min(len(p) for p in s) for _, _, s in own]
        else:
            in_order = global_batches(r.rows, world, *batches)
            steps, least = _slices(r.held, rank, itertools.islice(in_order, r.max_steps))
        return cls(
            data=r.data,
            node_ids=list(r.node_ids),
            steps=steps,
            least=least,
            seed=r.seed,
            rank=rank,
            world=world,
            mode=r.mode,
            compression=r.compression,
            syncs=_rounds(len(steps), r.mode.outer_step()),
        )

    @property
    def outer(self) -> OuterStepSpec | None:
        return self.mode.outer_step()

    @property
    def alone(self) -> bool:
        return isinstance(self.mode, DiLoCoAloneSpec)

    @property
    def regroup(self) -> bool:
        return isinstance(self.mode, DiLoCoGroupSpec) and self.mode.regroup is not None

    @property
    def sync_batchnorm(self) -> bool:
        return isinstance(self.mode, DdpSpec | DiLoCoGroupSpec) and self.mode.sync_batchnorm

    @property
    def sharding(self) -> str:
        return self.mode.sharding if isinstance(self.mode, ShardedSpec) else "none"

    @property
    def shard_units(self) -> tuple[str, ...] | None:
        units = self.mode.shard_units if isinstance(self.mode, ShardedSpec) else None
        return None if units is None else tuple(units)


def _slices(
    held: Sequence[int], rank: int, batches: Iterable[tuple[int, int, list[np.ndarray[Any, Any]]]]
) -> tuple[list[tuple[np.ndarray[Any, Any], int]], list[int]]:
    """Replica ``rank``'s slice of every global batch of ``batches``, as positions among the
    rows ``held`` here, with the batch's size; the fewest rows a replica has per step.

    Raises:
        EngineError: ``BAD_REQUEST`` for a slice with rows that were not staged here.
    """
    staged = np.asarray(held, dtype=np.int64)
    steps, least = [], []
    for _, _, slices in batches:
        least.append(min(len(s) for s in slices))
        mine = slices[rank]
        local = np.searchsorted(staged, mine)
        if len(mine) and (local.max() >= len(staged) or not np.array_equal(staged[local], mine)):
            raise EngineError(
                ErrorCode.BAD_REQUEST,
                f"replica {rank}'s slice of a step has rows that were not staged here",
            )
        steps.append((local, sum(len(s) for s in slices)))
    return steps, least


def _ids(nodes: Sequence[Node]) -> list[str]:
    return [node.node_id for node in nodes]


def _reset_inner(plan: ReplicaPlan, inner: list[torch.optim.Optimizer]) -> None:
    """At a synchronisation of a replica ``alone``: drop the inner optimizers' state when the
    plan says ``reset`` (the coordinator takes the outer step)."""
    if plan.outer is not None and plan.outer.inner_state == "reset":
        for optimizer in inner:
            optimizer.state = defaultdict(dict)


def _rounds(steps: int, outer: OuterStepSpec | None) -> list[tuple[int, ...]]:
    """Per step of a run of ``steps``, the fragments DiLoCo synchronises after it; nothing
    without ``outer``."""
    if outer is None:
        return []
    return fragment_syncs(steps, outer.sync_every, outer.fragments, outer.also)


class _Chain(torch.nn.Module):
    """The differentiable run as one module for DDP: each filter under its own autocast, its
    module called on a batch as its ``inputs`` says. A filter with a ``step`` function (alone
    in its run) is called with what the function passes."""

    def __init__(self, run: list[Node], device: torch.device) -> None:
        super().__init__()
        self.filters = [node.filter for node in run]
        self.parts = torch.nn.ModuleList([f.module for f in self.filters])
        self.device = device
        self.stepped = step_of(self.filters[-1]) is not None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.stepped:
            with autocast(self.filters[0], self.device):
                return self.parts[0](*args, **kwargs)
        (x,) = args
        for f, module in zip(self.filters, self.parts, strict=True):
            with autocast(f, self.device):
                x = call_module(f, x, module)
        return x


def _synced_batchnorm(chain: _Chain) -> None:
    """Every BatchNorm layer of ``chain`` as a ``torch.nn.SyncBatchNorm`` over the group (the
    same parameters and buffers, now normalising with the global batch's statistics); each
    filter keeps the module it trains."""
    for k, module in enumerate(chain.parts):
        synced = torch.nn.SyncBatchNorm.convert_sync_batchnorm(module)  # type: ignore[no-untyped-call]
        chain.parts[k] = synced
        chain.filters[k].module = synced


class _Alone:
    """The chain as a replica that all-reduces nothing (a plan ``alone``): DDP's face, no DDP."""

    def __init__(self, chain: _Chain) -> None:
        self.module = chain

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()


Wrapped = DistributedDataParallel | _Alone | Sharded
"""The differentiable run as a replica trains it."""


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
        self._plan: ReplicaPlan | None = None
        self._ddp: Wrapped | None = None
        self._outer: OuterStep | None = None
        self._kept: OuterStep | None = None  # the outer step of a group left, for a regroup
        self._pending: int | None = None  # the step whose synchronisation the group broke in
        self._sync_point: SyncPoint | None = None  # a plan alone: its last synchronisation
        self._sharded: ShardedRun | None = None  # a plan with sharding: the run's shards
        self._incoming: tempfile.TemporaryDirectory[str] | None = None  # shard_file's files
        group.on_leave(self._forget)  # the plan and its DDP wrapper were for that group

    def set_plan(self, plan: ReplicaPlan) -> dict[str, int] | None:
        """Take the plan every replica walks and wrap the differentiable run in DDP (which
        checks the replicas' parameters agree, and broadcasts replica 0's); or, sharded, shard
        it and say what this replica holds (:meth:`ShardedRun.held`).

        Raises:
            EngineError: ``BAD_REQUEST`` before a join, or for a plan whose nodes are not plain
                filters then one differentiable run; ``COLLECTIVE_FAILED`` when the group broke.
        """
        _, run = self._prefix_and_run(plan.node_ids)
        self._unshardable(run)
        self.rows.held(plan.data, lazy=True)  # staged (not read: a dataset on disk stays there)
        self._ddp = None
        if plan.alone:
            self._drop_kept()
            self._ddp, self._plan, self._outer = _Alone(_Chain(run, self.nodes.device)), plan, None
            self._sync_point = None  # (the coordinator reads the weights themselves)
            if plan.compression is not None:  # the pseudo-gradients travel compressed
                self._sync_point = SyncPoint({node.node_id: trainable(node) for node in run})
            return None
        self.group.place()
        device = self.nodes.device
        try:
            chain = _Chain(run, device)
            if plan.sharding != "none":
                return self._shard(chain, run, plan)
            if plan.sync_batchnorm:
                _synced_batchnorm(chain)
            ids = [device.index] if device.type == "cuda" else None
            buckets = bucketing(plan.compression)
            # (regrouped, the replicas' local weights differ between synchronisations)
            init = not plan.regroup
            self._ddp = DistributedDataParallel(chain, device_ids=ids, init_sync=init, **buckets)
            if plan.compression is not None and plan.outer is None:  # (DiLoCo's: at a sync)
                compress(self._ddp, plan.compression, plan.seed)
        except RuntimeError as exc:
            if looks_collective(exc):
                raise self.group.broken("wrapping the model in DDP", exc) from exc
            raise
        self._plan = plan
        self._drop_outer()
        if plan.outer is not None:  # the global weights: replica 0's, as DDP broadcast them
            trained = [p for p in self._ddp.module.parameters() if p.requires_grad]
            self._outer = self._kept_for(plan, trained) or OuterStep(
                trained, plan.outer, plan.compression, len(plan.steps)
            )
        self._drop_kept()
        if not plan.regroup:
            self._pending = None
        return None

    def _kept_for(self, plan: ReplicaPlan, trained: list[torch.nn.Parameter]) -> OuterStep | None:
        """The outer step of the group this replica left, when ``plan`` regroups over the same
        parameters with the same outer step (then taken: no longer kept)."""
        kept = self._kept
        if not plan.regroup or kept is None or kept.spec != plan.outer:
            return None
        if len(kept.params) != len(trained) or any(
            a is not b for a, b in zip(kept.params, trained, strict=True)
        ):
            return None
        self._kept = None
        return kept

    def _shard(self, chain: _Chain, run: list[Node], plan: ReplicaPlan) -> dict[str, int]:
        """The run sharded by FSDP2 over the group (:mod:`engine.data_parallel.sharding`), its
        optimizers made over the shards: what :meth:`train` steps; what this replica holds of it."""
        units = None if plan.shard_units is None else unit_classes(plan.shard_units)
        self._sharded = ShardedRun(chain, run, self.optimizers, plan.sharding == "full", units)
        self._ddp, self._plan, self._outer = self._sharded.wrapped, plan, None
        return self._sharded.held()

    def _unshardable(self, run: list[Node]) -> None:
        """Before a new plan over ``run``: nodes still sharded over a group that is gone cannot
        train (their filters loaded again can).

        Raises:
            EngineError: ``BAD_REQUEST``: ``run``'s nodes are the ones sharded before.
        """
        if self._sharded is not None and {id(n) for n in run} & {id(n) for n in self._sharded.run}:
            raise EngineError(
                ErrorCode.BAD_REQUEST,
                "this replica's model is sharded over a group that is gone: its filters must "
                "be loaded again",
            )
        self._sharded = None

    def outer_momentum(self) -> dict[str, dict[str, torch.Tensor]]:
        """DiLoCo's outer momentum on this replica (torch SGD's buffers of the global
        weights), node → name → tensor; empty where there is none yet.

        Raises:
            EngineError: ``BAD_REQUEST`` for a replica whose plan has no outer step.
        """
        outer, names = self._outer_and_names()
        held: dict[str, dict[str, torch.Tensor]] = {}
        for (node, name), momentum in zip(names, outer.momenta(), strict=True):
            if momentum is not None:
                held.setdefault(node, {})[name] = momentum.detach().clone()
        return held

    def set_outer_momentum(self, momentum: dict[str, dict[str, Any]]) -> None:
        """Set DiLoCo's outer momentum (as :meth:`outer_momentum` gives it; a parameter left
        out has none).

        Raises:
            EngineError: ``BAD_REQUEST`` for a replica whose plan has no outer step;
                ``STATE_MISMATCH`` for momentum of parameters it does not have, or in another
                shape.
        """
        outer, names = self._outer_and_names()
        given = {(n, k) for n, named in momentum.items() for k in named}
        unknown = given - set(names)
        if unknown:
            raise EngineError(
                ErrorCode.STATE_MISMATCH, f"outer momentum of unknown parameters {sorted(unknown)}"
            )
        momenta: list[torch.Tensor | None] = []
        for (node, name), p in zip(names, outer.params, strict=True):
            value = momentum.get(node, {}).get(name)
            tensor = None if value is None else torch.as_tensor(value)
            if tensor is not None and tuple(tensor.shape) != tuple(p.shape):
                raise EngineError(
                    ErrorCode.STATE_MISMATCH,
                    f"outer momentum of {node}.{name} has shape {tuple(tensor.shape)}, the "
                    f"parameter {tuple(p.shape)}",
                )
            momenta.append(tensor)
        outer.load_momenta(momenta)

    def global_weights(self) -> contextlib.AbstractContextManager[None]:
        """A DiLoCo replica's weights set to the global model while the block runs (what a
        read of the model sees: a Streaming DiLoCo replica does not synchronise there;
        :meth:`OuterStep.global_weights`); nothing for another replica."""
        return contextlib.nullcontext() if self._outer is None else self._outer.global_weights()

    def _outer_and_names(self) -> tuple[OuterStep, list[tuple[str, str]]]:
        """The outer step, and each of its parameters' node and name, in its order."""
        plan = self._plan
        if self._outer is None or plan is None:
            raise EngineError(
                ErrorCode.BAD_REQUEST, "the outer state is a DiLoCo replica's, in a torch group"
            )
        _, run = self._prefix_and_run(plan.node_ids)
        named = {id(p): (node.node_id, k) for node in run for k, p in trainable(node).items()}
        return self._outer, [named[id(p)] for p in self._outer.params]

    def train(self, start: int, stop: int, snapshot: SnapshotWay | None = None) -> dict[str, Any]:
        """Global steps ``[start, stop)`` of the plan (module docstring); this replica's loss,
        rows, learning rate and (from a step function) metrics per step. With ``snapshot``,
        also what a checkpoint saves of it now (:meth:`_snapshot`), in the reply or as a file
        for its worker to keep (:class:`~protocol.daemon.DistTrainRequest`'s).

        Raises:
            EngineError: ``BAD_REQUEST`` before a plan or for steps outside it;
                ``COLLECTIVE_FAILED`` when the group breaks, with ``steps_done``.
        """
        plan, ddp = self._planned(stop)
        prefix, run = self._prefix_and_run(plan.node_ids)
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
        if self._pending is not None:  # its group broke in that synchronisation: made now
            self._owed(start, optimizers, said)
        from_disk = on_disk(self.rows.held(plan.data, lazy=True)[0])
        steps = range(start, stop)
        for step, (x, y) in zip(steps, read_ahead(read, steps, 1 if from_disk else 0), strict=True):
            xt, yt = self._inputs(prefix, run, x, y)
            for opt in optimizers:
                opt.zero_grad(set_to_none=True)
            try:
                loss, lr, figures = self._step(ddp, run, plan, step, xt, yt, accumulate, scaler)
            except RuntimeError as exc:
                if looks_collective(exc):
                    raise self.group.broken(f"step {step + 1}", exc, steps_done=step) from exc
                raise
            losses.append(loss)
            rows.append(len(plan.steps[step][0]))
            lrs.append(lr)
            metrics.append(figures)
            if self._outer is not None:  # (exchanges in flight may land after any step)
                self._synchronise(self._outer, optimizers, step, plan.syncs[step], said)
            elif plan.alone and plan.syncs and plan.syncs[step]:  # the coordinator's outer step
                _reset_inner(plan, optimizers)
        if stop == len(plan.steps) and isinstance(ddp, DistributedDataParallel):
            self._broadcast_buffers(ddp, steps_done=stop)
        if from_disk and stop < len(plan.steps):  # the next chunk's first rows, read meanwhile
            self.rows.read_next(plan.data, plan.steps[stop][0])
        if snapshot is not None:
            said["snapshot"] = self._snapshot(plan, prefix, run, stop, snapshot)
        return said | ({"metrics": metrics} if any(metrics) else {})

    def _snapshot(
        self,
        plan: ReplicaPlan,
        prefix: list[Node],
        run: list[Node],
        done: int,
        snapshot: SnapshotWay = "in_reply",
    ) -> dict[str, Any]:
        """What a checkpoint saves of this replica as its chunk ends, sent in the chunk's own
        reply: its states and its run's optimizer states (and a DiLoCo replica's outer
        momentum); sharded, its shards saved with torch.distributed.checkpoint
        (:meth:`ShardedRun.save_shards`: every replica at once) as the files it wrote
        (``shards``: name → bytes; replica 0's include the ``.metadata``), what every replica
        holds alike (``rest``) and its plain filters' states (``plain``). Kept, one file of it
        for the worker to keep (``{"shards": {SNAPSHOT_FILE: frame}}``): all of it
        (``"kept_whole"``) or its optimizer states alone (``"kept_inner"``). ``done``: the steps
        taken."""
        if self._sharded is not None:
            with tempfile.TemporaryDirectory(prefix="somatize-shards-") as folder:
                try:
                    rest = self._sharded.save_shards(folder)
                except (RuntimeError, CheckpointException) as exc:
                    if isinstance(exc, RuntimeError) and not looks_collective(exc):
                        raise
                    where = "saving the checkpoint's shards"
                    raise self.group.broken(where, exc, steps_done=done) from exc
                files = {p.name: p.read_bytes() for p in sorted(Path(folder).iterdir())}
            return {"shards": files, "rest": rest, "plain": self.nodes.get_state(_ids(prefix))}
        taken = {"optimizers": self.optimizers.get_optimizer_state(_ids(run))}
        if snapshot != "kept_inner":
            taken["states"] = self.nodes.get_state(plan.node_ids, live=True)
            if self._outer is not None:
                taken["outer"] = self.outer_momentum()
        if snapshot == "in_reply":
            return taken
        return {"shards": {SNAPSHOT_FILE: encode_frame(taken)}}

    def shard_file(self, name: str, data: bytes, offset: int = 0) -> None:
        """Keep a piece of one file of a sharded checkpoint (:meth:`_snapshot`'s), ``data``
        at ``offset``, until :meth:`load_shards` reads it: the coordinator sends them one at
        a time, this replica's own shards and the ``.metadata``, each in pieces in order (the
        first, at ``0``, starts the file afresh; each next one goes on where the last ended).

        Raises:
            EngineError: ``BAD_REQUEST`` for a name that is not a plain file name, or a piece
                that does not go on where the file ends.
        """
        if not is_plain_file_name(name):
            raise EngineError(ErrorCode.BAD_REQUEST, f"{name!r} is not a checkpoint file's name")
        if self._incoming is None:
            self._incoming = tempfile.TemporaryDirectory(prefix="somatize-shards-")
        path = Path(self._incoming.name) / name
        held = path.stat().st_size if offset and path.exists() else 0
        if offset != held:
            raise EngineError(
                ErrorCode.BAD_REQUEST,
                f"a piece of checkpoint file {name} at {offset}, where {held} bytes of it are here",
            )
        with path.open("ab" if offset else "wb") as file:
            file.write(data)

    def load_shards(self, rest: dict[str, Any]) -> None:
        """Load the sharded checkpoint whose files :meth:`shard_file` kept into this replica's
        shards (a collective: every replica at once; :meth:`ShardedRun.load_shards`), then
        drop the files. ``rest``: what every replica holds alike, as it was saved.

        Raises:
            EngineError: ``BAD_REQUEST`` for a replica not sharded or without the files;
                ``STATE_MISMATCH`` for a checkpoint of other tensors; ``COLLECTIVE_FAILED``.
        """
        incoming, self._incoming = self._incoming, None
        if self._sharded is None or incoming is None:
            if incoming is not None:
                incoming.cleanup()
            raise EngineError(
                ErrorCode.BAD_REQUEST,
                "dist_load_shards loads a sharded replica from the files dist_shard_file gave it",
            )
        with incoming:
            try:
                self._sharded.load_shards(incoming.name, rest)
            except (RuntimeError, CheckpointException) as exc:
                if isinstance(exc, RuntimeError) and not looks_collective(exc):
                    raise
                raise self.group.broken("loading the checkpoint's shards", exc) from exc

    def evaluate(self, node_ids: Sequence[str], x: Any, y: Any) -> dict[str, Any]:
        """A sharded replica's model evaluated on its part of the validation rows (``x``,
        ``y``) through its shards, every replica of the group at once and forwarding as many
        batches (:mod:`engine.evaluation`); with no rows of its own it forwards one training
        row for the others' sake. Its figures, ``rows``: 0 with none.

        Raises:
            EngineError: ``BAD_REQUEST`` for a replica whose plan is not sharded;
                ``COLLECTIVE_FAILED`` when the group breaks.
        """
        sharded, plan = self._sharded, self._plan
        if sharded is None or plan is None:
            raise EngineError(
                ErrorCode.BAD_REQUEST,
                "dist_evaluate evaluates a sharded replica, and this one is not",
            )
        counted = num_rows(x) > 0
        if not counted:
            x, y = self.rows.held(plan.data, ONE_ROW)
        sharded.wrapped.module.eval()
        try:
            scores = Evaluation(self.nodes).evaluate(
                node_ids, x, y, sharded.wrapped, self._most_batches
            )
        except RuntimeError as exc:
            if looks_collective(exc):
                raise self.group.broken("evaluating the sharded model", exc) from exc
            raise
        return scores if counted else scores | {"rows": 0}

    def _most_batches(self, batches: int) -> int:
        """The most batches any replica of the group evaluates (a collective)."""
        most = torch.tensor([batches], dtype=torch.int64, device=self.nodes.device)
        dist.all_reduce(most, op=dist.ReduceOp.MAX)
        return int(most.item())

    def pieces(self) -> dict[str, Any]:
        """A sharded replica's shards of its model, where they lie, and which they are
        (:meth:`ShardedRun.pieces`): no collective, no optimizer state.

        Raises:
            EngineError: ``BAD_REQUEST`` for a replica whose plan is not sharded.
        """
        if self._sharded is None:
            raise EngineError(
                ErrorCode.BAD_REQUEST, "dist_pieces reads a sharded replica, and this one is not"
            )
        return self._sharded.pieces()

    def pseudo_gradients(self, compression: Compression) -> dict[str, Any]:
        """A replica ``alone`` at a synchronisation: its pseudo-gradients as ``compression``
        has them travel (:class:`~engine.data_parallel.outer_step.SyncPoint`).

        Raises:
            EngineError: ``BAD_REQUEST`` without a plan ``alone``.
        """
        return self._alone().pseudo_gradients(compression)

    def outer_update(self, update: dict[str, Any]) -> None:
        """A replica ``alone`` takes the coordinator's outer ``update`` (compressed).

        Raises:
            EngineError: ``BAD_REQUEST`` without a plan ``alone`` or for an update that cannot
                be decoded; ``GRADIENT_MISMATCH`` for one of another model.
        """
        self._alone().update(update)

    def _alone(self) -> SyncPoint:
        if self._sync_point is None or self._plan is None or not self._plan.alone:
            raise EngineError(
                ErrorCode.BAD_REQUEST,
                "pseudo-gradients and outer updates are for a replica planned alone, with "
                "compression",
            )
        return self._sync_point

    def _synchronise(
        self,
        outer: OuterStep,
        inner: list[torch.optim.Optimizer],
        step: int,
        fragments: tuple[int, ...],
        said: dict[str, Any],
    ) -> None:
        """DiLoCo's synchronisation of ``fragments`` after global step ``step``, and the
        exchanges that land there (:mod:`engine.data_parallel.outer_step`). When the group breaks in
        it, the replica owes it (module docstring): the error says so, with the chunk's results so
        far (``said``)."""
        try:
            outer.after(step, fragments, inner)
        except RuntimeError as exc:
            if looks_collective(exc):
                self._pending = step
                self.group.break_off()  # (no communication hook on a DiLoCo replica)
                where = f"synchronising after step {step + 1}"
                owed = {"sync_pending": step + 1, "results": said}
                raise self.group.broken(where, exc, step + 1, owed) from exc
            raise

    def _owed(self, start: int, inner: list[torch.optim.Optimizer], said: dict[str, Any]) -> None:
        """The synchronisation this replica owes, made before training on from ``start``.

        Raises:
            EngineError: ``BAD_REQUEST`` when ``start`` is not where it was owed.
        """
        plan, outer, owed = self._plan, self._outer, self._pending
        assert plan is not None and owed is not None
        if outer is None or start != owed + 1:
            raise EngineError(
                ErrorCode.BAD_REQUEST,
                f"this replica owes the synchronisation after step {owed + 1}, and was told to "
                f"train from step {start + 1}",
            )
        self._synchronise(outer, inner, owed, plan.syncs[owed], said)
        self._pending = None

    def _planned(self, stop: int) -> tuple[ReplicaPlan, Wrapped]:
        """The plan and the DDP wrapper, when the plan goes as far as ``stop``."""
        plan, ddp = self._plan, self._ddp
        if plan is None or ddp is None:
            raise EngineError(ErrorCode.BAD_REQUEST, "dist_train before dist_plan")
        if stop > len(plan.steps):
            raise EngineError(
                ErrorCode.BAD_REQUEST, f"the plan has {len(plan.steps)} steps, not {stop}"
            )
        return plan, ddp

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
        ddp: Wrapped,
        run: list[Node],
        plan: ReplicaPlan,
        step: int,
        xt: Any,
        yt: Any,
        accumulate: int,
        scaler: torch.amp.GradScaler | None,
    ) -> tuple[float, float, dict[str, float]]:
        """Global step ``step``: forward and backward of this replica's rows of it (their
        gradients all-reduced), then one optimizer step; the replica's mean loss, the
        learning rate the step took and the replica's mean of each metric."""
        local, batch = plan.steps[step]
        ddp.module.train()
        torch.manual_seed(replica_seed(plan.seed, plan.rank, step + 1))
        cut = min(accumulate, plan.least[step]) if plan.least[step] else 1
        inner = plan.outer is not None  # DiLoCo's inner step: no all-reduce
        loss, metrics = self._accumulated(
            ddp, run, xt, yt, (len(local), batch, plan.world), cut, scaler, inner
        )
        ends = self.optimizers.ends_epoch(step + 1)
        return loss, self.optimizers.step_run(run, scaler, epoch_end=ends), metrics

    def _accumulated(
        self,
        ddp: Wrapped,
        run: list[Node],
        xt: Any,
        yt: Any,
        rows_of: tuple[int, int, int],
        parts: int,
        scaler: torch.amp.GradScaler | None,
        inner: bool = False,
    ) -> tuple[float, dict[str, float]]:
        """Forward and backward of this replica's ``mine`` rows of a ``batch``-row global
        step over ``world`` replicas (``rows_of``), in ``parts`` slices (``accumulate``; every
        replica as many, none empty) of which only the last all-reduces (DDP's ``no_sync``
        before it; before all of them for DiLoCo's ``inner`` step): the gradients left are the
        global batch's mean loss's. The replica's mean loss (0 with no rows) and its mean of
        each metric a step function returned."""
        mine, batch, world = rows_of
        if not mine:  # one row read to join the all-reduce, its loss counted for nothing
            with ddp.no_sync() if inner else contextlib.nullcontext():
                loss = self.nodes.batch_loss(run, xt, yt, ddp).loss
                backward(loss * 0.0, scaler)
            return 0.0, {}
        slices = np.array_split(np.arange(mine), parts)
        total, metrics = 0.0, RowMeans()
        for j, part in enumerate(slices):
            index = torch.from_numpy(part).to(self.nodes.device)
            last = j == len(slices) - 1 and not inner
            syncing = contextlib.nullcontext() if last else ddp.no_sync()
            with syncing:
                computed = self.nodes.batch_loss(run, part_of(xt, index), part_of(yt, index), ddp)
                backward(computed.loss * (len(part) * world / batch), scaler)
            total += float(computed.loss.detach()) * len(part)
            metrics.add(computed.metrics, len(part))
        return total / mine, metrics.means()

    def _broadcast_buffers(self, ddp: DistributedDataParallel, steps_done: int) -> None:
        """Replica 0's buffers to every replica once more after the last step: DDP broadcasts
        them before each forward, so the last one left each replica its own."""
        try:
            for buffer in ddp.module.buffers():
                dist.broadcast(buffer, 0)
        except RuntimeError as exc:
            if looks_collective(exc):
                raise self.group.broken("broadcasting the buffers", exc, steps_done) from exc
            raise

    def _forget(self) -> None:
        if self._incoming is not None:  # a checkpoint's files never loaded
            self._incoming.cleanup()
            self._incoming = None
        self._ddp = None
        self._plan = None
        if self._outer is not None:  # kept: a regroup carries it over
            self._drop_kept()
            self._kept, self._outer = self._outer, None
        self._sync_point = None

    def _drop_outer(self) -> None:
        """The outer step of the plan before goes (its exchange thread with it)."""
        if self._outer is not None:
            self._outer.close()
        self._outer = None

    def _drop_kept(self) -> None:
        """The outer step kept from a group left goes."""
        if self._kept is not None:
            self._kept.close()
        self._kept = None

    def _prefix_and_run(self, node_ids: Sequence[str]) -> tuple[list[Node], list[Node]]:
        """The plain filters before the differentiable run, and the run.

        Raises:
            EngineError: ``BAD_REQUEST`` for nodes that are not plain filters then one run.
        """
        nodes = self.nodes.select(node_ids)
        run = [n for n in nodes if n.differentiable]
        first = nodes.index(run[0]) if run else len(nodes)
        if not run or any(not n.differentiable for n in nodes[first:]):
            raise EngineError(
                ErrorCode.BAD_REQUEST,
                f"a torch collective trains plain filters then one run of TorchFilters; "
                f"got {list(node_ids)}",
            )
        return nodes[:first], run
