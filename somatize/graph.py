"""Filters and graphs of them: built with ``a >> b``, fitted in-process with :meth:`Graph.fit`.

A :class:`Filter` learns in ``fit(x, y=None) -> state`` and applies what it learned in
``forward(x, state) -> output``. Its state is *returned*, never kept on ``self``, so the same
filter object can be shipped to a worker, fitted there, and its state carried back and forth on
the wire. The filter that learns by gradient descent, :class:`~somatize.filters.TorchFilter`, is
in :mod:`somatize.filters`.

A graph is a chain of filters with stable node ids: the id a filter was given with
``Filter.named``, else its default name (snake case of its class, or of its module's class for a
``TorchFilter``), made unique in graph order with ``_2``, ``_3``... The ids are what states,
gradients and partitions are keyed by everywhere, locally and on the wire.

:meth:`Graph.fit` trains copies of the filters with :class:`engine.engine.Engine` — the same engine
the filter daemon runs — and returns a :class:`FittedGraph`; the graph's own filters (and the
initial weights of its modules) are left untouched, so one graph can be fitted many times, locally
and distributed, from the same starting point.
"""

from __future__ import annotations

import copy
import os
import re
from collections.abc import Iterator, Mapping
from typing import Any, Self, overload

from engine.data.dataset_rows import dataset_rows, is_map_dataset
from engine.devices import resolve_device
from engine.engine import Engine, FitSettings
from protocol.rules.rows import batch_problem, rows_of
from somatize.errors import GraphError
from somatize.keywords import suggesting
from somatize.saved import read, save


def snake_case(name: str) -> str:
    """``StandardScaler`` -> ``standard_scaler``; the default node id of a filter class."""
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", name).lower()


