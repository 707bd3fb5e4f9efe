"""DataParallel's torch collective: the coordinator as rendezvous and clock, torch.distributed
as the data plane.

:func:`choose` decides how a run reduces its gradients. ``coordinator`` when asked for, or when
the replicas cannot form a group (:mod:`~coordinator.strategies.process_group`: in-process
workers, an address not known, a replica that cannot reach the rendezvous on replica 0; or a
replica that holds no rows); else ``torch``. Under ``auto`` the replicas that reached the
rendezvous also form a trial group — the data plane itself, gloo's connections between every
pair, not only the store — and a group that does not form falls back to ``coordinator``. The
reason says why either way.

:class:`TorchTraining` then runs the training phase. Every replica joins one process group
through that store (gloo, NCCL when every replica is on CUDA) with the plan they all walk, and
is told to train a *chunk* of global steps at a time: per step its slice, forward, backward with
DDP's bucketed all-reduce, one optimizer step (:mod:`engine.data_parallel.replica`). The coordinator
never touches a gradient; per chunk it receives each replica's losses and emits one progress event
(``step``: the steps done, ``losses``: each step's of the chunk); the chunks grow and are
sent ahead as :mod:`coordinator.strategies.chunks` says — the next while one trains — except
where the coordinator reads the replicas in between (an epoch's evaluation) or could have to
undo it (``elastic``). A checkpoint does not stop it: the
chunk that ends where one falls due carries it in its reply (``snapshot``: replica 0's states
and optimizer states, a sharded run's every replica's shards as torch.distributed.checkpoint
saved them), so training goes on while the snapshot travels and is written.
The loop over steps is the replicas' own (``engine.data_parallel.replica``); the coordinator's, over
chunks that end where a checkpoint falls due, has no round to configure or aggregate.

Faults. When a call of a chunk fails, the others are given the collective timeout to end and
are cancelled after it (:func:`~coordinator.strategies.process_group.settle`). Without
``elastic`` the job fails, naming the lost worker rather than a survivor that only saw the group
break. With it, the lost replicas are replaced, every replica is brought to the most advanced
survivor's step (a survivor may have completed one step more than another when the group broke),
the group is formed again on a fresh store and training resumes from that step — so the result
is still ``graph.fit``'s.
"""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from coordinator.errors import StrategyFailed, WorkerCallError
from coordinator.strategies.base import Emit, concurrently
from coordinator.strategies.chunks import Chunk, cancelled, next_chunk
from coordinator.strategies.data_parallel.checkpoints import KEPT, ReplicaCheckpoints, Shards
from coordinator.strategies.data_parallel.elastic import (
    MAX_RECOVERIES,
    RECOVERABLE,
    Replicas,
    Snapshot,
    every_replica_lost,
)
from coordinator.strategies.data_parallel.phase import Choice, TrainingPhase
from coordinator.strategies.history import Evaluate, History
from coordinator.strategies.kept_on_worker import KeptLimit
from coordinator.strategies.process_group import (
    PROBE_TIMEOUT,
    Broken,
    Rendezvous,
    join,
    leave,
    rendezvous,
    settle,
)
from coordinator.strategies.steps import StepBoundaries, TrainingSettings
from protocol.daemon import (
    DdpSpec,
    DistPlanRequest,
    DistTrainRequest,
    ReplicaModeSpec,
    ReplicaPlace,
    ShardedSpec,
    SnapshotWay,
)
from protocol.errors import ErrorCode
from protocol.options.strategies import DataParallelOptions

__all__ = [
    "TRIAL_TIMEOUT",
    "TorchTraining",
    "choose",
    "chunk_progress",
    "replica_plans",
]


