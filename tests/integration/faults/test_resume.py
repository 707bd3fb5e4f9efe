"""No progress lost: a job running when its coordinator is SIGKILLed is queued again by the next
coordinator on the same state directory, resumes from its last checkpoint, and ends as an
undisturbed run would; a job that ends keeps its checkpoints only when it did not succeed."""

from __future__ import annotations

import signal
import time

import numpy as np
import pytest
import torch

import somatize as sz
from protocol.messages import GetCheckpoint, GetResult
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
from tests.integration.strategies.test_fedavg_live import Pause
from tests.utils import UNIT

pytestmark = pytest.mark.integration


class Paced(torch.nn.Sequential):
    """The tests' MLP (same parameters, same maths), a little slow: the coordinator can be
    killed while it trains."""

    def forward(self, x):
        time.sleep(0.06)
        return super().forward(x)


def paced() -> torch.nn.Module:
    torch.manual_seed(0)  # as tests.coordinator.strategies.data_parallel.test_data_parallel.model
    return Paced(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def _checkpointed_at(job: sz.Job, at: int, key: str = "step") -> sz.JobEventInfo:
    """Follow the job until it has saved a checkpoint at step (``key``: or round) ``at`` or
    later."""
    for event in job.events(timeout=120 * UNIT):
        if event.event == "checkpoint" and event.data[key] >= at:
            return event
        assert event.event not in ("succeeded", "failed", "cancelled"), event
    raise AssertionError("the job's events ended before its checkpoint")


@pytest.mark.parametrize(
    ("collective", "sharding"), [("torch", "none"), ("coordinator", "none"), ("torch", "full")]
)
def test_a_data_parallel_job_outlives_a_sigkilled_coordinator_and_equals_an_undisturbed_run(
    tmp_path, collective, sharding
):
    """Sharded (FSDP2), the checkpoint is each replica's shards as torch.distributed.checkpoint
    saved them, never joined on the coordinator, and each resumed replica loads its own,
    with its optimizer's momentum; the client joins them when it fetches one."""
    x, y = dataset()
    graph = graph_for("sgd", shuffle=True, module=paced())
    strategy = sz.DataParallel(2, collective=collective, checkpoint_every=5, sharding=sharding)
    with cluster(tmp_path, {"w1": (), "w2": ()}) as c:
        with sz.connect(c.url) as client:
            job = client.submit(graph, x, y, strategy=strategy)
            saved = _checkpointed_at(job, 10)
            assert saved.data["bytes"] > 0 and saved.data["seq"] >= 2
        assert c.stop_coordinator(signal.SIGKILL) != 0  # mid-training, nothing cleaned up
        c.start_coordinator()
        with sz.connect(c.url) as client:
            fitted = client.job(job.id, graph).result(timeout=120 * UNIT)
            events = list(client.job(job.id).events())
            last = client.job(job.id).checkpoint()  # its end's
            if sharding != "none":  # its files asked for one at a time: of a seq, by name
                nameless = GetCheckpoint(job_id=job.id, file=".metadata")
                unknown = GetCheckpoint(job_id=job.id, seq=last.seq, file="__9_0.distcp")
                fileless = GetCheckpoint(job_id=job.id, seq=last.seq, offset=0)
                replicaless = GetResult(job_id=job.id, offset=0)  # a range of what?
                for asked, code in (
                    (nameless, "bad_request"),
                    (unknown, "no_checkpoint"),
                    (fileless, "bad_request"),
                    (replicaless, "bad_request"),
                ):
                    with pytest.raises(sz.ClientError) as refused:
                        client._call(asked)
                    assert refused.value.code == code
        expected = reference_training(x, y, "sgd", shuffle=True)
        for key, value in expected.items():
            torch.testing.assert_close(fitted.states["mlp"][key], value, rtol=0, atol=1e-6)
        kinds = [e.event for e in events]
        resumed = next(e for e in events if e.event == "resumed")
        assert resumed.data["step"] >= 10  # not from the start: from its checkpoint
        assert kinds.count("queued") == 2 and kinds[-1] == "succeeded"
        steps = [e.data["step"] for e in events if e.event == "progress" and "step" in e.data]
        assert steps[-1] == 21
        for key, value in expected.items():
            torch.testing.assert_close(last.states["mlp"][key], value, rtol=0, atol=1e-6)
        kept = list((c.state_dir / "checkpoints" / job.id).glob("*.ckpt"))
        assert len(kept) == 1  # it succeeded: its end alone is kept, to continue from
        folders = list((c.state_dir / "checkpoints" / job.id).glob("*.shards"))
        if sharding == "none":
            assert folders == []
        else:  # each replica's shards, replica 0's with where each lies
            assert len(folders) == 1 and folders[0].stem == kept[0].stem
            files = sorted(p.name for p in folders[0].iterdir())
            assert files == [".metadata", "__0_0.distcp", "__1_0.distcp"]


@pytest.mark.parametrize(("collective", "atol"), [("torch", 1e-6), ("coordinator", 1e-5)])
def test_a_diloco_job_outlives_a_sigkilled_coordinator_and_equals_an_undisturbed_run(
    tmp_path, collective, atol
):
    """DiLoCo with checkpoints: SIGKILLed after its checkpoint at a synchronisation, resumed
    by the next coordinator with every replica's own inner Adam state and the outer momentum,
    it ends as the hand-written loop. On the torch group the replicas keep the global model
    and the outer momentum and send them with the chunk that ends at the checkpoint's
    synchronisation; through the coordinator, the coordinator keeps them."""
    x, y = dataset()
    graph = graph_for("adam", shuffle=True, module=paced())
    strategy = sz.DiLoCo(2, 3, 0.7, 0.9, checkpoint_every=5, collective=collective)
    with cluster(tmp_path, {"w1": (), "w2": ()}) as c:
        with sz.connect(c.url) as client:
            job = client.submit(graph, x, y, strategy=strategy)
            saved = _checkpointed_at(job, 10)
            assert saved.data["step"] in (12, 15, 21)  # a sync's (3, 6, ... over the run)
        assert c.stop_coordinator(signal.SIGKILL) != 0
        c.start_coordinator()
        with sz.connect(c.url) as client:
            fitted = client.job(job.id, graph).result(timeout=120 * UNIT)
            events = list(client.job(job.id).events())
    expected, _ = diloco_by_hand(x, y, "adam", 2, 3, outer_lr=0.7, outer_momentum=0.9)
    for key, value in expected.items():
        torch.testing.assert_close(fitted.states["mlp"][key], value, rtol=0, atol=atol)
    placed = [e.data["collective"] for e in events if e.event == "placed"]
    assert placed == [collective, collective]  # the first run's and the resumed one's
    resumed = next(e for e in events if e.event == "resumed")
    assert resumed.data["step"] >= 10
    assert [e.event for e in events].count("queued") == 2
    saved_at = [e.data["step"] for e in events if e.event == "checkpoint"]
    assert set(saved_at) <= {6, 12, 15, 21}  # the first sync at or after each multiple of 5


def test_a_succeeded_job_keeps_its_checkpoints_as_it_asks(tmp_path):
    """keep_on_success: the newest (its end, what resume_from continues: the default), every
    one kept (keep_checkpoints), or none; each still readable while it stands."""
    x, y = dataset()
    graph = graph_for("sgd")
    kept = {}
    with cluster(tmp_path, {"w1": (), "w2": ()}) as c, sz.connect(c.url) as client:
        for keep in ("newest", "all", "none"):
            strategy = sz.DataParallel(
                2, checkpoint_every=5, keep_checkpoints=10, keep_on_success=keep
            )
            job = client.submit(graph, x, y, strategy=strategy)
            job.result(timeout=120 * UNIT)
            folder = c.state_dir / "checkpoints" / job.id
            kept[keep] = sorted(int(p.stem) for p in folder.glob("*.ckpt"))
            saved = [e.data["seq"] for e in job.events() if e.event == "checkpoint"]
            if kept[keep]:
                assert client.job(job.id).checkpoint(kept[keep][0]).seq == kept[keep][0]
    assert len(saved) == 5  # steps 5, 10, 15, 20 and the end, 21
    assert kept == {"newest": saved[-1:], "all": saved, "none": []}


def test_a_job_that_fails_or_is_cancelled_ends_in_its_event_stream_and_keeps_its_checkpoints(
    tmp_path,
):
    x, y = dataset()
    graph = graph_for("sgd", module=paced())
    with cluster(tmp_path, {"w1": (), "w2": ()}) as c, sz.connect(c.url) as client:
        job = client.submit(graph, x, y, strategy=sz.DataParallel(2, checkpoint_every=3))
        _checkpointed_at(job, 3)
        job.cancel()
        wait_for(lambda: job.status()["state"] == "cancelled", 30 * UNIT, "the cancel")
        assert list(job.events())[-1].event == "cancelled"
        assert list((c.state_dir / "checkpoints" / job.id).glob("*.ckpt"))


def test_a_fedavg_job_with_a_server_optimizer_outlives_a_sigkilled_coordinator(tmp_path):
    """FedAdam's moments and the round are in the checkpoint: the resumed job ends where
    Reddi et al.'s Algorithm 2, computed by hand over the same rounds, ends."""
    data = shards(sizes=(40, 40))  # what FedAvg's contiguous shards of these rows are
    x, y = np.vstack([d[0] for d in data]), np.vstack([d[1] for d in data])
    options = {"lr": 0.05, "beta1": 0.9, "beta2": 0.99, "tau": 1e-3}
    strategy = sz.FedAvg(6, workers=2, min_workers=2, server=sz.FedAdam(**options))
    fed_graph = fedavg_graph(Pause().named("pause"))
    with cluster(tmp_path, {"w1": (), "w2": ()}) as c:
        with sz.connect(c.url) as client:
            job = client.submit(fed_graph, x, y, strategy=strategy)
            _checkpointed_at(job, 2, key="round")
        assert c.stop_coordinator(signal.SIGKILL) != 0
        c.start_coordinator()
        with sz.connect(c.url) as client:
            fitted = client.job(job.id, fed_graph).result(timeout=120 * UNIT)
            events = list(client.job(job.id).events())
    resumed = next(e for e in events if e.event == "resumed")
    assert 2 <= resumed.data["round"] < 6
    rounds = [e.data["round"] for e in events if e.event == "progress" and "round" in e.data]
    assert rounds[-1] == 6
    expected = reference_rounds(data, 6, epochs=1, server=HandAdam(**options))
    assert_model(fitted.states, expected[-1][0])
