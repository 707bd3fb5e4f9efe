"""A fitted graph saved and loaded without pickle (issue 18, item 5): ``FittedGraph.save`` /
``sz.load``, read back by torch's restricted unpickler alone, every leaf as it was."""

from __future__ import annotations

import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import somatize as sz
from somatize.cli.demo import digits_graph
from somatize.cli.tables import describe_state, dtype_name
from somatize.saved import save


def _digits_like(n: int = 120) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 64)).astype(np.float32), rng.integers(0, 10, size=n)


class Odd(sz.Filter):
    """A plain filter whose state holds every kind of leaf a state may hold."""

    def fit(self, x: Any, y: Any = None) -> Any:
        return {
            "mean": np.asarray(x).mean(0),
            "count": np.int64(len(x)),
            "bf16": torch.ones(3, dtype=torch.bfloat16),
            "pair": (np.arange(3, dtype=np.uint16), [np.float32(0.5), "text", None, True]),
            7: 1.5,
        }

    def forward(self, x: Any, state: Any) -> Any:
        return np.asarray(x) - state["mean"]


def _same(a: Any, b: Any) -> None:
    """``a`` and ``b`` hold the same leaves, of the same types, shapes, dtypes and values."""
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, dict):
        assert list(a) == list(b)
        for key in a:
            _same(a[key], b[key])
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for u, v in zip(a, b, strict=True):
            _same(u, v)
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    elif isinstance(a, np.ndarray | np.generic):
        assert a.dtype == b.dtype and np.shape(a) == np.shape(b)
        np.testing.assert_array_equal(a, b)
    else:
        assert a == b


def test_a_fitted_graph_saved_loads_with_weights_only_and_predicts_the_same(tmp_path):
    x, y = _digits_like()
    fitted = digits_graph(epochs=2).fit(x, y)
    path = tmp_path / "digits.pt"
    fitted.save(path)

    raw = torch.load(path, weights_only=True)  # torch's restricted unpickler: no code runs
    assert raw["format"] == "somatize.fitted" and raw["version"] == 1
    assert raw["node_ids"] == ["standardize", "hidden", "head"]
    assert isinstance(raw["states"]["standardize"]["mean"], torch.Tensor)
    assert raw["epoch_losses"] == pytest.approx(fitted.epoch_losses)

    again = sz.load(path, digits_graph(epochs=2))  # the graph built again, as to train
    assert isinstance(again, sz.FittedGraph)
    _same(again.states, fitted.states)
    assert again.epoch_losses == pytest.approx(fitted.epoch_losses)
    np.testing.assert_array_equal(np.asarray(again.forward(x)), np.asarray(fitted.forward(x)))
    _same(sz.load(path), fitted.states)  # without the graph: the states by node id


def test_every_kind_of_leaf_comes_back_as_it_was(tmp_path):
    x, _ = _digits_like(10)
    fitted = sz.Graph([Odd().named("odd")]).fit(x)
    fitted.save(tmp_path / "odd.pt")
    _same(sz.load(tmp_path / "odd.pt"), fitted.states)


def test_what_cannot_be_saved_without_pickle_is_refused_naming_node_and_key(tmp_path):
    class Holder:
        pass

    for state, words in (
        ({"vocab": {"words": np.array(["a", "b"])}}, "node 'n', key 'vocab''words': a numpy"),
        ({"model": Holder()}, "node 'n', key 'model': a Holder is not saved without pickle"),
        ({(1, 2): 3}, "dict keys must be strings or integers, not (1, 2)"),
    ):
        with pytest.raises(sz.GraphError) as refused:
            save(tmp_path / "x.pt", {"n": state}, ["n"])
        assert words in str(refused.value)
    with pytest.raises(sz.GraphError, match=r"no state for the nodes \['m'\]"):
        save(tmp_path / "x.pt", {"n": {}}, ["n", "m"])


def test_load_refuses_other_files_and_another_graph_and_runs_no_code(tmp_path):
    x, y = _digits_like()
    path = tmp_path / "digits.pt"
    digits_graph(epochs=1).fit(x, y).save(path)
    with pytest.raises(sz.GraphError, match=r"holds the states of the nodes \['standardize'"):
        sz.load(path, sz.Graph([Odd().named("odd")]))

    torch.save({"some": torch.zeros(2)}, tmp_path / "plain.pt")
    with pytest.raises(sz.GraphError, match="is not a saved fitted graph"):
        sz.load(tmp_path / "plain.pt")

    ran = tmp_path / "ran"
    torch.save({"format": "somatize.fitted", "states": _Payload(str(ran))}, tmp_path / "evil.pt")
    with pytest.raises(sz.GraphError, match="is not a saved fitted graph"):
        sz.load(tmp_path / "evil.pt")
    assert not ran.exists()  # the pickled call was refused, never made
    with zipfile.ZipFile(tmp_path / "evil.pt") as z:  # (it was there to be made)
        assert any(b"_touch" in z.read(n) for n in z.namelist() if n.endswith(".pkl"))


def _touch(path: str) -> None:
    Path(path).touch()


class _Payload:
    """Unpickled by a full unpickler, it would create the file ``path``."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (_touch, (self.path,))


def test_the_result_table_names_dtypes_one_way():
    assert dtype_name(np.dtype("float32")) == dtype_name(torch.float32) == "float32"
    assert dtype_name(torch.bfloat16) == "bfloat16" and dtype_name(np.dtype("int64")) == "int64"
    rows = dict(
        (key, dtype)
        for key, _, dtype in describe_state({"mean": np.zeros(3, np.float32), "w": torch.ones(2)})
    )
    assert rows == {"mean": "float32", "w": "float32"}


def test_the_history_is_saved_with_the_states_and_an_older_file_keeps_its_losses(tmp_path):
    x, y = _digits_like()
    fitted = digits_graph(epochs=2).fit(x, y, validation=(x[:40], y[:40]))
    assert [row["epoch"] for row in fitted.history] == [1, 2] and "val_loss" in fitted.history[0]
    fitted.save(tmp_path / "with.pt")
    again = sz.load(tmp_path / "with.pt", digits_graph(epochs=2))
    assert again.history == fitted.history

    # A file written before histories (states and losses only): its losses are its rows.
    save(tmp_path / "before.pt", fitted.states, fitted.graph.node_ids, fitted.epoch_losses)
    raw = torch.load(tmp_path / "before.pt", weights_only=True)
    del raw["history"]
    torch.save(raw, tmp_path / "before.pt")
    older = sz.load(tmp_path / "before.pt", digits_graph(epochs=2))
    losses = fitted.epoch_losses
    assert older.history == [{"epoch": 1, "loss": losses[0]}, {"epoch": 2, "loss": losses[1]}]


def test_a_checkpoints_fitted_graph_predicts_with_the_checkpoints_states():
    x, y = _digits_like()
    fitted = digits_graph(epochs=1).fit(x, y)
    saved = sz.JobCheckpoint(seq=1, position={"step": 3, "epoch": 1}, states=fitted.states)
    again = saved.fitted(digits_graph(epochs=1))
    np.testing.assert_array_equal(np.asarray(again.forward(x)), np.asarray(fitted.forward(x)))
