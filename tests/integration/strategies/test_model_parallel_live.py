"""ModelParallel on live stage workers: the same answer as the unsplit model, activations sent
worker to worker or relayed through the coordinator, and a clear failure when a stage dies."""

from __future__ import annotations

import signal
import time
import urllib.request

import pytest
import torch

import somatize as sz
from tests.coordinator.strategies.model_parallel.test_model_parallel import (
    dataset,
    graph,
    reference,
)
from tests.integration.cluster import cluster, wait_for
from tests.utils import UNIT

pytestmark = pytest.mark.integration


def _metric(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        for line in response.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    raise AssertionError(f"no metric {name}")


class SlowTanh(torch.nn.Module):
    def forward(self, x):
        time.sleep(0.3)
        return torch.tanh(x)


@pytest.mark.parametrize(
    ("transport", "peer_links"),
    [("torch", False), ("websocket", True), ("websocket", False)],
    ids=["torch", "direct", "relay"],
)
def test_live_pipeline_equals_the_unsplit_model_and_refuses_unknown_tags(
    tmp_path, transport, peer_links
):
    x, y = dataset()
    workers = {"w0": ("stage0",), "w1": ("stage1",), "w2": ("stage2",)}
    with cluster(tmp_path, workers, peer_links=peer_links) as c, sz.connect(c.url) as client:
        two = [sz.Partition(["center", "a"], tag="stage0"), sz.Partition(["b", "c"], tag="stage1")]
        three = [
            sz.Partition(["center", "a"], worker="w2"),
            sz.Partition(["b"], tag="stage1"),
            sz.Partition(["c"], tag="stage0"),
        ]
        cases = [(two, 1, "gpipe"), (two, 4, "1f1b"), (three, 1, "gpipe"), (three, 4, "gpipe")]
        for partitions, micro, schedule in cases:
            strategy = sz.ModelParallel(partitions, micro, schedule, transport=transport)
            job = client.submit(graph(), x, y, strategy=strategy)
            fitted = job.result(timeout=120 * UNIT)
            expected = reference(x, y)
            for node in "abc":
                for key, value in expected[node].items():
                    torch.testing.assert_close(fitted.states[node][key], value, rtol=0, atol=1e-5)
            linked = [e for e in job.events() if e.data.get("phase") == "linked"]
            assert linked, "live stages exchange tensors worker to worker"
            assert linked[0].data["transport"] == transport
            if transport == "torch":
                assert "every stage reached the rendezvous on" in linked[0].data["reason"]
            else:
                assert linked[0].data["reason"] == "transport='websocket' was asked for"
                assert bool(linked[0].data["direct"]) is peer_links
                assert bool(linked[0].data["relay"]) is not peer_links
            placed = job.status()["workers"]
            assert placed == [
                p.worker or {"stage0": "w0", "stage1": "w1"}[p.tag] for p in partitions
            ]
        relayed = _metric(c.port, "somatize_relayed_bytes_total")
        # Direct links and the torch transport bypass the coordinator entirely.
        assert (relayed > 0) is (transport == "websocket" and not peer_links)
        with pytest.raises(
            sz.ClientError,
            match=r"no worker answers to tag 'gpu'.*tags \['stage0', 'stage1', 'stage2'\]",
        ):
            client.submit(
                graph(),
                x,
                y,
                strategy=sz.ModelParallel([sz.Partition(["center", "a", "b", "c"], tag="gpu")]),
            )


@pytest.mark.parametrize("transport", ["torch", "websocket"])
def test_a_stage_worker_killed_mid_step_fails_the_job_naming_stage_and_worker(tmp_path, transport):
    x, y = dataset(n=64)
    torch.manual_seed(0)
    g = sz.TorchFilter(torch.nn.Linear(5, 6)).named("head") >> sz.TorchFilter(
        torch.nn.Sequential(SlowTanh(), torch.nn.Linear(6, 2)), batch_size=8, epochs=20
    ).named("tail")
    parts = [sz.Partition(["head"], worker="w0"), sz.Partition(["tail"], worker="w1")]
    with cluster(tmp_path, {"w0": (), "w1": ()}) as c, sz.connect(c.url) as client:
        strategy = sz.ModelParallel(parts, micro_batches=2, transport=transport)
        job = client.submit(g, x, y, strategy=strategy)
        wait_for(lambda: (job.status()["progress"] or {}).get("step", 0) >= 1, 60 * UNIT, "a step")
        c.send_signal(c.workers["w1"], signal.SIGKILL)
        with pytest.raises(sz.JobFailed) as failure:
            job.result(timeout=30 * UNIT)
        assert failure.value.code == "worker_lost"
        assert "stage 1 ['tail'] on worker 'w1'" in failure.value.message
        wait_for(lambda: c.worker_state("w0") == "idle", 15 * UNIT, "w0 to be freed")
        assert c.healthy()
