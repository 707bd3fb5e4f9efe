"""DiLoCo on the replicas' torch group that outlives a replica: checkpoints after a
synchronisation, and elastic rounds — the coordinator the quorum keeper (torchft's Lighthouse),
the tensors never through it.

The replicas keep the global model and the outer momentum themselves
(:mod:`engine.data_parallel.outer_step`), so what a checkpoint or a joiner needs is on them. Chunks
end at synchronisations (:func:`protocol.rules.batching.synchronises`), where every replica holds
the global model.

**Checkpoints.** The chunk that ends at the synchronisation a checkpoint falls due at
(:class:`~.checkpoints.SyncCheckpoints`) has every replica leave its inner optimizer state on
its worker as one file, the first also the global model and the outer momentum (alike on every
replica: one copy crosses its link); the next chunk trains while the coordinator reads them, a
piece at a time, and writes the checkpoint. Sent with the chunk's reply, they held up the next
chunk wherever the model is validated after the synchronisation (4.4 s of each 25-step round on
a 100 Mbit/s link, the 52 MB of each replica). The outer momentum is saved as the
coordinator's own outer step keeps it
(:class:`~coordinator.strategies.federated.server_optimizers.FedAvgM`: m = −torch's momentum
buffer), so a run checkpointed on either path resumes on either. A resumed run sets every
replica to the global model and its inner state before the group forms, and the momentum once
the plan is taken.

**Elastic** (one round a chunk). A replica whose worker or daemon is lost mid-round takes no
further part: the others train the round out alone (nothing crosses the network between
synchronisations) and the group breaks in its synchronisation. Each survivor stands as before
it, owing it (:mod:`engine.data_parallel.modes.diloco_group`); the coordinator reports the lost
(``worker_lost``, ``worker_dropped``), forms the group again with the survivors — each keeping its
local weights, global weights and outer momentum, its place among the replicas unchanged — and has
them make the synchronisation: the round's average is the survivors'. Then each lost replica's place
is taken by a worker idle now (its own, with a fresh daemon, when only the daemon died), set to a
survivor's states (the global model), inner optimizer state and outer momentum, and the group is
formed once more with it (``worker_joined``): it trains from the next round. A place nobody takes
stays empty, tried again at each synchronisation. A model with buffers, which DDP broadcasts at
every inner step, cannot train a round out without a replica: such a run is elastic through the
coordinator (:mod:`.diloco`).
"""

from __future__ import annotations

import asyncio
import bisect
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from coordinator.context import StrategyContext
from coordinator.errors import StrategyFailed, WorkerCallError
from coordinator.strategies.data_parallel.checkpoints import (
    ReplicaCheckpoints,
    SyncCheckpoints,
    sync_payload,
)
from coordinator.strategies.data_parallel.elastic import (
    MAX_RECOVERIES,
    RECOVERABLE,
    Snapshot,
    every_replica_lost,
)
from coordinator.strategies.data_parallel.torch_collective import TorchTraining
from coordinator.strategies.kept_on_worker import KeptLimit, KeptOnWorker
from coordinator.strategies.process_group import Broken
from protocol.codec import decode
from protocol.daemon import (
    DiLoCoGroupSpec,
    DistOuterStateRequest,
    DistTrainRequest,
    OuterStepSpec,
    ReplicaModeSpec,
    ReplicaPlace,
    SnapshotWay,
)
from protocol.errors import ErrorCode
from protocol.files.shard_files import SNAPSHOT_FILE
from protocol.rules.batching import synchronises

__all__ = [
    "SyncsOnTorch",
    "kept_snapshots",
    "momentum_of",
    "saved_momentum",
    "snapshot_payload",
]


