"""FedAvg and FedProx: federated averaging of models trained where the data is.

McMahan et al. 2017, "Communication-Efficient Learning of Deep Networks from Decentralized
Data", Algorithm 1 (FederatedAveraging; K clients indexed by k, B the local minibatch size,
E the number of local epochs, η the learning rate)::

    Server executes:
        initialize w_0
        for each round t = 1, 2, ... do
            m ← max(C · K, 1)
            S_t ← (random set of m clients)
            for each client k ∈ S_t in parallel do
                w^k_{t+1} ← ClientUpdate(k, w_t)
            w_{t+1} ← Σ_{k=1}^{K} (n_k / n) w^k_{t+1}

    ClientUpdate(k, w):   // Run on client k
        B ← (split P_k into batches of size B)
        for each local epoch i from 1 to E do
            for batch b ∈ B do
                w ← w − η ∇ℓ(w; b)
        return w to server

Here a client is a worker; its data P_k is either its own dataset (``WorkerData``: it never
leaves the worker) or a contiguous shard of the rows the client sent (``numpy.array_split``),
staged in its filter daemon once per job. Each round:

* selection: m = max(``min_workers``, ⌈``fraction`` · K⌉) of the K workers still usable, namely
  ``sorted(numpy.random.default_rng(seed + t).choice(K, m, replace=False))`` as positions in
  the list of usable workers (placement order);
* ClientUpdate: the global model is *sent* to each selected worker (``set_state``), which trains
  ``local_epochs`` epochs on its staged data with a fresh optimizer (``batched_fit`` with
  ``reset_optimizer``; batches, optimizer and ``lr`` are its TorchFilters' own) and answers with
  its row count n_k; its trained states are then pulled (``get_state``), at most ``FETCHES``
  workers at a time, however many train at once;
* aggregation: the mean of the states weighted by n_k over those who answered, each folded
  into an :class:`~coordinator.strategies.aggregate.Accumulator` as it arrives (so the
  coordinator holds a few client states at a time, not m, and averages while it receives), then
  the server optimizer (:mod:`~coordinator.strategies.server_opt`: plain averaging by default,
  or FedAvgM, FedAdam, FedYogi after Reddi et al. 2021) steps from w_t towards that mean on the
  TorchFilters' states.

Plain filters (a ``Center`` before the network) have no state to start from: each client fits
them on its own data in every round, as ``graph.fit`` would, and their global state is the
row-weighted mean of the clients' states (for a ``Center``, the mean of all rows).

FedProx (Li et al. 2020, "Federated Optimization in Heterogeneous Networks", Algorithm 2) is
FedAvg whose clients minimise h_k(w; w_t) = F_k(w) + μ/2 ‖w − w_t‖²: the same rounds with the
proximal term added to every local batch's loss (``batched_fit`` with ``prox_mu``).

A worker that fails or times out in a round is dropped from that round and named in the round's
event; the round goes on if at least ``min_workers`` answered. One whose connection is gone
(``worker_lost``) is not selected again; one whose daemon died (``daemon_crashed``, or
``timeout``, after which the agent kills it) is set up again (filters and data) before it next
trains. The final model is set on a worker and read back over the wire.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Self

import numpy as np

from coordinator.context import StrategyContext
from coordinator.errors import WorkerCallError
from coordinator.strategies import server_opt
from coordinator.strategies.aggregate import Accumulator, AggregationError
from coordinator.strategies.base import (
    Emit,
    JobInputs,
    Placement,
    Strategy,
    StrategyFailed,
    StrategyOptionsError,
    concurrently,
    parse_options,
)
from protocol.errors import ErrorCode
from protocol.strategy_options import FedAvgOptions, FedProxOptions

STAGED = "local"
"""The name a worker's training data is staged under in its daemon."""

FETCHES = 16
"""Trained states pulled from the workers at once: the coordinator holds at most this many
client states (arriving or being folded into the mean), however many workers train."""

