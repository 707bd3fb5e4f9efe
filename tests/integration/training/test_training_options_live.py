"""A step-wise cosine schedule, clipping and accumulation on live workers: DataParallel(2) on
both collectives and a 2-stage ModelParallel on both transports equal ``graph.fit`` and the
independent plain torch loop, and report the learning rate of every step; the pipeline also
evaluates validation data at each epoch's end as the loop's own evaluation does."""

from __future__ import annotations

import pytest
import torch

import somatize as sz
from tests.coordinator.strategies.test_training_options import joined, net_graph, split_graph
from tests.integration.cluster import cluster
from tests.training_reference import classes, evaluation, mlp, reference_fit
from tests.utils import UNIT

pytestmark = pytest.mark.integration


def _close(states, expected):
    for key, value in expected.items():
        torch.testing.assert_close(torch.as_tensor(states[key]), value, rtol=0, atol=1e-5)


def _lrs(job) -> list[float]:
    """Every step's learning rate from the job's progress events (one a step, or a chunk's)."""
    lrs: list[float] = []
    for event in job.events():
        if event.event == "progress" and event.data.get("phase") == "training":
            lrs += event.data.get("lrs") or [event.data["lr"]]
    return lrs


def test_live_data_parallel_and_model_parallel_with_a_schedule_clipping_and_accumulation(
    tmp_path,
):
    x, y = classes()
    x_val, y_val = classes(n=61, seed=2)
    figures: list[dict[str, float]] = []
    at_end = evaluation(x_val, y_val, figures)
    expected = reference_fit(mlp(), x, y, accumulate=3, clip=0.5, cosine=True, at_epoch_end=at_end)
    graph = net_graph(accumulate=3)
    _close(graph.fit(x, y).states["mlp"], expected.state())
    split = split_graph(accumulate=3)
    _close(joined(split.fit(x, y).states), expected.state())
    workers = {"w0": ("s0",), "w1": ("s1",)}
    with cluster(tmp_path, workers, peer_links=True) as c, sz.connect(c.url) as client:
        for collective in ["torch", "coordinator"]:
            strategy = sz.DataParallel(2, collective=collective)
            job = client.submit(graph, x, y, strategy=strategy)
            _close(job.result(timeout=120 * UNIT).states["mlp"], expected.state())
            assert _lrs(job) == pytest.approx(expected.lrs, abs=1e-12)
        for transport in ["torch", "websocket"]:
            stages = [sz.Partition(["a"], tag="s0"), sz.Partition(["b"], tag="s1")]
            strategy = sz.ModelParallel(stages, 2, "1f1b", transport=transport)
            job = client.submit(split, x, y, strategy=strategy, validation=(x_val, y_val))
            fitted = job.result(timeout=120 * UNIT)
            _close(joined(fitted.states), expected.state())
            assert _lrs(job) == pytest.approx(expected.lrs, abs=1e-12)
            assert [row["epoch"] for row in fitted.history] == [1, 2, 3]
            for row, scores, loss in zip(
                fitted.history, figures, expected.epoch_losses, strict=True
            ):
                assert row["val_loss"] == pytest.approx(scores["val_loss"], abs=1e-5)
                assert row["loss"] == pytest.approx(loss, abs=1e-5)
