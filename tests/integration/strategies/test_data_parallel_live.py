"""DataParallel on live workers: the same answer as single-process training, and a clear
failure when a replica dies."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
import urllib.request

import pytest
import torch

import somatize as sz
from tests.coordinator.strategies.data_parallel.test_data_parallel import (
    dataset,
    graph_for,
    model,
    reference_training,
)
from tests.integration.cluster import cluster, wait_for
from tests.utils import UNIT, Center, agent_daemons

pytestmark = pytest.mark.integration


class Slow(torch.nn.Module):
    """A linear layer that takes its time, so a replica can be killed mid-step."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(6, 3)

    def forward(self, x):
        time.sleep(0.2)
        return self.lin(x)


@pytest.mark.parametrize("collective", ["torch", "coordinator"])
def test_live_data_parallel_equals_single_process_training_with_2_and_3_workers(
    tmp_path, collective
):
    """Uneven slices (203 rows, batches of 32 over 2 and 3 replicas), Adam shuffled and SGD
    with momentum in order: either collective gives what a plain torch loop gives."""
    x, y = dataset()
    with cluster(tmp_path, {"w1": (), "w2": (), "w3": ()}) as c, sz.connect(c.url) as client:
        for workers, optimizer, shuffle in [(2, "adam", True), (3, "sgd", False)]:
            strategy = sz.DataParallel(workers, collective=collective)
            graph = graph_for(optimizer, shuffle=shuffle)
            job = client.submit(graph, x, y, strategy=strategy)
            fitted = job.result(timeout=120 * UNIT)
            expected = reference_training(x, y, optimizer, shuffle=shuffle)
            for key, value in expected.items():
                torch.testing.assert_close(fitted.states["mlp"][key], value, rtol=0, atol=1e-5)
            record = job.status()
            assert len(record["workers"]) == workers
            assert record["progress"]["step"] == record["progress"]["steps"] == 21
            placed = first(events_of(job), "placed")
            assert placed.data["collective"] == collective
            if collective == "torch":
                assert placed.data["backend"] == "gloo"
                assert "every replica reached the rendezvous" in placed.data["collective_reason"]
        # A model whose gradients take two chunk messages (1.3 MB): through the coordinator
        # each step's mean is folded as the replies arrive and goes out as it folds.
        graph = graph_for("sgd", epochs=1, module=wide())
        strategy = sz.DataParallel(3, collective=collective)
        fitted = client.submit(graph, x, y, strategy=strategy).result(timeout=120 * UNIT)
        expected = reference_training(x, y, "sgd", epochs=1, module=wide())
        for key, value in expected.items():
            torch.testing.assert_close(fitted.states["mlp"][key], value, rtol=0, atol=1e-5)
        means, ahead = mean_counts(c.port), sent_ahead(c.port)
    steps = 21 + 21 + 7  # 203 rows in batches of 32: 7 steps an epoch; 3, 3 and 1 epochs
    assert means == ({"mean_streamed": steps} if collective == "coordinator" else {})
    # On the torch collective a chunk (1, 2, then 4 steps) goes out while the one before
    # trains, within an epoch: its end is checkpointed, so nothing is sent past it.
    assert (ahead > 0) == (collective == "torch")


def wide(seed: int = 0) -> torch.nn.Module:
    """An MLP like :func:`model`'s, wide enough that its gradients take two chunk messages."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 1024), torch.nn.Tanh(), torch.nn.Linear(1024, 300)
    )


def mean_counts(port: int) -> dict[str, int]:
    """How many gradient means the coordinator made, by how (its ``/metrics``)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    found = re.findall(r'somatize_worker_call_seconds_count\{cmd="(mean_\w+)"\} (\d+)', text)
    return {how: int(count) for how, count in found}


