"""Rows of a job's data, and the checks ``graph.fit`` makes on them, in words both sides use.

The engine (:mod:`engine.nodes`) refuses labels that do not have one row per input row, and a
TorchFilter to train without labels; the coordinator makes the same checks when a job is
submitted (:func:`coordinator.jobs.submission.vetted`), so that data ``graph.fit`` would refuse is
refused before it waits for workers, in the same words, rather than failing on a worker
mid-run. No I/O, no torch: rows are read from ``shape`` or ``len()``.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Sequence
from typing import Any

__all__ = ["inline_data_problem", "needs_labels", "rows_disagree", "rows_of"]


def rows_of(x: Any) -> int | None:
    """How many rows ``x`` has: its first dimension, or the length of a list or tuple
    (``None``: it is not row data, a scalar or an object)."""
    shape = getattr(x, "shape", None)
    if shape is not None and len(shape) > 0:
        return int(shape[0])
    return len(x) if isinstance(x, list | tuple) else None


def rows_disagree(x_rows: int, y_rows: int) -> str:
    """Why labels of ``y_rows`` rows cannot go with ``x_rows`` input rows."""
    return f"x has {x_rows} rows and y has {y_rows}: they must match"


def needs_labels(node_id: str, doing: str = "training") -> str:
    """Why the TorchFilter ``node_id`` cannot be trained (``doing``) without labels."""
    return f"node {node_id!r} is differentiable: {doing} it needs labels (y)"


def inline_data_problem(
    node_ids: Sequence[str], differentiable: Collection[str], x: Any, y: Any
) -> str | None:
    """Why ``graph.fit(x, y)`` would refuse data sent with a job of ``node_ids`` whose
    TorchFilters are ``differentiable``, in its words; ``None`` when it would not.

    The rows of ``x`` and ``y`` are checked first (their disagreement would otherwise surface
    as an index out of range on a worker), then the labels a TorchFilter needs (named as the
    engine names them: the last node of the first run of TorchFilters, whose loss it is).
    """
    if y is not None:
        x_rows, y_rows = rows_of(x), rows_of(y)
        if x_rows is None:
            return f"x of type {type(x).__name__} has no rows: give an array, a tensor or a list"
        if y_rows is None:
            return f"y of type {type(y).__name__} has no rows: give an array, a tensor or a list"
        if x_rows != y_rows:
            return rows_disagree(x_rows, y_rows)
    elif differentiable:
        first = next(i for i, n in enumerate(node_ids) if n in differentiable)
        run = itertools.takewhile(lambda n: n in differentiable, node_ids[first:])
        return needs_labels(list(run)[-1])
    return None
