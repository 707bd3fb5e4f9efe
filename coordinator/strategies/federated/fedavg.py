"""FedAvg: federated averaging of models trained where the data is (FedProx: ``fedprox.py``).

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

Here a client is a worker; its data P_k is its own dataset (``WorkerData``: the coordinator never
uploads it; only what the filters return comes back) or a contiguous shard of the rows the
client sent, staged in its daemon once per job.
Selection is ``sorted(default_rng(seed + t).choice(K, m, replace=False))`` over the usable
workers, m = max(``min_workers``, ⌈``fraction`` · K⌉). ClientUpdate is ``batched_fit`` with a
fresh optimizer (the TorchFilters' own optimizer, ``lr`` and batches) from w_t sent with
``set_state``; the trained states are pulled (``get_state``) at most ``FETCHES`` at a time and
folded into an :class:`~coordinator.strategies.aggregate.Accumulator` as they arrive, so the
coordinator holds a few client states, not m; or, with an ``aggregator``, a Byzantine-robust
rule (:mod:`~coordinator.strategies.federated.robust`: median, trimmed mean, Krum, Bulyan) replaces
the mean on the TorchFilters' weights (:mod:`~coordinator.strategies.federated.round_fold`). The
server optimizer (:mod:`~coordinator.strategies.federated.server_optimizers`: plain averaging, or
FedAvgM, FedAdam, FedYogi after Reddi et al. 2021) then steps from w_t towards the mean on the
TorchFilters' states. Plain filters (a ``Center`` before the network) are fitted by each client on
its own data every round, as ``graph.fit`` would; their global state is the row-weighted mean of the
clients'.

Workers that fail in a round are dropped from it (:mod:`~coordinator.strategies.federated.cohort`);
the round goes on if at least ``min_workers`` answered. The final model is set on a worker and read
back over the wire.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Self

import numpy as np

from coordinator.context import StrategyContext
from coordinator.errors import StrategyFailed, StrategyOptionsError, WorkerCallError
from coordinator.jobs.checkpoints import CheckpointPolicy
from coordinator.strategies.aggregate import AggregationError
from coordinator.strategies.base import (
    Emit,
    JobInputs,
    Placement,
    Strategy,
    concurrently,
    parse_options,
)
from coordinator.strategies.federated import robust
from coordinator.strategies.federated import server_optimizers as server_opt
from coordinator.strategies.federated.cohort import (
    ClientUpdate,
    Cohort,
    DroppedWorker,
    FederatedPosition,
    contiguous_shards,
    listed,
    reasons,
    round_lr,
)
from coordinator.strategies.federated.evaluation import RoundEvaluation
from coordinator.strategies.federated.privacy import DPFold, Privacy
from coordinator.strategies.federated.round_fold import MeanFold, RobustFold, RoundFold
from coordinator.strategies.federated.secure_aggregation import SecureRound, each_client
from coordinator.strategies.history import History
from protocol.daemon import BatchedFitRequest
from protocol.errors import ErrorCode
from protocol.options.base import Dialect
from protocol.options.secure_aggregation import secagg_options
from protocol.options.strategies import (
    DEFAULT_KEEP_CHECKPOINTS,
    DEFAULT_RESTART_TIMEOUT,
    FedAvgOptions,
)
from protocol.rules.rows import rows_of

STAGED = "local"
"""The name a worker's training data is staged under in its daemon."""

FETCHES = 16
"""Trained states pulled from the workers at once: the coordinator holds at most this many
client states (arriving or being folded into the mean), however many workers train."""


