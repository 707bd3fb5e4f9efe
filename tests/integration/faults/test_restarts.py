"""``max_restarts``: a job that a lost worker would fail goes back to its last checkpoint on the
workers there are and ends as an undisturbed run would; once its restarts are spent, or when no
workers come within ``restart_timeout``, it fails with the fault that stopped it."""

from __future__ import annotations

import signal

import numpy as np
import pytest
import torch

import somatize as sz
from tests.coordinator.strategies.data_parallel.test_data_parallel import (
    dataset,
    graph_for,
    reference_training,
)
from tests.coordinator.strategies.data_parallel.test_diloco import diloco_by_hand
from tests.coordinator.strategies.federated.test_fedavg import (
    HandAdam,
    assert_model,
    reference_rounds,
    shards,
)
from tests.coordinator.strategies.federated.test_fedavg import graph as fedavg_graph
from tests.integration.cluster import cluster, wait_for
from tests.integration.faults.test_resume import _checkpointed_at, paced
from tests.integration.strategies.test_fedavg_live import Pause
from tests.utils import UNIT

pytestmark = pytest.mark.integration


EPOCHS = 8
"""56 steps of the paced model: time enough to kill a worker mid-training after a checkpoint."""


def _followed_to(job: sz.Job, kind: str) -> sz.JobEventInfo:
    """Follow the job's events until one of ``kind``."""
    for event in job.events(timeout=120 * UNIT):
        if event.event == kind:
            return event
        assert event.event not in ("succeeded", "failed", "cancelled"), event
    raise AssertionError(f"the job's events ended before {kind!r}")


def _replica_worker(job: sz.Job, exclude: str | None = None) -> str:
    """One worker the job runs on now (not ``exclude``)."""
    workers = wait_for(lambda: job.status()["workers"], 30 * UNIT, "the placement")
    return next(w for w in workers if w != exclude)


@pytest.mark.parametrize(
    ("collective", "sharding"),
    [("coordinator", "none"), ("torch", "full")],
    ids=["plain", "sharded"],
)
def test_a_replica_sigkilled_restarts_the_job_from_its_checkpoint_on_a_spare_worker(
    tmp_path, collective, sharding
):
    """DataParallel(2, max_restarts=1) on three workers: one replica's worker SIGKILLed after
    the checkpoint at step 10, the job restarts on the survivor and the idle one from that
    checkpoint, and its model is the plain torch loop's to 1e-6. Sharded (FSDP2), the
    checkpoint is each replica's shards, which the restarted replicas load, each its own."""
    x, y = dataset()
    graph = graph_for("sgd", epochs=EPOCHS, shuffle=True, module=paced())
    strategy = sz.DataParallel(
        2, collective=collective, checkpoint_every=5, max_restarts=1, sharding=sharding
    )
    with cluster(tmp_path, {"w1": (), "w2": (), "w3": ()}) as c, sz.connect(c.url) as client:
        job = client.submit(graph, x, y, strategy=strategy)
        _checkpointed_at(job, 10)
        victim = _replica_worker(job)
        (spare,) = {"w1", "w2", "w3"} - set(job.status()["workers"])
        c.send_signal(c.workers[victim], signal.SIGKILL)
        fitted = job.result(timeout=120 * UNIT)
        events = list(job.events())
        record = job.status()
    expected = reference_training(x, y, "sgd", epochs=EPOCHS, shuffle=True)
    for key, value in expected.items():
        torch.testing.assert_close(fitted.states["mlp"][key], value, rtol=0, atol=1e-6)
    kinds = [e.event for e in events]
    restarting = next(e for e in events if e.event == "restarting")
    assert restarting.data["attempt"] == 1 and restarting.data["max_restarts"] == 1
    assert restarting.data["code"] == "worker_lost" and repr(victim) in restarting.data["message"]
    resumed = next(e for e in events if e.event == "resumed")
    assert resumed.data["step"] >= 10  # from its checkpoint, not the start
    assert kinds.index("restarting") < kinds.index("resumed") and kinds[-1] == "succeeded"
    assert kinds.count("placed") == 2
    assert victim not in record["workers"] and spare in record["workers"]


def test_diloco_on_the_torch_group_restarts_from_its_checkpoint_as_the_hand_loop(tmp_path):
    """DiLoCo(2, max_restarts=1) on the replicas' torch group: a replica's worker SIGKILLed
    after the checkpoint at a synchronisation, the job restarts on the survivor and the idle
    worker from it — the global model, each replica's inner Adam state and the outer momentum
    the replicas sent with that chunk — and ends as the plain-torch DiLoCo loop."""
    x, y = dataset()
    graph = graph_for("adam", epochs=EPOCHS, shuffle=True, module=paced())
    strategy = sz.DiLoCo(2, 3, 0.7, 0.9, checkpoint_every=5, max_restarts=1, collective="torch")
    with cluster(tmp_path, {"w1": (), "w2": (), "w3": ()}) as c, sz.connect(c.url) as client:
        job = client.submit(graph, x, y, strategy=strategy)
        _checkpointed_at(job, 10)
        victim = _replica_worker(job)
        c.send_signal(c.workers[victim], signal.SIGKILL)
        fitted = job.result(timeout=120 * UNIT)
        events = list(job.events())
    expected, _ = diloco_by_hand(
        x, y, "adam", 2, 3, outer_lr=0.7, outer_momentum=0.9, epochs=EPOCHS
    )
    for key, value in expected.items():
        torch.testing.assert_close(fitted.states["mlp"][key], value, rtol=0, atol=1e-6)
    kinds = [e.event for e in events]
    assert [e.data["collective"] for e in events if e.event == "placed"] == ["torch", "torch"]
    resumed = next(e for e in events if e.event == "resumed")
    assert resumed.data["step"] >= 10 and kinds.index("restarting") < kinds.index("resumed")
    assert kinds[-1] == "succeeded"


