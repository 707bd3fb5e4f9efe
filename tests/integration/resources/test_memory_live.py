"""Memory over many jobs: what the coordinator keeps of a job ends with the job, and the worker
agent, which relays tensors between the coordinator and its daemons, never loads torch; nor does
the coordinator for runs whose tensors it only passes on.

Each job here ships a 1 M-parameter model (4 MB) and checkpoints; the coordinator, which
freezes what is alive every second and collects reference cycles every ten minutes
(coordinator.server.collector), grew by about one model a job when a cycle held ended jobs
(job → inputs → checkpoints → a closure → job): 308 MiB after 10 jobs, 494 after 40.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

import somatize as sz
from tests.coordinator.strategies.model_parallel.test_model_parallel import (
    dataset,
    graph,
    reference,
)
from tests.integration.cluster import cluster
from tests.utils import UNIT


def _resident_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


def test_the_coordinator_after_100_jobs_holds_what_it_held_after_10(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 256)).astype(np.float32)
    y = x.copy()
    net = torch.nn.Sequential(
        torch.nn.Linear(256, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 256)
    )
    graph = sz.Graph(
        [sz.TorchFilter(net, loss="mse", optimizer="sgd", lr=1e-3, batch_size=128).named("net")]
    )
    strategy = sz.DataParallel(1, checkpoint_every=1)
    resident = {}
    with cluster(tmp_path, {"w1": ()}) as c, sz.connect(c.url) as client:
        for k in range(1, 101):
            fitted = client.submit(graph, x, y, strategy).result(timeout=120 * UNIT)
            if k in (10, 100):
                resident[k] = _resident_mib(c.coordinator.pid)
        agent = Path(f"/proc/{c.workers['w1'].pid}/maps").read_text()
    assert fitted.states["net"]["0.weight"].shape == (2048, 256)
    # a leak of one model a job would be 90 × 4 MiB over about 300
    assert resident[100] <= 1.1 * resident[10], resident
    # 100 models and their updates through it, as bytes (torch is 220 MiB of an agent's 290)
    assert "libtorch" not in agent


def test_a_coordinator_passes_the_states_of_unshuffled_runs_on_without_torch(tmp_path):
    """Data parallel on the torch collective and a pipeline over its stages' torch group: the
    replicas and stages compute, the coordinator only passes their states on, into checkpoints
    and the results, as the bytes they came as (torch would be 220 MiB of it). A shuffled run's
    order is torch's generator: that coordinator imports torch for it."""
    x, y = dataset()
    two = [sz.Partition(["center", "a"], worker="w0"), sz.Partition(["b", "c"], worker="w1")]
    strategies = [
        sz.DataParallel(2, checkpoint_every=1),
        sz.ModelParallel(two, 2, "1f1b", transport="torch", checkpoint_every=1),
    ]
    # Exec'd, not forked from the suite's zygote, which imported torch (tests.zygote).
    with cluster(tmp_path, {"w0": (), "w1": ()}, fork=False) as c, sz.connect(c.url) as client:
        jobs = [client.submit(graph(), x, y, strategy) for strategy in strategies]
        results = [job.result(timeout=120 * UNIT) for job in jobs]
        coordinator = Path(f"/proc/{c.coordinator.pid}/maps").read_text()
    expected = reference(x, y)
    for fitted in results:
        for node in "abc":
            for key, value in expected[node].items():
                torch.testing.assert_close(fitted.states[node][key], value, rtol=0, atol=1e-5)
    assert "libtorch" not in coordinator
