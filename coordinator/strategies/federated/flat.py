"""The float leaves of a model state as one vector, and back.

Robust aggregation (Krum's distances between whole models), clipping (the norm of a whole
update) and masking (one vector per client) see a client's model as a point of R^d, not as a
tree. :class:`Flat` fixes the order once, from the first tree it is given (its float leaves,
depth first in that tree's key order), and then reads any tree of the same structure in that
order, whatever the order of its own keys; integer, bool and non-numeric leaves are not part
of the vector (they are never averaged: :mod:`~coordinator.strategies.aggregate`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeAlias

import numpy as np

from coordinator.strategies.aggregate import (
    AggregationError,
    Path,
    Tree,
    describe,
    iter_leaves,
    leaf_kind,
    leaf_shape,
    like,
    to_numpy,
)

Vector: TypeAlias = np.ndarray[Any, np.dtype[np.float64]]


class Flat:
    """The float leaves of trees shaped like ``template``, as float64 vectors of length
    :attr:`size`.

    Raises:
        AggregationError: ``template`` has a complex leaf (no real vector holds it).
    """

    def __init__(self, template: Tree) -> None:
        self.paths: list[Path] = []
        self.shapes: list[tuple[int, ...]] = []
        for path, leaf in iter_leaves(template):
            kind = leaf_kind(leaf)
            if kind == "complex":
                raise AggregationError.at(
                    path, f"complex leaves have no place in R^d ({describe(leaf)})"
                )
            if kind == "float":
                self.paths.append(path)
                self.shapes.append(leaf_shape(leaf))
        sizes = [int(np.prod(shape, dtype=np.int64)) for shape in self.shapes]
        self.bounds = np.cumsum([0, *sizes]).tolist()

    @property
    def size(self) -> int:
        """d: how many numbers the vector holds."""
        return int(self.bounds[-1])

    def vector(self, tree: Tree) -> Vector:
        """``tree``'s float leaves, in the template's order, as one float64 vector.

        Raises:
            AggregationError: a leaf is missing or of another shape than the template's.
        """
        out = np.empty(self.size, dtype=np.float64)
        for k, path in enumerate(self.paths):
            leaf = leaf_at(tree, path)
            if leaf_kind(leaf) != "float" or leaf_shape(leaf) != self.shapes[k]:
                raise AggregationError.at(
                    path,
                    f"expected a float leaf of shape {list(self.shapes[k])}, got {describe(leaf)}",
                )
            out[self.bounds[k] : self.bounds[k + 1]] = to_numpy(leaf).reshape(-1)
        return out

    def tree(self, vector: Vector, like_tree: Tree) -> Tree:
        """``like_tree`` with its float leaves taken from ``vector`` (each cast to its leaf's
        type, dtype and device); its other leaves as they are."""
        values = {
            path: vector[self.bounds[k] : self.bounds[k + 1]].reshape(self.shapes[k])
            for k, path in enumerate(self.paths)
        }
        return _replace((), like_tree, values)


def leaf_at(tree: Tree, path: Path) -> Any:
    """The leaf of ``tree`` at ``path``.

    Raises:
        AggregationError: ``path`` is not in ``tree``.
    """
    node = tree
    for depth, key in enumerate(path):
        try:
            node = node[key]
        except (KeyError, IndexError, TypeError):
            raise AggregationError.at(path[: depth + 1], "missing") from None
    return node


def _replace(path: Path, tree: Tree, values: dict[Path, Vector]) -> Tree:
    if isinstance(tree, Mapping):
        return {key: _replace((*path, key), value, values) for key, value in tree.items()}
    if isinstance(tree, list | tuple):
        items = [_replace((*path, i), value, values) for i, value in enumerate(tree)]
        return tuple(items) if isinstance(tree, tuple) else items
    new = values.get(path)
    return tree if new is None else like(tree, new)
