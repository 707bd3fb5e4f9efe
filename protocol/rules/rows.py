"""Rows of a job's data, and the checks ``graph.fit`` makes on them, in words both sides use.

A *batch* is an array (or tensor), or a tuple or a dict (``str`` keys) of batches, every array in
it with the same number of rows (its first dimension): ``{"ids": ..., "mask": ...}``, ``(x1,
x2)``. Everything that splits a job's data (global batches, replica slices, shards, micro-batches)
splits each of its arrays alike, with :func:`take_rows`. A list is rows, never a batch of arrays.

The engine (:mod:`engine.nodes`) refuses labels that do not have one row per input row, and a
TorchFilter to train without labels; the coordinator makes the same checks when a job is
submitted (:func:`coordinator.jobs.submission.vetted`), so that data ``graph.fit`` would refuse is
refused before it waits for workers, in the same words, rather than failing on a worker
mid-run. No I/O, no torch: rows are read from ``shape`` or ``len()``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from typing import Any

__all__ = [
    "batch_problem",
    "inline_data_problem",
    "is_batch_tree",
    "leaves",
    "map_leaves",
    "model_loss_with_labels",
    "needs_labels",
    "rows_disagree",
    "rows_of",
    "take_rows",
]


def _is_array(x: Any) -> bool:
    shape = getattr(x, "shape", None)
    return shape is not None and not isinstance(x, type) and len(shape) > 0


def is_batch_tree(x: Any) -> bool:
    """True for a tuple or a dict (``str`` keys) whose leaves are all arrays (tensors...) of at
    least one dimension: a batch of several arrays, split by rows alike."""
    if isinstance(x, tuple) and x:
        return all(_is_array(v) or is_batch_tree(v) for v in x)
    if isinstance(x, Mapping) and x:
        return all(isinstance(k, str) for k in x) and all(
            _is_array(v) or is_batch_tree(v) for v in x.values()
        )
    return False


def leaves(x: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """``(path, array)`` of every array of a batch (``x`` itself, path ``""``, for one array):
    ``["ids"]``, ``[0]``..."""
    if isinstance(x, tuple) and is_batch_tree(x):
        for k, v in enumerate(x):
            yield from leaves(v, f"{path}[{k}]")
    elif isinstance(x, Mapping) and is_batch_tree(x):
        for k, v in x.items():
            yield from leaves(v, f"{path}[{k!r}]")
    else:
        yield path, x


def map_leaves(fn: Callable[[Any], Any], x: Any) -> Any:
    """``x`` with ``fn`` applied to each of its arrays (to ``x`` itself when it is not a tuple
    or dict of arrays), the tuples and dicts kept as they are (a mapping becomes a ``dict``)."""
    if isinstance(x, tuple) and is_batch_tree(x):
        return tuple(map_leaves(fn, v) for v in x)
    if isinstance(x, Mapping) and is_batch_tree(x):
        return {k: map_leaves(fn, v) for k, v in x.items()}
    return fn(x)


def take_rows(x: Any, index: Any) -> Any:
    """Rows ``index`` (a slice, an index array) of every array of ``x``; ``None`` stays
    ``None``."""
    return None if x is None else map_leaves(lambda a: a[index], x)


def batch_problem(x: Any, name: str = "x") -> str | None:
    """Why ``x``, a tuple or dict of arrays, is not a batch: arrays whose rows disagree; or a
    tuple or dict mixing arrays and other values. ``None`` when it is one (or no tuple or dict
    of arrays at all)."""
    if not isinstance(x, tuple | Mapping) or not x:
        return None
    values = list(x.values()) if isinstance(x, Mapping) else list(x)
    if not any(_is_array(v) or is_batch_tree(v) for v in values):
        return None
    if not is_batch_tree(x):
        return (
            f"{name} mixes arrays with other values: a batch is an array, or a tuple or dict "
            "(str keys) of arrays"
        )
    rows = {path: int(a.shape[0]) for path, a in leaves(x)}
    if len(set(rows.values())) > 1:
        said = ", ".join(f"{name}{path} has {n}" for path, n in rows.items())
        return f"the arrays of a batch must have as many rows: {said}"
    return None


def rows_of(x: Any) -> int | None:
    """How many rows ``x`` has: its first dimension, that of every array of a batch (a tuple
    or dict of arrays), or the length of a list or tuple (``None``: it is not row data, a
    scalar or an object, or a batch whose arrays disagree: :func:`batch_problem`)."""
    if _is_array(x):
        return int(x.shape[0])
    if is_batch_tree(x):
        rows = {int(a.shape[0]) for _, a in leaves(x)}
        return rows.pop() if len(rows) == 1 else None
    return len(x) if isinstance(x, list | tuple) else None


def rows_disagree(x_rows: int, y_rows: int) -> str:
    """Why labels of ``y_rows`` rows cannot go with ``x_rows`` input rows."""
    return f"x has {x_rows} rows and y has {y_rows}: they must match"


def needs_labels(node_id: str, doing: str = "training") -> str:
    """Why the TorchFilter ``node_id`` cannot be trained (``doing``) without labels."""
    return (
        f"node {node_id!r} is differentiable: {doing} it needs labels (y), unless its model "
        "computes its own loss (loss='model') or a step= function says what a step computes"
    )


def model_loss_with_labels(node_id: str) -> str:
    """Why labels ``y`` cannot go with the TorchFilter ``node_id`` whose model computes its
    own loss."""
    return (
        f"node {node_id!r} has loss='model': its model computes the loss from the batch, so "
        "the labels belong in x (a dict's 'labels', say), not in y"
    )


def step_not_alone(node_id: str, joined: Sequence[str]) -> str:
    """Why the TorchFilter ``node_id`` with a ``step`` function cannot train with the
    TorchFilters ``joined`` next to it (which would train with it as one model)."""
    return (
        f"node {node_id!r} has a step function, and TorchFilters {list(joined)} stand beside "
        "it as one model: a filter with a step trains alone (put the modules in one, or a "
        "plain filter between)"
    )


def inline_data_problem(
    node_ids: Sequence[str],
    differentiable: Collection[str],
    x: Any,
    y: Any,
    labelled: Collection[str] | None = None,
) -> str | None:
    """Why ``graph.fit(x, y)`` would refuse data sent with a job of ``node_ids`` whose
    TorchFilters are ``differentiable``, in its words; ``None`` when it would not.

    A batch (a tuple or dict of arrays) whose arrays disagree is refused first, then rows of
    ``x`` and ``y`` that disagree (their disagreement would otherwise surface as an index out
    of range on a worker), then a missing label where the run's loss needs it (named as the
    engine names it: the last node of the first run of TorchFilters, whose loss it is), those
    runs being the ones whose last node is in ``labelled`` (default: all of them).
    """
    for name, data in (("x", x), ("y", y)):
        problem = batch_problem(data, name)
        if problem is not None:
            return problem
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
        last = list(run)[-1]
        if labelled is None or last in labelled:
            return needs_labels(last)
    return None