_REDO_SETUP = frozenset({ErrorCode.DAEMON_CRASHED, ErrorCode.TIMEOUT})
"""Failures after which the worker's daemon is gone, with the job's filters and data."""


@dataclass
class _Workers:
    """What the coordinator knows of the job's workers during a run, by position."""

    ids: list[str]
    rows: dict[int, int] = field(default_factory=dict)  # staged rows of each set-up worker
    lost: dict[int, str] = field(default_factory=dict)  # never selected again, and why
    stale: set[int] = field(default_factory=set)  # to be set up again before training

    def usable(self) -> list[int]:
        return [i for i in range(len(self.ids)) if i not in self.lost]

    def drop(self, i: int, error: WorkerCallError) -> str:
        """Note what ``error`` means for worker ``i``; return how to name it in a report."""
        reason = f"{error.code}: {error.info.message}"
        if error.code is ErrorCode.WORKER_LOST:
            self.lost[i] = reason
        elif error.code in _REDO_SETUP:
            self.stale.add(i)
        return reason


class FedAvg(Strategy):
    """Federated averaging over the job's workers (see the module docstring).

    Args:
        rounds: communication rounds.
        local_epochs: epochs each selected worker trains per round.
        fraction: C, the share of the usable workers selected per round, in (0, 1].
        min_workers: the least number of workers a round needs answers from.
        workers: reserve this many workers; ``None`` takes every idle matching worker.
        tag: only workers with this tag.
        server: the server optimizer's name (``server_opt.OPTIMIZERS``); the default,
            ``"fedavg"``, takes the average as it is.
        server_options: its hyperparameters.
        prox_mu: FedProx's μ (0 for FedAvg); see :class:`FedProx`.
        seed: seeds the client selection (``default_rng(seed + round)``).
    """

    name = "fedavg"

    def __init__(
        self,
        rounds: int,
        local_epochs: int = 1,
        fraction: float = 1.0,
        min_workers: int = 1,
        workers: int | None = None,
        tag: str | None = None,
        server: str = server_opt.FedAvgServer.name,
        server_options: Mapping[str, Any] | None = None,
        seed: int = 0,
        prox_mu: float = 0.0,
    ) -> None:
        self.rounds = rounds
        self.local_epochs = local_epochs
        self.fraction = fraction
        self.min_workers = min_workers
        self.workers = workers
        self.tag = tag
        self.server = server
        self.server_options = dict(server_options or {})
        self.seed = seed
        self.prox_mu = prox_mu
        self._server_optimizer()  # refuse bad hyperparameters now, not when the job runs

    # -- options --------------------------------------------------------------------------------

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> Self:
        return cls(**_arguments(parse_options(FedAvgOptions, options)))

    def _server_optimizer(self) -> server_opt.ServerOptimizer:
        """A new server optimizer (fresh moments) for one run."""
        try:
            return server_opt.from_options(self.server, self.server_options)
        except (ValueError, TypeError) as exc:
            raise StrategyOptionsError(f"{self.name}: server: {exc}") from None

    def placement(self) -> Placement:
        if self.workers is None:
            return Placement(workers=self.min_workers, tag=self.tag, all_matching=True)
        return Placement(workers=self.workers, tag=self.tag)

    def validate(self, job: JobInputs) -> None:
        if not job.differentiable():
            raise StrategyOptionsError(
                f"{self.name} averages models trained by gradient descent and this graph has "
                "no TorchFilter; use Local"
            )
        if job.dataset is not None:
            return  # the labels are the workers' own: each one's first round will tell
        if job.y is None:
            raise StrategyOptionsError(f"{self.name} trains with labels: y is missing")
        rows = _rows(job.x)
        least = self.workers if self.workers is not None else self.min_workers
        if rows is not None and rows < least:
            raise StrategyOptionsError(
                f"{self.name}: x has {rows} rows, too few to give each of {least} workers a shard"
            )

    # -- the run ------------------------------------------------------------------------------

    async def run(self, ctx: StrategyContext, job: JobInputs, emit: Emit) -> dict[str, Any]:
        server = self._server_optimizer()
        torch_nodes = job.differentiable()
        workers = _Workers([w.id for w in ctx.workers])
        shards = self._shards(job, ctx.num_workers())

        # 1. Ship the filters and stage each worker's data, once per job.
        await emit("progress", {"phase": "loading", "workers": workers.ids})
        failed = await self._setup(ctx, job, shards, workers, range(ctx.num_workers()))
        await emit(
            "progress",
            {
                "phase": "staged",
                "rows": {workers.ids[i]: n for i, n in sorted(workers.rows.items())},
                "dropped": failed,
            },
        )
        self._check_enough(workers, failed, "setup")

        # 2. w_0: the TorchFilters' initial weights, as every worker unpickled them.
        global_state = await self._initial_state(ctx, workers, torch_nodes)

        for r in range(1, self.rounds + 1):
            # 3. Select m of the usable workers; set up again those whose daemon died.
            selected = self._select(r, workers)
            # 4. ClientUpdate on each, concurrently: w_t goes out, trained states come back and
            #    are folded into the weighted mean as they arrive (one state held, not m).
            mean, fetch = Accumulator(), asyncio.Semaphore(FETCHES)
            replies = await concurrently(
                *(
                    self._client_update(ctx, job, shards, workers, i, global_state, mean, fetch, r)
                    for i in selected
                )
            )
            answered = [(i, reply) for i, reply in replies if not isinstance(reply, str)]
            dropped = {workers.ids[i]: reply for i, reply in replies if isinstance(reply, str)}
            if len(answered) < self.min_workers:
                raise StrategyFailed(
                    ErrorCode.NOT_ENOUGH_WORKERS,
                    f"round {r}: {len(answered)} of {len(selected)} selected workers answered, "
                    f"min_workers is {self.min_workers}; {_listed(dropped)}",
                    round=r,
                    answered=[workers.ids[i] for i, _ in answered],
                    dropped=dropped,
                )
            # 5. w_{t+1}: the row-weighted mean, through the server optimizer for TorchFilters.
            averaged = mean.result()
            global_state = self._server_step(server, r, global_state, averaged, torch_nodes)
            rows = sum(int(reply["rows"]) for _, reply in answered)
            loss = sum(int(reply["rows"]) * float(reply["loss"]) for _, reply in answered)
            await emit(
                "progress",
                {
                    "phase": "round",
                    "round": r,
                    "rounds": self.rounds,
                    "selected": [workers.ids[i] for i in selected],
                    "workers": [workers.ids[i] for i, _ in answered],
                    "dropped": dropped,
                    "rows": rows,
                    "loss": loss / rows,
                },
            )

        # 6. The final model, set on a worker and read back over the wire.
        return await self._read_back(ctx, job, workers, global_state)

    # -- phases -------------------------------------------------------------------------------

    def _shards(self, job: JobInputs, k: int) -> list[tuple[Any, Any]] | None:
        """Contiguous shards of the client's rows, one per worker (``None``: WorkerData)."""
        if job.dataset is not None:
            return None
        n = _rows(job.x)
        if n is None:
            raise StrategyFailed(ErrorCode.BAD_REQUEST, f"{self.name}: x has no rows to split")
        if n < k:
            raise StrategyFailed(
                ErrorCode.BAD_REQUEST,
                f"{self.name}: x has {n} rows, too few to give each of {k} workers a shard",
            )
        bounds = np.cumsum([0, *(len(part) for part in np.array_split(np.arange(n), k))])
        return [
            (job.x[start:stop], job.y[start:stop])
            for start, stop in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True)
        ]

    async def _setup(
        self,
        ctx: StrategyContext,
        job: JobInputs,
        shards: list[tuple[Any, Any]] | None,
        workers: _Workers,
        which: Sequence[int],
    ) -> dict[str, str]:
        """Load the filters and stage the data on ``which``; the failures, by worker id."""

        async def one(i: int) -> str | None:
            try:
                await ctx.load(i, job.filters)
                if shards is None:
                    stage = {"cmd": "stage", "name": STAGED, "dataset": job.dataset}
                else:
                    stage = {"cmd": "stage", "name": STAGED, "x": shards[i][0], "y": shards[i][1]}
                staged = await ctx.call(i, stage)
            except WorkerCallError as exc:
                workers.rows.pop(i, None)
                workers.stale.add(i)
                return workers.drop(i, exc)
            rows = int(staged["rows"])
            if rows == 0:
                workers.lost[i] = "its dataset has no rows"
                return workers.lost[i]
            workers.rows[i] = rows
            workers.stale.discard(i)
            return None

        reasons = await concurrently(*(one(i) for i in which))
        return {
            workers.ids[i]: reason
            for i, reason in zip(which, reasons, strict=True)
            if reason is not None
        }

    async def _initial_state(
        self, ctx: StrategyContext, workers: _Workers, torch_nodes: list[str]
    ) -> dict[str, Any]:
        """The TorchFilters' states on the first worker that answers."""
        return await _on_first_answering(
            workers,
            lambda i: ctx.get_state(i, torch_nodes),
            "no worker could give the initial model",
        )

    def _select(self, r: int, workers: _Workers) -> list[int]:
        """S_t: m of the usable workers, drawn with ``default_rng(seed + r)``."""
        usable = workers.usable()
        if len(usable) < self.min_workers:
            raise StrategyFailed(
                ErrorCode.NOT_ENOUGH_WORKERS,
                f"round {r}: {len(usable)} usable workers left, min_workers is "
                f"{self.min_workers}; lost: {_listed(_named(workers, workers.lost))}",
                round=r,
                lost=_named(workers, workers.lost),
            )
        m = max(self.min_workers, math.ceil(self.fraction * len(usable)))
        picks = np.random.default_rng(self.seed + r).choice(len(usable), m, replace=False)
        return [usable[p] for p in sorted(picks.tolist())]

    async def _client_update(
        self,
        ctx: StrategyContext,
        job: JobInputs,
        shards: list[tuple[Any, Any]] | None,
        workers: _Workers,
        i: int,
        global_state: dict[str, Any],
        mean: Accumulator,
        fetch: asyncio.Semaphore,
        r: int,
    ) -> tuple[int, dict[str, Any] | str]:
        """ClientUpdate(k, w_t) on worker ``i``, its trained states folded into ``mean``: its
        rows and loss, or why it dropped out.

        Every selected worker trains at once; their states are then pulled ``fetch`` at a
        time (``get_state``), not sent with the fit's reply: m workers finishing together
        would otherwise push m states into the coordinator's memory at once.

        Raises:
            StrategyFailed: its states cannot be averaged with the others' (round ``r`` fails).
        """
        if i in workers.stale:
            failed = await self._setup(ctx, job, shards, workers, [i])
            if failed:
                return i, failed[workers.ids[i]]
        # Only the TorchFilters start from w_t: plain filters are fitted anew on the worker's data.
        model = {n: global_state[n] for n in job.differentiable()}
        try:
            await ctx.set_state(i, model)
            fit = await ctx.call(
                i,
                {
                    "cmd": "batched_fit",
                    "node_ids": job.node_ids,
                    "data": STAGED,
                    "epochs": self.local_epochs,
                    "prox_mu": self.prox_mu,
                    "reset_optimizer": True,
                    "return_output": False,  # the model's outputs on private data stay there
                    "return_states": False,  # pulled below, a few workers at a time
                },
            )
            async with fetch:
                states = await ctx.get_state(i, job.node_ids)
                try:
                    mean.add(workers.ids[i], fit["rows"], states)
                except AggregationError as exc:
                    raise StrategyFailed(
                        ErrorCode.AGGREGATION_MISMATCH, f"round {r}: {exc}"
                    ) from exc
        except WorkerCallError as exc:
            return i, workers.drop(i, exc)
        return i, {"rows": fit["rows"], "loss": fit["loss"]}

    def _server_step(
        self,
        server: server_opt.ServerOptimizer,
        r: int,
        global_state: dict[str, Any],
        averaged: dict[str, Any],
        torch_nodes: list[str],
    ) -> dict[str, Any]:
        """w_{t+1}: the server optimizer's step on the TorchFilters, the mean for the rest."""
        current = {n: global_state[n] for n in torch_nodes}
        try:
            stepped = server.step(current, {n: averaged[n] for n in torch_nodes})
        except AggregationError as exc:
            raise StrategyFailed(
                ErrorCode.AGGREGATION_MISMATCH, f"round {r}: {server.name}: {exc}"
            ) from exc
        return {**averaged, **stepped}

    async def _read_back(
        self,
        ctx: StrategyContext,
        job: JobInputs,
        workers: _Workers,
        global_state: dict[str, Any],
    ) -> dict[str, Any]:
        """Set the final model on a worker and read it back (the next one if that one fails)."""

        async def read_back(i: int) -> dict[str, Any]:
            await ctx.set_state(i, global_state)
            return await ctx.read_back_state(i, job.node_ids)

        return await _on_first_answering(
            workers, read_back, "no worker is left to read the final model back from"
        )

    def _check_enough(self, workers: _Workers, failed: Mapping[str, str], phase: str) -> None:
        usable = [i for i in workers.usable() if i not in workers.stale]
        if len(usable) < self.min_workers:
            raise StrategyFailed(
                ErrorCode.NOT_ENOUGH_WORKERS,
                f"{phase}: {len(usable)} of {len(workers.ids)} workers are ready, min_workers "
                f"is {self.min_workers}; {_listed(dict(failed))}",
                dropped=dict(failed),
            )


