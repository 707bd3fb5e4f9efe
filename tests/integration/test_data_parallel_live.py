"""DataParallel on live workers: the same answer as single-process training, and a clear
failure when a replica dies."""

from __future__ import annotations

import signal
import time

import pytest
import torch

import somatize as sz
from tests.coordinator.test_data_parallel import dataset, graph_for, reference_training
from tests.integration.cluster import UNIT, cluster, wait_for

pytestmark = pytest.mark.integration


class Slow(torch.nn.Module):
    """A linear layer that takes its time, so a replica can be killed mid-step."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(6, 3)

    def forward(self, x):
        time.sleep(0.2)
        return self.lin(x)


def test_live_data_parallel_equals_single_process_training_with_2_and_3_workers(tmp_path):
    x, y = dataset()
    with cluster(tmp_path, {"w1": (), "w2": (), "w3": ()}) as c, sz.connect(c.url) as client:
        for workers, optimizer in [(2, "adam"), (3, "sgd")]:
            job = client.submit(graph_for(optimizer), x, y, strategy=sz.DataParallel(workers))
            fitted = job.result(timeout=120 * UNIT)
            expected = reference_training(x, y, optimizer)
            for key, value in expected.items():
                torch.testing.assert_close(fitted.states["mlp"][key], value, rtol=0, atol=1e-5)
            record = job.status()
            assert len(record["workers"]) == workers
            assert record["progress"]["step"] == record["progress"]["steps"] == 21


def test_a_replica_killed_mid_training_fails_the_job_naming_it(tmp_path):
    x, y = dataset(n=64)
    graph = sz.Graph(
        [sz.TorchFilter(Slow(), loss="cross_entropy", batch_size=8, epochs=50).named("slow")]
    )
    with cluster(tmp_path, {"w1": (), "w2": ()}) as c, sz.connect(c.url) as client:
        job = client.submit(graph, x, y, strategy=sz.DataParallel(2))
        wait_for(
            lambda: (job.status()["progress"] or {}).get("step", 0) >= 2, 60 * UNIT, "training"
        )
        c.send_signal(c.workers["w2"], signal.SIGKILL)
        with pytest.raises(sz.JobFailed) as failure:
            job.result(timeout=30 * UNIT)
        assert failure.value.code == "worker_lost"
        assert "'w2'" in failure.value.message
        # The other replica is stopped and freed, not left computing for a dead job.
        wait_for(lambda: c.worker_state("w1") == "idle", 15 * UNIT, "w1 to be freed")
