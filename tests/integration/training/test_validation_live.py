"""Validation on live workers: FedAvg's federated evaluation (each worker evaluates the new
global model on its own ``x_val``/``y_val`` and the round's figures are theirs weighted by
rows), DataParallel with validation rows sent with the job, and the history in
``job.result()`` and ``somatize result``."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import somatize as sz
from tests.coordinator.strategies.test_validation import net_graph
from tests.integration.cluster import cluster
from tests.training_reference import classes, evaluation, mlp, reference_fit
from tests.utils import UNIT, somatize_cli

pytestmark = pytest.mark.integration


def test_live_federated_evaluation_and_validation(tmp_path):
    data = {}
    for k, (n, n_val) in enumerate([(90, 31), (120, 47)]):
        x, y = classes(n=n, seed=10 + k)
        x_val, y_val = classes(n=n_val, seed=20 + k)
        np.savez(tmp_path / f"w{k}.npz", x=x, y=y, x_val=x_val, y_val=y_val)
        data[f"w{k}"] = {"clinic": tmp_path / f"w{k}.npz"}
    with cluster(tmp_path, {"w0": (), "w1": ()}, data=data) as c, sz.connect(c.url) as client:
        graph = net_graph(scheduler=None, epochs=1)
        strategy = sz.FedAvg(rounds=2, evaluate_fraction=1.0)
        job = client.submit(graph, sz.WorkerData("clinic"), strategy=strategy)
        fitted = job.result(timeout=120 * UNIT)
        rounds = [e.data for e in job.events() if e.data.get("phase") == "round"]
        for row in rounds:  # the round's figures: each worker's, weighted by its rows
            figures = row["evaluation"]
            assert sorted(figures) == ["w0", "w1"]
            rows = {w: f["rows"] for w, f in figures.items()}
            assert rows == {"w0": 31, "w1": 47}
            for name in ("val_loss", "accuracy"):
                mean = sum(f[name] * f["rows"] for f in figures.values()) / 78
                assert row[name] == pytest.approx(mean, abs=1e-9)
        # The last round evaluated the final model: each worker's figures are a plain torch
        # evaluation of it on that worker's own file.
        model = mlp()
        model.load_state_dict({k: torch.as_tensor(v) for k, v in fitted.states["mlp"].items()})
        for worker in ("w0", "w1"):
            with np.load(data[worker]["clinic"]) as npz:
                own: list[dict[str, float]] = []
                evaluation(npz["x_val"], npz["y_val"], own)(model)
            last = rounds[-1]["evaluation"][worker]
            assert last["val_loss"] == pytest.approx(own[0]["val_loss"], abs=1e-5)
            assert last["accuracy"] == pytest.approx(own[0]["accuracy"], abs=1e-6)
        assert [row["round"] for row in fitted.history] == [1, 2]
        assert fitted.history[-1]["val_loss"] == rounds[-1]["val_loss"]

        # DataParallel with validation rows sent: the history in the result and the CLI.
        x, y = classes()
        x_val, y_val = classes(n=61, seed=2)
        figures: list[dict[str, float]] = []
        expected = reference_fit(
            mlp(), x, y, cosine=True, at_epoch_end=evaluation(x_val, y_val, figures)
        )
        job = client.submit(
            net_graph(), x, y, strategy=sz.DataParallel(2), validation=(x_val, y_val)
        )
        fitted = job.result(timeout=120 * UNIT)
        assert [row["epoch"] for row in fitted.history] == [1, 2, 3]
        for row, scores in zip(fitted.history, figures, strict=True):
            assert row["val_loss"] == pytest.approx(scores["val_loss"], abs=1e-5)
            assert row["accuracy"] == pytest.approx(scores["accuracy"], abs=1e-6)
        assert fitted.history[-1]["loss"] == pytest.approx(expected.epoch_losses[-1], abs=1e-5)
        board, png = tmp_path / "board", tmp_path / "curves.png"
        shown = somatize_cli(
            c.url, "result", job.id, "--tensorboard", str(board), "--plot", str(png), seconds=120
        )
        job_file = tmp_path / "job.py"
        job_file.write_text(JOB_FILE)
        live_board = tmp_path / "live-board"
        submitted = somatize_cli(
            c.url, "submit", "--tensorboard", str(live_board), str(job_file), seconds=120
        )
    assert shown.returncode == 0, shown.stderr
    table = shown.stdout + shown.stderr
    assert "val_loss" in table and "accuracy" in table
    assert f"{fitted.history[-1]['val_loss']:.4f}" in table
    assert "saved the curves (39 steps and 3 epochs)" in shown.stderr  # 13 steps an epoch
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    scalars = _scalars(board)
    assert sorted(scalars) == ["accuracy", "loss", "lr", "step/loss", "val_loss"]
    assert [step for step, _ in scalars.pop("step/loss")] == list(range(1, 40))
    for tag, points in scalars.items():
        assert points == [(row["epoch"], pytest.approx(row[tag])) for row in fitted.history]
    # Written while the job ran: its two epochs' loss and learning rate (a Local job trains in
    # one call and reports no step of its own: no step/loss).
    assert submitted.returncode == 0, submitted.stderr
    written = _scalars(live_board)
    assert sorted(written) == ["loss", "lr"] and [s for s, _ in written["loss"]] == [1, 2]


JOB_FILE = """
import numpy as np
import torch
import somatize as sz

rng = np.random.default_rng(1)
x = rng.normal(size=(64, 4)).astype(np.float32)
y = (x[:, 0] > 0).astype(np.int64)
torch.manual_seed(0)
net = sz.TorchFilter(torch.nn.Linear(4, 2), loss="cross_entropy", lr=0.5, epochs=2)
graph = sz.Graph([net.named("linear")])
"""


def _scalars(directory: Path) -> dict[str, list[tuple[int, float]]]:
    """The scalars of the TensorBoard files in ``directory``, read with tensorboard's reader."""
    events = EventAccumulator(str(directory))
    events.Reload()
    return {
        tag: [(s.step, s.value) for s in events.Scalars(tag)] for tag in events.Tags()["scalars"]
    }
