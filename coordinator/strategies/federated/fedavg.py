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

Here a client is a worker (or one of its ``clients_per_worker`` virtual clients); its data P_k
is its own dataset (``WorkerData``: the coordinator never uploads it; only what the filters return
comes back) or a contiguous shard of the rows the client sent, staged in its daemon once per job.

The loop above is :meth:`~coordinator.strategies.rounds.RoundStrategy.run`'s, the same for every
round strategy; FedAvg fills its hooks, each a line of the paper:

* ``start`` — initialize w_0: the TorchFilters' initial weights, as every worker unpickled them;
  or, resumed, w_t, the server optimizer's moments and t from the job's checkpoint.
* ``configure_round`` — S_t: ``sorted(default_rng(seed + t).choice(K, m, replace=False))`` over
  the usable workers' clients, m = max(``min_workers``, ⌈``fraction`` · K⌉); and how their models
  will be combined: the round's fold (:mod:`~coordinator.strategies.federated.round_fold`: the
  row-weighted mean, a Byzantine-robust rule of
  :mod:`~coordinator.strategies.federated.robust`, or DP-FedAvg's clipped and noised sum of
  :mod:`~coordinator.strategies.federated.privacy`), collected in the clear or masked
  (:mod:`~coordinator.strategies.federated.collection`,
  :mod:`~coordinator.strategies.federated.secure_aggregation`).
* ``train_round`` — ClientUpdate(k, w_t) on each k ∈ S_t in parallel (a worker's own clients in
  turn): ``batched_fit`` with a fresh optimizer (the TorchFilters' own optimizer, ``lr`` and
  batches) from w_t sent with it; each trained model collected as it arrives, so that the
  coordinator holds a few client states, not m. Workers that fail are dropped from the round
  (:mod:`~coordinator.strategies.federated.cohort`); it goes on if at least ``min_workers``
  answered.
* ``aggregate_round`` — w_{t+1} ← the fold's x̄, stepped through the server optimizer
  (:mod:`~coordinator.strategies.federated.server_optimizers`: plain averaging, or FedAvgM,
  FedAdagrad, FedAdam, FedYogi after Reddi et al. 2021) on the TorchFilters' states; plain
  filters (a ``Center`` before the network), fitted by each client on its own data every round
  as ``graph.fit`` would, take the row-weighted mean of the clients'.
* ``evaluate_round`` — the new global model evaluated
  (:mod:`~coordinator.strategies.federated.evaluation`); ``record_round`` its row of the history
  and the round's event; ``checkpoint_round`` w_{t+1}, the server's moments and t.
* ``final_states`` — the final model, set on a worker and read back over the wire.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from coordinator.context import StrategyContext
from coordinator.errors import StrategyFailed, StrategyOptionsError, WorkerCallError
from coordinator.strategies.base import Emit, JobInputs, Placement, concurrently
from coordinator.strategies.federated import robust
from coordinator.strategies.federated import server_optimizers as server_opt
from coordinator.strategies.federated.cohort import (
    ClientUpdate,
    Cohort,
    DroppedWorker,
    FederatedPosition,
    Shards,
    contiguous_shards,
    listed,
    reasons,
    round_lr,
)
from coordinator.strategies.federated.collection import Collection, InTheClear
from coordinator.strategies.federated.evaluation import Evaluated, RoundEvaluation
from coordinator.strategies.federated.privacy import DPFold, Privacy, load_accountant
from coordinator.strategies.federated.round_fold import RobustFold, RoundFold, RowWeightedMean
from coordinator.strategies.federated.secure_aggregation import SecureRound, SecureSum
from coordinator.strategies.history import History
from coordinator.strategies.rounds import RoundCheckpoints, RoundStrategy
from protocol.daemon import BatchedFitRequest
from protocol.errors import ErrorCode
from protocol.options.federated import FedAvgOptions
from protocol.rules.rows import rows_of

STAGED = "local"
"""The name a worker's training data is staged under in its daemon."""