async def choose(run: Replicas, wanted: str, limit: float) -> Choice:
    """The collective of a run whose replicas are set up (filters loaded, rows staged).

    Raises:
        StrategyFailed: ``COLLECTIVE_FAILED`` when ``torch`` was asked for and cannot be had.
    """
    if wanted == "coordinator":
        return Choice("coordinator", "collective='coordinator' was asked for")
    empty = [run.ids[i] for i, held in enumerate(run.position.held) if len(held) == 0]
    replicas = list(range(run.ctx.num_workers()))
    if empty:
        meet: Rendezvous | str = f"{empty} hold no rows (fewer rows than replicas)"
    else:
        meet = await rendezvous(run.ctx, replicas, min(PROBE_TIMEOUT, limit), limit)
    if isinstance(meet, Rendezvous):
        failed = await _trial_group(run, replicas, meet, limit) if wanted == "auto" else None
        if failed is None:
            return Choice("torch", meet.reason, meet.backend, meet)
        meet = f"{meet.reason}, but their group did not form: {failed}"
    if wanted == "torch":
        raise StrategyFailed(ErrorCode.COLLECTIVE_FAILED, f"collective='torch': {meet}")
    return Choice("coordinator", meet)


TRIAL_TIMEOUT = 10.0
"""Seconds ``auto``'s trial group may take to form before the run trains through the
coordinator instead."""


async def _trial_group(
    run: Replicas, replicas: list[int], meet: Rendezvous, limit: float
) -> str | None:
    """Form the group once (a trial): ``None`` when it formed (it is formed again, on the same
    store, to train), else why not, the store closed.

    Raises:
        WorkerCallError: a replica failed otherwise than by its group (its worker was lost).
    """
    prefix = f"trial-{secrets.token_hex(4)}/"
    try:
        await join(run.ctx, replicas, meet, prefix, min(TRIAL_TIMEOUT, limit))
    except WorkerCallError as exc:
        if exc.code is not ErrorCode.COLLECTIVE_FAILED:
            raise
        await leave(run.ctx, replicas)
        return str(exc)
    return None


