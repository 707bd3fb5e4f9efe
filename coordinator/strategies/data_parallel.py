"""DataParallel: synchronous data-parallel SGD over N replicas (all-reduce of gradients).

Every global batch is exactly the batch ``graph.fit`` would take (:mod:`protocol.batching`, with
the last TorchFilter's ``batch_size``, ``shuffle`` and ``seed``); it is split across the replicas
together with its labels (``numpy.array_split``: uneven splits allowed). Each replica computes the
gradient of its slice's mean loss; the coordinator averages the gradients weighted by slice size —
which is the gradient of the global batch's mean loss — and every replica applies that same mean
with its own persistent optimizer. With a mean-reduced loss and no randomness in the model, the
result equals single-process training on the same global batches (Goyal et al. 2017, §2: "the
same as a single-worker minibatch of size kn").

Data crosses the wire once per job: each replica is sent the rows it will ever see, staged in its
filter daemon, and per step only row indices go out and gradients come back. Plain filters before
the first TorchFilter are fitted on each replica's share of the first epoch, their states
averaged (weighted by rows) and set everywhere before training starts.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Self

import numpy as np

from coordinator.context import StrategyContext
from coordinator.strategies.aggregate import AggregationError, weighted_mean
from coordinator.strategies.base import (
    Emit,
    JobInputs,
    Placement,
    Strategy,
    StrategyFailed,
    StrategyOptionsError,
    check_options,
    concurrently,
)
from protocol.batching import batches, generator
from protocol.errors import ErrorCode
from protocol.messages import NodeInfo

STAGED = "train"
"""The name a replica's rows are staged under in its daemon."""


@dataclass(frozen=True)
class Training:
    """The training settings of a run (those of its last TorchFilter)."""

    epochs: int
    batch_size: int | None
    shuffle: bool
    seed: int

    @classmethod
    def of(cls, info: NodeInfo) -> Training:
        return cls(
            epochs=info.epochs if info.epochs is not None else 1,
            batch_size=info.batch_size,
            shuffle=bool(info.shuffle),
            seed=info.seed or 0,
        )


def schedule(rows: int, replicas: int, training: Training) -> Iterator[tuple[int, int, list[Any]]]:
    """``(epoch, step, slices)`` of every step: the global batch's row indices split in
    ``replicas`` slices (some may be empty when a batch has fewer rows than replicas)."""
    order = generator(training.seed) if training.shuffle else None
    size = training.batch_size or rows
    for epoch in range(training.epochs):
        for step, index in enumerate(batches(rows, size, order)):
            rows_ = np.arange(rows)[index] if isinstance(index, slice) else index.numpy()
            yield epoch, step, np.array_split(rows_, replicas)