def sent_ahead(port: int) -> int:
    """How many chunks of steps the coordinator sent while the one before was training."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    found = re.findall(r'somatize_worker_call_seconds_count\{cmd="chunk_sent_ahead"\} (\d+)', text)
    return int(found[0]) if found else 0


def test_auto_falls_back_to_the_coordinator_when_a_replica_cannot_reach_the_rendezvous(
    tmp_path,
):
    """Workers that announce an address the others cannot reach (TEST-NET-1): ``auto`` trains
    through the coordinator and says why; ``torch`` is refused naming who could not reach whom."""
    x, y = dataset(n=64)
    with cluster(tmp_path, {}) as c, sz.connect(c.url) as client:
        for worker in ("w1", "w2"):
            c.start_worker(
                worker,
                args=["--peer-listen", "127.0.0.1:0", "--peer-advertise", "192.0.2.1:9"],
            )
        job = client.submit(graph_for("sgd", epochs=1), x, y, strategy=sz.DataParallel(2))
        fitted = job.result(timeout=120 * UNIT)
        placed = first(events_of(job), "placed")
        refused = client.submit(
            graph_for("sgd", epochs=1), x, y, strategy=sz.DataParallel(2, collective="torch")
        )
        with pytest.raises(sz.JobFailed) as failure:
            refused.result(timeout=120 * UNIT)
    expected = reference_training(x, y, "sgd", epochs=1)
    for key, value in expected.items():
        torch.testing.assert_close(fitted.states["mlp"][key], value, rtol=0, atol=1e-5)
    assert placed.data["collective"] == "coordinator"
    assert (
        "['w2'] cannot reach the rendezvous on 'w1' at 192.0.2.1"
        in (placed.data["collective_reason"])
    )
    assert failure.value.code == "collective_failed"
    assert "collective='torch': ['w2'] cannot reach" in failure.value.message


@pytest.mark.parametrize("collective", ["torch", "coordinator"])
def test_a_replica_killed_mid_training_fails_the_job_naming_it(tmp_path, collective):
    x, y = dataset(n=64)
    graph = sz.Graph(
        [sz.TorchFilter(Slow(), loss="cross_entropy", batch_size=8, epochs=50).named("slow")]
    )
    with cluster(tmp_path, {"w1": (), "w2": ()}) as c, sz.connect(c.url) as client:
        job = client.submit(graph, x, y, strategy=sz.DataParallel(2, collective=collective))
        wait_for(
            lambda: (job.status()["progress"] or {}).get("step", 0) >= 2, 60 * UNIT, "training"
        )
        assert len(daemons_of(c.workers["w1"])) == 1  # the job's daemon (no spares here)
        killed_at = time.monotonic()
        c.send_signal(c.workers["w2"], signal.SIGKILL)
        with pytest.raises(sz.JobFailed) as failure:
            job.result(timeout=30 * UNIT)
        failed_after = time.monotonic() - killed_at
        assert failure.value.code == "worker_lost"
        assert "'w2'" in failure.value.message
        # The other replica is stopped and freed (its job daemon closed), not left computing
        # or waiting in a collective for a dead job: w1 keeps no daemon.
        wait_for(lambda: c.worker_state("w1") == "idle", 15 * UNIT, "w1 to be freed")
        wait_for(lambda: not daemons_of(c.workers["w1"]), 15 * UNIT, "w1's job daemon")
    assert failed_after < 3.0 * UNIT  # within the cluster's heartbeat timeout (3 s)


# -- elastic --------------------------------------------------------------------------------------

DELAY = 0.03
"""Seconds each forward of the slow model sleeps unless a test says otherwise: steps long enough
to kill a worker mid-run."""


class SlowSequential(torch.nn.Sequential):
    """The MLP of :func:`model` (same parameter names and maths), each forward ``delay``
    seconds slower."""

    def __init__(self, *modules: torch.nn.Module, delay: float = DELAY):
        super().__init__(*modules)
        self.delay = delay

    def forward(self, x):
        time.sleep(self.delay)
        return super().forward(x)


def slow_graph(optimizer: str, epochs: int, batch_size: int, delay: float = DELAY) -> sz.Graph:
    return graph_for(optimizer, epochs, batch_size, module=SlowSequential(*model(), delay=delay))


def events_of(job) -> list:
    return list(job.events(timeout=30 * UNIT))


def first(events, kind, **match):
    return next(
        e for e in events if e.event == kind and all(e.data.get(k) == v for k, v in match.items())
    )


def step_reached(job, step: int) -> bool:
    return (job.status()["progress"] or {}).get("step", 0) >= step


def daemons_of(agent: subprocess.Popen) -> list[int]:
    """The pids of an agent's filter daemons (its children, or its fork server's)."""
    return sorted(agent_daemons(agent.pid))


def test_elastic_replaces_a_killed_replica_with_a_spare_and_restarts_a_crashed_daemon(tmp_path):
    """2 replicas + a spare: the replica killed mid-training is replaced by the spare, a daemon
    killed later is restarted on its own worker; the result is still single-process training's."""
    x, y = dataset(n=96)
    # 6 steps an epoch, 30 in all, each over 0.1 s: the 20 after step 10 outlast the test's
    # look at the progress on a busy machine (at 0.03 s, one run ended its training first and
    # lost its daemon while the coordinator read the result)
    graph = slow_graph("adam", epochs=5, batch_size=16, delay=0.1)
    strategy = sz.DataParallel(2, elastic=True, elastic_timeout=30 * UNIT, collective="coordinator")
    with cluster(tmp_path, {"w1": (), "w2": (), "w3": ()}) as c, sz.connect(c.url) as client:
        job = client.submit(graph, x, y, strategy=strategy)
        wait_for(lambda: step_reached(job, 3), 60 * UNIT, "step 3")
        killed_at = time.time()
        c.send_signal(c.workers["w2"], signal.SIGKILL)
        c.workers["w2"].wait(timeout=10 * UNIT)
        wait_for(lambda: step_reached(job, 10), 60 * UNIT, "step 10")
        for pid in daemons_of(c.workers["w1"]):
            os.kill(pid, signal.SIGKILL)
        fitted = job.result(timeout=120 * UNIT)
        events = events_of(job)

    for key, value in reference_training(x, y, "adam", epochs=5, batch_size=16).items():
        torch.testing.assert_close(fitted.states["mlp"][key], value, rtol=0, atol=1e-5)
    lost = first(events, "worker_lost", worker="w2")
    assert lost.data["code"] == "worker_lost"
    replaced = first(events, "worker_replaced", lost="w2")
    assert replaced.data["worker"] == "w3"
    restored = first(events, "worker_restored", worker="w3")
    assert restored.data["from"] == "w1"
    resumed = first(events, "progress", step=lost.data["step"])
    crashed = first(events, "worker_lost", worker="w1")
    assert crashed.data["code"] == "daemon_crashed"
    assert first(events, "worker_replaced", lost="w1").data["worker"] == "w1"
    assert first(events, "worker_restored", worker="w1").data["from"] == "w3"
    training = [e for e in events if e.event == "progress" and e.data["phase"] == "training"]
    steps = [e.data["step"] for e in training]
    assert steps == list(range(1, 31))  # each step once, in order: resumed, not skipped or redone
    print(
        f"\nelastic DataParallel, SIGKILL of a replica's agent (step {lost.data['step']}): "
        f"detected {lost.time - killed_at:.3f} s after the kill; replacement reserved "
        f"{replaced.time - lost.time:.3f} s, restored {restored.time - lost.time:.3f} s and the "
        f"failed step completed {resumed.time - lost.time:.3f} s after detection"
    )


