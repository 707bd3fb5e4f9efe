"""The checks ``graph.fit`` makes on a job's data, made at submit in the same words: each case
is refused by :func:`protocol.rules.rows.inline_data_problem` exactly as ``graph.fit`` refuses it
(the in-process engine is the reference), and data ``graph.fit`` takes is not refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import somatize as sz
from engine.errors import EngineError
from protocol.rules.rows import inline_data_problem, rows_of
from tests.utils import Center


def _torch(name: str, n_in: int = 4) -> sz.TorchFilter:
    torch.manual_seed(0)
    return sz.TorchFilter(torch.nn.Linear(n_in, 4), loss="mse", epochs=1).named(name)


def _problem(graph: sz.Graph, x, y) -> str | None:
    differentiable = {n for n, f in graph.items() if getattr(f, "differentiable", False)}
    return inline_data_problem(graph.node_ids, differentiable, x, y)


X = np.zeros((10, 4), np.float32)
Y = np.zeros((10, 4), np.float32)

REFUSED = {
    "more x rows than y": (lambda: Center() >> _torch("net"), X, Y[:7]),
    "more y rows than x, plain only": (lambda: sz.Graph([Center()]), X[:3], Y),
    "no labels for a TorchFilter": (lambda: Center() >> _torch("net"), X, None),
    "no labels, the first run's last node": (
        lambda: _torch("a") >> _torch("b") >> Center() >> _torch("c"),
        X,
        None,
    ),
    "torch tensors of other lengths": (
        lambda: sz.Graph([_torch("net")]),
        torch.zeros(5, 4),
        torch.zeros(6, 4),
    ),
    "lists of other lengths": (lambda: sz.Graph([Center()]), X.tolist(), [0] * 9),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_data_graph_fit_refuses_is_refused_at_submit_in_its_words(case):
    make, x, y = REFUSED[case]
    with pytest.raises(EngineError) as in_process:
        make().fit(x, y)
    assert _problem(make(), x, y) == in_process.value.message


def test_data_graph_fit_takes_is_not_refused():
    assert _problem(Center() >> _torch("net"), X, Y) is None
    assert _problem(sz.Graph([Center()]), X, None) is None  # plain filters need no labels
    assert _problem(sz.Graph([_torch("net")]), torch.zeros(3, 4), np.zeros((3, 4))) is None


def test_the_rows_of_data():
    assert rows_of(X) == 10 and rows_of(torch.zeros(3, 2)) == 3 and rows_of([1, 2]) == 2
    assert rows_of(np.float32(1.0)) is None and rows_of({"a": 1}) is None
    assert "x of type dict has no rows" in str(inline_data_problem([], set(), {"a": 1}, Y))
