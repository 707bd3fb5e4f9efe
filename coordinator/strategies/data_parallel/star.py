"""DataParallel's coordinator collective: every step's gradients averaged by the coordinator.

The path for replicas that cannot reach each other (behind NAT, across sites), where a hub is
the only way: per step each replica computes the gradient of its slice, the coordinator takes
their mean weighted by slice size (Goyal et al. 2017: the gradient of the global batch's mean
loss), and every replica applies that mean with its own persistent optimizer. A step's mean
travels with the next step's request, so a step is one round trip. A replica's half of a step —
the mean applied, forward, loss, backward, its gradients read — is
:meth:`engine.data_parallel.star_replica.StarReplica.step`.

The exchange is streamed, not stored and forwarded
(:mod:`~coordinator.strategies.data_parallel.mean_fold`): the mean is folded range by range as the
replies arrive, and step ``s + 1``'s requests are sent while step ``s``'s replies are still coming
in, each of their chunks as soon as the mean bytes it carries are final. So the coordinator's
receiving, averaging and sending overlap, and the replicas start receiving the mean before the last
gradient byte is in. Two steps are in flight at once only where nothing can need the first to be
undone: not in an ``elastic`` run (a lost replica is restored from a survivor standing at the step
that failed), nor across a checkpoint (saved once every replica has applied its step's mean).
Replies the fold cannot take are averaged whole, with the same result and the same errors.

With ``compression`` (``"fp16"``, ``"bf16"``, ``"int8"``) both legs travel compressed
(:mod:`protocol.compressed_trees`): each replica sends its gradients encoded (int8 with its own
error feedback), the coordinator decodes them, averages them whole (a compressed reply is not
folded as it arrives) and sends the mean encoded by its own compressor (int8 with the
coordinator's error feedback: DoubleSqueeze, Tang et al. 2019), which each replica decodes before
applying it. The residuals are not checkpointed: a resumed run's start empty.

This is why its loop is its own, not the round loop of :mod:`coordinator.strategies.rounds`:
there a round ends (aggregated, recorded) before the next is configured; here step ``s + 1`` is
launched while step ``s`` is still landing.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import itertools
import sys
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from coordinator.errors import StrategyFailed
from coordinator.strategies.aggregate import (
    AggregationError,
    format_path,
    non_finite,
    weighted_mean,
)
from coordinator.strategies.data_parallel.checkpoints import ReplicaCheckpoints
from coordinator.strategies.data_parallel.elastic import DataParallelPosition, Replicas
from coordinator.strategies.data_parallel.mean_fold import FoldBuffers, FoldDeclined, StreamedMean
from coordinator.strategies.data_parallel.phase import TrainingPhase
from coordinator.strategies.steps import global_batches
from protocol.compressed_trees import (
    TreeCompressor,
    decode,
    is_compressed,
)
from protocol.daemon import ApplyGradientsRequest, GradientsRequest
from protocol.errors import BadCompressedTree, ErrorCode
from protocol.options.compression import Compression
from protocol.rules.batching import replica_seed

__all__ = ["GlobalBatchPlan", "StarTraining", "apply_mean", "average", "received"]

T = TypeVar("T")

GlobalBatchPlan = Iterable[tuple[int, int, list[Any]]]
"""``(epoch, step, slices by replica)`` of every step of a run."""


@dataclass(kw_only=True)
class _Step:
    """One global step in flight: its calls, and the fold its gradients land in."""

    done: int  # the global step, from 1
    epoch: int
    weights: dict[int, int]  # rows of each replica that has any, by replica
    fold: StreamedMean
    previous: StreamedMean | None  # the mean its requests carry, released once they landed
    calls: asyncio.Task[dict[int, Any]]
    launched: float  # time.monotonic
    ends_epoch: bool  # the last step of its epoch (epoch-wise schedulers step after it)
    buffers: asyncio.Future[Any] | None  # replica 0's buffers after its forward (if synced)


@dataclass(frozen=True)
class _Prior:
    """What a step's requests carry of the step before: its mean (``None``: applied already),
    whether it ended an epoch, and replica 0's buffers after it (DDP's ``broadcast_buffers``:
    the other replicas take them before their forward)."""

    mean: StreamedMean | None = None
    ends_epoch: bool = False
    buffers: asyncio.Future[Any] | None = None


@dataclass(kw_only=True)
class StarTraining:
    """The training phase of a DataParallel run through the coordinator (module docstring).

    Args:
        phase: the replicas, set up (rows staged; the plain prefix fitted or a checkpoint
            set), the last TorchFilter's settings (batches, epochs), the rows of the client's
            data (``0`` over WorkerData: each replica's own), the history and the evaluation.
        staged: the name each replica's rows are staged under.
        syncs_buffers: the model has buffers: replica 0's are broadcast each step.
        compression: what gradients and means travel as.
    """

    phase: TrainingPhase
    staged: str
    syncs_buffers: bool = False
    compression: Compression | None = None
    pool: FoldBuffers = field(default_factory=FoldBuffers)
    _total: int = 0
    _means: TreeCompressor | None = None  # the coordinator's, with its int8 residual

    def __post_init__(self) -> None:
        phase = self.phase
        self.run, self.training, self.rows = phase.run, phase.training, phase.rows
        self.emit = self.run.emit
        self.history, self.evaluate = phase.history, phase.evaluate
        self.bounds = phase.bounds  # where validate_every evaluates between epoch ends
        if self.compression is not None:
            self._means = TreeCompressor(self.compression)

    async def train(self, total: int, start: int, saves: ReplicaCheckpoints) -> None:
        """Train global steps ``start + 1 ... total``, saving checkpoints as ``saves`` says,
        and apply the last mean everywhere."""
        if "torch" not in sys.modules:  # the means are torch tensors: imported off the loop
            await asyncio.to_thread(importlib.import_module, "torch")
        position = self.run.position
        own, replicas = position.own, self.run.ctx.num_workers()
        plan: GlobalBatchPlan = (
            own.batches(self.training)
            if own
            else global_batches(self.rows, replicas, self.training)
        )
        self._total = total
        flying: _Step | None = None  # launched, not landed
        try:
            steps = itertools.islice(_with_next(plan), total)  # (max_steps may stop mid-epoch)
            for done, (now, after) in enumerate(steps, start=1):
                if done <= start:
                    continue  # trained before the checkpoint it resumed from
                if flying is not None and not (
                    self.run.elastic or saves.due(flying.done, total) or self._evaluates(flying)
                ):
                    # Pipelined: this step's requests go out as the last one's mean folds.
                    landing = flying
                    prior = _Prior(flying.fold, flying.ends_epoch, flying.buffers)
                    flying = self._launch(done, now, after, prior)
                    await self._land(landing)
                    continue
                if flying is not None:
                    await self._land(flying)
                    await self._checkpoint(flying, saves, total)
                    await self._validate(flying)
                flying = self._launch(done, now, after, self._pending(flying))
            if flying is not None:
                await self._land(flying)
                await self._validate(flying)
        finally:
            if flying is not None and not flying.calls.done():
                flying.calls.cancel()
                with contextlib.suppress(BaseException):
                    await flying.calls
        position.phase, position.step = "finishing", None
        await apply_mean(self.run, position)
        await saves.after(total, total)  # the end: kept with the result, to continue from

    def _launch(
        self, done: int, now: tuple[int, int, list[Any]], after: Any, prior: _Prior
    ) -> _Step:
        """Start step ``done``'s calls: each replica applies the ``prior`` step's mean (a
        fold, or ``None``), takes replica 0's buffers after it, then computes the gradient of
        its slice into this step's fold; its rows of the next step (``after``) are read
        meanwhile."""
        position, held = self.run.position, self.run.position.held
        epoch, _, slices = now
        after = after if done < self._total else None  # the run's last step
        position.phase, position.epoch, position.step = "training", epoch, done
        replicas = range(self.run.ctx.num_workers())
        local = {i: np.searchsorted(held[i], slices[i]) for i in replicas if len(slices[i])}
        # Rows on a worker's disk: each replica reads its next step's while this one is
        # averaged (engine.data.read_ahead.NextRead).
        ahead = {
            i: np.searchsorted(held[i], after[2][i])
            for i in local
            if position.own and after is not None and len(after[2][i])
        }
        weights = {i: len(slices[i]) for i in sorted(local)}
        fold = StreamedMean(weights, self.pool)
        if self.compression is not None:
            fold.decline(f"the gradients travel as {self.compression}: averaged whole")
        targets = [i for i in replicas if i in local or prior.mean is not None]
        buffers: asyncio.Future[Any] | None = None
        if self.syncs_buffers:  # replica 0's after this step: its reply's, or as they were
            buffers = (
                prior.buffers if 0 not in local else asyncio.get_running_loop().create_future()
            )
        call = self._call(done, local, ahead, prior, fold, buffers)
        calls = asyncio.ensure_future(self.run.on_all(call, targets))
        launched = time.monotonic()
        ends = after is None or after[0] != epoch
        return _Step(
            done=done,
            epoch=epoch,
            weights=weights,
            fold=fold,
            previous=prior.mean,
            calls=calls,
            launched=launched,
            ends_epoch=ends,
            buffers=buffers,
        )

    def _call(
        self,
        done: int,
        local: Mapping[int, Any],
        ahead: Mapping[int, Any],
        prior: _Prior,
        fold: StreamedMean,
        buffers: asyncio.Future[Any] | None,
    ) -> Callable[[int, bool], Awaitable[Any]]:
        """A replica's part of step ``done``: apply the prior step's mean (unless the replica
        is ``fresh``: it copied a survivor that had applied it), take replica 0's buffers (the
        others), then the gradient of its ``local`` rows, if it has any this step, landing in
        ``fold``, its forward seeded by the filter's seed, the replica and the step (dropout);
        replica 0's reply sets ``buffers``."""
        ctx, node_ids, mean = self.run.ctx, self.run.job.node_ids, prior.mean

        async def call(i: int, fresh: bool) -> Any:
            apply, pace = (None, None) if fresh or mean is None else await mean.take()
            if i in local:
                rows = np.asarray(local[i]).tolist()
                after = np.asarray(ahead[i]).tolist() if i in ahead else None
                broadcast = await prior.buffers if prior.buffers is not None and i else None
                request = GradientsRequest(
                    node_ids=node_ids,
                    data=self.staged,
                    rows=rows,
                    apply=apply,
                    apply_ends_epoch=apply is not None and prior.ends_epoch,
                    read_next=after,
                    seed=replica_seed(self.training.seed, i, done),
                    buffers=broadcast,
                    return_buffers=buffers is not None and i == 0,
                    compression=None if self._means is None else self._means.compression,
                )
                sink = fold.sink(i) if self.compression is None else None
                result = await ctx.call(i, request, pace=pace, sink=sink)
                if i == 0 and buffers is not None and not buffers.done():
                    buffers.set_result(_copied(result["buffers"]))  # the fold reuses its bytes
                return result
            if apply is not None:
                await ctx.apply_gradients(i, apply, pace=pace, epoch_end=prior.ends_epoch)
            return None

        return call

    async def _land(self, step: _Step) -> None:
        """Await step ``step``'s replies: its mean (folded, or made from the whole replies),
        its loss in a progress event."""
        results = await step.calls
        if step.previous is not None:
            step.previous.release()  # its mean reached every replica with these requests
        ids, ctx = self.run.ids, self.run.ctx
        try:
            mean = step.fold.result()
            assert step.fold.finished is not None
            ctx.observe("mean_streamed", step.fold.finished - step.launched)
            sent = [(ids[i], results[i].get("gradients")) for i in step.weights]
            finite_or_refused(mean, sent, "gradients")
        except FoldDeclined:
            model = self.run.job.trained_shapes()
            grads = [
                (ids[i], w, received(ids[i], "gradients", results[i]["gradients"], model))
                for i, w in step.weights.items()
            ]
            # Summed in float32: a gradient mean needs no float64, and it is ~7x faster.
            mean = average(grads, precise=False, what="gradients")
            if self._means is not None:
                mean = self._means.encode(mean)
            step.fold.settle(mean)
            ctx.observe("mean_whole", time.monotonic() - step.launched)
        self.run.position.mean, self.run.position.mean_ends_epoch = mean, step.ends_epoch
        if step.buffers is not None and step.buffers.done():
            self.run.position.buffers = step.buffers.result()
        weights = step.weights
        losses = [w * float(results[i]["loss"]) for i, w in weights.items()]
        epochs = self.bounds.epochs_run
        progress = {"phase": "training", "epoch": step.epoch + 1, "epochs": epochs}
        progress |= {"step": step.done, "steps": self._total, "rows": sum(weights.values())}
        loss, lr = sum(losses) / sum(weights.values()), results[min(weights)].get("lr")
        progress |= {"loss": loss} | ({"lr": lr} if lr is not None else {})  # replicas alike
        await self.emit("progress", progress)
        if self.history is not None:
            figures = [
                (results[i]["metrics"], w) for i, w in weights.items() if "metrics" in results[i]
            ]
            self.history.add(loss, sum(weights.values()), lr, figures)
            if step.ends_epoch and self.evaluate is None:
                await self.history.close(step.epoch + 1)

    async def _checkpoint(self, step: _Step, saves: ReplicaCheckpoints, total: int) -> None:
        """If a checkpoint falls due after ``step``: every replica applies its mean, then it
        is saved."""
        if saves.due(step.done, total):
            await self._apply(step)
            await saves.after(step.done, total)

    def _evaluates(self, step: _Step) -> bool:
        """Whether the model is evaluated after ``step``, in a run with validation data: it
        ends an epoch, or ``validate_every`` falls there."""
        validates = self.bounds.validates_after(step.done)
        return self.evaluate is not None and (step.ends_epoch or validates)

    async def _validate(self, step: _Step) -> None:
        """If the model is evaluated after ``step``: every replica applies its mean, the model
        is evaluated as it stands, and the epoch's row closes with its figures (or, between
        epoch ends, the history records a validation)."""
        if self._evaluates(step):
            assert self.evaluate is not None and self.history is not None
            await self._apply(step)
            scores = await self.evaluate()
            if step.ends_epoch:
                await self.history.close(step.epoch + 1, scores)
            else:
                await self.history.validated(step.epoch + 1, step.done, scores)

    async def _apply(self, step: _Step) -> None:
        """Every replica applies ``step``'s mean (if not done already): it may be read now."""
        await apply_mean(self.run, self.run.position)
        step.fold.release()

    def _pending(self, step: _Step | None) -> _Prior:
        """What the step after ``step`` applies: ``step``'s mean, unless applied already."""
        if step is None:
            return _Prior()
        mean = None if self.run.position.mean is None else step.fold
        return _Prior(mean, self.run.position.mean_ends_epoch, step.buffers)