class FedAvg(Strategy):
    """Federated averaging over the job's workers; the options are ``somatize.FedAvg``'s, the
    server optimizer given by name (``server_opt.OPTIMIZERS``) and hyperparameters, and
    ``prox_mu`` FedProx's μ (0 for FedAvg)."""

    name = "fedavg"
    saves_checkpoints = True
    asks_start_loss: ClassVar[bool] = False
    """Whether each client reports its loss at w_t before training (q-FedAvg's F_k(w_t))."""

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
        aggregator: Mapping[str, Any] | None = None,
        client_config: Sequence[Mapping[str, Any]] | None = None,
        clients_per_worker: int = 1,
        privacy: Mapping[str, Any] | None = None,
        secure_aggregation: Mapping[str, Any] | None = None,
        seed: int = 0,
        prox_mu: float = 0.0,
        device: str | None = None,
        checkpoint_every: int | None = None,
        keep_checkpoints: int = DEFAULT_KEEP_CHECKPOINTS,
        max_restarts: int = 0,
        restart_timeout: float = DEFAULT_RESTART_TIMEOUT,
        evaluate_fraction: float = 0.0,
    ) -> None:
        self.rounds = rounds
        self.local_epochs = local_epochs
        self.fraction = fraction
        self.min_workers = min_workers
        self.workers = workers
        self.tag = tag
        self.server = server
        self.server_options = dict(server_options or {})
        self.aggregator = dict(aggregator) if aggregator is not None else None
        self.client_config = [dict(c) for c in client_config] if client_config else None
        self.clients_per_worker = clients_per_worker
        self.privacy = dict(privacy) if privacy is not None else None
        self.secure_aggregation = (
            dict(secure_aggregation) if secure_aggregation is not None else None
        )
        self.seed = seed
        self.prox_mu = prox_mu
        self.device = device
        self.checkpoint_every = checkpoint_every
        self.keep_checkpoints = keep_checkpoints
        self.max_restarts = max_restarts
        self.restart_timeout = restart_timeout
        self.evaluate_fraction = evaluate_fraction
        self._evaluation: RoundEvaluation | None = None
        self._server_optimizer()  # refuse bad hyperparameters now, not when the job runs
        self._fold([], {})
        self._privacy()

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> Self:
        return cls(**arguments(parse_options(FedAvgOptions, options)))

    def _server_optimizer(self) -> server_opt.ServerOptimizer:
        """A new server optimizer (fresh moments) for one run."""
        try:
            return server_opt.from_options(self.server, self.server_options)
        except (ValueError, TypeError) as exc:
            raise StrategyOptionsError(f"{self.name}: server: {exc}") from None

    def _fold(self, torch_nodes: list[str], start: Mapping[str, Any]) -> RoundFold:
        """A new round's aggregation from w_t (``start``): the row-weighted mean, or the robust
        rule asked for."""
        if self.aggregator is None:
            return MeanFold()
        try:
            rule = robust.from_options(self.aggregator)
        except ValueError as exc:
            raise StrategyOptionsError(f"{self.name}: aggregator: {exc}") from None
        return RobustFold(rule, torch_nodes)

    def _privacy(self) -> Privacy | None:
        """A new run's DP-FedAvg state (clip, accountant), if the job asked for privacy."""
        if self.privacy is None:
            return None
        try:
            return Privacy(self.privacy)
        except ValueError as exc:
            raise StrategyOptionsError(f"{self.name}: privacy: {exc}") from None

    def placement(self) -> Placement:
        if self.workers is None:
            return Placement(
                workers=self.min_workers, tag=self.tag, all_matching=True, device=self.device
            )
        return Placement(workers=self.workers, tag=self.tag, device=self.device)

    def validate(self, job: JobInputs) -> None:
        if not job.differentiable():
            raise StrategyOptionsError(
                f"{self.name} averages models trained by gradient descent and this graph has "
                "no TorchFilter; use Local"
            )
        if self.evaluate_fraction and (job.dataset is None or job.x_val is not None):
            raise StrategyOptionsError(
                f"{self.name}: evaluate_fraction has workers evaluate on their own validation "
                "data: the job trains on WorkerData and sends no x_val"
            )
        plain = [n for n in job.node_ids if n not in job.differentiable()]
        for option in ("privacy", "secure_aggregation"):
            if getattr(self, option) is not None and plain:
                raise StrategyOptionsError(
                    f"{self.name}: {option} covers the TorchFilters' models, and the plain "
                    f"filters {plain} would be averaged in the clear: leave them out of the job"
                )
        if job.dataset is not None:
            return  # the labels are the workers' own: each one's first round will tell
        if job.y is None:
            raise StrategyOptionsError(f"{self.name} trains with labels: y is missing")
        rows = rows_of(job.x)
        least = self.workers if self.workers is not None else self.min_workers
        if rows is not None and rows < least * self.clients_per_worker:
            clients = f"{least} workers"
            if self.clients_per_worker > 1:
                clients = f"{least * self.clients_per_worker} clients ({least} workers)"
            raise StrategyOptionsError(
                f"{self.name}: x has {rows} rows, too few to give each of {clients} a shard"
            )

    async def run(self, ctx: StrategyContext, job: JobInputs, emit: Emit) -> dict[str, Any]:
        torch_nodes = job.differentiable()
        cohort = Cohort([w.id for w in ctx.workers], per_worker=self.clients_per_worker)
        shards = contiguous_shards(job, ctx.num_workers(), self.name)

        # Ship the filters and stage each worker's data P_k, once per job.
        await emit("progress", {"phase": "loading", "workers": cohort.ids})
        failed = await cohort.set_up(ctx, job, STAGED, shards, range(ctx.num_workers()))
        staged = {cohort.ids[i]: n for i, n in sorted(cohort.rows.items())}
        await emit("progress", {"phase": "staged", "rows": staged, "dropped": reasons(failed)})
        cohort.check_ready(self.min_workers, failed)

        # initialize w_0: the TorchFilters' initial weights, as every worker unpickled them; or,
        # resumed, w_t, the server optimizer's moments and t from the job's checkpoint.
        at = await self._start(ctx, job, cohort, torch_nodes, emit)
        policy = CheckpointPolicy(self.checkpoint_every, 1, time.monotonic)
        policy.start()
        # The new global model evaluated each round (coordinator.strategies.federated.evaluation):
        # on the rows sent, or by a share of the workers on their own (its rows weighted).
        share = self.evaluate_fraction or (1.0 if job.val_split is not None else 0.0)
        evaluate = self._evaluation = RoundEvaluation(job, share, self.seed)
        history = History(emit, "round")

        while at.round < self.rounds:
            r = at.round + 1
            # S_t ← a random set of m = max(min_workers, ⌈C · K⌉) clients.
            population = len(cohort.clients())
            selected = self._select(r, cohort)
            # w^k_{t+1} ← ClientUpdate(k, w_t) on each k ∈ S_t in parallel (a worker's own
            # clients in turn), each folded into the weighted mean as it arrives (a few client
            # states held, not m), or kept for the robust rule asked for.
            fold: RoundFold = self._fold(torch_nodes, at.global_state)
            if at.privacy is not None:  # clipped updates, noised (McMahan et al. 2018)
                fold = at.privacy.fold(at.global_state, torch_nodes, len(selected))
            fetch = asyncio.Semaphore(FETCHES)
            secure, early = None, list[DroppedWorker]()
            if self.secure_aggregation is not None:  # keys and shares before training
                secure, early = await self._secure_setup(ctx, at, selected, torch_nodes)
            turns: dict[int, list[int]] = {}
            for c in selected:
                turns.setdefault(cohort.worker_of(c), []).append(c)
            updates = [
                u
                for group in await concurrently(
                    *(
                        self._worker_round(ctx, job, shards, at, i, clients, fold, fetch, secure)
                        for i, clients in turns.items()
                    )
                )
                for u in group
            ]
            answered = [u for u in updates if isinstance(u, ClientUpdate)]
            dropped = early + [u for u in updates if isinstance(u, DroppedWorker)]
            cohort.check_answered(
                r, self.min_clients, selected, [u.client for u in answered], dropped
            )
            # w_{t+1} ← Σ (n_k / n) w^k_{t+1} (or the robust rule's aggregate), stepped through
            # the server optimizer (Reddi et al. 2021) for the TorchFilters.
            if secure is not None:
                aggregate, how = await self._secure_sum(ctx, at, selected, secure)
            else:
                aggregate, how = fold.result()
            if at.privacy is not None and isinstance(fold, DPFold):
                how |= at.privacy.spent(fold, len(selected), population)
            at.global_state = server_opt.step_on(
                at.server, at.global_state, aggregate, torch_nodes, r
            )
            at.round = r
            rows = sum(u.rows for u in answered)
            # The new global model evaluated (on the rows sent, or federated), and the
            # round's row of the history.
            evaluated = await evaluate(ctx, cohort, at.global_state, r)
            history.add(sum(u.rows * u.loss for u in answered) / rows, rows, round_lr(answered))
            said = {
                "rounds": self.rounds,
                "selected": [cohort.label(c) for c in selected],
                "workers": [cohort.label(u.client) for u in answered],
                "dropped": reasons(dropped),
                "rows": rows,
            }
            said |= how | ({"client_config": self.config_of(r)} if self.client_config else {})
            await history.close(r, evaluated.scores, said | evaluated.event())
            if job.checkpoints is not None and policy.due(r, self.rounds):
                state = {"global_state": at.global_state, "server": at.server.state_dict()}
                if at.privacy is not None:
                    state["privacy"] = at.privacy.state_dict()
                await job.checkpoints.save({"round": r}, state)
                policy.saved()

        if job.checkpoints is not None:
            await job.checkpoints.flush()
        await history.finish({"round": at.round, "rounds": self.rounds})

        # The final model, set on a worker and read back over the wire.
        async def read_back(i: int) -> dict[str, Any]:
            await ctx.set_state(i, at.global_state)
            return await ctx.read_back_state(i, job.node_ids)

        return await cohort.first_answering(
            read_back, "no worker is left to read the final model back from"
        )

    async def _start(
        self,
        ctx: StrategyContext,
        job: JobInputs,
        cohort: Cohort,
        torch_nodes: list[str],
        emit: Emit,
    ) -> FederatedPosition:
        """Where the rounds start: w_0 read from a worker, or the job's checkpoint (round t
        draws its clients with ``default_rng(seed + t)`` and trains them with fresh
        optimizers: w_t and the server's moments are all a resumed run needs)."""
        server, privacy = self._server_optimizer(), self._privacy()
        resume = job.checkpoints.resume if job.checkpoints is not None else None
        if resume is None:
            initial = await cohort.first_answering(
                lambda i: ctx.get_state(i, torch_nodes), "no worker could give the initial model"
            )
            return FederatedPosition(initial, server, cohort, privacy=privacy)
        server.load_state_dict(resume.payload["server"])
        if privacy is not None and "privacy" in resume.payload:
            # (A private job continuing one that was not accounts for its own rounds only.)
            privacy.load_state_dict(resume.payload["privacy"])
        at = FederatedPosition(resume.payload["global_state"], server, cohort, privacy=privacy)
        at.round = int(resume.position["round"])
        assert job.checkpoints is not None
        await emit("resumed", job.checkpoints.resumed())
        return at

    def config_of(self, r: int) -> dict[str, Any]:
        """Round ``r``'s client config (``{}``: the strategy's and the filters' own)."""
        return self.client_config[r - 1] if self.client_config else {}

    def epochs_through(self, r: int) -> int:
        """The local epochs a client trains in rounds 1 to ``r``: what its learning-rate
        schedules have stepped through by the end of round ``r``."""
        rounds = range(1, r + 1)
        return sum(self.config_of(t).get("local_epochs", self.local_epochs) for t in rounds)

    @property
    def min_clients(self) -> int:
        """The fewest clients a round needs answers from: ``min_workers`` workers' worth."""
        return self.min_workers * self.clients_per_worker

    def _select(self, r: int, cohort: Cohort) -> list[int]:
        """S_t: m of the usable workers' clients, drawn with ``default_rng(seed + r)``."""
        usable = cohort.usable()
        if len(usable) < self.min_workers:
            lost = cohort.lost_reasons()
            raise StrategyFailed(
                ErrorCode.NOT_ENOUGH_WORKERS,
                f"round {r}: {len(usable)} usable workers left, min_workers is "
                f"{self.min_workers}; lost: {listed(cohort.lost.values())}",
                round=r,
                lost=lost,
            )
        clients = cohort.clients()
        m = max(self.min_clients, math.ceil(self.fraction * len(clients)))
        picks = np.random.default_rng(self.seed + r).choice(len(clients), m, replace=False)
        return [clients[p] for p in sorted(picks.tolist())]

    async def _worker_round(
        self,
        ctx: StrategyContext,
        job: JobInputs,
        shards: list[tuple[Any, Any]] | None,
        at: FederatedPosition,
        i: int,
        clients: list[int],
        fold: RoundFold,
        fetch: asyncio.Semaphore,
        secure: SecureRound | None = None,
    ) -> list[ClientUpdate | DroppedWorker]:
        """ClientUpdate(k, w_t) of each of ``clients`` on worker ``i``, in turn, their trained
        states folded into ``fold``; or why they dropped out. The states are pulled ``fetch``
        at a time, not sent with the fit's reply: m clients finishing together would push m
        states into memory at once. A client that fails is dropped and the worker goes on with
        the next, unless the worker itself is gone (lost, or its daemon with the job's data).

        Raises:
            StrategyFailed: a client's states cannot be aggregated with the others' (the round
                fails).
        """
        cohort = at.cohort
        if i in cohort.stale:
            failed = await cohort.set_up(ctx, job, STAGED, shards, [i])
            if self._evaluation is not None:
                self._evaluation.forget(i)
            if failed:
                return [failed[0]]
        # Only the TorchFilters start from w_t: plain filters are fitted anew on the client's data.
        model = {n: at.global_state[n] for n in job.differentiable()}
        config = self.config_of(at.round + 1)
        out: list[ClientUpdate | DroppedWorker] = []
        for c in clients:
            if secure is not None and cohort.label(c) not in secure.shared:
                continue  # dropped out before training (keys, shares): counted there
            train = BatchedFitRequest(
                node_ids=job.node_ids,
                data=STAGED,
                rows=cohort.partition(c),
                epochs=config.get("local_epochs", self.local_epochs),
                lr=config.get("lr"),
                batch_size=config.get("batch_size"),
                prox_mu=self.prox_mu,
                reset_optimizer=True,
                # The schedules span every round's local epochs; this round's start where the
                # rounds before left them.
                schedule_before=self.epochs_through(at.round),
                schedule_epochs=max(1, self.epochs_through(self.rounds)),
                start_loss=self.asks_start_loss,
                clip_norm=at.privacy.client_clip if at.privacy is not None else None,
                return_output=False,  # the model's outputs on private data stay there
                return_states=False,  # pulled below, a few clients at a time
                # Every client starts from w_t within its training's call (no set_state
                # first): one round trip fewer each, which a round over 10,000 feels.
                start=model,
            )
            try:
                fit = await ctx.call(i, train)
                if secure is not None:  # its masked model, never the model itself
                    masked = await ctx.call(i, secure.mask_request(cohort.label(c), fit["rows"]))
                    secure.took_masked(cohort.label(c), masked["masked"])
                    out.append(ClientUpdate.of(c, fit))
                    continue
                async with fetch:
                    states = await ctx.get_state(i, job.node_ids)
                    try:
                        fold.add(cohort.label(c), fit, states)
                    except AggregationError as exc:
                        raise StrategyFailed(
                            ErrorCode.AGGREGATION_MISMATCH, f"round {at.round + 1}: {exc}"
                        ) from exc
            except WorkerCallError as exc:
                dropped = cohort.drop(i, exc)
                out.append(DroppedWorker(cohort.label(c), dropped.code, dropped.message))
                if i in cohort.lost or i in cohort.stale:
                    return out
                continue
            out.append(ClientUpdate.of(c, fit))
        return out

    async def _secure_setup(
        self,
        ctx: StrategyContext,
        at: FederatedPosition,
        selected: list[int],
        torch_nodes: list[str],
    ) -> tuple[SecureRound, list[DroppedWorker]]:
        """Secure aggregation's first two steps for round t's ``selected`` clients: their keys,
        then their shares (Bonawitz et al. 2017, rounds 0 and 1); who dropped out in them."""
        cohort = at.cohort
        options = secagg_options(self.secure_aggregation or {}, Dialect.WIRE)
        start = {n: at.global_state[n] for n in torch_nodes}
        secure = SecureRound(at.round + 1, [cohort.label(c) for c in selected], options, start)
        dropped = await each_client(ctx, cohort, selected, secure.keys_request, secure.took_keys)
        keyed = [c for c in selected if cohort.label(c) in secure.keys]
        dropped += await each_client(ctx, cohort, keyed, secure.share_request, secure.took_shares)
        return secure, dropped

    async def _secure_sum(
        self, ctx: StrategyContext, at: FederatedPosition, selected: list[int], secure: SecureRound
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """Round t's last step (Unmasking): the survivors' shares, and from them the mean of
        their models; the survivors that failed it (their models are in the sum all the same)."""
        cohort = at.cohort
        survivors = [c for c in selected if cohort.label(c) in secure.masked]
        late = await each_client(ctx, cohort, survivors, secure.unmask_request, secure.took_unmask)
        model = secure.result()
        summary: dict[str, Any] = {"summed": len(secure.masked)}
        if late:
            summary["unmask_failed"] = reasons(late)
        return {**at.global_state, **model}, {"secure_aggregation": summary}


def arguments(options: FedAvgOptions) -> dict[str, Any]:
    """The constructor's arguments from checked options (the server optimizer as its name and
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
        "aggregator": options.aggregator,
        "client_config": options.client_config,
        "clients_per_worker": options.clients_per_worker,
        "privacy": options.privacy,
        "secure_aggregation": options.secure_aggregation,
        "seed": options.seed,
        "device": options.device,
        "checkpoint_every": options.checkpoint_every,
        "keep_checkpoints": options.keep_checkpoints,
        "max_restarts": options.max_restarts,
        "restart_timeout": options.restart_timeout,
        "evaluate_fraction": options.evaluate_fraction,
    }