def test_a_restart_waits_for_the_lost_worker_and_the_next_fault_past_max_restarts_fails(
    tmp_path,
):
    """Two workers and max_restarts=1: the killed worker started again under its id takes the
    restarted job; killing one again fails it with worker_lost, the restart spent."""
    x, y = dataset()
    graph = graph_for("sgd", epochs=EPOCHS, module=paced())
    strategy = sz.DataParallel(2, checkpoint_every=3, max_restarts=1, restart_timeout=60 * UNIT)
    with cluster(tmp_path, {"w1": (), "w2": ()}) as c, sz.connect(c.url) as client:
        job = client.submit(graph, x, y, strategy=strategy)
        _checkpointed_at(job, 3)
        c.send_signal(c.workers["w2"], signal.SIGKILL)
        c.workers["w2"].wait(timeout=10 * UNIT)
        wait_for(lambda: job.status()["state"] == "queued", 30 * UNIT, "the restart")
        c.start_worker("w2")  # the same id comes back: the job takes it again
        _followed_to(job, "resumed")
        c.send_signal(c.workers["w1"], signal.SIGKILL)
        with pytest.raises(sz.JobFailed) as failure:
            job.result(timeout=60 * UNIT)
        kinds = [e.event for e in job.events()]
    assert failure.value.code == "worker_lost" and "'w1'" in failure.value.message
    assert kinds.count("restarting") == 1 and kinds[-1] == "failed"


def test_a_restart_that_finds_no_workers_in_time_fails_with_the_fault(tmp_path):
    x, y = dataset()
    graph = graph_for("sgd", epochs=EPOCHS, module=paced())
    strategy = sz.DataParallel(2, checkpoint_every=3, max_restarts=2, restart_timeout=1.0)
    with cluster(tmp_path, {"w1": (), "w2": ()}) as c, sz.connect(c.url) as client:
        job = client.submit(graph, x, y, strategy=strategy)
        _checkpointed_at(job, 3)
        c.send_signal(c.workers["w2"], signal.SIGKILL)
        with pytest.raises(sz.JobFailed) as failure:
            job.result(timeout=60 * UNIT)
        assert c.worker_state("w1") == "idle"  # the survivor is free again
    assert failure.value.code == "worker_lost"
    assert "restart 1 of 2 found no workers within restart_timeout=1s" in failure.value.message
    assert list(c.state_dir.joinpath("checkpoints", job.id).glob("*.ckpt"))  # kept: it failed


def test_a_fedavg_round_short_of_workers_restarts_from_its_checkpoint_with_its_moments(tmp_path):
    """FedAvg(6, FedAdam, max_restarts=1) over 2 of 3 workers: a selected worker SIGKILLed after
    the checkpoint at round 2 leaves a round short (min_workers=2); the job restarts on the two
    left from that checkpoint — the global model, FedAdam's moments, the round — and ends where
    Reddi et al.'s Algorithm 2 computed by hand over the same rounds ends."""
    data = shards(sizes=(40, 40))
    x, y = np.vstack([d[0] for d in data]), np.vstack([d[1] for d in data])
    options = {"lr": 0.05, "beta1": 0.9, "beta2": 0.99, "tau": 1e-3}
    strategy = sz.FedAvg(
        6,
        workers=2,
        min_workers=2,
        server=sz.FedAdam(**options),
        checkpoint_every=1,
        max_restarts=1,
    )
    fed_graph = fedavg_graph(Pause().named("pause"))
    with cluster(tmp_path, {"w1": (), "w2": (), "w3": ()}) as c, sz.connect(c.url) as client:
        job = client.submit(fed_graph, x, y, strategy=strategy)
        _checkpointed_at(job, 2, key="round")
        victim = _replica_worker(job)
        c.send_signal(c.workers[victim], signal.SIGKILL)
        fitted = job.result(timeout=120 * UNIT)
        events = list(job.events())
    restarting = next(e for e in events if e.event == "restarting")
    assert restarting.data["attempt"] == 1
    assert restarting.data["code"] in ("not_enough_workers", "worker_lost")
    resumed = next(e for e in events if e.event == "resumed")
    assert 2 <= resumed.data["round"] < 6
    rounds = [e.data["round"] for e in events if e.event == "progress" and "round" in e.data]
    assert rounds[-1] == 6
    expected = reference_rounds(data, 6, epochs=1, server=HandAdam(**options))
    assert_model(fitted.states, expected[-1][0])
