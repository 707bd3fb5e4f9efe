"""Evaluating a federated run's global model each round, the coordinator running no user code.

Two ways, by where the validation data is:

* sent with the job (``x_val``, ``y_val``): one worker evaluates the new global model on it
  (the first that answers), as ``graph.fit`` evaluates at an epoch's end;
* the workers' own (federated evaluation, Flower's ``evaluate``): ``evaluate_fraction`` of the
  usable workers — max(1, ⌈fraction · K⌉) of them, drawn with ``default_rng([seed, round, 1])``
  — each evaluate it on their own split of their dataset (``val``: an ``.npz``'s
  ``x_val``/``y_val``), and the round's figures are theirs weighted by rows
  (:func:`~coordinator.strategies.history.row_weighted`); each worker's are reported too. A
  worker that fails to evaluate is left out of the figures and named, the round goes on.

The validation rows are staged in a worker's daemon once (again after it is set up anew), the
global model set there, and the daemon evaluates (:class:`~protocol.daemon.EvaluateRequest`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from coordinator.context import StrategyContext
from coordinator.errors import WorkerCallError
from coordinator.strategies.base import JobInputs, concurrently
from coordinator.strategies.federated.cohort import Cohort, DroppedWorker, reasons
from coordinator.strategies.history import VALIDATION, row_weighted
from protocol.daemon import EvaluateRequest, StageRequest

__all__ = ["Evaluated", "RoundEvaluation"]

DEFAULT_SPLIT = "val"
"""The split federated evaluation reads when the job names none."""


@dataclass(frozen=True)
class Evaluated:
    """A round's evaluation: the figures (``None``: nothing evaluated), each worker's (by id,
    federated only) and who failed to."""

    scores: dict[str, Any] | None
    by_worker: dict[str, dict[str, Any]] = field(default_factory=dict)
    dropped: list[DroppedWorker] = field(default_factory=list)

    def event(self) -> dict[str, Any]:
        """What the round's event says of it beyond the row's figures."""
        said: dict[str, Any] = {}
        if self.by_worker:
            said["evaluation"] = self.by_worker
        if self.dropped:
            said["evaluation_dropped"] = reasons(self.dropped)
        return said


@dataclass
class RoundEvaluation:
    """How a federated run evaluates its global model (module docstring)."""

    job: JobInputs
    fraction: float  # federated evaluation's share of the workers (0: not federated)
    seed: int
    staged: set[int] = field(default_factory=set)  # workers holding the validation rows

    @property
    def federated(self) -> bool:
        return self.fraction > 0

    def stage(self) -> StageRequest:
        """What stages the validation rows on a worker."""
        if self.federated:
            split = self.job.val_split or DEFAULT_SPLIT
            return StageRequest(name=VALIDATION, dataset=self.job.dataset, split=split)
        return StageRequest(name=VALIDATION, x=self.job.x_val, y=self.job.y_val)

    async def __call__(
        self, ctx: StrategyContext, cohort: Cohort, model: Mapping[str, Any], r: int
    ) -> Evaluated:
        """Round ``r``'s evaluation of the global ``model``."""
        if self.federated:
            return await self._federated(ctx, cohort, model, r)
        if self.job.x_val is None:
            return Evaluated(None)
        scores = await cohort.first_answering(
            lambda i: self._on(ctx, i, model), f"round {r}: no worker could evaluate the model"
        )
        return Evaluated(scores)

    async def _federated(
        self, ctx: StrategyContext, cohort: Cohort, model: Mapping[str, Any], r: int
    ) -> Evaluated:
        ready = cohort.ready()
        m = max(1, math.ceil(self.fraction * len(ready)))
        picks = np.random.default_rng([self.seed, r, 1]).choice(len(ready), m, replace=False)
        chosen = [ready[p] for p in sorted(picks.tolist())]

        async def one(i: int) -> dict[str, Any] | DroppedWorker:
            try:
                return await self._on(ctx, i, model)
            except WorkerCallError as exc:
                return DroppedWorker.of(exc)

        answers = await concurrently(*(one(i) for i in chosen))
        by_worker = {
            cohort.ids[i]: a for i, a in zip(chosen, answers, strict=True) if isinstance(a, dict)
        }
        dropped = [a for a in answers if isinstance(a, DroppedWorker)]
        scores = row_weighted(list(by_worker.values())) if by_worker else None
        return Evaluated(scores, by_worker, dropped)

    async def _on(self, ctx: StrategyContext, i: int, model: Mapping[str, Any]) -> dict[str, Any]:
        """Worker ``i``'s evaluation of ``model`` on the validation rows it holds."""
        if i not in self.staged:
            await ctx.call(i, self.stage())
            self.staged.add(i)
        await ctx.set_state(i, dict(model))
        scores: dict[str, Any] = await ctx.call(
            i, EvaluateRequest(node_ids=self.job.node_ids, data=VALIDATION)
        )
        return scores

    def forget(self, i: int) -> None:
        """Worker ``i`` was set up anew: its daemon no longer holds the validation rows."""
        self.staged.discard(i)