def test_elastic_takes_back_the_lost_worker_before_a_queued_job_then_fails_when_none_comes(
    tmp_path,
):
    """The lost worker reconnecting is reserved for the waiting job ahead of a queued one; later,
    with no worker to come, an elastic job fails once ``elastic_timeout`` has passed."""
    x, y = dataset(n=96)
    graph = slow_graph("sgd", epochs=4, batch_size=16)
    strategy = sz.DataParallel(2, elastic=True, elastic_timeout=30 * UNIT, collective="coordinator")
    with cluster(tmp_path, {"w1": (), "w2": ()}) as c, sz.connect(c.url) as client:
        job = client.submit(graph, x, y, strategy=strategy)
        wait_for(lambda: step_reached(job, 3), 60 * UNIT, "step 3")
        queued = client.submit(sz.Graph([Center().named("c")]), x, strategy=sz.Local())
        c.send_signal(c.workers["w2"], signal.SIGKILL)
        c.workers["w2"].wait(timeout=10 * UNIT)
        wait_for(lambda: c.worker_state("w2") == "lost", 10 * UNIT, "w2 to be lost")
        c.start_worker("w2")  # the same id reconnecting: it goes to the waiting job
        fitted = job.result(timeout=120 * UNIT)
        queued.result(timeout=60 * UNIT)
        events, queued_events = events_of(job), events_of(queued)

        short = sz.DataParallel(2, elastic=True, elastic_timeout=1.0)
        doomed = client.submit(graph, x, y, strategy=short)
        wait_for(lambda: step_reached(doomed, 1), 60 * UNIT, "step 1")
        c.send_signal(c.workers["w2"], signal.SIGKILL)
        with pytest.raises(sz.JobFailed) as failure:
            doomed.result(timeout=60 * UNIT)
        doomed_events = events_of(doomed)
        wait_for(lambda: c.worker_state("w1") == "idle", 15 * UNIT, "w1 to be freed")

    for key, value in reference_training(x, y, "sgd", epochs=4, batch_size=16).items():
        torch.testing.assert_close(fitted.states["mlp"][key], value, rtol=0, atol=1e-5)
    assert first(events, "worker_replaced", lost="w2").data["worker"] == "w2"
    # The queued job got a worker only once the elastic job had ended.
    assert first(queued_events, "placed").time >= first(events, "succeeded").time

    assert failure.value.code == "not_enough_workers"
    assert "lost its worker 'w2'" in failure.value.message
    assert "waited 1s for a replacement (2 workers) and none came" in failure.value.message
    lost, failed = first(doomed_events, "worker_lost", worker="w2"), first(doomed_events, "failed")
    assert failed.time - lost.time >= 1.0