@dataclass(kw_only=True)
class TorchTraining:
    """The training phase of a DataParallel run on a torch group (module docstring): the
    ``phase`` whole, and the run's ``options`` (its collective timeout, ``sync_batchnorm``,
    ``compression``, ``sharding`` and ``shard_units``)."""

    phase: TrainingPhase
    options: DataParallelOptions

    def __post_init__(self) -> None:
        phase, setup = self.phase, self.phase.setup
        self.run, self.choice = setup.run, setup.choice  # (the choice's store: made anew)
        self.training, self.rows, self.steps_per_epoch = (
            phase.training,
            phase.rows,
            setup.steps_per_epoch,
        )
        self.history: History | None = phase.history  # the rows of the run's epochs
        self.evaluate = phase.evaluate  # the model's figures on the validation data, now
        self.emit, self.timeout = self.run.emit, self.options.collective_timeout
        self.token = secrets.token_hex(4)
        self.formations = 0
        self.breaks: Counter[int] = Counter()  # times the group broke, by the step resumed from

    async def train(self, total: int, start: int, saves: ReplicaCheckpoints) -> None:
        """Train global steps ``[start, total)``, emitting progress per chunk, a chunk ending
        where a checkpoint falls due (``saves``) and the checkpoint saved then; the next chunk
        sent while one trains where nothing is read between them (module docstring)."""
        position, chunk, step = self.run.position, 1, start
        await self._form(fresh_store=False, step=start)
        try:  # resumed from a sharded checkpoint: each replica loads its shards now
            await saves.load_shards(lambda calls: self._settle(calls, start))
        except Broken as broken:
            raise broken.blame() from None
        loop = asyncio.get_running_loop()
        ahead: Chunk | None = None  # the next chunk, queued on every replica behind this one
        landed = loop.time()  # when the last chunk's results were in
        try:
            while step < total:
                if ahead is None:
                    stop = self._stop(step, chunk, total, saves)
                    ahead = self._send(step, stop, saves.due(stop, total))
                now, ahead = ahead, None
                if self._overlaps(now.stop, total):
                    after = self._stop(now.stop, chunk, total, saves)
                    ahead = self._send(now.stop, after, saves.due(after, total))
                position.phase, position.step = "training", step + 1
                try:
                    results = await now.calls
                except Broken as broken:
                    await cancelled(ahead)
                    ahead = None
                    step = await self._recover(broken, step)
                    chunk = 1
                    continue
                if now.sent < landed:  # sent ahead: the metrics count it
                    self.run.ctx.observe("chunk_sent_ahead", loop.time() - now.sent)
                began, landed = max(now.sent, landed), loop.time()
                await self._progress(step, now.stop, results)
                chunk = next_chunk(chunk, now.stop - step, landed - began)
                step = now.stop
                if now.snapshot:  # taken as the chunk ended, while the next one trains
                    await self._save(saves, step, total, results)
                await self._after_chunk(step)
        finally:
            await cancelled(ahead)
        position.step = None

    def _stop(self, step: int, chunk: int, total: int, saves: ReplicaCheckpoints) -> int:
        """Where a chunk of ``chunk`` steps after ``step`` ends: at ``total``, at a checkpoint
        due, at an epoch's end when the model is evaluated there."""
        stop = min(total, step + chunk, saves.stop_at(step, total))
        if self.evaluate is not None:  # evaluated where an epoch ends, and validate_every's
            stop = min(stop, self.bounds.next_read(step))
        return stop

    def _overlaps(self, stop: int, total: int) -> bool:
        """Whether the chunk after the one ending at ``stop`` may be sent before that one ends:
        when no evaluation reads the replicas between them (a checkpoint comes with the
        chunk's reply) and no recovery could need the chunk undone (not ``elastic``)."""
        return stop < total and not (self.run.elastic or self._evaluated_at(stop))

    def _evaluated_at(self, stop: int) -> bool:
        """Whether the model is evaluated after step ``stop``."""
        return self.evaluate is not None and self.bounds.reads_after(stop)

    @property
    def bounds(self) -> StepBoundaries:
        """Where the run's epochs close and the model is validated."""
        return self.training.boundaries(self.steps_per_epoch)

    def _send(self, step: int, stop: int, snapshot: bool) -> Chunk:
        """Steps ``[step, stop)`` sent to every replica (each worker's daemon takes requests
        one at a time, so a chunk sent early waits behind the one before). With
        ``snapshot`` (a checkpoint due after it) replica 0 — sharded: every replica — sends
        what the checkpoint saves with its reply."""
        sharded = self.options.sharding != "none"

        def call(i: int) -> Awaitable[Any]:
            taken = self._snapshot_of(i) if snapshot else None
            request = DistTrainRequest(start=step, stop=stop, snapshot=taken)
            if taken is not None and (sharded or taken != "in_reply"):
                return self.run.ctx.call_keeping(i, request, KEPT, relayed=True)  # kept till read
            return self._call(i, request)

        calls = {i: call(i) for i in self._all()}
        settled = asyncio.ensure_future(self._settle(calls, stop))
        return Chunk(stop, settled, asyncio.get_running_loop().time(), snapshot)

    def _snapshot_of(self, i: int) -> SnapshotWay | None:
        """What replica ``i`` gives of a checkpoint due after its chunk: replica 0, or every
        replica of a sharded run, in its reply; the others nothing."""
        return "in_reply" if self.options.sharding != "none" or i == 0 else None

    async def _save(
        self, saves: ReplicaCheckpoints, step: int, total: int, results: Mapping[int, Any]
    ) -> None:
        """Save the checkpoint due after step ``step`` from the chunk's ``results``."""
        await saves.save(step, total, await self._snapshot(results))

    async def _after_chunk(self, step: int) -> None:
        """What follows a chunk that ended at ``step``, its progress and checkpoint done
        (nothing here)."""

    async def _snapshot(self, results: Mapping[int, Any]) -> Snapshot | Shards:
        """The checkpoint's snapshot the replicas sent with a chunk's ``results``: replica
        0's, or every sharded replica's files (as many and as large as the model allows)."""
        if self.options.sharding != "none":
            taken = [results[i]["snapshot"] for i in self._all()]
            kept = [t["shards"] for t in taken]
            limit = KeptLimit.of(self.run.job.trained_shapes(), len(kept))
            ctx = self.run.ctx
            return await Shards.of(ctx, kept, taken[0]["rest"], taken[0]["plain"], limit)
        taken = results[0]["snapshot"]
        return Snapshot(self.run.ids[0], taken["states"], taken["optimizers"])

    async def _form(self, fresh_store: bool, step: int, regroup: bool = False) -> None:
        """Every replica, standing at ``step``, joins the group (on a new store when
        ``fresh_store``) and takes the plan; ``regroup``: DiLoCo's replicas carry over what
        they hold, each at its place among them (:class:`~protocol.daemon.DistPlanRequest`)."""
        ctx, replicas = self.run.ctx, list(self._all())
        meet = self.choice.meet
        if fresh_store or meet is None:
            await leave(ctx, replicas)
            probe = min(PROBE_TIMEOUT, self.timeout)
            again = await rendezvous(ctx, replicas, probe, self.timeout)
            if not isinstance(again, Rendezvous):
                raise StrategyFailed(ErrorCode.COLLECTIVE_FAILED, f"forming the group: {again}")
            # (its backend as chosen at first: the replicas' devices have not changed)
            meet = dataclasses.replace(again, backend=self._backend)
            self.choice = dataclasses.replace(self.choice, meet=meet)
        self.formations += 1
        await join(ctx, replicas, meet, f"{self.token}/{self.formations}/", self.timeout)
        training = self.training

        shared = DistPlanRequest(
            node_ids=self.run.job.node_ids,
            data=self.run.staged,
            held=[],
            rows=0,
            **training.batch_plan(),
            mode=self._mode(None),
            compression=self.options.compression,
        )

        plan = replica_plans(self.run, shared, self.rows)
        world = self.run.ctx.num_workers()

        def placed(i: int) -> DistPlanRequest:
            if not regroup:
                return plan(i)
            mode = self._mode(ReplicaPlace(rank=i, world=world))
            return plan(i).model_copy(update={"mode": mode})

        try:
            planned = await self._settle({i: self._call(i, placed(i)) for i in replicas}, step)
        except Broken as broken:
            raise broken.blame() from None
        sharding = self.options.sharding
        if sharding != "none":  # what each replica holds of the model, as it says
            held = {self.run.ids[i]: planned[i] for i in sorted(planned)}
            await self.emit("progress", {"phase": "sharded", "sharding": sharding} | held)

    def _mode(self, regroup: ReplicaPlace | None) -> ReplicaModeSpec:
        """How the replicas train: DDP, or sharded by FSDP2; ``regroup`` is DiLoCo's
        (:class:`~.diloco_torch.SyncsOnTorch`)."""
        o = self.options
        if o.sharding != "none":
            units = None if o.shard_units is None else list(o.shard_units)
            return ShardedSpec(sharding=o.sharding, shard_units=units)
        return DdpSpec(sync_batchnorm=o.sync_batchnorm)

    @property
    def _backend(self) -> Literal["gloo", "nccl"]:
        return "nccl" if self.choice.backend == "nccl" else "gloo"

    async def _recover(self, broken: Broken, step: int) -> int:
        """Without ``elastic``: fail. With it: replace the lost, bring every replica to the most
        advanced survivor, form the group again; the step training resumes from."""
        if not self.run.elastic:
            raise broken.blame()
        lost = {i: e for i, e in broken.errors.items() if e.code in RECOVERABLE}
        odd = [e for i, e in broken.errors.items() if i not in lost and i not in broken.done]
        if odd:
            raise odd[0]
        survivors = {i: done for i, done in broken.done.items() if i not in lost}
        if not survivors:
            raise every_replica_lost(lost, self.run.position.where)
        source = max(survivors, key=lambda i: (survivors[i], -i))
        resume = survivors[source]
        self.breaks[resume] += 1
        if self.breaks[resume] > MAX_RECOVERIES:  # a group that breaks at the same step anew
            blamed = broken.blame()
            raise StrategyFailed(
                blamed.code,
                f"step {resume + 1}: the group broke {MAX_RECOVERIES} times over; the last: "
                f"{blamed}",
                **blamed.to_info().detail,
            )
        self.run.position.step = resume + 1
        snapshot = await self.run.recover(lost, source) if lost else None
        behind = [i for i, done in survivors.items() if done < resume]
        if behind:
            if snapshot is None:
                snapshot = await self.run.snapshot(source)
            copy = snapshot

            async def bring(i: int) -> None:
                await self.run.ctx.set_state(i, copy.states)
                await self.run.ctx.set_optimizer_state(i, copy.optimizers)

            await concurrently(*(bring(i) for i in behind))
        await self._form(fresh_store=True, step=resume)
        return resume

    async def _progress(self, start: int, stop: int, results: Mapping[int, Any]) -> None:
        await chunk_progress(
            self.emit,
            self.training,
            self.steps_per_epoch,
            (start, stop),
            results,
            history=self.history,
            evaluate=self.evaluate,
        )

    def _all(self) -> list[int]:
        """The replicas taking part (all but those DiLoCo's elastic rounds dropped)."""
        return self.run.present()

    def _call(self, i: int, request: Any) -> Awaitable[Any]:
        """``request`` on replica ``i``: the replicas compute, the coordinator passes their
        tensors on (snapshots into checkpoints, momentum to joiners): relayed."""
        return self.run.ctx.call(i, request, relayed=True)

    async def _settle(self, calls: Mapping[int, Awaitable[Any]], stop: int) -> dict[int, Any]:
        return await settle(calls, self.run.ids, self.timeout, stop, patient=self.run.elastic)


