"""A map-style dataset as the row tables the engine trains on, read a batch at a time.

A ``torch.utils.data.Dataset`` (anything with ``len()`` and ``dataset[i]``: a Hugging Face
``datasets.Dataset`` in its torch format too) is never read whole: :func:`dataset_rows` makes it
row tables (:class:`~engine.data.npy_rows.Rows`) whose rows are read when a batch asks for them
— through the dataset's ``__getitems__`` when it has one (a batch in one call), else item by
item — and stacked; nothing is kept but the last batch's items, shared by its columns. An item
is ``(x, y)``, or ``x`` alone; ``x`` (and ``y``) an array or a tuple or dict of arrays: a dict
item (``{"input_ids": ..., "labels": ...}``) makes a dict batch.

``graph.fit(dataset)`` trains on one in process; ``sz.WorkerData(name, loader=make_dataset)``
makes one in the filter daemon: ``make_dataset(path)`` runs there, on the path the worker was
started with for ``name`` (``--data NAME=PATH``; a client never names a path) —
:func:`loader_rows`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from engine.data.npy_rows import Rows

__all__ = ["dataset_rows", "is_map_dataset", "loader_rows"]


def is_map_dataset(data: Any) -> bool:
    """Whether ``data`` is a map-style dataset rather than an array, a batch or a list of
    rows: it has ``len()`` and ``[i]`` and is none of those."""
    if isinstance(data, np.ndarray | Rows | list | tuple | Mapping | str | bytes):
        return False
    if getattr(data, "shape", None) is not None and hasattr(data, "dtype"):  # a tensor
        return False  # (a Hugging Face dataset has a shape too, and no dtype)
    return callable(getattr(data, "__getitem__", None)) and callable(getattr(data, "__len__", None))


class _Items:
    """The dataset's items, read for one index at a time; the last read is kept for the other
    columns (the engine takes each column's rows in turn, with the same index)."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset
        self._last: tuple[bytes, list[Any]] | None = None

    def read(self, index: np.ndarray[Any, Any]) -> list[Any]:
        key, last = index.tobytes(), self._last
        if last is not None and last[0] == key:
            return last[1]
        batched = getattr(self.dataset, "__getitems__", None)
        if callable(batched) and index.size:
            items = list(batched([int(i) for i in index]))
        else:
            items = [self.dataset[int(i)] for i in index]
        self._last = (key, items)
        return items


def _array(value: Any) -> np.ndarray[Any, Any]:
    detach = getattr(value, "detach", None)  # a torch tensor
    return np.asarray(detach().cpu().numpy() if callable(detach) else value)


def _at(item: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        item = item[key]
    return item


class _Column(Rows):
    """One array of the dataset's items (at ``path`` inside each), as a row table."""

    def __init__(self, items: _Items, path: tuple[Any, ...], first: Any, rows: int) -> None:
        self._items = items
        self._path = path
        sample = _array(_at(first, path))
        self.shape = (rows, *sample.shape)
        self.dtype = sample.dtype

    def _read(self, index: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        items = self._items.read(index)
        if not items:
            return np.empty((0, *self.shape[1:]), self.dtype)
        picked = [_array(_at(item, self._path)) for item in items]
        return np.stack(picked).astype(self.dtype, copy=False)


def _columns(items: _Items, first: Any, path: tuple[Any, ...], rows: int) -> Any:
    """The row tables of the part of each item at ``path``: one, or a tuple or dict of them."""
    value = _at(first, path)
    if isinstance(value, Mapping):
        return {k: _columns(items, first, (*path, k), rows) for k in value}
    if isinstance(value, tuple | list) and value and _arrays(value):
        return tuple(_columns(items, first, (*path, k), rows) for k in range(len(value)))
    return _Column(items, path, first, rows)


def _arrays(values: Any) -> bool:
    """A tuple of arrays (a batch's), not a row given as a list of numbers."""
    return all(getattr(v, "shape", None) is not None and len(v.shape) > 0 for v in values)


def dataset_rows(dataset: Any) -> tuple[Any, Any]:
    """``x`` and ``y`` (``None`` when the items are not pairs) of a map-style ``dataset``, as
    row tables read a batch at a time.

    Raises:
        ValueError: the dataset has no length or no items.
        Exception: whatever the dataset's first item raised (a user error).
    """
    try:
        rows = len(dataset)
    except TypeError as exc:
        raise ValueError(f"the dataset ({type(dataset).__name__}) has no len()") from exc
    if rows == 0:
        raise ValueError("the dataset is empty")
    first = dataset[0]
    items = _Items(dataset)
    if isinstance(first, tuple | list) and len(first) == 2:
        return _columns(items, first, (0,), rows), _columns(items, first, (1,), rows)
    return _columns(items, first, (), rows), None


def loader_rows(loader: Callable[[Path], Any], path: Path) -> tuple[Any, Any]:
    """``x`` and ``y`` of the dataset ``loader(path)`` makes (:func:`dataset_rows`).

    Raises:
        ValueError: the loader's dataset has no length or no items.
        Exception: whatever ``loader`` or the dataset's first item raised (a user error).
    """
    try:
        return dataset_rows(loader(path))
    except ValueError as exc:
        raise ValueError(str(exc).replace("the dataset", "the loader's dataset", 1)) from exc
