"""Means over rows of figures given a batch at a time.

An epoch's loss and metrics, a validation set's figures: each batch's figure is a mean over its
rows, and the whole is the mean weighted by the batches' rows. The engine adds a batch (or a
replica's slice of a global batch) at a time; the coordinator adds the replicas' slices of each
step of a data-parallel run the same way, so an epoch's figures are ``graph.fit``'s.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["RowMeans"]


class RowMeans:
    """Means over rows of figures given a batch at a time (each batch's figure a mean over its
    rows)."""

    def __init__(self) -> None:
        self._sums: dict[str, float] = {}
        self._rows: dict[str, int] = {}

    def add(self, figures: Mapping[str, float], rows: int) -> None:
        """A batch of ``rows`` rows with its ``figures``."""
        for name, value in figures.items():
            self._sums[name] = self._sums.get(name, 0.0) + float(value) * rows
            self._rows[name] = self._rows.get(name, 0) + rows

    def means(self, prefix: str = "") -> dict[str, float]:
        """Each figure's mean over the rows that gave it, named ``prefix + name``."""
        return {
            prefix + name: total / self._rows[name] if self._rows[name] else float("nan")
            for name, total in self._sums.items()
        }

    def state_dict(self) -> dict[str, Any]:
        """The sums so far (a checkpoint's)."""
        return {"sums": dict(self._sums), "rows": dict(self._rows)}

    @classmethod
    def of(cls, state: Mapping[str, Any] | None) -> RowMeans:
        """Means resumed from :meth:`state_dict`'s (``None``: none yet)."""
        means = cls()
        if state is not None:
            means._sums = {str(k): float(v) for k, v in state["sums"].items()}
            means._rows = {str(k): int(v) for k, v in state["rows"].items()}
        return means