class Filter:
    """A unit of a graph: ``fit`` learns a state, ``forward`` applies it.

    Subclass and override both. The defaults make an identity filter with an empty state.
    """

    #: The node id chosen with :meth:`named`; ``None`` lets the graph derive one.
    name: str | None = None
    #: Trained by gradient descent by the engine (see :class:`TorchFilter`).
    differentiable: bool = False

    def fit(self, x: Any, y: Any = None) -> Any:
        """Learn from ``x`` (and labels ``y``) and return the state ``forward`` needs."""
        return {}

    def forward(self, x: Any, state: Any) -> Any:
        """Apply the learned ``state`` to ``x``."""
        return x

    def named(self, name: str) -> Self:
        """Choose this filter's node id in a graph (default: its class name in snake case)."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"a node id is a non-empty string, not {name!r}")
        self.name = name
        return self

    def default_name(self) -> str:
        """The node id used when none was chosen with :meth:`named`."""
        return snake_case(type(self).__name__)

    def __rshift__(self, other: Filter | Graph) -> Graph:
        return Graph([self]) >> other


class Graph:
    """An ordered chain of filters with stable node ids."""

    def __init__(self, filters: list[Filter]) -> None:
        seen: set[int] = set()
        for f in filters:
            if not isinstance(f, Filter):
                raise GraphError(f"a graph is made of Filters, not {type(f).__name__}")
            if id(f) in seen:
                raise GraphError(
                    f"the same {type(f).__name__} object appears twice in the graph; "
                    "use two instances"
                )
            seen.add(id(f))
        self._filters = list(filters)
        self._ids = _assign_ids(self._filters)

    def __rshift__(self, other: Filter | Graph) -> Graph:
        if isinstance(other, Graph):
            return Graph(self._filters + other._filters)
        if isinstance(other, Filter):
            return Graph([*self._filters, other])
        return NotImplemented

    @property
    def node_ids(self) -> list[str]:
        """Node ids in graph order."""
        return list(self._ids)

    def items(self) -> Iterator[tuple[str, Filter]]:
        """``(node_id, filter)`` pairs in graph order."""
        return iter(zip(self._ids, self._filters, strict=True))

    def __getitem__(self, node_id: str) -> Filter:
        try:
            return self._filters[self._ids.index(node_id)]
        except ValueError:
            raise KeyError(f"no node {node_id!r} in the graph (nodes: {self._ids})") from None

    def __len__(self) -> int:
        return len(self._filters)

    def __repr__(self) -> str:
        return " >> ".join(self._ids) or "Graph([])"

    @suggesting
    def fit(
        self,
        x: Any,
        y: Any = None,
        *,
        batch_size: int | None = None,
        device: str = "cpu",
        validation: tuple[Any, Any] | None = None,
    ) -> FittedGraph:
        """Train the graph in this process and return the fitted graph.

        Plain filters are fitted in order on all rows; each run of TorchFilters trains as one
        autograd graph (see :meth:`engine.fitting.Fitting.batched_fit`).

        Args:
            x: input rows: a numpy array or torch tensor, a tuple or dict of them with as many
                rows each (``{"ids": ..., "mask": ...}``: a TorchFilter's module is called as
                ``module(**x)``, a tuple's as ``module(*x)``), a map-style dataset (read a
                batch at a time, never whole; its ``(x, y)`` items' labels are ``y``), or
                whatever the first filter takes.
            y: labels, row-aligned with ``x``; none when the model computes its own loss
                (``loss="model"``) or a ``step`` function takes what the batch holds.
            batch_size: overrides the TorchFilters' own ``batch_size``.
            device: where the TorchFilters train (``"cpu"``, ``"cuda"``, ``"cuda:N"``,
                ``"mps"``); the fitted states are CPU tensors whatever it is.
            validation: ``(x_val, y_val)`` (``(x_val, None)`` without labels), evaluated at the
                end of every epoch with the model as it stands then, a batch at a time:
                ``val_loss`` (the last TorchFilter's loss) and its ``metrics``, in
                :attr:`FittedGraph.history`.

        Raises:
            ValueError: ``device`` is not a device, or not one of this machine's;
                ``validation`` is not a pair of row-aligned inputs and labels.
        """
        x, y = dataset_data(x, y)
        validation = checked_validation(validation)
        engine = Engine(device=resolve_device(device))
        engine.load({node_id: copy.deepcopy(f) for node_id, f in self.items()})
        settings = FitSettings(batch_size=batch_size, validation=validation, output=False)
        result = engine.fitting.batched_fit(self.node_ids, x, y, settings)
        return FittedGraph(
            self, result.states, history=result.history, validations=result.step_scores
        )


class FittedGraph:
    """A graph together with a learned state for every node.

    Attributes:
        graph: the graph that was fitted.
        states: each node's state by node id (a TorchFilter's is its module's ``state_dict``).
        history: a row per epoch (per round for FedAvg/FedProx: ``round``), when the graph
            trained a TorchFilter: ``epoch``, ``loss`` (the epoch's mean training loss), ``lr``
            (the learning rate of its last step) and, with validation data, ``val_loss`` and
            each metric of the model at the epoch's end.
        epoch_losses: the ``loss`` of each row of the history.
        validations: with ``validate_every=N`` (a TorchFilter's), the model's validation
            figures every N optimizer steps within an epoch: ``epoch``, ``step``, ``val_loss``
            and each metric (an epoch's end is in its history row).
    """

    def __init__(
        self,
        graph: Graph,
        states: Mapping[str, Any],
        *,
        history: list[dict[str, Any]] | None = None,
        validations: list[dict[str, Any]] | None = None,
    ) -> None:
        missing = [node_id for node_id in graph.node_ids if node_id not in states]
        if missing:
            raise GraphError(f"a fitted graph needs a state for every node; missing {missing}")
        self.graph = graph
        self.states = dict(states)
        self.history = [dict(row) for row in history or []]
        self.validations = [dict(row) for row in validations or []]

    @property
    def epoch_losses(self) -> list[float]:
        return [row["loss"] for row in self.history if "loss" in row]

    def forward(self, x: Any) -> Any:
        """Run ``x`` through the graph with the learned states, in this process."""
        engine = Engine()
        engine.load(dict(self.graph.items()))
        return engine.fitting.composite_forward(self.graph.node_ids, x, self.states)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the learned states to ``path``, without pickle: ``torch.load(path,
        weights_only=True)`` reads the file, and ``sz.load(path, graph)`` makes this fitted
        graph again from it and the graph (:mod:`somatize.saved` has its layout).

        Raises:
            GraphError: a state holds something that cannot be saved without pickle.
        """
        save(path, self.states, self.graph.node_ids, self.epoch_losses, self.history)

    def __repr__(self) -> str:
        return f"FittedGraph({self.graph!r})"


def dataset_data(x: Any, y: Any) -> tuple[Any, Any]:
    """``x`` and ``y`` as the engine takes them: a map-style dataset (``torch.utils.data``'s,
    a Hugging Face ``datasets.Dataset`` in its torch format) as row tables read a batch at a
    time (:mod:`engine.data.dataset_rows`), its pairs' labels as ``y`` unless ``y`` is
    given; anything else as it is."""
    if not is_map_dataset(x):
        return x, y
    rows, labels = dataset_rows(x)
    return rows, labels if y is None else y


def checked_validation(validation: Any) -> tuple[Any, Any] | None:
    """``validation`` as ``(x_val, y_val)``: a pair of batches with as many rows, ``y_val``
    ``None`` for a model that takes no labels (its own loss, or a step function); or a
    map-style dataset (:func:`dataset_data`).

    Raises:
        ValueError: it is not a pair of row-aligned inputs and labels.
    """
    if validation is None:
        return None
    if is_map_dataset(validation):
        return dataset_data(validation, None)
    if isinstance(validation, tuple | list) and len(validation) == 2:
        validation = dataset_data(*validation)
    if not isinstance(validation, tuple | list) or len(validation) != 2:
        raise ValueError(
            f"validation is a pair (x_val, y_val), or (x_val, None) without labels, not "
            f"{validation!r:.80}"
        )
    x_val, y_val = validation
    for name, data in (("x_val", x_val), ("y_val", y_val)):
        problem = batch_problem(data, name)
        if problem is not None:
            raise ValueError(problem)
    rows = [rows_of(x_val), rows_of(y_val) if y_val is not None else rows_of(x_val)]
    if None in rows or rows[0] != rows[1] or not rows[0]:
        raise ValueError(
            f"validation needs x_val and y_val with as many rows (got {rows[0]} and {rows[1]})"
        )
    return x_val, y_val


def _assign_ids(filters: list[Filter]) -> list[str]:
    chosen = [f.name for f in filters if f.name is not None]
    duplicates = sorted({n for n in chosen if chosen.count(n) > 1})
    if duplicates:
        raise GraphError(f"node ids must be unique; {duplicates} named more than once")
    taken = set(chosen)
    ids = []
    for f in filters:
        if f.name is not None:
            ids.append(f.name)
            continue
        base = f.default_name()
        candidate, n = base, 1
        while candidate in taken:
            n += 1
            candidate = f"{base}_{n}"
        taken.add(candidate)
        ids.append(candidate)
    return ids


@overload
def load(path: str | os.PathLike[str]) -> dict[str, Any]: ...
@overload
def load(path: str | os.PathLike[str], graph: Graph) -> FittedGraph: ...
def load(path: str | os.PathLike[str], graph: Graph | None = None) -> Any:
    """Read a file :meth:`FittedGraph.save` (or ``somatize result --save``) wrote
    (:mod:`somatize.saved` has its layout).

    Args:
        path: the file.
        graph: the graph the states are for (built again as it was to train).

    Returns:
        With ``graph``, the :class:`FittedGraph` (``forward`` it to predict); without, the
        states by node id, as they were saved.

    Raises:
        GraphError: the file is not one of these, or ``graph`` has other nodes than it.
    """
    saved = read(path)
    if graph is None:
        return saved.states
    if graph.node_ids != saved.node_ids:
        raise GraphError(
            f"{os.fspath(path)} holds the states of the nodes {saved.node_ids}, and the graph "
            f"has {graph.node_ids}: build the graph that was trained"
        )
    return FittedGraph(graph, saved.states, history=saved.history)
