"""DataParallel's checkpoints: when its replicas stand together after a step, replica 0's model
and optimizer state, and the step; a run that resumes sets every replica to them.

The replicas are in lockstep, so one replica's state is every replica's: a checkpoint after
step ``s`` is replica 0's states and optimizer states (momentum, Adam moments, step counts) once
step ``s``'s update is applied everywhere. The data order is a function of the seed and the
epoch (:mod:`protocol.rules.batching`), so the step is all the position a run needs: resumed, it
trains steps ``s + 1 ...`` exactly as the undisturbed run would have.

A sharded run's replicas each hold a shard of the model: its checkpoint (:class:`Shards`) is the
files torch.distributed.checkpoint wrote of each replica's shards, every replica at once as the
chunk ended, kept on each replica's worker and read from there a piece at a time into the store
while training goes on (the coordinator never joins them, nor holds one whole); a resumed run,
sharded again, sends each replica its own files and the ``.metadata`` and has them all load at
once, each reading the rows it holds (:meth:`ReplicaCheckpoints.load_shards`).

DiLoCo's replicas stand together only at a synchronisation, and each keeps an inner optimizer
of its own: :class:`SyncCheckpoints` saves, after a synchronisation, the global model, every
replica's inner optimizer state (by replica) and the outer optimizer's state (its momentum).
``checkpoint_every`` steps then means the first synchronisation at or after each multiple. On
the torch group the replicas leave it on their workers as the chunk that ends at that
synchronisation ends (:attr:`SyncCheckpoints.syncs` says where chunks may end), and the next
chunk trains while the coordinator reads and writes it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Self

from coordinator.context import StrategyContext
from coordinator.errors import StrategyFailed
from coordinator.storage.checkpoints import (
    Checkpoint,
    CheckpointPolicy,
    Payload,
    RunCheckpoints,
)
from coordinator.strategies.data_parallel.elastic import Replicas, Snapshot
from coordinator.strategies.kept_on_worker import KeptLimit, KeptOnWorker
from protocol.daemon import DistLoadShardsRequest, DistShardFileRequest
from protocol.errors import ErrorCode
from protocol.files.shard_files import METADATA

__all__ = ["KEPT", "ReplicaCheckpoints", "Shards", "SyncCheckpoints", "sync_payload"]


KEPT = ("snapshot", "shards")
"""Where a sharded replica's reply to a chunk that takes a checkpoint holds its files, which its
worker keeps (:meth:`~coordinator.context.StrategyContext.call_keeping`)."""


@dataclass(frozen=True)
class Shards:
    """A sharded run's checkpoint as its replicas left it with a chunk's replies: the files
    torch.distributed.checkpoint wrote of each replica's shards, kept on its worker
    (``kept[i]``: replica ``i``'s), what every replica holds alike (``rest``: buffers, step
    counts, the groups' settings, schedulers) and the plain filters' states (``plain``). Read
    a piece at a time from where they are
    (:class:`~coordinator.storage.kept_files.KeptFileSource`), the coordinator never holds one
    whole.

    Raises:
        StrategyFailed: ``STATE_MISMATCH``: two replicas wrote files of one name.
    """

    kept: list[KeptOnWorker]
    rest: dict[str, Any]
    plain: dict[str, Any]
    _where: dict[str, KeptOnWorker] = field(init=False, repr=False)  # file name → its replica's

    @classmethod
    async def of(
        cls,
        ctx: StrategyContext,
        said: list[Any],
        rest: dict[str, Any],
        plain: dict[str, Any],
        limit: KeptLimit,
    ) -> Self:
        """What each replica said in place of its files (``said[i]``: replica ``i``'s), held
        to ``limit`` (what a checkpoint of the model can be) before any of them is read.

        Raises:
            StrategyFailed: ``STATE_MISMATCH``: a replica's files are not as a worker keeps
                them, or two replicas wrote files of one name; ``RESOURCE_LIMIT``: they are
                more or larger than ``limit`` (each worker drops them first).
        """
        kept = [KeptOnWorker.of(ctx, i, s, "shards") for i, s in enumerate(said)]
        try:
            limit.check(kept, "a checkpoint")
        except StrategyFailed:
            await asyncio.gather(*(replica.release() for replica in kept))
            raise
        return cls(kept, rest, plain)

    def __post_init__(self) -> None:
        where: dict[str, KeptOnWorker] = {}
        for replica in self.kept:
            for name in replica.files:
                if name in where:
                    raise StrategyFailed(
                        ErrorCode.STATE_MISMATCH,
                        f"two replicas (one: {replica.worker}) saved a file {name}",
                    )
                where[name] = replica
        object.__setattr__(self, "_where", where)

    def payload(self) -> dict[str, Any]:
        """What the checkpoint's file holds beside the list of the files."""
        said = {"by_replica": [sorted(k.files) for k in self.kept]}
        return {"shards": said | {"rest": self.rest, "plain": self.plain}}

    def sizes(self) -> dict[str, int]:
        return {name: replica.files[name] for name, replica in self._where.items()}

    async def read(self, name: str, offset: int, length: int) -> bytes:
        return await self._where[name].read(name, offset, length)

    async def release(self) -> None:
        await asyncio.gather(*(replica.release() for replica in self.kept))


Settle = Callable[[Mapping[int, Awaitable[Any]]], Awaitable[dict[int, Any]]]
"""Calls on every replica of a group, awaited together under the collective's timeout."""


@dataclass
class ReplicaCheckpoints(RunCheckpoints):
    """A DataParallel run's checkpoints (module docstring); with ``checkpoints`` ``None``
    (``checkpoint_every=0``, or none kept) it saves nothing and resumes from nothing."""

    run: Replicas
    epochs: int
    shards_to_load: Checkpoint | None = field(default=None, repr=False)  # once sharded

    @classmethod
    def of(cls, run: Replicas, every: int | None, steps_per_epoch: int, epochs: int) -> Self:
        checkpoints = run.job.checkpoints
        policy = CheckpointPolicy.of(every, steps_per_epoch, checkpoints)
        return cls(checkpoints=checkpoints, policy=policy, run=run, epochs=epochs)

    async def restore(self) -> int:
        """Set every replica to the checkpoint the job resumes from, say so (``resumed``);
        the steps it had done (``0`` when it starts from the beginning)."""
        resume = self.checkpoints.resume if self.checkpoints is not None else None
        if resume is None:
            return 0
        ctx = self.run.ctx
        if "shards" in resume.payload:  # loaded once the replicas are sharded again
            self.shards_to_load = self._shards_of(resume)
            plain = resume.payload["shards"]["plain"]

            async def put(i: int, fresh: bool) -> None:
                if plain:
                    await ctx.set_state(i, plain)

        else:
            states, optimizers = resume.payload["states"], resume.payload["optimizers"]

            async def put(i: int, fresh: bool) -> None:
                await ctx.set_state(i, states)
                await ctx.set_optimizer_state(i, optimizers)

        await self.run.on_all(put, range(ctx.num_workers()))
        assert self.checkpoints is not None
        await self.run.emit("resumed", self.checkpoints.resumed())
        return int(resume.position["step"])

    def _shards_of(self, resume: Checkpoint) -> Checkpoint:
        """``resume``, a sharded checkpoint, when this run can load it.

        Raises:
            StrategyFailed: ``STATE_MISMATCH``: the run is not sharded.
        """
        if not self.run.sharded:
            raise StrategyFailed(
                ErrorCode.STATE_MISMATCH,
                f"checkpoint {resume.seq} holds a sharded run's shards: resume it with "
                "sharding='full' or 'gradients'",
            )
        return resume

    async def load_shards(self, settle: Settle) -> None:
        """Load the sharded checkpoint :meth:`restore` found into the replicas, sharded now:
        each is sent its own files and the ``.metadata`` (every file, when the checkpoint was
        of another number of replicas), one piece of one file at a time, then all load them
        together (``settle``), each reading the rows it holds. Nothing to do for a run that
        did not resume from one.

        Raises:
            StrategyFailed: ``STATE_MISMATCH``: a file of the checkpoint is gone or damaged.
        """
        resume, self.shards_to_load = self.shards_to_load, None
        if resume is None:
            return
        said = resume.payload["shards"]
        ctx = self.run.ctx
        replicas = range(ctx.num_workers())
        everything = sorted(said["files"])
        same = len(said["by_replica"]) == len(replicas)
        for i in replicas:
            names = sorted({*said["by_replica"][i], METADATA}) if same else everything
            for name in names:
                await self._send_file(i, resume, name)
        rest = said["rest"]
        await settle({i: ctx.call(i, DistLoadShardsRequest(rest=rest)) for i in replicas})

    async def _send_file(self, replica: int, resume: Checkpoint, name: str) -> None:
        """Send file ``name`` of ``resume`` to ``replica`` a piece at a time (at most the
        job's ``piece_bytes`` in memory, and in a message, at once).

        Raises:
            StrategyFailed: ``STATE_MISMATCH``: the file is gone or damaged.
        """
        assert self.checkpoints is not None
        size = int(resume.payload["shards"]["files"][name]["bytes"])
        offset = 0
        while True:
            try:
                data = await asyncio.to_thread(
                    resume.shard_range, name, offset, self.checkpoints.piece_bytes
                )
                if not data and offset < size:
                    raise ValueError(f"its shards' file {name} ends at {offset} of {size} bytes")
            except (OSError, ValueError) as exc:
                raise StrategyFailed(
                    ErrorCode.STATE_MISMATCH, f"resuming from checkpoint {resume.seq}: {exc}"
                ) from exc
            piece = DistShardFileRequest(name=name, data=data, offset=offset)
            await self.run.ctx.call(replica, piece)
            offset += len(data)
            if offset >= size:
                return

    async def after(self, done: int, total: int) -> None:
        """Save a checkpoint after step ``done`` if one is due (every replica has applied that
        step's update), read from the replicas now."""
        if self.checkpoints is None or not self.policy.due(done, total):
            return
        await self.save(done, total, await self.run.snapshot(0))

    async def save(self, done: int, total: int, snapshot: Snapshot | Shards) -> None:
        """Save ``snapshot``, the replicas as they stood after step ``done`` (taken as a chunk
        of steps ended, sent with its reply), if a checkpoint is still due then (one due by
        time is not, once another was saved since); shards not saved are released where they
        were left."""
        if self.checkpoints is None or not self.policy.due(done, total):
            if isinstance(snapshot, Shards):
                await snapshot.release()
            return
        per_epoch = max(1, self.policy.per_epoch)
        position: dict[str, Any] = {
            "step": done,
            "epoch": min(self.epochs, (done - 1) // per_epoch + 1),
        }
        if isinstance(snapshot, Shards):
            await self.checkpoints.save(position, snapshot.payload(), snapshot)
        else:
            payload = {"states": snapshot.states, "optimizers": snapshot.optimizers}
            await self.checkpoints.save(position, payload)
        self.policy.saved()


@dataclass
class SyncCheckpoints(ReplicaCheckpoints):
    """DiLoCo's checkpoints through the coordinator, saved after a synchronisation (module
    docstring); ``outer`` is the outer optimizer's state a resumed run starts from."""

    outer: Any = None
    last: int = 0  # the step of the last checkpoint saved (or resumed from)
    syncs: list[int] = field(default_factory=list)  # the steps synchronisations follow (torch)

    async def restore(self) -> int:
        """Every replica set to the checkpoint's global model and its own inner optimizer
        state (a replica with none saved, dropped then, takes the first replica's); the steps
        it had done (``0`` when the run starts from the beginning)."""
        resume = self.checkpoints.resume if self.checkpoints is not None else None
        if resume is None:
            return 0
        states, optimizers = resume.payload["states"], resume.payload["optimizers"]
        self.outer = resume.payload["outer"]
        ctx = self.run.ctx
        first = optimizers[min(optimizers, key=int)]

        async def put(i: int, fresh: bool) -> None:
            await ctx.set_state(i, states)
            await ctx.set_optimizer_state(i, optimizers.get(str(i), first))

        await self.run.on_all(put, range(ctx.num_workers()))
        assert self.checkpoints is not None
        await self.run.emit("resumed", self.checkpoints.resumed())
        self.last = int(resume.position["step"])
        return self.last

    def stop_at(self, done: int, total: int) -> int:
        """The first synchronisation after ``done`` a checkpoint falls due at by its count
        (:attr:`syncs`); ``total`` when none does, or the synchronisations are not known (the
        coordinator's rounds end at each)."""
        if self.checkpoints is None:
            return total
        return next((s for s in self.syncs if s > done and self._passed(s)), total)

    def due(self, done: int, total: int) -> bool:
        """Whether to save after the synchronisation that ends step ``done``: when the policy
        says so, or when a multiple of ``checkpoint_every`` was passed since the last one —
        without it, an epoch's end (a synchronisation seldom falls on one: H counts over the
        run)."""
        if self.checkpoints is None:
            return False
        return self._passed(done) or self.policy.due(done, total)

    def _passed(self, done: int) -> bool:
        """Whether a multiple of ``checkpoint_every`` (or of an epoch) lies after the last
        checkpoint — with :attr:`syncs` known, after the synchronisation before ``done`` —
        and at or before ``done``."""
        every = self.policy.every
        if every is None:
            every = self.policy.per_epoch
        since = self.last
        if self.syncs:
            since = max([since] + [s for s in self.syncs if s < done])
        return bool(every) and done // every > since // every

    async def after_sync(self, done: int, payload: Payload) -> None:
        """Save the run as it stands after the synchronisation that ends step ``done``:
        ``payload`` (:func:`sync_payload`'s, or what a coroutine function gives it as the write
        starts). Call it when :meth:`due`."""
        assert self.checkpoints is not None
        per_epoch = max(1, self.policy.per_epoch)
        position: dict[str, Any] = {
            "step": done,
            "epoch": min(self.epochs, (done - 1) // per_epoch + 1),
        }
        await self.checkpoints.save(position, payload)
        self.policy.saved()
        self.last = done


def sync_payload(global_state: Any, optimizers: Mapping[int, Any], outer: Any) -> dict[str, Any]:
    """What a DiLoCo checkpoint holds of the run: ``global_state``, the inner ``optimizers`` of
    the replicas present (by replica) and the ``outer`` optimizer's state."""
    return {
        "states": global_state,
        "optimizers": {str(i): state for i, state in optimizers.items()},
        "outer": outer,
    }