def replica_plans(
    run: Replicas, shared: DistPlanRequest, rows: int
) -> Callable[[int], DistPlanRequest]:
    """Each replica's plan: ``shared`` with the rows replica ``i`` holds of the ``rows`` sent,
    or, on the replicas' own datasets, their sizes and its place among them."""
    own, held = run.position.own, run.position.held

    def plan(i: int) -> DistPlanRequest:
        if own is not None:  # the replicas' own rows: no row list to send
            return shared.model_copy(update={"sizes": own.in_order, "position": own.places[i]})
        return shared.model_copy(update={"held": np.asarray(held[i]).tolist(), "rows": rows})

    return plan


async def chunk_progress(
    emit: Emit,
    training: TrainingSettings,
    per_epoch: int,
    steps: tuple[int, int],
    results: Mapping[int, Any],
    *,
    history: History | None,
    evaluate: Evaluate | None,
) -> None:
    """One progress event for the steps ``[start, stop)`` the replicas trained (``results``,
    by replica): each step's loss, row-weighted over the replicas as ``graph.fit`` reports a
    batch's mean loss (``loss``: the last one's); and the history's rows, evaluated where an
    epoch ends (and where ``validate_every`` says)."""
    start, stop = steps
    bounds = training.boundaries(per_epoch)
    losses, batch_rows, metrics = [], [], []
    lrs = next(iter(results.values())).get("lrs") or []  # the replicas step alike
    for j in range(stop - start):
        rows = [results[i]["rows"][j] for i in results]
        values = [results[i]["losses"][j] for i in results]
        weighted = sum(r * v for r, v in zip(rows, values, strict=True))
        losses.append(weighted / max(sum(rows), 1))
        batch_rows.append(sum(rows))
        stepped = [i for i in results if results[i].get("metrics")]  # a step function's
        metrics.append([(results[i]["metrics"][j], results[i]["rows"][j]) for i in stepped])
    await emit(
        "progress",
        {
            "phase": "training",
            "epoch": bounds.epoch(stop),
            "epochs": bounds.epochs_run,
            "step": stop,
            "steps": bounds.total,
            "loss": losses[-1],
            "losses": losses,
            "chunk": stop - start,
            "rows": sum(batch_rows),
            "batch_rows": batch_rows,
        }
        | ({"lr": lrs[-1], "lrs": lrs} if lrs else {}),
    )
    if history is not None:
        await history.steps(
            start, losses, batch_rows, lrs, bounds, evaluate=evaluate, metrics=metrics
        )
