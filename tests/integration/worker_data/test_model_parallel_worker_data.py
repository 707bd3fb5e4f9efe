"""Issue 15: ModelParallel on data that lives on the workers.

Two live stage workers serve the same rows as ``local`` (an ``x.npy``/``y.npy`` directory each):
the first stage reads its ``x``, the last its ``y``; the model equals
the unsplit one trained in one process on those rows, over the torch transport and over
WebSocket links. Stages whose datasets disagree in rows are refused at submit.
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch

import somatize as sz
from tests.coordinator.strategies.model_parallel.test_model_parallel import dataset, layers
from tests.integration.cluster import cluster
from tests.utils import UNIT

pytestmark = pytest.mark.integration

EPOCHS, BATCH = 2, 16


def _graph() -> sz.Graph:
    a, b, c = layers()
    return (
        sz.TorchFilter(a, optimizer="sgd", lr=0.05).named("a")
        >> sz.TorchFilter(b, optimizer="sgd", lr=0.05).named("b")
        >> sz.TorchFilter(
            c, loss="mse", optimizer="sgd", lr=0.05, batch_size=BATCH, epochs=EPOCHS, shuffle=False
        ).named("c")
    )


def _reference(x, y):
    """The unsplit model in one process: rows in order, one step per global batch."""
    model = torch.nn.Sequential(*copy.deepcopy(layers()))
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in model]
    xt, yt = torch.as_tensor(x), torch.as_tensor(y)
    for _ in range(EPOCHS):
        for lo in range(0, len(xt), BATCH):
            for opt in opts:
                opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(xt[lo : lo + BATCH]), yt[lo : lo + BATCH])
            loss.backward()
            for opt in opts:
                opt.step()
    return {name: m.state_dict() for name, m in zip("abc", model, strict=True)}


def _npy_dir(path: Path, x: np.ndarray, y: np.ndarray) -> Path:
    path.mkdir()
    np.save(path / "x.npy", x)
    np.save(path / "y.npy", y)
    return path


def test_model_parallel_reads_x_on_the_first_stage_and_y_on_the_last(tmp_path):
    x, y = dataset()
    data = {w: {"local": _npy_dir(tmp_path / w, x, y)} for w in ("w0", "w1")}
    data["w2"] = {"local": _npy_dir(tmp_path / "w2", x[:40], y[:40])}
    with cluster(tmp_path, {"w0": (), "w1": (), "w2": ()}, data=data) as c, c.client() as client:
        split = [sz.Partition(["a"], worker="w0"), sz.Partition(["b", "c"], worker="w1")]
        job = client.submit(_graph(), sz.WorkerData("local"), strategy=sz.ModelParallel(split, 2))
        fitted = job.result(timeout=120 * UNIT)
        expected = _reference(x, y)
        for node in "abc":
            for key, value in expected[node].items():
                torch.testing.assert_close(fitted.states[node][key], value, rtol=0, atol=1e-5)

        short = [sz.Partition(["a"], worker="w0"), sz.Partition(["b", "c"], worker="w2")]
        # Refused at submit, from what the workers announced: nothing is queued.
        with pytest.raises(sz.ClientError, match=r"their rows must agree; .* w0 60, w2 40 rows"):
            client.submit(_graph(), sz.WorkerData("local"), strategy=sz.ModelParallel(short))

        # Over WebSocket links, three stages: the middle one's worker holds a dataset of other
        # rows, which it never reads; the last takes its labels from its own.
        three = [
            sz.Partition(["a"], worker="w0"),
            sz.Partition(["b"], worker="w2"),
            sz.Partition(["c"], worker="w1"),
        ]
        by_websocket = sz.ModelParallel(three, 2, transport="websocket")
        job = client.submit(_graph(), sz.WorkerData("local"), strategy=by_websocket)
        fitted = job.result(timeout=120 * UNIT)
        linked = [e.data for e in job.events() if e.data.get("phase") == "linked"]
        assert [e["transport"] for e in linked] == ["websocket"]
        for node in "abc":
            for key, value in expected[node].items():
                torch.testing.assert_close(fitted.states[node][key], value, rtol=0, atol=1e-5)
