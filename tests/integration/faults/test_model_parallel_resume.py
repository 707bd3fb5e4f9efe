"""No progress lost in a pipeline: a ModelParallel job outlives a SIGKILLed coordinator (resumed
from its checkpoint by the next one), and a stage whose worker is SIGKILLed moves to a spare;
either way the result is the unsplit model's in a plain torch loop. On the torch transport a
checkpoint is what the stages sent with the replies of the chunk it ends (``snapshot``), saved
while the next chunk trains."""

from __future__ import annotations

import signal
import time

import pytest
import torch

import somatize as sz
from tests.coordinator.strategies.model_parallel.test_model_parallel import (
    dataset,
    layers,
    reference,
)
from tests.integration.cluster import cluster
from tests.integration.faults.test_resume import _checkpointed_at
from tests.utils import UNIT, Center

pytestmark = pytest.mark.integration

EPOCHS = 4
"""60 rows in batches of 16: 4 global batches an epoch, 16 in all."""


class Paced(torch.nn.Sequential):
    """A stage's layers (same parameters, same maths), a little slow: a process can be killed
    while the pipeline trains."""

    def forward(self, x):
        time.sleep(0.05)
        return super().forward(x)


def paced_graph() -> sz.Graph:
    a, b, c = layers()
    settings = {"optimizer": "adam", "lr": 0.01}
    return (
        Center().named("center")
        >> sz.TorchFilter(a, **settings).named("a")
        >> sz.TorchFilter(Paced(*b.children()), **settings).named("b")
        >> sz.TorchFilter(
            c, loss="mse", batch_size=16, epochs=EPOCHS, shuffle=False, **settings
        ).named("c")
    )


def partitions() -> list[sz.Partition]:
    return [sz.Partition(["center", "a"], tag="stage0"), sz.Partition(["b", "c"], tag="stage1")]


def assert_unsplit(states, atol: float) -> None:
    x, y = dataset()
    expected = reference(x, y, "adam", epochs=EPOCHS)
    for node in "abc":
        for key, value in expected[node].items():
            torch.testing.assert_close(states[node][key], value, rtol=0, atol=atol)


def test_a_pipeline_outlives_a_sigkilled_coordinator_and_equals_the_unsplit_model(tmp_path):
    x, y = dataset()
    graph = paced_graph()
    strategy = sz.ModelParallel(partitions(), micro_batches=2, checkpoint_every=3)
    with cluster(tmp_path, {"w1": ("stage0",), "w2": ("stage1",)}) as c:
        with sz.connect(c.url) as client:
            job = client.submit(graph, x, y, strategy=strategy)
            _checkpointed_at(job, 6)
        assert c.stop_coordinator(signal.SIGKILL) != 0  # mid-training
        c.start_coordinator()
        with sz.connect(c.url) as client:
            fitted = client.job(job.id, graph).result(timeout=120 * UNIT)
            events = list(client.job(job.id).events())
    assert_unsplit(fitted.states, atol=1e-6)
    linked = [e.data for e in events if e.data.get("phase") == "linked"]
    assert {said["transport"] for said in linked} == {"torch"}  # checkpoints in the replies
    resumed = next(e for e in events if e.event == "resumed")
    assert resumed.data["step"] >= 6  # from its checkpoint, not the start
    steps = [e.data["step"] for e in events if e.event == "progress" and "step" in e.data]
    assert steps[-1] == 4 * EPOCHS and [e.event for e in events][-1] == "succeeded"


def test_a_stage_whose_worker_is_sigkilled_moves_to_a_spare(tmp_path):
    x, y = dataset()
    strategy = sz.ModelParallel(
        partitions(), micro_batches=2, checkpoint_every=2, spares=1, spare_tag="spare"
    )
    workers = {"w1": ("stage0",), "w2": ("stage1",), "w3": ("spare",)}
    with cluster(tmp_path, workers) as c, sz.connect(c.url) as client:
        job = client.submit(paced_graph(), x, y, strategy=strategy)
        _checkpointed_at(job, 4)
        c.send_signal(c.workers["w2"], signal.SIGKILL)
        fitted = job.result(timeout=120 * UNIT)
        events = list(job.events())
    assert_unsplit(fitted.states, atol=1e-6)
    kinds = [e.event for e in events]
    lost = next(e.data for e in events if e.event == "worker_lost")
    assert (lost["stage"], lost["worker"], lost["code"]) == (1, "w2", "worker_lost")
    replaced = next(e.data for e in events if e.event == "worker_replaced")
    assert replaced == {"stage": 1, "lost": "w2", "worker": "w3"}
    resumed = [e.data for e in events[kinds.index("worker_replaced") :] if e.event == "resumed"]
    assert resumed and resumed[0]["step"] >= 4
    assert kinds[-1] == "succeeded"