async def apply_mean(run: Replicas, position: DataParallelPosition) -> None:
    """Every replica applies the last step's mean, if one is pending (a replica ``fresh`` from
    a survivor that had applied it already skips it)."""
    mean = position.mean
    if mean is None:
        return

    ends, buffers = position.mean_ends_epoch, position.buffers

    async def finish(i: int, fresh: bool) -> None:
        if not fresh:
            request = ApplyGradientsRequest(
                gradients=mean, epoch_end=ends, buffers=buffers if i else None
            )
            await run.ctx.call(i, request)

    await run.on_all(finish, range(run.ctx.num_workers()))
    position.mean = None


def average(
    contributions: Sequence[tuple[str, float, Any]], precise: bool = True, what: str = "states"
) -> Any:
    """The weighted mean of ``contributions`` (each ``what``), or the job's failure naming
    what disagrees, or the contributor whose values are not finite."""
    try:
        mean = weighted_mean(contributions, precise=precise)
    except AggregationError as exc:
        raise StrategyFailed(ErrorCode.AGGREGATION_MISMATCH, str(exc)) from exc
    finite_or_refused(mean, [(label, tree) for label, _, tree in contributions], what)
    return mean


def finite_or_refused(mean: Any, contributions: Sequence[tuple[str, Any]], what: str) -> None:
    """Refuse a mean that holds a NaN or an infinity, naming the contributors whose trees do
    (a hostile or diverged replica): one pass over the mean, the trees read only then.

    Raises:
        StrategyFailed: ``AGGREGATION_MISMATCH`` naming the workers and where.
    """
    where = non_finite(mean)
    if where is None:
        return
    blamed = [label for label, tree in contributions if non_finite(tree) is not None]
    who = f"worker{'s' if len(blamed) > 1 else ''} {', '.join(map(repr, blamed))}"
    who = who if blamed else "a worker"
    raise StrategyFailed(
        ErrorCode.AGGREGATION_MISMATCH,
        f"{who} sent {what} that are not finite (NaN or infinity) at "
        f"{format_path(where)}: refused rather than averaged into the model",
        workers=blamed,
    )


