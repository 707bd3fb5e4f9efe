"""Rows held under a name for later commands, and reading a step's rows ahead.

Data-parallel and federated jobs send a worker its data once (or name a dataset of its own) and
then only name rows of it, so that per step only gradients (or per round only states) cross the
wire. A dataset read from disk by rows (:class:`~engine.data.npy_rows.Rows`) stays there: its
rows are read when asked for, the next step's in the background while this one is averaged.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from engine.batches import num_rows, on_disk, take, whole
from engine.data.read_ahead import NextRead
from engine.errors import EngineError
from engine.nodes import check_same_rows
from protocol.daemon import DataSource
from protocol.errors import ErrorCode

__all__ = ["HeldRows"]


class HeldRows:
    """Inputs and labels by name, on the CPU (batches go to the device as they are used)."""

    def __init__(self) -> None:
        self._held: dict[str, tuple[Any, Any]] = {}
        self._next: NextRead[tuple[str, bytes], tuple[Any, Any]] = NextRead()

    def hold(self, name: str, x: Any, y: Any = None) -> int:
        """Keep ``x`` (and ``y``) under ``name`` for later commands; returns the row count."""
        check_same_rows(x, y)
        self._next.drop()
        self._held[name] = (x, y)
        return num_rows(x)

    def of(self, source: DataSource, lazy: bool = False) -> tuple[Any, Any]:
        """The ``x`` and ``y`` a request names: given inline, or the ``rows`` (all: ``None``)
        of what is held under its ``data`` (:meth:`held`)."""
        if source.data is None:
            return source.x, source.y
        return self.held(source.data, source.rows, lazy=lazy)

    def held(
        self,
        name: str,
        rows: Sequence[int] | np.ndarray[Any, Any] | None = None,
        *,
        lazy: bool = False,
    ) -> tuple[Any, Any]:
        """The data held under ``name``, or its ``rows`` (in that order; a list, or an index
        array taken as it is). A dataset read from disk by rows (:class:`Rows`) is read whole
        for the whole of it, unless ``lazy``: then it is returned as it is, for a training loop
        that reads it a batch at a time (:mod:`engine.training`)."""
        try:
            x, y = self._held[name]
        except KeyError:
            raise EngineError(
                ErrorCode.BAD_REQUEST,
                f"no data held under {name!r} (held: {sorted(self._held)})",
            ) from None
        if rows is None:
            if lazy:
                return x, y
            return whole(x), whole(y)
        n = num_rows(x)
        index = np.asarray(rows, dtype=np.int64)
        if index.size and (index.min() < 0 or index.max() >= n):
            raise EngineError(
                ErrorCode.BAD_REQUEST,
                f"rows of {name!r} must lie in [0, {n}); "
                f"got {int(index.min())}..{int(index.max())}",
            )
        ahead = self._next.take((name, index.tobytes()))
        if ahead is not None:
            return ahead.result()
        return take(x, index), None if y is None else take(y, index)

    def read_next(self, name: str, rows: Sequence[int] | np.ndarray[Any, Any]) -> None:
        """Start reading ``rows`` of the data held under ``name`` in the background, for the
        :meth:`held` call that will ask for them: a data-parallel step's rows, read while the
        step before is averaged. Data in memory needs no reading ahead: nothing is done."""
        x, y = self._held.get(name, (None, None))
        index = np.asarray(rows, dtype=np.int64)
        if on_disk(x) and index.size and 0 <= index.min() <= index.max() < num_rows(x):

            def read() -> tuple[Any, Any]:
                return take(x, index), None if y is None else take(y, index)

            self._next.start((name, index.tobytes()), read)
