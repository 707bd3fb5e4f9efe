"""Local: the whole graph on one worker, all the data — the distributed path's baseline.

The result equals ``graph.fit`` in the client's process: the worker's daemon runs the same
engine on the same data. On ``WorkerData`` it trains where the data is: the worker stages its
own dataset and fits on it, as ``graph.fit`` would on those rows.
"""

from __future__ import annotations

from typing import Any

from coordinator.context import StrategyContext
from coordinator.strategies.base import Emit, JobInputs, Placement, Strategy
from coordinator.strategies.history import VALIDATION, History, validation_stage
from protocol.daemon import BatchedFitRequest
from protocol.options.strategies import LocalOptions

STAGED = "local"
"""The name a worker's own dataset is staged under in its daemon."""


class Local(Strategy):
    """One worker, optionally pinned by id (``worker``) or by ``tag``, and by ``device``."""

    options_model = LocalOptions
    options: LocalOptions

    def placement(self) -> Placement:
        o = self.options
        return Placement(workers=1, worker_id=o.worker, tag=o.tag, device=o.device)

    async def run(self, ctx: StrategyContext, job: JobInputs, emit: Emit) -> dict[str, Any]:
        # 1. Ship the filters to the worker's daemon, and the validation data.
        await emit("progress", {"phase": "loading", "nodes": len(job.node_ids)})
        await ctx.load(0, job.filters)
        validation = validation_stage(job)
        if validation is not None:
            await ctx.call(0, validation)
        # 2. Train the whole chain there, as graph.fit would (on its own rows for WorkerData),
        #    evaluating it on the validation data at the end of every epoch.
        data: dict[str, Any] = {"x": job.x, "y": job.y}
        if job.dataset is not None:
            staged = await ctx.call(0, job.own_data(STAGED))
            await emit("progress", {"phase": "training", "rows": staged["rows"]})
            data = {"data": STAGED}
        else:
            await emit("progress", {"phase": "training"})
        request = BatchedFitRequest(
            node_ids=job.node_ids,
            **data,
            validation=VALIDATION if validation is not None else None,
            return_output=False,
            return_states=False,
        )
        fit = await ctx.call(0, request)
        history = History(emit)
        for row in fit.get("history") or []:
            await history.record(row)
        for row in fit.get("step_scores") or []:  # validate_every's, made as the loop ran
            history.validations.append(dict(row))
        losses = [row["loss"] for row in history.rows]  # as before histories: the loss curve's
        await history.finish({"epochs": len(history.rows), "epoch_losses": losses})
        # 3. The states, read back over the wire.
        return await ctx.read_back_state(0, job.node_ids)