@dataclass(kw_only=True)
class SyncsOnTorch(TorchTraining):
    """DiLoCo's training phase on the torch group, checkpointed and elastic (module
    docstring): the replicas step alone and take the ``outer`` step together."""

    outer: OuterStepSpec
    lost: dict[int, WorkerCallError] = field(default_factory=dict)  # dropped, and why

    def __post_init__(self) -> None:
        super().__post_init__()
        self.sync_stops: list[int] = []  # the steps synchronisations follow
        self.momentum: dict[str, dict[str, Any]] | None = None  # a resumed run's, to set

    async def train(self, total: int, start: int, saves: ReplicaCheckpoints) -> None:
        assert isinstance(saves, SyncCheckpoints)
        ends = synchronises(total, self.outer.sync_every, self.outer.also)
        self.sync_stops = [g + 1 for g in range(total) if ends[g]]
        saves.syncs = self.sync_stops
        if saves.outer is not None:  # resumed: the outer momentum as it was saved
            self.momentum = momentum_of(saves.outer)
        await super().train(total, start, saves)

    def _stop(self, step: int, chunk: int, total: int, saves: ReplicaCheckpoints) -> int:
        """Where a chunk ends: at a synchronisation (the first at or after where
        DataParallel's would end); elastic, at the next one. Streaming DiLoCo's where
        DataParallel's would: its reads are no synchronisations (the global model is read
        where it stands), and it keeps nothing that needs the model whole."""
        if self.outer.streams():
            return super()._stop(step, chunk, total, saves)
        stop = step + 1 if self.run.elastic else super()._stop(step, chunk, total, saves)
        return self.sync_stops[bisect.bisect_left(self.sync_stops, stop)]

    def _snapshot_of(self, i: int) -> SnapshotWay | None:
        """Every replica leaves its part on its worker: the first present the global model and
        the outer momentum (alike on every replica) with its inner optimizer state, each other
        its inner optimizer state."""
        return "kept_whole" if i == min(self._all()) else "kept_inner"

    async def _save(
        self, saves: ReplicaCheckpoints, step: int, total: int, results: Mapping[int, Any]
    ) -> None:
        """Save the checkpoint the replicas left on their workers with the chunk's
        ``results``, read while the next chunk trains (module docstring)."""
        assert isinstance(saves, SyncCheckpoints) and saves.checkpoints is not None
        kept = await kept_snapshots(self.run.ctx, results, saves.checkpoints.whole_bytes)
        pieces = saves.checkpoints.piece_bytes

        async def payload() -> dict[str, Any]:
            try:
                frames = await asyncio.gather(*(k.whole(SNAPSHOT_FILE, pieces) for k in kept))
            finally:
                await asyncio.gather(*(k.release() for k in kept))
            taken = await asyncio.to_thread(lambda: [decode(f) for f in frames])
            return snapshot_payload({k.worker: t for k, t in zip(kept, taken, strict=True)})

        await saves.after_sync(step, payload)

    def _mode(self, regroup: ReplicaPlace | None) -> ReplicaModeSpec:
        """DiLoCo over the group; ``regroup``: the group formed again, the replica's place
        among the replicas as given."""
        sync_batchnorm = self.options.sync_batchnorm
        return DiLoCoGroupSpec(outer=self.outer, sync_batchnorm=sync_batchnorm, regroup=regroup)

    async def _form(self, fresh_store: bool, step: int, regroup: bool = False) -> None:
        await super()._form(fresh_store, step, regroup)
        if self.momentum is not None:
            await self._set_momentum(self._all(), self.momentum)
            self.momentum = None

    async def _set_momentum(self, replicas: list[int], momentum: dict[str, Any]) -> None:
        request = DistOuterStateRequest(momentum=momentum)
        try:
            await self._settle({i: self._call(i, request) for i in replicas}, 0)
        except Broken as broken:
            raise broken.blame() from None

    async def _after_chunk(self, step: int) -> None:
        if self.lost:  # a place left empty: taken now if a worker is idle
            await self._join(step)

    async def _recover(self, broken: Broken, step: int) -> int:
        """Without ``elastic``: fail. With it: the round's synchronisation made by the
        survivors alone, then the lost places taken (module docstring); the step training
        goes on from."""
        if not self.run.elastic:
            raise broken.blame()
        results: dict[int, Any] | None = None  # the round's, by survivor
        while True:
            stop, owing = self._owed(broken)
            if results is None:
                said = {i: owed["results"] for i, owed in owing.items()}
                results = said | {i: r for i, r in broken.results.items() if i not in owing}
            results = {i: r for i, r in results.items() if i not in broken.errors or i in owing}
            self.breaks[stop] += 1
            if self.breaks[stop] > MAX_RECOVERIES:
                blamed = broken.blame()
                raise StrategyFailed(
                    blamed.code,
                    f"step {stop}: the group broke {MAX_RECOVERIES} times over in its "
                    f"synchronisation; the last: {blamed}",
                    **blamed.to_info().detail,
                )
            await self._drop({i: e for i, e in broken.errors.items() if e.code in RECOVERABLE})
            await self._form(fresh_store=True, step=stop, regroup=True)
            if not owing:  # the survivors made it (a replica lost after its part in it)
                break
            owed = DistTrainRequest(start=stop, stop=stop)  # the synchronisation, made now
            try:
                await self._settle({i: self._call(i, owed) for i in self._all()}, stop)
                break
            except Broken as again:
                broken = again
        await self._progress(step, stop, results)
        await self._join(stop)
        return stop

    def _owed(self, broken: Broken) -> tuple[int, dict[int, dict[str, Any]]]:
        """The synchronisation every survivor of ``broken`` owes (the step it follows), and
        what each said of it; none owed (``{}``) when every survivor made it.

        Raises:
            WorkerCallError: a survivor failed otherwise than by the group breaking in it.
            StrategyFailed: every replica was lost; or the survivors stand apart (some made
                the synchronisation and some did not, or they owe different ones).
        """
        lost = {i: e for i, e in broken.errors.items() if e.code in RECOVERABLE}
        survivors = [i for i in self._all() if i not in lost]
        if not survivors:
            raise every_replica_lost(lost, self.run.position.where)
        owing: dict[int, dict[str, Any]] = {}
        for i, error in broken.errors.items():
            if i in lost:
                continue
            said = error.info.detail
            if error.code is not ErrorCode.COLLECTIVE_FAILED or "sync_pending" not in said:
                raise error
            owing[i] = said
        if not owing:
            return max(broken.done.values()), {}
        stops = {int(said["sync_pending"]) for said in owing.values()}
        if len(stops) != 1 or set(owing) != set(survivors):
            made = sorted(self.run.ids[i] for i in survivors if i not in owing)
            raise StrategyFailed(
                ErrorCode.COLLECTIVE_FAILED,
                f"the group broke in a synchronisation that {made} made and "
                f"{sorted(self.run.ids[i] for i in owing)} did not (after steps "
                f"{sorted(stops)}): their global models differ",
            )
        return stops.pop(), owing

    async def _drop(self, lost: dict[int, WorkerCallError]) -> None:
        """The replicas ``lost`` take no further part until their places are taken."""
        run = self.run
        if not lost:
            return
        await run.report(lost)
        for i, error in sorted(lost.items()):
            run.absent.add(i)
            self.lost[i] = error
            await run.emit(
                "worker_dropped",
                {"replica": i, "worker": error.worker_id, "replicas": len(run.present())}
                | run.position.at(),
            )

    async def _join(self, step: int) -> None:
        """After the synchronisation that ends step ``step``, each lost place taken by a worker
        idle now, set to a survivor's states, inner optimizer state and outer momentum, and the
        group formed with it (module docstring)."""
        run, ctx = self.run, self.run.ctx
        source = run.present()[0]
        snapshot: Snapshot | None = None
        momentum: dict[str, Any] = {}
        joined: dict[int, str] = {}  # replica → the worker it lost
        for i, error in sorted(self.lost.items()):
            old = run.ids[i]
            if not await run.idle_worker(i, error):
                continue
            try:
                if snapshot is None:
                    snapshot = await run.snapshot(source)
                    said = await ctx.call(source, DistOuterStateRequest())
                    momentum = said["momentum"]
                await run.restore(i, snapshot)
            except WorkerCallError as exc:
                if exc.code not in RECOVERABLE or exc.worker_id == run.ids[source]:
                    raise
                self.lost[i] = exc  # the joiner went too: the place stays empty
                continue
            joined[i] = old
        if not joined:
            return
        for i in joined:
            del self.lost[i]
            run.absent.discard(i)
        await self._form(fresh_store=True, step=step, regroup=True)
        await self._set_momentum(sorted(joined), momentum)
        for i, old in joined.items():
            await run.emit(
                "worker_joined",
                {"replica": i, "lost": old, "worker": run.ids[i], "from": run.ids[source]}
                | run.position.at(),
            )


