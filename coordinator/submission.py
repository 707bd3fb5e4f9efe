"""What a submitted job is, or why it is refused: its strategy, inputs and placement.

Checked in a worker thread (:meth:`coordinator.jobs.JobManager.submit`): linear in the
graph's size, nothing here touches the event loop or the store.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from coordinator.errors import StrategyOptionsError
from coordinator.registry import WorkerRecord
from coordinator.strategies import JobInputs, Placement, Strategy, strategy_from_spec
from protocol.errors import ErrorCode, RequestRefused
from protocol.messages import Submit
from protocol.wording import listed

__all__ = ["placement_of", "rows_of", "unlabelled", "vetted"]


def vetted(msg: Submit) -> tuple[Strategy, JobInputs, Placement]:
    """The strategy, inputs and placement of a submitted job, or why it is refused (checked in
    a worker thread: see :meth:`JobManager.submit`).

    Raises:
        RequestRefused: ``BAD_REQUEST`` naming what is wrong.
    """
    try:
        strategy = strategy_from_spec(msg.strategy.name, msg.strategy.options)
    except StrategyOptionsError as exc:
        raise RequestRefused.of(ErrorCode.BAD_REQUEST, str(exc)) from exc
    missing = [n for n in msg.graph.node_ids if n not in msg.graph.filters]
    if missing or len(msg.graph.filters) != len(msg.graph.node_ids):
        raise RequestRefused.of(
            ErrorCode.BAD_REQUEST,
            "graph.filters must hold exactly the nodes of graph.node_ids; missing "
            f"{listed(missing)}",
        )
    filters = {n: msg.graph.filters[n] for n in msg.graph.node_ids}  # in graph order
    if msg.loader is not None and msg.dataset is None:
        raise RequestRefused.of(
            ErrorCode.BAD_REQUEST, "a loader opens a worker's dataset: name the dataset too"
        )
    if (msg.x is None) == (msg.dataset is None):
        raise RequestRefused.of(
            ErrorCode.BAD_REQUEST,
            "a job trains on data it sends (x, y) or on the workers' own dataset, "
            "exactly one of the two",
        )
    inputs = JobInputs(
        msg.graph.node_ids, filters, msg.x, msg.y, dict(msg.graph.nodes), msg.dataset, msg.loader
    )
    try:
        strategy.validate(inputs)
    except StrategyOptionsError as exc:
        raise RequestRefused.of(ErrorCode.BAD_REQUEST, str(exc)) from exc
    return strategy, inputs, placement_of(strategy, inputs)


def placement_of(strategy: Strategy, inputs: JobInputs) -> Placement:
    """The strategy's placement, also requiring the job's dataset on every worker."""
    placement = strategy.placement()
    if inputs.dataset is None:
        return placement
    return dataclasses.replace(placement, dataset=inputs.dataset)


def unlabelled(inputs: JobInputs, workers: Iterable[WorkerRecord]) -> str | None:
    """Why a job that trains TorchFilters on the workers' dataset cannot: every worker that
    serves it announced rows without labels (``y``). ``None`` when some has them, when what it
    holds is not known (a path for a loader), or when the job needs none."""
    name = inputs.dataset
    if name is None or inputs.loader is not None or not inputs.differentiable():
        return None
    served = [w for w in workers if name in w.datasets]
    if not served or any(w.datasets[name].x is None or w.datasets[name].y for w in served):
        return None
    return (
        f"dataset {name!r} has no labels (y) on {listed([w.id for w in served])}: its "
        "TorchFilters cannot train on it (serve it with a y.npy, or a y in the .npz)"
    )


def rows_of(x: Any) -> int | None:
    """How many rows ``x`` holds, when it says."""
    shape = getattr(x, "shape", None)
    if shape is not None and len(shape) > 0:
        return int(shape[0])
    return len(x) if isinstance(x, list | tuple) else None