class FedProx(FedAvg):
    """FedAvg whose clients add μ/2 ‖w − w_t‖² to their loss (Li et al. 2020).

    Args:
        mu: μ > 0 (with μ = 0 this would be FedAvg: ask for FedAvg instead).
        **kwargs: as :class:`FedAvg`.
    """

    name = "fedprox"

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> Self:
        checked = parse_options(FedProxOptions, options)
        return cls(**_arguments(checked), prox_mu=checked.mu)


# -- helpers ----------------------------------------------------------------------------------


def _arguments(options: FedAvgOptions) -> dict[str, Any]:
    """The constructor's arguments from checked options (the server split in name and
    hyperparameters)."""
    server = options.server_optimizer()
    return {
        "rounds": options.rounds,
        "local_epochs": options.local_epochs,
        "fraction": options.fraction,
        "min_workers": options.min_workers,
        "workers": options.workers,
        "tag": options.tag,
        "server": server.name,
        "server_options": server.hyperparameters(),
        "seed": options.seed,
    }


def _rows(x: Any) -> int | None:
    shape = getattr(x, "shape", None)
    if shape is not None and len(shape) > 0:
        return int(shape[0])
    return len(x) if isinstance(x, list | tuple) else None


def _named(workers: _Workers, by_index: Mapping[int, str]) -> dict[str, str]:
    return {workers.ids[i]: why for i, why in by_index.items()}


async def _on_first_answering(
    workers: _Workers, call: Callable[[int], Awaitable[dict[str, Any]]], failure: str
) -> dict[str, Any]:
    """``call`` on the usable, up-to-date workers in turn until one answers; each that fails is
    dropped. None answering is ``not_enough_workers``: ``failure`` and why each failed."""
    errors: dict[str, str] = {}
    for i in workers.usable():
        if i in workers.stale:
            continue
        try:
            return await call(i)
        except WorkerCallError as exc:
            errors[workers.ids[i]] = workers.drop(i, exc)
    raise StrategyFailed(
        ErrorCode.NOT_ENOUGH_WORKERS, f"{failure}; {_listed(errors)}", dropped=errors
    )


def _listed(reasons: Mapping[str, str]) -> str:
    if not reasons:
        return "no worker failed"
    return "dropped: " + "; ".join(f"{w} ({why})" for w, why in reasons.items())