def test_elastic_on_the_torch_collective_forms_the_group_again_and_still_equals_a_torch_loop(
    tmp_path,
):
    """A replica's agent SIGKILLed mid-training on the torch collective: the survivor leaves the
    broken group, the spare takes the lost replica's place with the survivor's model and
    optimizer state, the group is formed again and training resumes where the survivor stood."""
    x, y = dataset(n=96)
    graph = slow_graph("adam", epochs=5, batch_size=16)  # 6 steps an epoch, 30 in all
    strategy = sz.DataParallel(2, elastic=True, elastic_timeout=30 * UNIT, collective="torch")
    with cluster(tmp_path, {"w1": (), "w2": (), "w3": ()}) as c, sz.connect(c.url) as client:
        job = client.submit(graph, x, y, strategy=strategy)
        wait_for(lambda: step_reached(job, 3), 60 * UNIT, "step 3")
        c.send_signal(c.workers["w2"], signal.SIGKILL)
        fitted = job.result(timeout=120 * UNIT)
        events = events_of(job)

    for key, value in reference_training(x, y, "adam", epochs=5, batch_size=16).items():
        torch.testing.assert_close(fitted.states["mlp"][key], value, rtol=0, atol=1e-5)
    assert first(events, "placed").data["collective"] == "torch"
    assert first(events, "worker_lost", worker="w2").data["code"] == "worker_lost"
    assert first(events, "worker_replaced", lost="w2").data["worker"] == "w3"
    assert first(events, "worker_restored", worker="w3").data["from"] == "w1"
    steps = [e.data["step"] for e in events if e.event == "progress" and "step" in e.data]
    assert steps == sorted(steps) and steps[-1] == 30
