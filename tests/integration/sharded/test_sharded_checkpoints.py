"""A sharded job's checkpoints travel a piece at a time: each replica's files stay on its
worker and the coordinator reads them into its store in pieces while training goes on, so a
checkpoint larger than the coordinator's room for workers' replies (``--max-reassembly-bytes``)
is written whole, a client gets it back equal to the job's result, and a job continued from
it is sent each file in pieces too, under the workers' own ``--max-message-bytes`` (issue
33)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import somatize as sz
from tests.integration.cluster import Cluster
from tests.utils import UNIT

pytestmark = pytest.mark.integration

ROOM = 5 << 19
"""The coordinator's and workers' largest message and the coordinator's room for workers'
replies here: 2.5 MiB, over the model's weights (2 MiB: the job as submitted) and under each
replica's checkpoint files (its half of the weights and of Adam's two moments: 3 MiB), which
before came in the reply of the chunk that took it, and failed the job ``too_large``; and
which a job continuing from it sent each replica in one message, which its worker refused."""


def plain_adam(module: torch.nn.Module, x: np.ndarray, y: np.ndarray, epochs: int) -> dict:
    """The reference: Adam on the mean squared error of batches of 8 rows, in order."""
    optimizer = torch.optim.Adam(module.parameters(), lr=1e-3)
    for _ in range(epochs):
        for start in range(0, len(x), 8):
            optimizer.zero_grad()
            out = module(torch.as_tensor(x[start : start + 8]))
            torch.nn.functional.mse_loss(out, torch.as_tensor(y[start : start + 8])).backward()
            optimizer.step()
    return {k: v.detach() for k, v in module.state_dict().items()}


def test_a_sharded_checkpoint_larger_than_the_coordinators_room_for_replies_is_written(
    tmp_path,
):
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 512))
    reference = copy.deepcopy(module)
    weights = sum(p.numel() * 4 for p in module.parameters())
    assert weights < ROOM < 3 * weights / 2
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 512)).astype(np.float32)
    y = rng.normal(size=(16, 512)).astype(np.float32)

    def net(epochs: int) -> sz.Graph:
        options = {"optimizer": "adam", "lr": 1e-3, "batch_size": 8, "shuffle": False}
        return sz.Graph([sz.TorchFilter(module, epochs=epochs, **options).named("net")])

    strategy = sz.DataParallel(2, sharding="full", collective="torch", checkpoint_every=1)
    c = Cluster(tmp_path / "state", heartbeat_timeout=10.0)
    try:
        c.start_coordinator(["--max-message-bytes", str(ROOM), "--max-reassembly-bytes", str(ROOM)])
        for worker_id in ("w1", "w2"):
            c.start_worker(worker_id, args=["--max-message-bytes", str(ROOM)])
        with sz.connect(c.url) as client:
            job = client.submit(net(2), x, y, strategy=strategy)
            fitted = job.result(timeout=120 * UNIT)
            events = list(job.events())
            last = job.checkpoint()
            once = sz.DataParallel(2, sharding="full", collective="torch")
            continued = client.submit(net(3), x, y, strategy=once, resume_from=job)
            further = continued.result(timeout=120 * UNIT)
            resumed = next(e.data for e in continued.events() if e.event == "resumed")
    finally:
        c.close()
    saved = [e.data for e in events if e.event == "checkpoint"]
    assert [e.data for e in events if e.event == "checkpoint_failed"] == []
    assert [d["step"] for d in saved] == [1, 2, 3, 4]
    assert all(d["bytes"] > 3 * weights for d in saved)  # weights and both moments, every one
    folder = next((c.state_dir / "checkpoints" / job.id).glob("*.shards"))
    sizes = {p.name: p.stat().st_size for p in folder.iterdir()}
    assert sizes.keys() == {".metadata", "__0_0.distcp", "__1_0.distcp"}
    assert min(sizes["__0_0.distcp"], sizes["__1_0.distcp"]) > ROOM
    assert last.position["step"] == 4
    for key, value in fitted.states["net"].items():
        torch.testing.assert_close(torch.as_tensor(last.states["net"][key]), value, rtol=0, atol=0)
    assert resumed["step"] == 4 and resumed["from_job"] == job.id
    for key, value in plain_adam(reference, x, y, epochs=3).items():
        torch.testing.assert_close(further.states["net"][key], value, rtol=0, atol=1e-5)