@dataclass(kw_only=True)
class FederatedRun:
    """One run of a federated strategy: where it stands (:class:`FederatedPosition`, what a
    checkpoint saves) and what it runs with."""

    ctx: StrategyContext
    job: JobInputs
    emit: Emit
    torch_nodes: list[str]
    shards: Shards | None  # the rows sent, one shard per worker (None: WorkerData)
    position: FederatedPosition
    evaluation: RoundEvaluation
    history: History
    checkpoints: RoundCheckpoints

    @property
    def round(self) -> int:
        """The rounds done."""
        return self.position.round

    @round.setter
    def round(self, done: int) -> None:
        self.position.round = done

    @property
    def cohort(self) -> Cohort:
        return self.position.cohort


@dataclass
class FederatedRound:
    """One round t: S_t (drawn from ``population`` clients), how their models are combined,
    and what came of it."""

    t: int
    population: int
    selected: list[int]
    fold: RoundFold
    collection: Collection
    answered: list[ClientUpdate] = field(default_factory=list)
    dropped: list[DroppedWorker] = field(default_factory=list)
    how: dict[str, Any] = field(default_factory=dict)  # what the aggregation says of itself
    evaluated: Evaluated = field(default_factory=lambda: Evaluated(None))


class FedAvg(RoundStrategy[FederatedRun, FederatedRound]):
    """Federated averaging over the job's workers (module docstring); its options are
    :class:`~protocol.options.federated.FedAvgOptions` (``somatize.FedAvg``)."""

    options_model: ClassVar[type[FedAvgOptions]] = FedAvgOptions
    options: FedAvgOptions
    saves_checkpoints = True
    asks_start_loss: ClassVar[bool] = False
    """Whether each client reports its loss at w_t before training (q-FedAvg's F_k(w_t))."""

    def __init__(self, options: FedAvgOptions) -> None:
        super().__init__(options)
        if options.privacy is not None:
            # The accountant's import takes seconds: here, where a submitted job's strategy is
            # built off the event loop, not when its run starts on it.
            load_accountant()

    @property
    def rounds(self) -> int:
        return self.options.rounds

    def proximal_mu(self) -> float:
        """μ of the proximal term each client adds to its loss (FedProx's; 0: none)."""
        return 0.0

    def round_fold(self, torch_nodes: list[str], start: dict[str, Any]) -> RoundFold:
        """A new round's aggregation from w_t (``start``): the row-weighted mean, or the robust
        rule asked for."""
        if self.options.aggregator is None:
            return RowWeightedMean()
        return RobustFold(robust.for_options(self.options.aggregator), torch_nodes)

    def placement(self) -> Placement:
        o = self.options
        if o.workers is None:
            return Placement(workers=o.min_workers, tag=o.tag, all_matching=True, device=o.device)
        return Placement(workers=o.workers, tag=o.tag, device=o.device)

    def validate(self, job: JobInputs) -> None:
        o = self.options
        if not job.differentiable():
            raise StrategyOptionsError(
                f"{self.name} averages models trained by gradient descent and this graph has "
                "no TorchFilter; use Local"
            )
        if o.evaluate_fraction and (job.dataset is None or job.x_val is not None):
            raise StrategyOptionsError(
                f"{self.name}: evaluate_fraction has workers evaluate on their own validation "
                "data: the job trains on WorkerData and sends no x_val"
            )
        plain = [n for n in job.node_ids if n not in job.differentiable()]
        for option in ("privacy", "secure_aggregation"):
            if getattr(o, option) is not None and plain:
                raise StrategyOptionsError(
                    f"{self.name}: {option} covers the TorchFilters' models, and the plain "
                    f"filters {plain} would be averaged in the clear: leave them out of the job"
                )
        if job.dataset is not None:
            return  # the labels are the workers' own: each one's first round will tell
        torch_nodes = job.differentiable()
        missing = torch_nodes and job.missing_labels(torch_nodes[-1], self.name)
        if missing:
            raise StrategyOptionsError(missing)
        rows = rows_of(job.x)
        least = o.workers if o.workers is not None else o.min_workers
        if rows is not None and rows < least * o.clients_per_worker:
            clients = f"{least} workers"
            if o.clients_per_worker > 1:
                clients = f"{least * o.clients_per_worker} clients ({least} workers)"
            raise StrategyOptionsError(
                f"{self.name}: x has {rows} rows, too few to give each of {clients} a shard"
            )

    # -- the round loop's hooks (coordinator.strategies.rounds) ----------------------------------

    async def start(self, ctx: StrategyContext, job: JobInputs, emit: Emit) -> FederatedRun:
        torch_nodes = job.differentiable()
        cohort = Cohort([w.id for w in ctx.workers], per_worker=self.options.clients_per_worker)
        shards = contiguous_shards(job, ctx.num_workers(), self.name)

        # Ship the filters and stage each worker's data P_k, once per job.
        await emit("progress", {"phase": "loading", "workers": cohort.ids})
        failed = await cohort.set_up(ctx, job, STAGED, shards, range(ctx.num_workers()))
        staged = {cohort.ids[i]: n for i, n in sorted(cohort.rows.items())}
        await emit("progress", {"phase": "staged", "rows": staged, "dropped": reasons(failed)})
        cohort.check_ready(self.options.min_workers, failed)

        # initialize w_0: the TorchFilters' initial weights, as every worker unpickled them; or,
        # resumed, w_t, the server optimizer's moments and t from the job's checkpoint.
        checkpoints = RoundCheckpoints.of(job, self.options.checkpoint_every, self.rounds)
        position = await self._initial(ctx, cohort, torch_nodes, checkpoints, emit)
        checkpoints.start()
        # The new global model evaluated each round (coordinator.strategies.federated.evaluation):
        # on the rows sent, or by a share of the workers on their own (its rows weighted).
        share = self.options.evaluate_fraction or (1.0 if job.val_split is not None else 0.0)
        evaluation = RoundEvaluation(job, share, self.options.seed)
        history = History(emit, "round")
        return FederatedRun(
            ctx=ctx,
            job=job,
            emit=emit,
            torch_nodes=torch_nodes,
            shards=shards,
            position=position,
            evaluation=evaluation,
            history=history,
            checkpoints=checkpoints,
        )

    async def configure_round(self, run: FederatedRun, t: int) -> FederatedRound:
        at, cohort = run.position, run.cohort
        # S_t ← a random set of m = max(min_workers, ⌈C · K⌉) clients.
        population = len(cohort.clients())
        selected = self._select(t, cohort)
        # How their models will be combined: the weighted mean (or the robust rule asked for,
        # or q-FedAvg's update); clipped and noised for a private job (McMahan et al. 2018).
        fold: RoundFold
        if at.privacy is not None:
            fold = at.privacy.fold(at.global_state, run.torch_nodes, len(selected))
        else:
            fold = self.round_fold(run.torch_nodes, at.global_state)
        # And how they reach it: pulled in the clear, or masked for a sum the coordinator alone
        # sees (keys and shares exchanged before training).
        collection: Collection = InTheClear(fold, t)
        if self.options.secure_aggregation is not None:
            start = {n: at.global_state[n] for n in run.torch_nodes}
            labels = [cohort.label(c) for c in selected]
            secure = SecureRound(t, labels, self.options.secure_aggregation, start)
            collection = SecureSum(secure, at.global_state)
        early = await collection.before_training(run.ctx, cohort, selected)
        return FederatedRound(t, population, selected, fold, collection, dropped=early)

    async def train_round(self, run: FederatedRun, work: FederatedRound) -> None:
        # w^k_{t+1} ← ClientUpdate(k, w_t) on each k ∈ S_t in parallel (a worker's own clients
        # in turn), each collected as it arrives.
        turns: dict[int, list[int]] = {}
        for c in work.selected:
            turns.setdefault(run.cohort.worker_of(c), []).append(c)
        rounds = (self._worker_round(run, work, i, clients) for i, clients in turns.items())
        updates = [u for group in await concurrently(*rounds) for u in group]
        work.answered = [u for u in updates if isinstance(u, ClientUpdate)]
        work.dropped += [u for u in updates if isinstance(u, DroppedWorker)]
        run.cohort.check_answered(
            work.t,
            self.options.min_clients,
            work.selected,
            [u.client for u in work.answered],
            work.dropped,
        )

    async def aggregate_round(self, run: FederatedRun, work: FederatedRound) -> None:
        # w_{t+1} ← Σ (n_k / n) w^k_{t+1} (or the robust rule's aggregate, or the secure sum),
        # stepped through the server optimizer (Reddi et al. 2021) for the TorchFilters.
        at = run.position
        aggregate, how = await work.collection.aggregate(run.ctx, run.cohort, work.selected)
        if at.privacy is not None and isinstance(work.fold, DPFold):
            how |= at.privacy.spent(work.fold, len(work.selected), work.population)
        at.global_state = server_opt.step_on(
            at.server, at.global_state, aggregate, run.torch_nodes, work.t
        )
        work.how = how

    async def evaluate_round(self, run: FederatedRun, work: FederatedRound) -> None:
        # The new global model evaluated (on the rows sent, or federated).
        work.evaluated = await run.evaluation(
            run.ctx, run.cohort, run.position.global_state, work.t
        )

    async def record_round(self, run: FederatedRun, work: FederatedRound) -> None:
        answered, cohort = work.answered, run.cohort
        rows = sum(u.rows for u in answered)
        figures = [(u.metrics, u.rows) for u in answered]
        loss = sum(u.rows * u.loss for u in answered) / rows
        run.history.add(loss, rows, round_lr(answered), figures)
        said = {
            "rounds": self.rounds,
            "selected": [cohort.label(c) for c in work.selected],
            "workers": [cohort.label(u.client) for u in answered],
            "dropped": reasons(work.dropped),
            "rows": rows,
        }
        config = self.options.config_of(work.t)
        said |= work.how | ({"client_config": config} if self.options.client_config else {})
        await run.history.close(work.t, work.evaluated.scores, said | work.evaluated.event())

    async def checkpoint_round(self, run: FederatedRun, work: FederatedRound) -> None:
        # w_{t+1}, the server optimizer's moments (and the privacy spent): all a resumed run
        # needs, round t drawing its clients with default_rng(seed + t).
        if run.checkpoints.due(work.t, self.rounds):
            at = run.position
            state = {"global_state": at.global_state, "server": at.server.state_dict()}
            if at.privacy is not None:
                state["privacy"] = at.privacy.state_dict()
            await run.checkpoints.save(work.t, state)

    async def finish(self, run: FederatedRun) -> None:
        await run.checkpoints.flush()
        await run.history.finish({"round": run.round, "rounds": self.rounds})

    async def final_states(self, run: FederatedRun) -> dict[str, Any]:
        # The final model, set on a worker and read back over the wire.
        ctx, job, model = run.ctx, run.job, run.position.global_state

        async def read_back(i: int) -> dict[str, Any]:
            await ctx.set_state(i, model)
            return await ctx.read_back_state(i, job.node_ids)

        return await run.cohort.first_answering(
            read_back, "no worker is left to read the final model back from"
        )

    # -- the steps the hooks take ----------------------------------------------------------------

    async def _initial(
        self,
        ctx: StrategyContext,
        cohort: Cohort,
        torch_nodes: list[str],
        checkpoints: RoundCheckpoints,
        emit: Emit,
    ) -> FederatedPosition:
        """Where the rounds start: w_0 read from a worker, or the job's checkpoint (round t
        draws its clients with ``default_rng(seed + t)`` and trains them with fresh
        optimizers: w_t and the server's moments are all a resumed run needs)."""
        server = server_opt.for_options(self.options.server_optimizer())
        mechanism = self.options.privacy
        privacy = Privacy(mechanism) if mechanism is not None else None
        resume = checkpoints.resume
        if resume is None:
            initial = await cohort.first_answering(
                lambda i: ctx.get_state(i, torch_nodes), "no worker could give the initial model"
            )
            return FederatedPosition(initial, server, cohort, privacy=privacy)
        done, saved = resume
        server.load_state_dict(saved["server"])
        if privacy is not None and "privacy" in saved:
            # (A private job continuing one that was not accounts for its own rounds only.)
            privacy.load_state_dict(saved["privacy"])
        at = FederatedPosition(saved["global_state"], server, cohort, privacy=privacy)
        at.round = done
        await emit("resumed", checkpoints.resumed())
        return at

    def _select(self, r: int, cohort: Cohort) -> list[int]:
        """S_t: m of the usable workers' clients, drawn with ``default_rng(seed + r)``."""
        o = self.options
        usable = cohort.usable()
        if len(usable) < o.min_workers:
            lost = cohort.lost_reasons()
            raise StrategyFailed(
                ErrorCode.NOT_ENOUGH_WORKERS,
                f"round {r}: {len(usable)} usable workers left, min_workers is "
                f"{o.min_workers}; lost: {listed(cohort.lost.values())}",
                round=r,
                lost=lost,
            )
        clients = cohort.clients()
        m = max(o.min_clients, math.ceil(o.fraction * len(clients)))
        picks = np.random.default_rng(o.seed + r).choice(len(clients), m, replace=False)
        return [clients[p] for p in sorted(picks.tolist())]

    def _client_update(
        self, run: FederatedRun, t: int, client: int, model: dict[str, Any]
    ) -> BatchedFitRequest:
        """ClientUpdate(k, w_t) of ``client`` in round ``t``: local epochs of SGD with a fresh
        optimizer from w_t (``model``), as this round's client config says."""
        o, privacy = self.options, run.position.privacy
        config = o.config_of(t)
        return BatchedFitRequest(
            node_ids=run.job.node_ids,
            data=STAGED,
            rows=run.cohort.partition(client),
            epochs=config.get("local_epochs", o.local_epochs),
            lr=config.get("lr"),
            batch_size=config.get("batch_size"),
            prox_mu=self.proximal_mu(),
            reset_optimizer=True,
            # The learning-rate schedules span every round's local epochs; this round's start
            # where the rounds before left them.
            schedule_before=o.epochs_through(t - 1),
            schedule_epochs=max(1, o.epochs_through(o.rounds)),
            start_loss=self.asks_start_loss,
            clip_norm=privacy.client_clip if privacy is not None else None,
            return_output=False,  # the model's outputs on private data stay there
            return_states=False,  # collected after, a few clients at a time
            # Every client starts from w_t within its training's call (no set_state first):
            # one round trip fewer each, which a round over 10,000 feels.
            start=model,
        )

    async def _worker_round(
        self, run: FederatedRun, work: FederatedRound, i: int, clients: list[int]
    ) -> list[ClientUpdate | DroppedWorker]:
        """ClientUpdate(k, w_t) of each of ``clients`` on worker ``i``, in turn, their trained
        models collected; or why they dropped out. A client that fails is dropped and the
        worker goes on with the next, unless the worker itself is gone (lost, or its daemon
        with the job's data).

        Raises:
            StrategyFailed: a client's states cannot be aggregated with the others' (the round
                fails).
        """
        ctx, job, cohort = run.ctx, run.job, run.cohort
        if i in cohort.stale:
            failed = await cohort.set_up(ctx, job, STAGED, run.shards, [i])
            run.evaluation.forget(i)
            if failed:
                return [failed[0]]
        # Only the TorchFilters start from w_t: plain filters are fitted anew on the client's data.
        model = {n: run.position.global_state[n] for n in job.differentiable()}
        out: list[ClientUpdate | DroppedWorker] = []
        for c in clients:
            label = cohort.label(c)
            if not work.collection.trains(label):
                continue  # dropped out before training (secure aggregation's keys, shares)
            try:
                fit = await ctx.call(i, self._client_update(run, work.t, c, model))
                await work.collection.collect(ctx, i, label, fit, job.node_ids)
            except WorkerCallError as exc:
                dropped = cohort.drop(i, exc)
                out.append(DroppedWorker(label, dropped.code, dropped.message))
                if i in cohort.lost or i in cohort.stale:
                    return out
                continue
            out.append(ClientUpdate.of(c, fit))
        return out
