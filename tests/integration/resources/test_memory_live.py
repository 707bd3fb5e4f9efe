"""Memory over many jobs: what the coordinator keeps of a job ends with the job, and the worker
agent, which relays tensors between the coordinator and its daemons, never loads torch.

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
