"""DiLoCo (Douillard et al. 2023): DataParallel's replicas, placement and data, each replica
stepping alone between synchronisations and an outer step at each.

On the torch collective the coordinator's part is DataParallel's (it is the rendezvous and the
clock, and never touches a weight): the replicas are told the outer step with their plan
(:class:`~protocol.daemon.OuterStepSpec`) and run it themselves (:mod:`engine.outer_step`).

Through the coordinator — workers that cannot reach each other, behind NAT — each replica trains
``alone`` (no group: :mod:`engine.replica`) from one synchronisation to the next, and at each
the coordinator reads every replica's weights, averages them (x̄, the mean of the replicas' local
models) and takes the outer step on the global weights it keeps: Nesterov SGD on the
pseudo-gradient x − x̄ is :class:`~coordinator.strategies.federated.server_optimizers.FedAvgM`
with ``nesterov`` (x + η (Δ + β m), Δ = x̄ − x), the same maths the replicas run over a group.
It then sets every replica to the new global weights. Each replica keeps its inner optimizer.

Either way the synchronisations fall after every ``sync_every`` steps of an epoch and at its end
(:func:`protocol.rules.batching.synchronises`), so the epoch's validation, its history row and the
result see the global model, which every replica holds alike.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from coordinator.context import StrategyContext
from coordinator.strategies.data_parallel.data_parallel import DataParallel, TrainingPhase
from coordinator.strategies.data_parallel.elastic import Replicas
from coordinator.strategies.data_parallel.star import average
from coordinator.strategies.data_parallel.torch_collective import chunk_progress, replica_plans
from coordinator.strategies.federated.server_optimizers import FedAvgM
from coordinator.strategies.history import Evaluate, History
from coordinator.strategies.steps import TrainingSettings
from protocol.daemon import DistPlanRequest, DistTrainRequest, OuterStepSpec
from protocol.options.server_optimizers import FedAvgMOptions
from protocol.options.strategies import DiLoCoOptions
from protocol.rules.batching import synchronises
from protocol.rules.traffic import sync_bytes

__all__ = ["CoordinatorSyncs", "DiLoCo"]


class DiLoCo(DataParallel):
    """``workers`` replicas that synchronise every ``sync_every`` steps (module docstring)."""

    options_model = DiLoCoOptions
    options: DiLoCoOptions
    saves_checkpoints = False

    def _outer_step(self) -> OuterStepSpec:
        return self.options.outer_step()

    def _traffic(self, shapes: list[list[int]]) -> dict[str, Any]:
        """A synchronisation's pseudo-gradients, every ``sync_every`` steps."""
        return {"sync_bytes": sync_bytes(shapes), "sync_every": self.options.sync_every}

    async def _through_coordinator(self, phase: TrainingPhase) -> None:
        """3. DiLoCo through the coordinator (module docstring)."""
        setup = phase.setup
        syncs = CoordinatorSyncs(
            setup.run,
            phase.training,
            phase.rows,
            setup.steps_per_epoch,
            self.options,
            phase.history,
            phase.evaluate,
        )
        await syncs.train(phase.total, phase.start)


@dataclass
class CoordinatorSyncs:
    """DiLoCo's training phase with the coordinator taking the outer steps (module
    docstring)."""

    run: Replicas
    training: TrainingSettings
    rows: int
    steps_per_epoch: int
    options: DiLoCoOptions
    history: History
    evaluate: Evaluate | None

    async def train(self, total: int, start: int) -> None:
        """Global steps ``[start, total)``: each round's inner steps on every replica, then
        the synchronisation; one progress event a round."""
        run, ctx = self.run, self.run.ctx
        replicas = list(range(ctx.num_workers()))
        plan = self._plans()
        await run.on_all(lambda i, fresh: ctx.call(i, plan(i)), replicas)
        nodes = run.torch_nodes
        global_state = await ctx.get_state(0, nodes)  # every replica's, after set-up
        o = self.options
        outer = FedAvgM(
            FedAvgMOptions(lr=o.outer_lr, momentum=o.outer_momentum, nesterov=o.nesterov)
        )
        step = start
        for stop in self._rounds(total):
            if stop <= step:
                continue
            run.position.phase, run.position.step = "training", step + 1
            results = await run.on_all(_train(ctx, step, stop), replicas)
            states = await run.on_all(lambda i, fresh: ctx.get_state(i, nodes), replicas)
            mean = average([(run.ids[i], 1.0, states[i]) for i in replicas])
            global_state = outer.step(global_state, mean)
            await run.on_all(_set(ctx, global_state), replicas)
            await chunk_progress(
                run.emit,
                self.training,
                self.steps_per_epoch,
                (step, stop),
                results,
                self.history,
                self.evaluate,
            )
            step = stop
        run.position.step = None

    def _plans(self) -> Callable[[int], DistPlanRequest]:
        """Each replica's plan: its rows, its place among the replicas, no group."""
        world = self.run.ctx.num_workers()
        shared = DistPlanRequest(
            node_ids=self.run.job.node_ids,
            data=self.run.staged,
            held=[],
            rows=0,
            epochs=self.training.epochs,
            batch_size=self.training.batch_size,
            shuffle=self.training.shuffle,
            seed=self.training.seed,
            outer=self.options.outer_step(),
            alone=True,
            world=world,
        )
        plan = replica_plans(self.run, shared, self.rows)
        return lambda i: plan(i).model_copy(update={"rank": i})

    def _rounds(self, total: int) -> list[int]:
        """The steps after which the replicas synchronise, as ``stop`` bounds."""
        per_epoch = self.steps_per_epoch
        in_epoch = [g % per_epoch for g in range(total)]
        ends = synchronises(in_epoch, [per_epoch] * total, self.options.sync_every)
        return [g + 1 for g in range(total) if ends[g]]


def _train(ctx: StrategyContext, start: int, stop: int) -> Callable[[int, bool], Awaitable[Any]]:
    """A replica's inner steps ``[start, stop)``, as :meth:`Replicas.on_all` calls it."""
    request = DistTrainRequest(start=start, stop=stop)
    return lambda i, fresh: ctx.call(i, request)


def _set(ctx: StrategyContext, states: dict[str, Any]) -> Callable[[int, bool], Awaitable[None]]:
    """A replica set to the global weights ``states``."""
    return lambda i, fresh: ctx.set_state(i, states)