def received(
    worker: str, what: str, tree: Any, model: Mapping[str, Sequence[Sequence[int]]] | None = None
) -> Any:
    """``tree`` (a worker's ``what``: gradients, pseudo-gradients) as the worker sent it:
    decoded when it travelled compressed, its layout checked against ``model`` (each node's
    trainable parameters' shapes) first.

    Raises:
        StrategyFailed: ``AGGREGATION_MISMATCH`` naming ``worker``, for a compressed tree that
            cannot be decoded or is not of the model.
    """
    if not is_compressed(tree):
        return tree
    try:
        return decode(tree, model)
    except BadCompressedTree as exc:
        raise StrategyFailed(
            ErrorCode.AGGREGATION_MISMATCH,
            f"worker {worker!r} sent {what} that cannot be decoded: {exc}",
        ) from exc


def _copied(tree: Any) -> Any:
    """``tree`` (dicts down to tensors or arrays) with every tensor copied into memory of its
    own."""
    if isinstance(tree, Mapping):
        return {k: _copied(v) for k, v in tree.items()}
    return tree.clone() if hasattr(tree, "clone") else np.array(tree, copy=True)


def _with_next(steps: Iterable[T]) -> Iterator[tuple[T, T | None]]:
    """Each of ``steps`` with the one after it (``None`` after the last)."""
    previous: list[T] = []
    for step in steps:
        if previous:
            yield previous.pop(), step
        previous.append(step)
    if previous:
        yield previous.pop(), None
