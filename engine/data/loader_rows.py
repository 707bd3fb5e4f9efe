"""A dataset made by the job's own code: ``sz.WorkerData(name, loader=make_dataset)``.

``make_dataset(path)`` runs in the filter daemon, on the path the worker was started with for
``name`` (``--data NAME=PATH``; a client never names a path), and returns a
``torch.utils.data.Dataset`` of ``(x, y)`` pairs (or of ``x`` alone) — an image folder, a parquet
file, anything such a dataset can read. :func:`loader_rows` makes it the two row tables the
engine trains on (:class:`~engine.data.npy_rows.Rows`): the rows a step asks for are read from the
dataset then, item by item, and stacked; nothing is read ahead or kept.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from engine.data.npy_rows import Rows

__all__ = ["loader_rows"]


class _Items:
    """The dataset's items, read for one index at a time; the last read is kept for the other
    column (the engine takes ``x``'s rows, then ``y``'s, with the same index)."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset
        self._last: tuple[bytes, list[Any]] | None = None

    def read(self, index: np.ndarray[Any, Any]) -> list[Any]:
        key, last = index.tobytes(), self._last
        if last is not None and last[0] == key:
            return last[1]
        items = [self.dataset[int(i)] for i in index]
        self._last = (key, items)
        return items


def _array(value: Any) -> np.ndarray[Any, Any]:
    detach = getattr(value, "detach", None)  # a torch tensor
    return np.asarray(detach().cpu().numpy() if callable(detach) else value)


class _Column(Rows):
    """One column (``x`` or ``y``) of the dataset's items, as a row table."""

    def __init__(self, items: _Items, column: int | None, first: Any, rows: int) -> None:
        self._items = items
        self._column = column
        sample = _array(first if column is None else first[column])
        self.shape = (rows, *sample.shape)
        self.dtype = sample.dtype

    def _read(self, index: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        items = self._items.read(index)
        if not items:
            return np.empty((0, *self.shape[1:]), self.dtype)
        picked = [item if self._column is None else item[self._column] for item in items]
        return np.stack([_array(v) for v in picked]).astype(self.dtype, copy=False)


def loader_rows(loader: Callable[[Path], Any], path: Path) -> tuple[Rows, Rows | None]:
    """``x`` and ``y`` (``None`` when the items are not pairs) of ``loader(path)``.

    Raises:
        ValueError: the loader's dataset has no length, no items, or items of another shape.
        Exception: whatever ``loader`` or the dataset's first item raised (a user error).
    """
    dataset = loader(path)
    try:
        rows = len(dataset)
    except TypeError as exc:
        raise ValueError(f"the loader's dataset ({type(dataset).__name__}) has no len()") from exc
    if rows == 0:
        raise ValueError("the loader's dataset is empty")
    first = dataset[0]
    items = _Items(dataset)
    if isinstance(first, tuple | list) and len(first) == 2:
        return _Column(items, 0, first, rows), _Column(items, 1, first, rows)
    return _Column(items, None, first, rows), None