class DataParallel(Strategy):
    """``workers`` replicas (optionally all tagged ``tag``) train one model in lockstep."""

    name = "data_parallel"

    def __init__(self, workers: int, tag: str | None = None) -> None:
        self.workers = workers
        self.tag = tag

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> Self:
        check_options(cls.name, options, {"workers", "tag"})
        workers = options.get("workers")
        if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
            raise StrategyOptionsError(
                f"data_parallel: workers must be a positive integer, not {workers!r}"
            )
        tag = options.get("tag")
        if tag is not None and (not isinstance(tag, str) or not tag):
            raise StrategyOptionsError(
                f"data_parallel: tag must be a non-empty string, not {tag!r}"
            )
        return cls(workers, tag)

    def placement(self) -> Placement:
        return Placement(workers=self.workers, tag=self.tag)

    def validate(self, job: JobInputs) -> None:
        self._plan(job)

    async def run(self, ctx: StrategyContext, job: JobInputs, emit: Emit) -> dict[str, Any]:
        torch_nodes, prefix, training = self._plan(job)
        n = int(job.x.shape[0]) if hasattr(job.x, "shape") else len(job.x)
        replicas = range(ctx.num_workers())
        ids = [w.id for w in ctx.workers]

        # 1. Ship the filters, then each replica's rows: the union of its slices over all steps.
        await emit("progress", {"phase": "loading", "replicas": len(replicas)})
        await concurrently(*(ctx.load(i, job.filters) for i in replicas))
        needed: list[set[int]] = [set() for _ in replicas]
        first_epoch: list[list[int]] = [[] for _ in replicas]
        steps_per_epoch = 0
        for epoch, step, slices in schedule(n, len(replicas), training):
            steps_per_epoch = max(steps_per_epoch, step + 1)
            for i, part in enumerate(slices):
                needed[i].update(part.tolist())
                if epoch == 0:
                    first_epoch[i].extend(part.tolist())
        held = [np.array(sorted(rows), dtype=np.int64) for rows in needed]
        await concurrently(*(self._stage(ctx, i, job, held[i]) for i in replicas))

        # 2. Plain filters before the torch part: fitted per shard, averaged by rows, set on all.
        if prefix:
            await emit("progress", {"phase": "fitting", "nodes": prefix})
            shards = [np.searchsorted(held[i], sorted(first_epoch[i])).tolist() for i in replicas]
            fitting = [i for i in replicas if shards[i]]
            fits = await concurrently(
                *(self._call(ctx, i, "composite_fit", prefix, shards[i]) for i in fitting)
            )
            contributions = [
                (ids[i], len(shards[i]), fit["states"])
                for i, fit in zip(fitting, fits, strict=True)
            ]
            averaged = _average(contributions)
            await concurrently(*(ctx.set_state(i, averaged) for i in replicas))

        # 3. Synchronous SGD: each slice's gradient, their weighted mean, one step everywhere.
        #    A step's mean travels with the next step's request (one round trip a step); the
        #    last mean, and any a replica with no rows in a step would miss, go on their own.
        total_steps = steps_per_epoch * training.epochs
        mean: Any = None
        plan = schedule(n, len(replicas), training)
        for done, (epoch, _, slices) in enumerate(plan, start=1):
            active = [i for i in replicas if len(slices[i])]
            idle = [i for i in replicas if not len(slices[i])]
            local = {i: np.searchsorted(held[i], slices[i]) for i in active}
            calls = [self._call(ctx, i, "gradients", job.node_ids, local[i], mean) for i in active]
            if mean is not None:
                calls += [ctx.apply_gradients(i, mean) for i in idle]
            results = (await concurrently(*calls))[: len(active)]
            weights = [len(slices[i]) for i in active]
            grads = [
                (ids[i], w, r["gradients"])
                for i, w, r in zip(active, weights, results, strict=True)
            ]
            # Summed in float32: a gradient mean needs no float64, and it is ~7x faster.
            mean = _average(grads, precise=False)
            losses = [w * float(r["loss"]) for w, r in zip(weights, results, strict=True)]
            progress = {"phase": "training", "epoch": epoch + 1, "epochs": training.epochs}
            progress |= {"step": done, "steps": total_steps, "loss": sum(losses) / sum(weights)}
            await emit("progress", progress)
        if mean is not None:
            await concurrently(*(ctx.apply_gradients(i, mean) for i in replicas))

        # 4. The final states, read back over the wire from every replica: they must agree.
        states = await concurrently(*(ctx.read_back_state(i, job.node_ids) for i in replicas))
        _check_replicas_agree(ids, states, torch_nodes)
        return states[0]

    def _plan(self, job: JobInputs) -> tuple[list[str], list[str], Training]:
        """The torch nodes, the plain prefix and the training settings; or why not."""
        if job.dataset is not None:
            raise StrategyOptionsError(
                "data_parallel splits the data the client sends; for data that stays on the "
                "workers (WorkerData) use FedAvg"
            )
        torch_nodes = job.differentiable()
        if not torch_nodes:
            raise StrategyOptionsError(
                "data_parallel trains TorchFilters and this graph has none; use Local"
            )
        first = job.node_ids.index(torch_nodes[0])
        late = [n for n in job.node_ids[first:] if n not in torch_nodes]
        if late:
            raise StrategyOptionsError(
                f"data_parallel fits plain filters only before the first TorchFilter; {late} "
                f"come after {torch_nodes[0]!r}"
            )
        if job.y is None:
            raise StrategyOptionsError("data_parallel trains with labels: y is missing")
        return torch_nodes, job.node_ids[:first], Training.of(job.nodes[torch_nodes[-1]])

    @staticmethod
    async def _stage(ctx: StrategyContext, i: int, job: JobInputs, rows: Any) -> None:
        await ctx.call(i, {"cmd": "stage", "name": STAGED, "x": job.x[rows], "y": job.y[rows]})

    @staticmethod
    async def _call(
        ctx: StrategyContext, i: int, cmd: str, nodes: list[str], rows: Any, apply: Any = None
    ) -> Any:
        """A command on replica ``i``'s staged rows (positions in what it holds)."""
        request = {"cmd": cmd, "node_ids": nodes, "data": STAGED, "rows": np.asarray(rows).tolist()}
        if apply is not None:
            request["apply"] = apply
        return await ctx.call(i, request)


def _average(contributions: Sequence[tuple[str, float, Any]], precise: bool = True) -> Any:
    try:
        return weighted_mean(contributions, precise=precise)
    except AggregationError as exc:
        raise StrategyFailed(ErrorCode.AGGREGATION_MISMATCH, str(exc)) from exc


def _check_replicas_agree(ids: list[str], states: list[dict[str, Any]], nodes: list[str]) -> None:
    """Every replica applied the same steps to the same start: their weights must be equal."""
    for node in nodes:
        for key, value in states[0][node].items():
            reference = np.asarray(value)
            for worker, other in zip(ids[1:], states[1:], strict=True):
                if not np.array_equal(np.asarray(other[node][key]), reference):
                    raise StrategyFailed(
                        ErrorCode.INTERNAL,
                        f"replicas diverged: node {node!r}, key {key!r} differs between "
                        f"{ids[0]!r} and {worker!r}",
                    )