def saved_momentum(momentum: Mapping[str, Mapping[str, Any]]) -> list[Any]:
    """A replica's outer momentum (torch SGD's buffers, node → name → tensor) as a checkpoint
    holds it: the coordinator's outer step's state (``FedAvgM.state_dict``: m = −buffer, in
    float64, under each parameter's path)."""
    return [
        [[node, name], [-np.asarray(buffer, dtype=np.float64)]]
        for node, named in momentum.items()
        for name, buffer in named.items()
    ]


def momentum_of(saved: list[Any]) -> dict[str, dict[str, Any]]:
    """The outer momentum a replica sets from a checkpoint's (:func:`saved_momentum`)."""
    momentum: dict[str, dict[str, Any]] = {}
    for (node, name), (moment, *_) in saved:
        buffer = (-np.asarray(moment, dtype=np.float64)).astype(np.float32)
        momentum.setdefault(node, {})[name] = buffer
    return momentum


async def kept_snapshots(
    ctx: StrategyContext, results: Mapping[int, Any], nbytes: int
) -> list[KeptOnWorker]:
    """The snapshot each replica of ``results`` left on its worker (one file, of at most
    ``nbytes``: what its reply could have held), replica by replica.

    Raises:
        StrategyFailed: ``STATE_MISMATCH``: a replica left none, or other files;
            ``RESOURCE_LIMIT``: one is larger than ``nbytes``. Every replica's is dropped
            first, none of them read.
    """
    kept: list[KeptOnWorker] = []
    refused: StrategyFailed | None = None
    for i in sorted(results):
        taken = results[i].get("snapshot") if isinstance(results[i], dict) else None
        said = taken.get("shards") if isinstance(taken, dict) else None
        try:
            replica = KeptOnWorker.of(ctx, i, said, "checkpoint's snapshot")
            kept.append(replica)
            if set(replica.files) != {SNAPSHOT_FILE}:
                raise StrategyFailed(
                    ErrorCode.STATE_MISMATCH,
                    f"replica {i} kept {sorted(replica.files)} for the checkpoint, not its "
                    f"{SNAPSHOT_FILE!r}",
                )
            KeptLimit(1, nbytes).check([replica], f"replica {i}'s part of a checkpoint")
        except StrategyFailed as exc:
            refused = refused or exc
    if refused is not None:
        await asyncio.gather(*(k.release() for k in kept))
        raise refused
    return kept


def snapshot_payload(taken: Mapping[int, Any]) -> dict[str, Any]:
    """The checkpoint of what each replica left of its snapshot (``taken``, decoded, by
    replica): the first's global model and outer momentum, every one's inner optimizer state.

    Raises:
        StrategyFailed: ``STATE_MISMATCH``: a replica's snapshot lacks its part.
    """
    first = min(taken)
    for i, said in taken.items():
        wants = ("states", "optimizers", "outer") if i == first else ("optimizers",)
        if not isinstance(said, dict) or any(key not in said for key in wants):
            raise StrategyFailed(
                ErrorCode.STATE_MISMATCH,
                f"replica {i}'s part of the checkpoint does not hold its {', '.join(wants)}",
            )
    optimizers = {i: said["optimizers"] for i, said in taken.items()}
    whole = taken[first]
    return sync_payload(whole["states"], optimizers, saved_momentum(whole["outer"]))
